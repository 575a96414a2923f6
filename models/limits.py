"""Position limits, without torch: the serving side checks them before ONNX Runtime runs."""

from __future__ import annotations

from typing import Any


class PositionLimitError(ValueError):
    """A position beyond a bounded scheme's table."""


def check_positions(position_ids: Any, max_positions: int | None) -> None:
    """Raise a clear error for positions a bounded scheme cannot represent.

    `position_ids` is a numpy array or a torch tensor.
    """
    if max_positions is None:
        return
    count = position_ids.size if isinstance(position_ids.size, int) else position_ids.numel()
    if count == 0:
        return
    highest = int(position_ids.max())
    if highest >= max_positions:
        raise PositionLimitError(
            f"position_ids: position {highest} is at or beyond max_positions={max_positions} "
            f"of this model (prompt plus generated tokens must fit in {max_positions})"
        )
