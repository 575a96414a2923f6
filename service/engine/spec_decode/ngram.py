"""The n-gram ("prompt lookup") proposer: guesses copied from earlier in the request's own history,
no model and no state (registered as `ngram` in `proposer.PROPOSERS`)."""

from __future__ import annotations

from dataclasses import dataclass


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
