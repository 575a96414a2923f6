"""Where the checkout lives: the one definition of the repository root every package uses for its
default paths (the model repository, reports, the proto folder)."""

from __future__ import annotations

from pathlib import Path

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent


def sized_repository(size: str) -> Path:
    """The default model repository of a named size served with random weights (`python -m export
    --size small` writes it, `python -m bench --size small` reads it): beside the trained one, outside git."""
    return REPOSITORY_ROOT / f"model_repository-{size}"
