"""A request's draft state (its history for the proposer, and how well its guesses fare: the
back-off that pauses guessing where it does not pay), and how many guesses its step may verify."""

from __future__ import annotations

from dataclasses import dataclass, field

from contract.cache_policy import CachePolicy
from service.engine.messages import MAX_SPECULATIVE_TOKENS

# The back-off, for blocks of up to 16 guesses at one stream (fitted with `python -m bench --sections
# speculative` and a replay of its greedy outputs; docs/speculative.md, "When it stops"). A verification of
# k guesses costs about VERIFY_STEPS + VERIFY_STEPS_PER_GUESS x k plain decode steps here (one row, the
# fused prompt graph in place, one thread, with the engine's sampling and bookkeeping around it), so
# a block pays when it keeps more than that cost less one token. A block kept whole doubles the next
# one; a block cut short halves it, to no fewer than MIN_GUESSES. Each verification's net gain (the
# tokens it gave over the plain steps it cost) enters a running mean; when the mean falls below zero
# the request stops guessing for PAUSE_STEPS steps, twice as long after each pause (at most
# 2**MAX_DOUBLINGS times), and starts again from MIN_GUESSES. While it pauses it reserves no room for
# guesses (Request.lookahead), so a pause costs nothing but the steps it does not guess.
VERIFY_STEPS = 1.6
VERIFY_STEPS_PER_GUESS = 0.12
MIN_GUESSES = 4
GAIN_DECAY = 0.7  # weight of the running mean's past at each verification
PAUSE_STEPS = 8
MAX_DOUBLINGS = 6


@dataclass
class DraftState:
    """A request's speculative state: its history as bytes (for the proposer), the most guesses its
    next block may have, and how well its guesses have paid (drafting pauses while they do not)."""

    history: bytearray = field(default_factory=bytearray)
    fed: int = 0  # tokens of prompt + output in `history`
    cap: int = MAX_SPECULATIVE_TOKENS  # most guesses its next block may have
    gain: float = 0.0  # running mean of its verifications' net gain, in plain steps
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

    def record(self, proposed: int, accepted: int) -> bool:
        """One verification's outcome: the next block's size, and a pause while guesses do not pay.
        True when the request may guess more from now on than before (its cap grew)."""
        if not proposed:
            return False
        self.proposed += proposed
        self.accepted += accepted
        before = self.cap
        if accepted == proposed:
            self.cap = min(MAX_SPECULATIVE_TOKENS, 2 * max(self.cap, proposed))
        else:
            self.cap = max(MIN_GUESSES, self.cap // 2)
        gain = 1 + accepted - (VERIFY_STEPS + VERIFY_STEPS_PER_GUESS * proposed)
        self.gain = GAIN_DECAY * self.gain + (1 - GAIN_DECAY) * gain
        if self.gain < 0:  # try again afterwards, from a fresh start and a small block
            self.paused = PAUSE_STEPS << min(self.pauses, MAX_DOUBLINGS)
            self.pauses += 1
            self.gain, self.cap = 0.0, MIN_GUESSES
        return self.cap > before

    def tick(self) -> bool:
        """A step without drafting while paused: True when the pause has just ended."""
        self.paused -= 1
        return self.paused == 0


def draft_room(policy: CachePolicy, num_tokens: int, remaining: int, wanted: int) -> int:
    """How many guesses a request may verify this step. A bounded row verifies a block only while
    the block fits its budget without an eviction (a block that evicts would need a mask per
    query: each guess sees one old token fewer, which the graph's mask cannot say), so once its
    window is full it decodes a token a step. `remaining`: new tokens it may still produce (the
    guesses and the bonus token never pass max_new_tokens)."""
    room = min(wanted, remaining - 1)
    before_eviction = policy.room(num_tokens)
    if before_eviction is not None:
        room = min(room, before_eviction)
    return max(room, 0)
