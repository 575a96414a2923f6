"""Where the checkout lives: the one definition of the repository root every package uses for its
default paths (the model repository, reports, the proto folder)."""

from __future__ import annotations

from pathlib import Path

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent
