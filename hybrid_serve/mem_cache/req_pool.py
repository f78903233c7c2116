"""Request pool: one row of ``req_to_token`` per running request, plus the shared slot allocator.

`SlotAllocator` is the free list behind all three pools (request rows, KV pages, Mamba slots). It
hands out integers ``1..size``; ``0`` is reserved as the padding target of every pool (invariant
I1) and is never handed out. Every slot is in exactly one state at any time: free, drawn into an
open allocation group (Mamba pool only), or allocated (held by whoever received it). That state is
kept in a byte per slot, so wrong frees are caught in O(1) per slot and the leak checker can list
the allocated slots without help from the pool's users.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Iterable

import torch

_FREE = 0
_ALLOCATED = 1
_GROUPED = 2  # drawn into an open allocation group, not yet handed out
_RESERVED = 3  # slot 0

SlotIds = int | Iterable[int] | torch.Tensor


def as_slot_list(slots: SlotIds) -> list[int]:
    """Normalise an int, an iterable of ints or an integer tensor (any device, any shape) to a list.

    A tensor on an accelerator is copied to the host (a synchronisation). Floats and bools raise
    `TypeError` rather than being silently truncated.
    """
    if isinstance(slots, torch.Tensor):
        if slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
            raise TypeError(f"slot ids must be an integer tensor, got dtype {slots.dtype}")
        return slots.reshape(-1).tolist()
    items = [slots] if isinstance(slots, int) else list(slots)
    if any(isinstance(s, bool) for s in items):
        raise TypeError("slot ids must be integers, got bool")
    return [operator.index(s) for s in items]


class SlotAllocator:
    """FIFO free list over the integer slots ``1..size`` with a per-slot ownership state.

    Contract:
    - Slot 0 is reserved and never handed out, freed or counted.
    - `alloc(n)` is all or nothing: it returns ``n`` distinct free slots, or ``None`` and leaves the
      allocator unchanged when fewer are available. It never raises for shortage. Cost O(n).
    - `free(slots)` returns allocated slots. Freeing slot 0, an id outside ``1..size``, a free slot,
      a slot drawn into an open group but not handed out, or the same slot twice in one call raises
      `ValueError` naming the slot(s), and then nothing is freed. Cost O(k) for k slots.
    - Order: slots are handed out oldest-freed first (FIFO); a fresh allocator hands out 1, 2, ...
    - Grouped allocation (`group_begin` / `group_end`, used by the Mamba pool): a bulk draw of up to
      ``n`` free slots that later `alloc` calls consume first. See those methods.

    The allocator only does bookkeeping; it owns no tensors. Ownership of a handed-out slot passes
    to the caller until the caller frees it.
    """

    def __init__(self, size: int, name: str = "pool") -> None:
        if size < 1:
            raise ValueError(f"{name}: size must be >= 1, got {size}")
        self.size = size
        self.name = name
        self._state = bytearray(size + 1)
        self._free: deque[int] = deque()
        self._group: deque[int] | None = None
        self._num_allocated = 0
        self.reset()

    # ----------------------------------------------------------------------------------- queries

    def available(self) -> int:
        """Slots that `alloc` could still hand out: the free list plus undrawn group slots."""
        return len(self._free) + (len(self._group) if self._group is not None else 0)

    @property
    def group_open(self) -> bool:
        return self._group is not None

    def group_remaining(self) -> int:
        """Undrawn slots of the open group (0 when no group is open)."""
        return len(self._group) if self._group is not None else 0

    def is_allocated(self, slot: int) -> bool:
        """True iff ``slot`` is in ``1..size`` and currently handed out."""
        return 0 < slot <= self.size and self._state[slot] == _ALLOCATED

    def allocated_slots(self) -> set[int]:
        """The set of slots currently handed out (O(size); meant for leak checks, not hot paths)."""
        state = self._state
        return {i for i in range(1, self.size + 1) if state[i] == _ALLOCATED}

    # ------------------------------------------------------------------------------ alloc / free

    def alloc(self, n: int = 1) -> list[int] | None:
        """Hand out ``n`` slots (group first while a group is open), or ``None`` if short.

        Raises `ValueError` only for a negative ``n`` (a caller bug, not a shortage).
        """
        if n < 0:
            raise ValueError(f"{self.name}: cannot allocate a negative number of slots ({n})")
        group = self._group
        from_group = min(n, len(group)) if group is not None else 0
        from_free = n - from_group
        if from_free > len(self._free):
            return None
        out = [group.popleft() for _ in range(from_group)] if group is not None else []
        free = self._free
        out.extend(free.popleft() for _ in range(from_free))
        state = self._state
        for s in out:
            state[s] = _ALLOCATED
        self._num_allocated += n
        return out

    def check_free(self, slots: list[int]) -> None:
        """Raise `ValueError` naming every slot of ``slots`` that may not be freed now."""
        state = self._state
        problems: dict[str, list[int]] = {}
        seen: set[int] = set()
        for s in slots:
            if s == 0:
                why = "slot 0 is reserved and never handed out"
            elif not 0 < s <= self.size:
                why = f"unknown slot (valid ids are 1..{self.size})"
            elif s in seen:
                why = "given more than once in the same call"
            elif state[s] == _FREE:
                why = "already free (double free)"
            elif state[s] == _GROUPED:
                why = "drawn into the open allocation group but never handed out"
            else:
                seen.add(s)
                continue
            problems.setdefault(why, []).append(s)
        if problems:
            detail = "; ".join(f"{why}: {ids}" for why, ids in problems.items())
            raise ValueError(f"{self.name}: cannot free slot(s) - {detail}")

    def free(self, slots: SlotIds) -> None:
        """Return allocated slots to the back of the free list (all of them, or none on error)."""
        ids = as_slot_list(slots)
        if not ids:
            return
        self.check_free(ids)
        state = self._state
        for s in ids:
            state[s] = _FREE
        self._free.extend(ids)
        self._num_allocated -= len(ids)

    # ------------------------------------------------------------------------- grouped allocation

    def group_begin(self, n: int) -> int:
        """Open a group by drawing ``min(n, free)`` slots in one go; return how many were drawn.

        Never raises for shortage (it draws what exists, possibly 0; the group is open either way).
        Raises `RuntimeError` if a group is already open (nesting is a bug) and `ValueError` for a
        negative ``n``. Drawn slots stay counted by `available` until `group_end`.
        """
        if self._group is not None:
            raise RuntimeError(f"{self.name}: alloc_group_begin while a group is already open")
        if n < 0:
            raise ValueError(f"{self.name}: cannot reserve a negative number of slots ({n})")
        k = min(n, len(self._free))
        free = self._free
        group = deque(free.popleft() for _ in range(k))
        state = self._state
        for s in group:
            state[s] = _GROUPED
        self._group = group
        return k

    def group_end(self) -> int:
        """Close the open group; its undrawn slots go back to the FRONT of the free list, in order.

        Returns how many slots went back. Without an open group this is a harmless no-op returning
        0, so callers may end unconditionally (e.g. in a ``finally``). Because the rest goes back to
        the front, a begin/end pair with no allocation in between leaves the free list as it was.
        """
        group = self._group
        if group is None:
            return 0
        self._group = None
        state = self._state
        for s in group:
            state[s] = _FREE
        self._free.extendleft(reversed(group))
        return len(group)

    # ------------------------------------------------------------------------ reset / integrity

    def reset(self) -> None:
        """Forget every allocation: all of ``1..size`` free in ascending order, no group open.

        Only for a full flush; slots held elsewhere become dangling, so callers must drop them.
        """
        self._state[:] = bytes(len(self._state))
        self._state[0] = _RESERVED
        self._free = deque(range(1, self.size + 1))
        self._group = None
        self._num_allocated = 0

    def check_integrity(self) -> None:
        """Verify the bookkeeping (O(size)); raise `RuntimeError` describing the first violation.

        Checks: slot 0 reserved and nowhere in the free list or group; free list and group hold
        distinct in-range slots in the matching state; free + grouped + allocated == size.
        """
        state = self._state
        if state[0] != _RESERVED:
            raise RuntimeError(f"{self.name}: slot 0 lost its reserved state")
        for label, seq, want in (
            ("free list", self._free, _FREE),
            ("group", self._group or (), _GROUPED),
        ):
            seen: set[int] = set()
            for s in seq:
                if not 0 < s <= self.size or s in seen or state[s] != want:
                    raise RuntimeError(f"{self.name}: {label} holds slot {s} wrongly")
                seen.add(s)
        counts = [state.count(st) for st in (_FREE, _GROUPED, _ALLOCATED, _RESERVED)]
        want = [len(self._free), len(self._group or ()), self._num_allocated, 1]
        if counts != want:
            raise RuntimeError(
                f"{self.name}: slot states (free, grouped, allocated, reserved) {counts} disagree "
                f"with the free list, group and counter {want}"
            )


class SlotPool:
    """Bookkeeping every pool shares: a `SlotAllocator` of ids 1..size (id 0 reserved), whose
    contract `free`, `available` and the rest follow."""

    allocator: SlotAllocator

    def available(self) -> int:
        """Ids that can still be handed out (with an open group: free list plus undrawn)."""
        return self.allocator.available()

    def allocated_slots(self) -> set[int]:
        """Ids currently handed out; undrawn group ids excluded (for the idle leak checker)."""
        return self.allocator.allocated_slots()

    def free(self, slots: SlotIds) -> None:
        """Return handed-out ids; bad ids raise `ValueError` naming them (nothing freed then).
        Freed contents are not cleared."""
        self.allocator.free(slots)

    def check_integrity(self) -> None:
        self.allocator.check_integrity()

    def clear(self) -> None:
        """Mark every id free and close any group (full flush); tensor contents are kept."""
        self.allocator.reset()


class ReqToTokenPool(SlotPool):
    """Table mapping (request row, token position) to a KV token location.

    ``req_to_token`` is an int32 tensor ``[size + 1, max_context_len]`` on ``device``. Row 0 is the
    padding row: it is never handed out and stays all zeros (padded batch rows read it and get KV
    location 0, the reserved padding page of the KV pool), provided nobody writes into it.

    Ownership: `alloc` hands rows to the caller (the scheduler puts one on each `Req` as
    ``req_slot``); the caller must `free` each row exactly once. Freed rows are NOT cleared: a new
    owner must write every position it reads, and positions past a request's ``seq_len`` hold an
    earlier owner's stale locations.
    """

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        if max_context_len < 1:
            raise ValueError(f"max_context_len must be >= 1, got {max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.allocator = SlotAllocator(size, name="ReqToTokenPool")
        self.req_to_token = torch.zeros(
            (size + 1, max_context_len), dtype=torch.int32, device=self.device
        )

    def alloc(self, n: int = 1) -> list[int] | None:
        """Hand out ``n`` distinct rows from ``1..size``, or ``None`` (pool unchanged) if short."""
        return self.allocator.alloc(n)
