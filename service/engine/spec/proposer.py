"""Proposers of draft tokens behind one interface, chosen by name (`--speculative-method`), as vLLM
selects its proposer by `speculative_config.method`.

A proposer that needs a model (a draft model) registers a factory that imports what it needs when
it is called: the front end reads the registry's names to check the flag and loads nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from service.engine.messages import EngineConfig


class Proposer(Protocol):
    """Guesses a request's next tokens from what it has so far (prompt and output, as bytes:
    `DraftState.history`), at most `limit` of them; none when it has no guess."""

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


def _ngram(config: EngineConfig) -> Proposer:
    return NgramProposer(config.ngram_prompt_lookup_min, config.ngram_prompt_lookup_max)


# --speculative-method NAME -> a factory of the engine's settings. A draft model would add its own.
PROPOSERS: dict[str, Callable[[EngineConfig], Proposer]] = {"ngram": _ngram}


def make_proposer(config: EngineConfig) -> Proposer:
    """The proposer `config.speculative_method` names, or a ValueError listing the names."""
    factory = PROPOSERS.get(config.speculative_method)
    if factory is None:
        raise ValueError(
            f"--speculative-method: {config.speculative_method!r} is not one of {', '.join(sorted(PROPOSERS))}"
        )
    return factory(config)
