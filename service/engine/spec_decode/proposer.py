"""Proposers of draft tokens behind one interface, chosen by name (`--speculative-method`), as vLLM
selects its proposer by `speculative_config.method`.

A proposer that needs a model (a draft model) registers a factory that imports what it needs when
it is called: the front end reads the registry's names to check the flag and loads nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from service.engine.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    from service.engine.messages import EngineConfig


class Proposer(Protocol):
    """Guesses a request's next tokens from what it has so far (prompt and output, as bytes:
    `DraftState.history`), at most `limit` of them; none when it has no guess."""

    def propose(self, history: bytearray, limit: int) -> list[int]: ...


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
