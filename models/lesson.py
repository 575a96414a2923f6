"""The seed lesson's permutation demonstration, runnable: `python -m models.lesson`.

Self-attention without positions is permutation-equivariant: reverse the rows of its input and
its output comes out reversed the same way, so the order of the tokens cannot matter to it.
Adding the sinusoidal code (the lesson's table, here from `models.positional.sinusoidal_table`)
breaks that symmetry. The lesson's attention has no mask; a causal mask, which every decoder in
this project uses, breaks it by itself, which is why a decoder without positions (`none`) still
learns some order.
"""

from __future__ import annotations

import numpy as np

from models.positional import sinusoidal_table

POSITIONS, DIMENSIONS = 4, 6


def softmax(z: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(z - z.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def self_attention(x: np.ndarray, causal: bool = False) -> np.ndarray:
    """The lesson's attention: queries, keys and values are the input rows themselves."""
    scores = x @ x.T / np.sqrt(x.shape[1])
    if causal:
        scores = np.where(np.tril(np.ones_like(scores, dtype=bool)), scores, -np.inf)
    return softmax(scores) @ x


def reversal_commutes(x: np.ndarray, code: np.ndarray | None = None, causal: bool = False) -> bool:
    """Does attention of the reversed rows (plus the code, if any) equal attention's output reversed?"""
    code = np.zeros_like(x) if code is None else code
    return bool(np.allclose(self_attention(x[::-1] + code, causal), self_attention(x + code, causal)[::-1]))


def main() -> None:
    table = sinusoidal_table(POSITIONS, DIMENSIONS).astype(np.float64)
    x = np.random.default_rng(0).normal(size=(POSITIONS, DIMENSIONS))
    print(f"Sinusoidal table, {POSITIONS} positions x {DIMENSIONS} dimensions:")
    print(np.round(table, 3))
    print(f"shape {table.shape}; row 0 alternates sin 0 = 0 and cos 0 = 1: {table[0]}")
    print(f"row 1, rounded: {np.round(table[1], 3)}")
    print()
    print("Reverse the rows of x, attend, and compare with attention's output reversed:")
    print(f"  without positions:                  {reversal_commutes(x)}")
    print(f"  with the sinusoidal code added:     {reversal_commutes(x, table)}")
    print(f"  without positions, causal mask:     {reversal_commutes(x, causal=True)}")
    print("The lesson's attention has no mask. A causal mask already breaks the symmetry, since each")
    print("row sees only the rows before it: decoders without positions still learn some order.")


if __name__ == "__main__":
    main()
