"""A request's draft state (its history for the proposer, and how well its guesses fare: the
back-off that pauses guessing where it does not pay), and how many guesses its step may verify."""

from __future__ import annotations

from dataclasses import dataclass, field

from contract.cache_policy import CachePolicy

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
