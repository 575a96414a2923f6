"""Speculative decoding: proposers of draft tokens, how many each request may draft, and the rule
that turns one verification call's logits into the tokens a request keeps.

A proposer guesses the next tokens of a request; the runner feeds the request's last token and the
guesses through the serving graph in one call (service.engine.worker.runner.ModelRunner.verify), which
returns the model's logits after each of them. The model's own token at each position is then
sampled exactly as without speculation (greedy: the argmax; sampled: the request's uniform for that
token index, service.engine.sampler), and a guess is kept while it equals that token; the first
token that differs is kept too (the "bonus" token), and the guesses after it are dropped. With a
deterministic proposer (a point mass q on each guess) this is the standard rejection rule: a guess d
is accepted with probability min(1, p(d) / q(d)) = p(d), and on rejection the token comes from p
without d, renormalised; drawing it with the request's own uniform is one way to draw from that
distribution, so the tokens are exactly those the stream samples without speculation (seeded
streams stay reproducible, and resume after an engine restart to the same text).

Only the tokens kept have their K/V written into the store (ModelRunner.commit): a rejected guess's
K/V never enters a row, a capacity class or the prefix cache, under every cache policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from contract.cache_policy import CachePolicy
from service.engine.messages import MAX_SPECULATIVE_TOKENS

__all__ = ["MAX_SPECULATIVE_TOKENS", "DraftState", "NgramProposer", "Proposer", "draft_room"]

# A verification call of T tokens costs about a plain step plus a quarter of one per token here (the
# fused prompt graph in place, one thread: 0.62 ms for 9 tokens at 640 of context against 0.21 ms a
# plain step of the fused decode graph; docs/measurements.md), so guesses pay only while most are kept: a request
# whose guesses are kept less than HALF_ACCEPTANCE of the time guesses half as many, and below
# MIN_ACCEPTANCE stops guessing for PAUSE_STEPS steps.
HALF_ACCEPTANCE = 0.75
MIN_ACCEPTANCE = 0.5
PAUSE_STEPS = 16
ACCEPTANCE_DECAY = 0.8  # weight of a request's running acceptance rate at each step
MODEL_ACCEPTANCE_DECAY = 0.98  # the same over all of a model's requests: where a new request starts


class Proposer(Protocol):
    """Guesses a request's next tokens from what it has so far (prompt and output)."""

    def propose(self, history: bytearray, limit: int) -> list[int]: ...


@dataclass(frozen=True)
class NgramProposer:
    """vLLM's n-gram ("prompt lookup") proposer: the longest suffix of the history, from `max_n`
    down to `min_n` tokens, that occurred earlier; the tokens that followed its latest earlier
    occurrence are the guess. No model, no state: on code, which repeats identifiers and whole lines,
    the guess is often right. Tokens are bytes here, so the history is searched as bytes (specials
    stand as 0: a guess is only a guess, verified before anything is kept)."""

    min_n: int = 3
    max_n: int = 12

    def propose(self, history: bytearray, limit: int) -> list[int]:
        """Where the occurrence found ends less than `limit` tokens before the end (a run of spaces,
        a repeated short line), the copy runs on over its own guesses, as an LZ77 copy overlaps
        itself: the period it found repeats, where vLLM's lookup would stop at the end (one guess)."""
        end = len(history)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            start = history.rfind(history[end - n :], 0, end - 1)
            if start >= 0:
                follows = history[start + n : start + n + limit]
                period = end - start - n  # the distance the copy looks back, once past the end
                while len(follows) < limit:  # (only once all `period` tokens after it are in)
                    follows.append(follows[len(follows) - period])
                return list(follows)
        return []


@dataclass
class DraftState:
    """A request's speculative state: its history as bytes (for the proposer), and how well its
    guesses have fared (a running acceptance rate; drafting pauses while it is low)."""

    history: bytearray = field(default_factory=bytearray)
    fed: int = 0  # tokens of prompt + output in `history`
    acceptance: float = 1.0
    paused: int = 0  # steps left without drafting
    pauses: int = 0  # how often drafting paused: each pause lasts twice as long as the one before
    proposed: int = 0
    accepted: int = 0

    def sync(self, tokens: list[int], prompt: list[int]) -> None:
        """Catch up with the request's tokens (prompt then output)."""
        if self.fed == 0:
            self.history += bytes(t if t < 256 else 0 for t in prompt)
            self.fed = len(prompt)
        new = tokens[self.fed - len(prompt) :]
        self.history += bytes(t if t < 256 else 0 for t in new)
        self.fed += len(new)

    def budget(self, wanted: int) -> int:
        """Guesses to ask the proposer for this step: all `wanted` while they are mostly kept, half
        while a fair share is."""
        return wanted if self.acceptance >= HALF_ACCEPTANCE else max(1, wanted // 2)

    def record(self, proposed: int, accepted: int) -> None:
        """One verification's outcome: a rate that stays low pauses drafting for a while."""
        if not proposed:
            return
        self.proposed += proposed
        self.accepted += accepted
        self.acceptance = ACCEPTANCE_DECAY * self.acceptance + (1 - ACCEPTANCE_DECAY) * accepted / proposed
        if self.acceptance < MIN_ACCEPTANCE:  # try again afterwards, from a fresh start
            self.paused, self.acceptance = PAUSE_STEPS << min(self.pauses, 6), 1.0
            self.pauses += 1


def draft_room(policy: CachePolicy, num_tokens: int, remaining: int, wanted: int) -> int:
    """How many guesses a request may verify this step. A bounded row verifies a block only while
    the block fits its budget without an eviction (a block that evicts would need a mask per
    query: each guess sees one old token fewer, which the graph's mask cannot say), so once its
    window is full it decodes a token a step. `remaining`: new tokens it may still produce (the
    guesses and the bonus token never pass max_new_tokens)."""
    room = min(wanted, remaining - 1)
    if policy.bounded and policy.budget is not None:
        room = min(room, policy.budget - num_tokens)
    return max(room, 0)
