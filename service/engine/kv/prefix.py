"""The prefix cache: the K/V of prompts' full blocks, kept after their prefill, keyed by a hash chain.

As vLLM's automatic prefix caching: block i of a prompt is keyed by hash(parent's key, its
tokens), the first block's parent being the extra key (the model and the cache policy's form),
so one key names a block and every token before it. A hit is the longest run of a prompt's
leading blocks that are cached; with rows per sequence (the store's) the hit is copied into
the new request's prefill as its past, and only the rest of the prompt is computed.

Blocks hold K/V as the prompt's prefill computed them (the layout's float dtype, also for int8
rows, whose prefill is float and quantized when written): a hit then gives the rest of the prompt
exactly the past a fresh prefill would, and its row exactly the cache. Each block is an array of
its own, counted in the store's physical bytes, inside its budget; evicted least recently used
(a hit touches its blocks leaf first, so a chain's leaves go before its root).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from service.engine.kv.arrays import Array, Backend
from service.engine.kv.scratch import ScratchArray


def block_hashes(token_ids: list[int], block_size: int, extra: Hashable) -> list[int]:
    """The chain of keys of the full blocks of `token_ids`: key i covers tokens [0, (i + 1) x block_size)."""
    hashes: list[int] = []
    parent = hash(extra)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


class CachedPast:
    """The prefix cache's K/V of a prompt's leading tokens as its blocks hold them, not yet copied:
    the prefill thread assembles them into its own call's cache array (the engine thread only
    looks the blocks up; a block evicted meanwhile stays alive while referenced here)."""

    def __init__(
        self, parts: list[Array], backend: Backend, dtype: str, local_parts: list[Array] | None = None
    ) -> None:
        """`local_parts`: a split row's local K/V of the last tokens before the hit (the window a
        local layer of the next token attends to), in order; None where the rows are not split."""
        self.parts = parts  # each (2 x layers, heads, n, head_dim), in order
        self.tokens = sum(int(part.shape[2]) for part in parts)
        self.backend, self.dtype = backend, dtype
        self.local_parts = local_parts
        self.local_tokens = sum(int(part.shape[2]) for part in local_parts or ())

    def assemble_local(self, room: int = 0) -> Array:
        """(2 x local layers, 1, heads, local tokens + room, head_dim): the local window, then `room` zeroed columns."""
        assert self.local_parts, "a split hit carries the local window"
        tensors, heads, _, head_dim = self.local_parts[0].shape
        out = self.backend.zeros((tensors, 1, heads, self.local_tokens + room, head_dim), self.dtype)
        start = 0
        for part in self.local_parts:
            out[:, 0, :, start : start + part.shape[2]] = part
            start += part.shape[2]
        return out

    def assemble(self, room: int = 0, scratch: ScratchArray | None = None) -> Array:
        """(2 x layers, 1, heads, tokens + room, head_dim): the blocks, then `room` zeroed columns
        (where a prompt call writes its new tokens' K/V in place). `scratch`: the calling thread's
        host memory to reuse (only where the backend's arrays are host arrays)."""
        tensors, heads, _, head_dim = self.parts[0].shape
        shape = (tensors, 1, heads, self.tokens + room, head_dim)
        out = (scratch or self.backend).empty(shape, self.dtype)
        start = 0
        for part in self.parts:
            out[:, 0, :, start : start + part.shape[2]] = part
            start += part.shape[2]
        out[:, 0, :, start:] = 0  # written over by the prompt call; zeroed, not uninitialised
        return out


@dataclass(frozen=True)
class CachedBlock:
    """One block's K/V, (2 x layers, heads, block_size, head_dim), with what its key was made of
    (checked on a hit, so a hash collision is never a wrong hit). A reusable segment's entry is one
    "block" of the segment's length, parent 0 (service.engine.prompts.segments)."""

    parent: int
    tokens: tuple[int, ...]
    kv: Array
    nbytes: int
    form: str  # the cache-policy form of the requests that share it (the `policy` metric label)
    # A split row's local layers' K/V of the block, (2 x local layers, heads, block_size, head_dim), kept
    # only for the blocks within a window of a cached prompt's end (what a hit there needs); else None.
    local: Array | None = None


class PrefixCache:
    """Cached blocks by key, least recently used first. Only the store changes it (the engine
    thread); `peek` may run on another thread (dict reads only)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: OrderedDict[int, CachedBlock] = OrderedDict()
        self.nbytes = 0
        self._bytes_by_form: dict[str, int] = {}  # kept as blocks come and go (metrics read it every step)
        self.tokens = 0  # tokens of every entry (blocks, and whole reusable segments)
        self.evictions = 0  # entries evicted, ever

    def _matched(self, token_ids: list[int], hashes: list[int], extra: Hashable) -> list[tuple[int, CachedBlock]]:
        found: list[tuple[int, CachedBlock]] = []
        parent = hash(extra)
        for index, key in enumerate(hashes):
            block = self.blocks.get(key)
            start = index * self.block_size
            if block is None or block.parent != parent:
                break
            if block.tokens != tuple(token_ids[start : start + len(block.tokens)]):
                break
            found.append((key, block))
            parent = key
        return found

    def peek(self, token_ids: list[int], hashes: list[int], extra: Hashable) -> int:
        """Tokens a lookup would find now (admission's estimate; touches nothing)."""
        return len(self._matched(token_ids, hashes, extra)) * self.block_size

    def peek_blocks(self, token_ids: list[int], hashes: list[int], extra: Hashable) -> list[CachedBlock]:
        """The blocks a lookup would find now (touches nothing; dict reads only)."""
        return [block for _, block in self._matched(token_ids, hashes, extra)]

    def lookup(self, token_ids: list[int], hashes: list[int], extra: Hashable) -> list[CachedBlock]:
        """The cached leading blocks, touched (the root last: most recently used)."""
        found = self._matched(token_ids, hashes, extra)
        for key, _ in reversed(found):
            self.blocks.move_to_end(key)
        return [block for _, block in found]

    def add(self, key: int, block: CachedBlock) -> None:
        self.blocks[key] = block
        self.nbytes += block.nbytes
        self._bytes_by_form[block.form] = self._bytes_by_form.get(block.form, 0) + block.nbytes
        self.tokens += len(block.tokens)

    def touch(self, keys: list[int]) -> None:
        """These keys (a chain, root first) become the most recently used, the root last."""
        for key in reversed(keys):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def remove(self, key: int) -> int:
        """Drop one entry (to keep it again with more of its K/V); its bytes."""
        block = self.blocks.pop(key)
        self.nbytes -= block.nbytes
        self._bytes_by_form[block.form] -= block.nbytes
        self.tokens -= len(block.tokens)
        return block.nbytes

    def evict_oldest(self, keep: frozenset[int] = frozenset()) -> int:
        """Drop the least recently used block not in `keep`; its bytes (0: none left to drop)."""
        for key in self.blocks:
            if key not in keep:
                block = self.blocks.pop(key)
                self.nbytes -= block.nbytes
                self._bytes_by_form[block.form] -= block.nbytes
                self.tokens -= len(block.tokens)
                self.evictions += 1
                return block.nbytes
        return 0

    def bytes_by_form(self) -> dict[str, int]:
        """Cached bytes by cache-policy form (forms once cached stay, at 0 when none is left)."""
        return dict(self._bytes_by_form)
