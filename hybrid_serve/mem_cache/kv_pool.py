"""Paged K/V cache for the full-attention layers of a hybrid model.

Only the full-attention layers have a KV cache; the model addresses them by their dense index among
attention layers (``0..num_layers-1``), not by their global layer id. Memory is handed out in pages
of ``page_size`` tokens. Page ``p`` covers the token locations ``p * page_size .. p * page_size +
page_size - 1``; page 0 (locations ``0..page_size-1``) is reserved as the write target of padded
batch rows and is never handed out (invariant I1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybrid_serve.mem_cache.kv_shape import KVShape, common_kv_shape, kv_bytes_per_token
from hybrid_serve.mem_cache.req_pool import SlotAllocator, SlotPool

_NO_LAYERS = KVShape.mha(1, 1)  # the trailing dims of a pool without attention layers


class KVPool(SlotPool):
    """The KV rows of every attention layer, as the layers describe them (``shapes``, one
    `KVShape` per layer, all of one shape: `hybrid_serve/mem_cache/kv_shape.py`):

    - ``k_buffer[i]``: ``[rows, heads, k_dim]``, K per head, or MLA's latent row as one head;
    - ``v_buffer[i]``: ``[rows, heads, v_dim]``, V per head; no columns (no memory) for a latent
      row, whose values are read from ``k_buffer``.

    ``rows = (num_pages + 1) * page_size``: page 0 is the reserved padding page.

    ``k_buffer[i]`` / ``v_buffer[i]`` are views into one contiguous allocation per kind, so the list
    entries are stable: kernels may keep references to them. Buffers start zeroed. Copies between
    pools (host tier) and to files (storage tier) move K and V rows alike, whatever their width.

    Allocation is by page: `alloc` returns CPU int64 page ids (host bookkeeping, whatever the buffer
    device), `free` takes them back. The caller owns the pages it received until it frees them,
    exactly once; the pool never frees on its own. Freed pages are not cleared, so a reader must
    only read locations it has written. Freeing is whole-page: the caller tracks which tokens of a
    page are in use.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        shapes: Sequence[KVShape],
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.shapes = tuple(shapes)
        self.shape = common_kv_shape(self.shapes) or _NO_LAYERS
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = len(self.shapes)
        self.dtype = dtype
        self.device = torch.device(device)
        self.allocator = SlotAllocator(num_pages, name="KVPool")
        rows = (num_pages + 1) * page_size
        s = self.shape
        self._k = torch.zeros((self.num_layers, rows, s.heads, s.k_dim), dtype=dtype, device=device)
        self._v = torch.zeros((self.num_layers, rows, s.heads, s.v_dim), dtype=dtype, device=device)
        self.k_buffer: list[torch.Tensor] = list(self._k.unbind(0))
        self.v_buffer: list[torch.Tensor] = list(self._v.unbind(0))

    @property
    def size(self) -> int:
        """Usable capacity in pages (page 0 excluded)."""
        return self.num_pages

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all attention layers (for sizing)."""
        return kv_bytes_per_token(self.shapes, self.dtype)

    # ----------------------------------------------------------------------------- allocation

    def alloc(self, n_pages: int) -> torch.Tensor | None:
        """Hand out ``n_pages`` distinct pages (int64 CPU tensor), or ``None`` (pool unchanged) if
        short. Never returns page 0."""
        pages = self.allocator.alloc(n_pages)
        if pages is None:
            return None
        return torch.tensor(pages, dtype=torch.int64)

    def alloc_locs(self, n_tokens: int) -> torch.Tensor | None:
        """Whole pages for ``n_tokens`` (a multiple of ``page_size``) as token locations (see
        `page_locs`), or ``None`` if short; all or nothing, as `alloc`."""
        pages = self.alloc(n_tokens // self.page_size)
        return None if pages is None else self.page_locs(pages)

    def free_locs(self, locs: torch.Tensor) -> None:
        """Free the pages of token locations ``locs`` (whole pages, as `alloc_locs` gave them)."""
        if len(locs):
            self.free((locs[:: self.page_size] // self.page_size).tolist())

    def available_tokens(self) -> int:
        return self.allocator.available() * self.page_size

    def page_locs(self, pages: torch.Tensor) -> torch.Tensor:
        """Token locations of ``pages``, page by page: int64 ``[len(pages) * page_size]`` on the
        device of ``pages``."""
        offsets = torch.arange(self.page_size, dtype=torch.int64, device=pages.device)
        return (pages.to(torch.int64).unsqueeze(-1) * self.page_size + offsets).reshape(-1)

    # ------------------------------------------------------------------------------- K/V access

    @property
    def k_all(self) -> torch.Tensor:
        """Every layer's K buffer in one ``[num_layers, rows, heads, k_dim]`` tensor
        (``k_buffer[i]`` is ``k_all[i]``)."""
        return self._k

    @property
    def v_all(self) -> torch.Tensor:
        return self._v

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_buffer[layer], v_buffer[layer])``: the live buffers, not copies."""
        return self.k_buffer[layer], self.v_buffer[layer]
