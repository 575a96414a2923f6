"""One model's speculative decisions around a verification call (the package's docstring says what
speculation is and why its tokens are those of the plain stream): whether any request guesses, what
each request feeds, the model's own token after each fed token, and how many a request keeps."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from service.engine.messages import EngineConfig
from service.engine.model_metrics import ModelMetrics
from service.engine.request import Request
from service.engine.sampler import Sampler, processed_logits
from service.engine.spec_decode.draft import draft_room
from service.engine.spec_decode.proposer import Proposer, make_proposer
from service.engine.spec_decode.verifier import BlockVerifier


class Speculator:
    """One model's speculative decisions around a verification call: what each request feeds (its
    last token and its guesses), the verification through the block verifier, the model's own token
    after each fed token, the tokens each keeps, and the counters."""

    def __init__(
        self, proposer: Proposer, verifier: BlockVerifier, sampler: Sampler, metrics: ModelMetrics, max_batch: int
    ) -> None:
        self.proposer, self.verifier, self.sampler = proposer, verifier, sampler
        self.metrics, self.max_batch = metrics, max_batch
        # Some request may now guess more tokens than the room its row was last given (a pause
        # ended, a cap grew): the engine's next step must be a full one, which reserves that room.
        self.grew = False
        # Whether some request may guess: set by the first request that does (`admit`); until then a
        # step skips looking for drafts. Whether a request guesses is its own parameter, resolved
        # once by the input processor (the request's field, or the server's --speculative-tokens).
        self.active = False

    @classmethod
    def of(cls, config: EngineConfig, verifier: BlockVerifier, sampler: Sampler, metrics: ModelMetrics) -> Speculator:
        """The proposer `--speculative-method` names, and the engine's batch limit for guessing."""
        return cls(make_proposer(config), verifier, sampler, metrics, config.speculative_max_batch)

    def admit(self, request: Request) -> None:
        """A new request: one that guesses turns speculation on for this model's steps."""
        if request.draft is not None:
            self.active = True

    def take_growth(self) -> bool:
        """Whether some request's room for guesses grew since the last call (see `grew`)."""
        grew, self.grew = self.grew, False
        return grew

    def drafts(self, requests: list[Request], verifies_blocks: Callable[[str], bool]) -> list[list[int]] | None:
        """What each request feeds this step: its last token and its proposer's guesses (None when
        none guesses: a plain step). No request guesses in a batch larger than `max_batch` (there the
        graph's time grows with the tokens fed, so guesses cost more than they save), in a row whose
        graph takes one token (`verifies_blocks`: whether a sequence's rows do), or while its drafting pauses."""
        if len(requests) > self.max_batch:
            return None
        fed, guessed = [], False
        for request in requests:
            guesses: list[int] = []
            draft = request.draft
            if draft is not None:
                if draft.paused:
                    self.grew = draft.tick() or self.grew
                else:
                    remaining = request.params.max_new_tokens - len(request.output_ids)
                    room = draft_room(request.cache_policy, request.num_tokens, remaining, request.lookahead)
                    if room and verifies_blocks(request.request_id):
                        draft.sync(request.output_ids, request.prompt_ids)
                        guesses = self.proposer.propose(draft.history, room)
                        guessed = guessed or bool(guesses)
            fed.append([request.output_ids[-1], *guesses])
        return fed if guessed else None

    def target_tokens(self, requests: list[Request], logits: list[np.ndarray]) -> list[list[int | Exception]]:
        """The model's own token after each fed token, as the sampler draws it without speculation:
        at token index len(output) + j, from the logits processed as there (`processed_logits`)."""
        rows_of: list[Request] = []
        indices: list[int] = []
        for request, rows in zip(requests, logits, strict=True):
            done = len(request.output_ids)
            rows_of += [request] * rows.shape[0]
            indices += range(done, done + rows.shape[0])
        stacked = processed_logits(np.concatenate(logits), rows_of, indices)
        ids, params = [r.request_id for r in rows_of], [r.params for r in rows_of]
        flat = self.sampler.sample_rows(ids, params, stacked, indices)
        out, start = [], 0
        for rows in logits:
            out.append(flat[start : start + rows.shape[0]])
            start += rows.shape[0]
        return out

    def verify(self, requests: list[Request], fed: list[list[int]]) -> list[np.ndarray]:
        """One verification call for the batch (per capacity class: the block verifier's): each
        request's logits after each token it fed. Nothing is kept until `keep`."""
        return self.verifier.verify([request.request_id for request in requests], fed)

    def keep(
        self, requests: list[Request], fed: list[list[int]], logits: list[np.ndarray]
    ) -> tuple[list[Request], list[int | Exception], list[np.ndarray]]:
        """After `verify`: each request keeps its fed tokens up to the first guess that differs from the
        model's own token, whose K/V alone are written into the store; returns the kept tokens flat
        (each with its request and its logits row), the guesses' outcomes recorded."""
        tokens = self.target_tokens(requests, logits)
        kept: dict[str, int] = {}
        flat_requests: list[Request] = []
        flat_tokens: list[int | Exception] = []
        flat_logits: list[np.ndarray] = []
        for request, fed_tokens, targets, rows in zip(requests, fed, tokens, logits, strict=True):
            count = accepted_prefix(request, fed_tokens, targets)
            kept[request.request_id] = count
            flat_requests += [request] * count
            flat_tokens += targets[:count]
            flat_logits.append(rows[:count])
            if len(fed_tokens) > 1:
                self.record(request, len(fed_tokens) - 1, count - 1)
        self.verifier.commit(kept)
        return flat_requests, flat_tokens, flat_logits

    def record(self, request: Request, guesses: int, accepted: int) -> None:
        """One request's verification: its draft state's back-off, and the counters."""
        assert request.draft is not None
        self.grew = request.draft.record(guesses, accepted) or self.grew
        metrics, form = self.metrics, request.cache_policy.form
        metrics.speculative_proposed[form].inc(guesses)
        metrics.speculative_steps(guesses).inc()
        if accepted:
            metrics.speculative_accepted[form].inc(accepted)
        for position in range(1, accepted + 1):
            metrics.speculative_accepted_at(position).inc()


def accepted_prefix(request: Request, fed: list[int], targets: list[int | Exception]) -> int:
    """How many of a speculative step's tokens a request keeps: the model's token after each fed
    token while it equals the next guess, then the first that differs (or none past one that ends
    the request: an EOS it may end at, its last allowed token, a failed sample)."""
    done, limit = len(request.output_ids), request.params.max_new_tokens
    for j, token in enumerate(targets):
        ends = (
            isinstance(token, Exception)
            or (token == request.eos_token_id and request.params.eos_allowed(done + j))
            or done + j + 1 >= limit
        )
        if ends or j + 1 >= len(fed) or token != fed[j + 1]:
            return j + 1
    return len(targets)
