"""Per-slot recurrent state of the recurrent layers (Gated DeltaNet, Mamba2).

One slot holds, for every recurrent layer, the short-convolution window and the recurrent state
of one sequence, in the shapes the layers describe (`mem_cache/state_shape.py`). A running
request owns one slot (``mamba_slot``), extra-buffer strategies also own track slots, and
radix-tree nodes and sessions own slots of their own; every slot has exactly one owner at a time
(invariant I2). Slot 0 is reserved: padded decode rows may write
garbage there, and it is never handed out (invariant I1).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from hybrid_serve.mem_cache.req_pool import SlotAllocator, SlotIds, SlotPool, as_slot_list
from hybrid_serve.mem_cache.state_shape import MambaStateShape, common_shape, state_bytes_per_slot

_NO_LAYERS = MambaStateShape(1, 1, (1,))  # the trailing dims of a pool without recurrent layers


class MambaPool(SlotPool):
    """State tensors for ``size`` slots (plus the reserved slot 0) and their free list.

    Built from one `MambaStateShape` per recurrent layer (``shapes``, the model's own
    description: `hybrid_serve/mem_cache/state_shape.py`), all of one shape:

    - ``conv_state``: ``[num_layers, size + 1, conv_dim, conv_width]`` in ``conv_dtype``, the
      last ``conv_width`` (kernel - 1) pre-convolution inputs, channel-first, oldest first.
    - ``ssm_state``: ``[num_layers, size + 1, *temporal]`` in ``ssm_dtype`` (fp32 by default),
      laid out as the layer's kernels read it (GDN: K-major [HV, dk, dv]; Mamba2: [H, P, N]).
    - ``hidden``: ``[size + 1, hidden_size]`` in ``conv_dtype``, one row per slot for the final
      hidden state (the normed hidden that feeds lm_head) at the last position of the tokens
      behind the slot's state, where a radix node says it is valid (exact prompt repeats then
      need no forward: `mem_cache/radix_cache.py`). Empty rows when ``hidden_size`` is 0.

    ``num_layers`` counts recurrent layers; the model addresses them by their dense index.
    All tensors start zeroed. `copy` and zeroing leave ``hidden`` alone: a row means something
    only through its node's flag.

    Ownership: `alloc` hands zeroed slots to the caller, who owns them until it passes them on or
    frees them, exactly once. Slot ids are host-side bookkeeping: `alloc` returns int64 CPU tensors
    whatever the state device; every method also accepts ids as ints, lists or tensors on any device
    (a device tensor costs a synchronisation).

    Grouped allocation (after SGLang PR #25000): the scheduler opens a group for a prefill round
    (`alloc_group`), drawing its slots from the free list at once; `alloc` serves from the group
    first. `available()` is the same with the group open or closed (`SlotAllocator.group_begin`).
    """

    def __init__(
        self,
        size: int,
        shapes: Sequence[MambaStateShape],
        conv_dtype: torch.dtype,
        ssm_dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        hidden_size: int = 0,
    ) -> None:
        self.shapes = tuple(shapes)
        shape = common_shape(self.shapes) or _NO_LAYERS
        self.size = size
        self.num_layers = len(self.shapes)
        self.conv_dtype = conv_dtype
        self.ssm_dtype = ssm_dtype
        self.device = torch.device(device)
        self.allocator = SlotAllocator(size, name="MambaPool")
        self.conv_state = torch.zeros(
            (self.num_layers, size + 1, *shape.conv), dtype=conv_dtype, device=self.device
        )
        self.ssm_state = torch.zeros(
            (self.num_layers, size + 1, *shape.temporal), dtype=ssm_dtype, device=self.device
        )
        self.hidden_size = hidden_size
        self.hidden = torch.zeros((size + 1, hidden_size), dtype=conv_dtype, device=self.device)

    @staticmethod
    def state_bytes_per_slot(
        shapes: Sequence[MambaStateShape],
        conv_dtype: torch.dtype,
        ssm_dtype: torch.dtype = torch.float32,
    ) -> int:
        """Bytes one slot occupies over all layers (conv plus ssm state), for sizing the pool."""
        return state_bytes_per_slot(shapes, conv_dtype, ssm_dtype)

    @property
    def bytes_per_slot(self) -> int:
        conv, ssm = self.conv_state[:, 0], self.ssm_state[:, 0]
        return conv.numel() * conv.element_size() + ssm.numel() * ssm.element_size()

    # ------------------------------------------------------------------------------ allocation

    def alloc(self, n: int = 1, *, zero: bool = True) -> torch.Tensor | None:
        """Hand out ``n`` distinct slots as an int64 CPU tensor, or ``None`` (pool unchanged) if
        short; the group first while one is open.

        Postcondition (with ``zero=True``, the default): the conv and ssm states of the returned
        slots are zero in every layer. ``zero=False`` skips that for a caller that overwrites the
        whole state at once, e.g. a copy-on-write destination filled by `copy`.
        """
        slots = self.allocator.alloc(n)
        if slots is None:
            return None
        out = torch.tensor(slots, dtype=torch.int64)
        if zero and slots:
            self._zero(out)
        return out

    def alloc_group_begin(self, n: int) -> int:
        """`SlotAllocator.group_begin`: moves ids only (`alloc` zeroes a slot it hands out)."""
        return self.allocator.group_begin(n)

    def alloc_group_end(self) -> int:
        """`SlotAllocator.group_end` (a no-op without an open group)."""
        return self.allocator.group_end()

    @contextmanager
    def alloc_group(self, n: int) -> Iterator[int]:
        """``with pool.alloc_group(n) as got:`` - begin/end pair that also ends on exceptions."""
        got = self.alloc_group_begin(n)
        try:
            yield got
        finally:
            self.alloc_group_end()

    @property
    def group_open(self) -> bool:
        return self.allocator.group_open

    def group_remaining(self) -> int:
        return self.allocator.group_remaining()

    # --------------------------------------------------------------------------- state access

    def get_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(conv_state[layer], ssm_state[layer])`` of one recurrent layer, which
        kernels update in place."""
        return self.conv_state[layer], self.ssm_state[layer]

    def copy(self, src: SlotIds, dst: SlotIds) -> None:
        """Copy conv and ssm state of ``src[i]`` into ``dst[i]`` in every layer (copy-on-write).

        Preconditions, checked (`ValueError` naming the ids): equal lengths; every id currently
        handed out (so never slot 0, a free slot or an undrawn group slot); no id repeated in
        ``dst``. ``src`` and ``dst`` may overlap: all sources are read before any write. Only the
        ``dst`` slots change.
        """
        src_ids = as_slot_list(src)
        dst_ids = as_slot_list(dst)
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"MambaPool.copy: {len(src_ids)} sources but {len(dst_ids)} targets")
        self._require_allocated(src_ids, "copy from")
        self._require_allocated(dst_ids, "copy into")
        if len(set(dst_ids)) != len(dst_ids):
            dup = sorted({s for s in dst_ids if dst_ids.count(s) > 1})
            raise ValueError(f"MambaPool.copy: target slot(s) {dup} given more than once")
        if not src_ids:
            return
        s = torch.tensor(src_ids, dtype=torch.int64, device=self.device)
        d = torch.tensor(dst_ids, dtype=torch.int64, device=self.device)
        self.conv_state.index_copy_(1, d, self.conv_state.index_select(1, s))
        self.ssm_state.index_copy_(1, d, self.ssm_state.index_select(1, s))

    def _require_allocated(self, ids: list[int], what: str) -> None:
        bad = [s for s in ids if not self.allocator.is_allocated(s)]
        if bad:
            raise ValueError(f"MambaPool: cannot {what} slot(s) {bad}: not currently handed out")

    def _zero(self, slots: torch.Tensor) -> None:
        idx = slots.to(self.device)
        self.conv_state.index_fill_(1, idx, 0)
        self.ssm_state.index_fill_(1, idx, 0)
