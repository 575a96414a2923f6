"""Model names beside the schemes' own: a scheme trained again with another seed.

A scheme's served model is named by the scheme (`rope`, trained with the recipe's seed). Further
training runs of the same recipe with other seeds (issue 55) export beside it as `<scheme>@seed<N>`
(`rope@seed2`): scored by the comparison, served only when named. '@' needs no quoting in a shell,
a JSON body, a Prometheus label value or a URL path segment (RFC 3986 allows it in a pchar), and it
reads as "rope at seed 2"; the scaling variants' '-' (`rope-ntk-x4`) is taken.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SEED_MARK = "@seed"
_SEEDED = re.compile(r"(?P<scheme>[a-z][a-z0-9-]*)@seed(?P<seed>[0-9]+)")


def seed_model_name(scheme: str, seed: int) -> str:
    """The model name of `scheme` trained with `seed` (not the served one): `rope@seed2`."""
    return f"{scheme}{SEED_MARK}{seed}"


@dataclass(frozen=True)
class SeedModel:
    """A model name split into its scheme and training seed (seed None: the scheme's served model)."""

    scheme: str
    seed: int | None

    @classmethod
    def parse(cls, name: str) -> SeedModel:
        match = _SEEDED.fullmatch(name)
        return cls(name, None) if match is None else cls(match["scheme"], int(match["seed"]))
