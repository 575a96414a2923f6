"""The KV store: the one owner of a model's K/V memory, sized by the budget the scheduler admits against.

Sequences live in capacity classes (classes.py). Each class with rows costs one graph call per
step, mostly fixed cost, so a sequence whose own rung has no rows joins the rung above when that
one has (`_placement`: the row is still >= 64% used). For the same reason a class whose rows would
all stay >= 64% full one rung up moves there whole when one of them fills (`_movers`): one
re-allocation, and still one call per step.

Accounting and memory are the same thing here: `reserve` allocates the row (or grows the class
array) at once, or says no, and refuses anything that would take the allocated bytes above the
budget at their peak. On the host a class changes its row count in place (region.py), so its peak
is its new size; device arrays are re-allocated, the old one alive while the members are copied.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from contract.cache_policy import FULL_POLICY, CachePolicy
from service.engine.kv.arrays import Array, Backend, NumpyArrays
from service.engine.kv.classes import GROWTH, CapacityClass, capacity_ladder
from service.engine.kv.layout import INT8, INT8_CHANNEL, KVLayout
from service.engine.kv.prefix import CachedBlock, CachedPast, PrefixCache
from service.engine.kv.rows import SplitKV
from service.engine.kv.spec import RowEviction, SlidingWindowSpec

# A class moves up the ladder as a whole when each of its rows would be at least this full there.
PROMOTED_FILL = 1 / GROWTH**2


class KVBudgetError(ValueError):
    """The budget cannot hold one sequence of the longest allowed length."""


def _populated(klass: CapacityClass | None) -> bool:
    return klass is not None and bool(klass.members or klass.reserved)


@dataclass(frozen=True)
class StoreStats:
    used_tokens: int  # tokens held or promised (rounded up to blocks in used_bytes)
    used_bytes: int
    physical_bytes: int  # K/V arrays allocated now
    peak_physical_bytes: int  # high-water mark (with both arrays while a device class is re-allocated)
    capacity_bytes: int
    sequences: int
    classes: int
    cached_bytes: int = 0  # the prefix cache's blocks (in used and physical bytes too)


class KVStore:
    """Every sequence's cache for one model, within `budget_bytes` of allocated K/V memory."""

    def __init__(
        self,
        layout: KVLayout,
        budget_bytes: int,
        block_size: int,
        max_tokens: int,
        backend: Backend | None = None,
        rotary_inv_freq: np.ndarray | None = None,
    ) -> None:
        """`rotary_inv_freq`: a RoPE model's inverse frequencies, with which bounded policies move sink keys."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.layout, self.block_size, self.max_tokens = layout, block_size, max_tokens
        self.backend: Backend = backend or NumpyArrays()
        self.rotary_inv_freq = rotary_inv_freq
        self.block_bytes = block_size * layout.token_bytes
        self.capacity_bytes = budget_bytes // self.block_bytes * self.block_bytes
        self.ladder = capacity_ladder(max_tokens, block_size)
        minimum = self.minimum_budget(layout, max_tokens, block_size)
        if self.capacity_bytes < minimum:
            raise KVBudgetError(
                f"kv cache budget {budget_bytes} bytes cannot hold one sequence of {max_tokens} tokens "
                f"(needs at least {minimum} bytes)"
            )
        self.classes: dict[int, CapacityClass] = {}  # float rows (the layout's dtype), by capacity
        self.kinds: dict[str, dict[int, CapacityClass]] = {layout.dtype: self.classes, INT8: {}, INT8_CHANNEL: {}}
        self.capacity_of: dict[str, int] = {}  # sequence -> the capacity of its class
        self.kind_of: dict[str, str] = {}  # sequence -> the storage kind of its class
        self.tokens: dict[str, int] = {}  # sequence -> tokens reserved
        self.physical_bytes = 0  # rows and the prefix cache's blocks
        self.peak_physical_bytes = 0
        self.prefix = PrefixCache(block_size)
        self._local_block_bytes = 0 if layout.local is None else layout.local.token_bytes * block_size

    @staticmethod
    def minimum_budget(layout: KVLayout, max_tokens: int, block_size: int) -> int:
        """One sequence of `max_tokens`, including its move from the class below (both rows alive)."""
        ladder = capacity_ladder(max_tokens, block_size)
        below = ladder[-2] if len(ladder) > 1 else 0
        whole_blocks = -(-(ladder[-1] + below) // block_size) * block_size
        window = layout.local  # a split row's local columns, in each row alive
        local = 0 if window is None else window.row_bytes(ladder[-1]) + window.row_bytes(below)
        return whole_blocks * layout.token_bytes + local

    def class_for(self, tokens: int) -> int:
        for capacity in self.ladder:
            if capacity >= tokens:
                return capacity
        raise ValueError(f"{tokens} tokens exceed the store's max_tokens={self.max_tokens}")

    def _placement(self, own: int, kind: str) -> int:
        """The class a sequence whose own rung of the ladder is `own` goes to: that one, or the next
        one up when that one holds rows and its own holds none. Every class with members costs one
        graph call per step, mostly fixed cost, so a row one rung wider (still >= 64% used) beats
        a call of its own."""
        classes = self.kinds[kind]
        if _populated(classes.get(own)):
            return own
        rung = self.ladder.index(own)
        if rung + 1 < len(self.ladder) and _populated(classes.get(self.ladder[rung + 1])):
            return self.ladder[rung + 1]
        return own

    def _class_of(self, sequence_id: str) -> CapacityClass | None:
        capacity = self.capacity_of.get(sequence_id)
        return None if capacity is None else self.kinds[self.kind_of[sequence_id]].get(capacity)

    # ------------------------------------------------------------------ accounting = allocation

    def capacity(self, sequence_id: str) -> int:
        """Tokens the sequence's row holds (0: none reserved)."""
        return self.capacity_of.get(sequence_id, 0)

    def reserve(
        self,
        sequence_id: str,
        tokens: int,
        policy: CachePolicy = FULL_POLICY,
        keep: frozenset[int] = frozenset(),
    ) -> bool:
        """Make room for `tokens` tokens of the sequence: a row for a new one (written later by
        `write`, in a class of the storage kind its cache `policy` takes: KVLayout.kind_of), a
        move to a wider class of its kind when its row is full. False, with nothing changed, when that
        would take the allocated memory above the budget. Cached prefix blocks make room first, except
        those in `keep` (the ones a prompt admitted in the same step is about to take)."""
        if tokens > self.max_tokens:
            return False
        current = self.capacity_of.get(sequence_id)
        kind = self.kind_of.get(sequence_id) or self.layout.kind_of(policy)
        if current is not None and current >= tokens:
            self.tokens[sequence_id] = max(tokens, self.tokens.get(sequence_id, 0))
            return True
        own = self.class_for(tokens)
        target = self._placement(own, kind)
        moving = self._class_of(sequence_id)
        movers, rows_needed = [sequence_id], 1
        if moving is not None and sequence_id in moving.members:
            movers = self._movers(moving, sequence_id, target)
            # Members as full as this one move this step too: room for them in one re-allocation.
            full = int((moving.lengths[: len(moving.members)] >= moving.capacity).sum())
            rows_needed = max(len(movers), full)
        destination = self._room(target, rows_needed, kind)
        if destination is None and target != own:
            target = own  # the rung above cannot grow within the budget: the sequence's own rung
            destination = self._room(target, rows_needed, kind)
        if destination is None:
            self.trim(all_spare=True)
            destination = self._room(target, rows_needed, kind) or self._room_evicting(target, rows_needed, kind, keep)
            if destination is None:
                return False
        if destination.free_rows < len(movers):
            movers = [sequence_id]  # no room for its whole class within the budget: the sequence alone
        destination.reserved.add(sequence_id)
        source = self._class_of(sequence_id)  # trim may have re-made it
        if source is not None:
            if sequence_id in source.members:  # a move: the rows' caches go with them, on the device
                for mover in reversed(movers):  # the last rows first: no row is copied twice
                    row = source.members.index(mover)
                    destination.write(mover, source.row_cache(row), int(source.lengths[row]), source.policies[row])
                    source.remove(mover)
                    self.capacity_of[mover] = target
            else:
                source.reserved.discard(sequence_id)
            self._release_if_empty(source)
        self.capacity_of[sequence_id] = target
        self.kind_of[sequence_id] = kind
        self.tokens[sequence_id] = max(tokens, self.tokens.get(sequence_id, 0))
        return True

    def _movers(self, source: CapacityClass, sequence_id: str, target: int) -> list[str]:
        """Who moves to `target` with a sequence whose row in `source` is full: the whole class when
        every member would fill at least PROMOTED_FILL of a row there (one class stays one graph
        call per step, where moving one by one would hold two calls per step until the last one
        moved, and re-allocate the wider class once per mover); else the sequence alone."""
        batch = len(source.members)
        if batch > 1 and not source.bounded and int(source.lengths[:batch].min()) >= PROMOTED_FILL * target:
            return list(source.members)
        return [sequence_id]

    def _room(self, capacity: int, rows_needed: int, kind: str) -> CapacityClass | None:
        """The class with `rows_needed` free rows, grown if it must be: with an eighth more rows of
        headroom if that fits, else exactly. Over the budget, the free rows it already has, else
        grown by the one row that must be."""
        existing = self.kinds[kind].get(capacity)
        if existing is not None and existing.free_rows >= rows_needed:
            return existing
        held = 0 if existing is None else existing.rows - existing.free_rows
        wanted = held + rows_needed
        for rows in dict.fromkeys((wanted + wanted // 8, wanted)):
            grown = self._reallocate(capacity, rows, kind)
            if grown is not None:
                return grown
        if existing is not None and existing.free_rows > 0:
            return existing
        return self._reallocate(capacity, held + 1, kind) if rows_needed > 1 else None

    def _room_evicting(
        self, capacity: int, rows_needed: int, kind: str, keep: frozenset[int] = frozenset()
    ) -> CapacityClass | None:
        """`_room`, making room by evicting cached prefix blocks not in `keep` (least recently used
        first) a class row's worth at a time: a cached block goes before any sequence is refused or
        preempted. Nothing is evicted when evicting all it may would still leave no room (a class
        that cannot grow beside its old array, on a device): the cache would be lost for nothing."""
        row_bytes = self.layout.row_bytes(capacity, kind)
        existing = self.kinds[kind].get(capacity)
        held = 0 if existing is None else existing.rows - existing.free_rows
        evictable = sum(block.nbytes for key, block in self.prefix.blocks.items() if key not in keep)
        if self.physical_bytes - evictable + self._growth_bytes(capacity, held + 1, kind) > self.capacity_bytes:
            return None
        step = rows_needed * row_bytes
        while True:
            freed = 0
            while freed < step and (nbytes := self.prefix.evict_oldest(keep)):
                freed += nbytes
            self.physical_bytes -= freed
            destination = self._room(capacity, rows_needed, kind)
            if destination is not None or not freed:
                return destination

    def _growth_bytes(self, capacity: int, rows: int, kind: str) -> int:
        """What making the class `rows` rows adds to the physical bytes at its peak: on the host its
        arrays change size in place (the difference); elsewhere a new array is allocated and
        filled while the old one is alive (the whole new array)."""
        old = self.kinds[kind].get(capacity)
        new_bytes = rows * self.layout.row_bytes(capacity, kind)
        return new_bytes - old.nbytes if old is not None and old.resizes_in_place else new_bytes

    def _reallocate(self, capacity: int, rows: int, kind: str) -> CapacityClass | None:
        """The class with `rows` rows, members kept: its arrays resized in place on the host, else a
        new array with the members copied over; None if that would exceed the budget at its peak."""
        old = self.kinds[kind].get(capacity)
        growth = self._growth_bytes(capacity, rows, kind)
        if self.physical_bytes + growth > self.capacity_bytes:
            return None
        self.peak_physical_bytes = max(self.peak_physical_bytes, self.physical_bytes + growth)
        if old is not None and old.resizes_in_place:
            fresh = CapacityClass.resized_from(old, rows)
        else:
            fresh = CapacityClass(
                self.backend, self.layout, capacity, rows, self.rotary_inv_freq, kind, self.capacity_bytes
            )
            if old is not None:
                fresh.copy_members_from(old)
        if old is not None:
            self.physical_bytes -= old.nbytes
        self.kinds[kind][capacity] = fresh
        self.physical_bytes += fresh.nbytes
        return fresh

    def _release_if_empty(self, klass: CapacityClass) -> None:
        if not klass.members and not klass.reserved:
            self.physical_bytes -= klass.nbytes
            del self.kinds[klass.kind][klass.capacity]

    def all_classes(self) -> list[CapacityClass]:
        return [klass for classes in self.kinds.values() for klass in classes.values()]

    def has_class(self, key: tuple[int, str]) -> bool:
        capacity, kind = key
        return capacity in self.kinds[kind]

    def trim(self, all_spare: bool = False) -> None:
        """Give back spare rows where more than a quarter of a class is spare (`all_spare`: every
        spare row, when memory ran out): in place on the host; on a device if the copy fits beside the old array."""
        for klass in self.all_classes():
            held = klass.rows - klass.free_rows
            if all_spare and held and klass.free_rows:
                self._reallocate(klass.capacity, held, klass.kind)
            elif held and klass.free_rows > max(1, klass.rows // 4):
                self._reallocate(klass.capacity, held + held // 8, klass.kind)

    def free(self, sequence_id: str) -> None:
        """The sequence is done (finished, aborted or preempted): its row is free at once."""
        klass = self._class_of(sequence_id)
        self.capacity_of.pop(sequence_id, None)
        self.kind_of.pop(sequence_id, None)
        self.tokens.pop(sequence_id, None)
        if klass is None:
            return
        if sequence_id in klass.members:
            klass.remove(sequence_id)
        klass.reserved.discard(sequence_id)
        self._release_if_empty(klass)

    def verifies_blocks(self, sequence_id: str) -> bool:
        """Whether a sequence's rows take several tokens in one call (StorageSpec.verifies_blocks); a
        sequence not yet in a class: its rows will be of the layout's float kind, which does."""
        kind = self.kind_of.get(sequence_id)
        return kind is None or self.layout.storage(kind).verifies_blocks

    def write(self, sequence_id: str, kv: Array, length: int, policy: RowEviction | None = None) -> None:
        """A prefilled prompt's cache, (tensors, heads, length, head_dim), into its reserved row
        (float K/V, quantized there for an int8 row; or an int8 row's own `Int8KV`)."""
        klass = self._class_of(sequence_id)
        if klass is None or sequence_id not in klass.reserved:
            raise KeyError(f"sequence {sequence_id!r} holds no reserved row")
        if length > klass.capacity:
            raise ValueError(f"sequence {sequence_id!r}: {length} tokens exceed its row of {klass.capacity}")
        klass.write(sequence_id, kv, length, policy)

    # ------------------------------------------------------------------ the prefix cache

    def cached_prefix(self, token_ids: list[int], hashes: list[int], extra: object, limit: int) -> tuple[int, Array]:
        """The longest cached run of the prompt's leading blocks, at most `limit` tokens: how many
        tokens and their K/V (2 x layers, 1, heads, tokens, head_dim), a copy (0 and None: a miss)."""
        past = self.cached_past(token_ids, hashes, extra, limit)
        return (0, None) if past is None else (past.tokens, past.assemble())

    def cached_past(self, token_ids: list[int], hashes: list[int], extra: object, limit: int) -> CachedPast | None:
        """`cached_prefix`'s blocks, not yet copied (None: a miss)."""
        blocks = self.prefix.lookup(token_ids, hashes, extra)
        tokens, repair = self._split_hit(blocks, min(len(blocks) * self.block_size, limit))
        if tokens <= 0:
            return None
        whole, rest = divmod(tokens, self.block_size)
        parts = [block.kv for block in blocks[:whole]] + ([blocks[whole].kv[:, :, :rest]] if rest else [])
        local = self._local_window(self.layout.local, blocks, tokens) if self.layout.local and not repair else None
        return CachedPast(parts, self.backend, self.layout.dtype, local, repair)

    def _split_hit(self, blocks: list[CachedBlock], tokens: int) -> tuple[int, int]:
        """A hit of at most `tokens` and the tokens before it whose local K/V are to be recomputed (0:
        none). Split rows need the local window before a hit: where the cache holds it (the blocks near a
        cached prompt's end), as is; else the window is recomputed after the global K/V
        (KVLayout.repair_tokens) where that costs fewer tokens than stepping back to a held window."""
        if self.layout.local is None:
            return tokens, 0
        held, repair = self._local_hit(self.layout.local, blocks, tokens), self.layout.repair_tokens
        if held == tokens or not repair or tokens - held <= repair:
            return held, 0
        return tokens, repair

    def peek_cached(self, token_ids: list[int], hashes: list[int], extra: object) -> int:
        """Tokens a lookup would find now (admission's estimate; touches nothing): for split rows, as
        `cached_past` rules on their local window (`_split_hit`)."""
        if self.layout.local is None:
            return self.prefix.peek(token_ids, hashes, extra)
        blocks = self.prefix.peek_blocks(token_ids, hashes, extra)
        return self._split_hit(blocks, len(blocks) * self.block_size)[0]

    def _local_hit(self, window: SlidingWindowSpec, blocks: list[CachedBlock], tokens: int) -> int:
        """The longest hit, at most `tokens`, whose local window (the `window - 1` tokens before it,
        which the next token's local layers attend to) every block covering it holds: a hit ends at
        a block boundary below `tokens` when the blocks just before it kept no local K/V."""
        size, past = self.block_size, window.keep_tokens
        while tokens > 0:
            first, last = max(0, tokens - past) // size, -(-tokens // size)
            if all(block.local is not None for block in blocks[first:last]):
                return tokens
            tokens = (last - 1) * size
        return 0

    def _local_window(self, window: SlidingWindowSpec, blocks: list[CachedBlock], tokens: int) -> list[Array]:
        """The local K/V of the `window - 1` tokens before `tokens` (at most), as parts of the blocks that hold them."""
        start, size = max(0, tokens - window.keep_tokens), self.block_size
        parts = []
        for index in range(start // size, -(-tokens // size)):
            low, high = max(start, index * size), min(tokens, (index + 1) * size)
            local = blocks[index].local
            assert local is not None
            parts.append(local[:, :, low - index * size : high - index * size])
        return parts

    def cache_prompt(self, token_ids: list[int], hashes: list[int], extra: object, kv: Array, form: str) -> int:
        """Keep the full blocks of a computed prompt, K/V (2 x layers, heads, length, head_dim), that
        are not cached yet, within the budget: older cached blocks make room, rows never do (when
        only this prompt's own blocks are left, the rest is not kept). Returns the blocks added."""
        chain, size, added = frozenset(hashes), self.block_size, 0
        parent = hash(extra)
        local, local_start = None, 0
        if isinstance(kv, SplitKV):  # the local K/V of the prompt's last tokens: kept for the blocks they cover
            local, kv = kv.local_kv, kv.global_kv
            local_start = int(kv.shape[2]) - int(local.shape[2])
        for index, key in enumerate(hashes):
            start = index * size
            block_local = None
            if local is not None and start >= local_start:
                block_local = self.backend.copy(local[:, :, start - local_start : start - local_start + size])
            if key not in self.prefix.blocks or (block_local is not None and self.prefix.blocks[key].local is None):
                nbytes = self.block_bytes + (0 if block_local is None else self._local_block_bytes)
                if key in self.prefix.blocks:  # kept before without its local K/V: replaced with them
                    self.physical_bytes -= self.prefix.remove(key)
                if not self._room_for_cached(nbytes, chain):
                    self.prefix.touch(hashes[:index])
                    return added
                tokens = tuple(token_ids[start : start + size])
                copied = self.backend.copy(kv[:, :, start : start + size])
                self._add_cached(key, CachedBlock(parent, tokens, copied, nbytes, form, block_local))
                added += 1
            parent = key
        self.prefix.touch(hashes)
        return added

    def cache_segment(self, key: int, tokens: tuple[int, ...], kv: Array, form: str) -> bool:
        """Keep a reusable segment's K/V computed on its own, (2 x layers, heads, T, head_dim), as one
        entry of the prefix cache (same budget, same eviction). False: no room without evicting rows."""
        nbytes = len(tokens) * self.layout.token_bytes
        if isinstance(kv, SplitKV) and self.layout.local:  # and the local K/V of its last tokens
            nbytes += int(kv.local_kv.shape[2]) * self.layout.local.token_bytes
        if key in self.prefix.blocks or not self._room_for_cached(nbytes, frozenset((key,))):
            return False
        self._add_cached(key, CachedBlock(0, tokens, kv, nbytes, form))
        return True

    def cached_segment(self, key: int, tokens: tuple[int, ...]) -> Array | None:
        """A segment's K/V kept by `cache_segment` (touched), or None. Never written in place: safe to
        read on another thread after it is evicted."""
        block = self.prefix.blocks.get(key)
        if block is None or block.tokens != tokens:
            return None
        self.prefix.touch([key])
        return block.kv

    def _room_for_cached(self, nbytes: int, keep: frozenset[int]) -> bool:
        """Evict older cached entries (not `keep`) until `nbytes` more fit the budget; False if they cannot."""
        while self.physical_bytes + nbytes > self.capacity_bytes:
            freed = self.prefix.evict_oldest(keep=keep)
            if not freed:
                return False
            self.physical_bytes -= freed
        return True

    def _add_cached(self, key: int, block: CachedBlock) -> None:
        self.prefix.add(key, block)
        self.physical_bytes += block.nbytes
        self.peak_physical_bytes = max(self.peak_physical_bytes, self.physical_bytes)

    # ------------------------------------------------------------------ reading

    def batches(self) -> Iterator[CapacityClass]:
        """Classes with members, float ones then int8 ones, each narrowest first: one graph call
        each per decode step."""
        for classes in self.kinds.values():
            for capacity in sorted(classes):
                if classes[capacity].members:
                    yield classes[capacity]

    def members(self) -> list[str]:
        return [sequence for klass in self.batches() for sequence in klass.members]

    def rewind(self, tokens: int) -> None:
        """Take back every member's last `tokens` tokens (benchmarks measure steps at a fixed context)."""
        for klass in self.batches():
            klass.rewind(tokens)

    def holders(self) -> list[str]:
        return list(self.capacity_of)

    def length(self, sequence_id: str) -> int:
        klass = self._class_of(sequence_id)
        assert klass is not None, f"sequence {sequence_id!r} holds no row"
        return int(klass.lengths[klass.members.index(sequence_id)])

    def held_bytes(self) -> dict[str, int]:
        """Bytes each sequence holds or is promised (its tokens in whole blocks of its storage kind, and
        a split row's local columns): the engine sums them by cache-policy form for the `policy` label."""
        blocks = {sequence: -(-tokens // self.block_size) for sequence, tokens in self.tokens.items()}
        return {
            sequence: self.layout.row_bytes(count * self.block_size, self.kind_of[sequence])
            for sequence, count in blocks.items()
        }

    def stats(self) -> StoreStats:
        return StoreStats(
            used_tokens=sum(self.tokens.values()) + self.prefix.tokens,
            used_bytes=sum(self.held_bytes().values()) + self.prefix.nbytes,
            physical_bytes=self.physical_bytes,
            peak_physical_bytes=self.peak_physical_bytes,
            capacity_bytes=self.capacity_bytes,
            sequences=len(self.capacity_of),
            classes=len(self.all_classes()),
            cached_bytes=self.prefix.nbytes,
        )
