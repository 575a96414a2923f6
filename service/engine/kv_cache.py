"""KV-cache block accounting for one model (no ONNX Runtime here).

The pool is a byte budget cut into fixed-size blocks of `block_size` tokens. A sequence holds
ceil(tokens / block_size) blocks and grows one block at a time, so memory reserved but
unused is under one block per running sequence instead of a maximum length per request.
The runner owns the tensors; this class only decides who may use how much.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheStats:
    used_blocks: int
    total_blocks: int
    block_bytes: int
    used_tokens: int

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.block_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.total_blocks * self.block_bytes


class KVCacheManager:
    def __init__(self, budget_bytes: int, bytes_per_token: int, block_size: int = 16) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.block_bytes = block_size * bytes_per_token
        self.total_blocks = budget_bytes // self.block_bytes
        if self.total_blocks <= 0:
            raise ValueError(f"kv cache budget {budget_bytes} bytes is below one block ({self.block_bytes} bytes)")
        self._free: list[int] = list(range(self.total_blocks - 1, -1, -1))
        self._blocks: dict[str, list[int]] = {}
        self._tokens: dict[str, int] = {}
        self._lock = threading.Lock()

    def blocks_needed(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_allocate(self, request_id: str, tokens: int) -> bool:
        with self._lock:
            missing = self.blocks_needed(tokens) - len(self._blocks.get(request_id, ()))
            return missing <= len(self._free)

    def allocate(self, request_id: str, tokens: int) -> bool:
        """Grow the request's blocks to hold `tokens` tokens; False (and no change) if the pool is short."""
        with self._lock:
            held = self._blocks.setdefault(request_id, [])
            if len(held) * self.block_size >= tokens:  # the usual decode step: room in the last block
                self._tokens[request_id] = max(tokens, self._tokens.get(request_id, 0))
                return True
            missing = self.blocks_needed(tokens) - len(held)
            if missing > len(self._free):
                if not held:
                    del self._blocks[request_id]
                return False
            for _ in range(max(missing, 0)):
                held.append(self._free.pop())
            self._tokens[request_id] = max(tokens, self._tokens.get(request_id, 0))
            return True

    def free(self, request_id: str) -> None:
        with self._lock:
            self._free.extend(reversed(self._blocks.pop(request_id, [])))
            self._tokens.pop(request_id, None)

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """Opaque block handles of a request, in order."""
        with self._lock:
            return tuple(self._blocks.get(request_id, ()))

    def holders(self) -> list[str]:
        with self._lock:
            return list(self._blocks)

    def stats(self) -> CacheStats:
        with self._lock:
            used = self.total_blocks - len(self._free)
            return CacheStats(used, self.total_blocks, self.block_bytes, sum(self._tokens.values()))
