"""How the report writes one figure: a number, a probe cell with its interval, a byte count."""

from __future__ import annotations

from loadtest.study.results import Cell, ModelInfo


def fmt(value: float | None, digits: int = 3, scale: float = 1.0, missing: str = "not servable") -> str:
    return missing if value is None else f"{value * scale:.{digits}f}"


def kv_bytes(info: ModelInfo, unit: str = "") -> str:
    """'4096', or for a split hybrid '1024 (+442 KB a sequence)': the bytes a token adds to a row and,
    where a row also carries fixed local columns, those, so a hybrid does not read as whole rows."""
    per_sequence = info.get("kv_bytes_per_sequence", 0)
    text = f"{info['kv_bytes_per_token']}{unit}"
    return text + (f" (+{per_sequence / 1e3:.0f} KB a sequence)" if per_sequence else "")


def cell(value: Cell | None, digits: int = 2) -> str:
    """'0.95 [0.90, 0.98]': a figure and its 95% interval."""
    if value is None:
        return "not servable"
    return f"{value['value']:.{digits}f} [{value['low']:.{digits}f}, {value['high']:.{digits}f}]"


def binary_bytes(value: float) -> str:
    """'1 MiB', '256 KiB'."""
    return f"{value / 2**20:g} MiB" if value >= 2**20 else f"{value / 1024:g} KiB"
