"""How the report writes one figure: a number, a probe cell with its interval, a byte count."""

from __future__ import annotations

from loadtest.study.results import Cell


def fmt(value: float | None, digits: int = 3, scale: float = 1.0, missing: str = "not servable") -> str:
    return missing if value is None else f"{value * scale:.{digits}f}"


def cell(value: Cell | None, digits: int = 2) -> str:
    """'0.95 [0.90, 0.98]': a figure and its 95% interval."""
    if value is None:
        return "not servable"
    return f"{value['value']:.{digits}f} [{value['low']:.{digits}f}, {value['high']:.{digits}f}]"


def binary_bytes(value: float) -> str:
    """'1 MiB', '256 KiB'."""
    return f"{value / 2**20:g} MiB" if value >= 2**20 else f"{value / 1024:g} KiB"
