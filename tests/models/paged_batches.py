"""Hand-built `ForwardBatch`es over a real paged KV pool, for testing one attention module alone.

`PagedRequests` keeps a request table, a KV pool of the shapes given and each request's pages,
and hands out batches the way the model runner would: the new tokens' locations in `out_loc`
(drawn a page at a time, so a request's tokens are spread over pages that are not adjacent),
their positions, and the prefix and extend lengths. No recurrent layers: the Mamba pool is empty.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybrid_serve.mem_cache.kv_pool import KVPool
from hybrid_serve.mem_cache.kv_shape import KVShape
from hybrid_serve.mem_cache.mamba_pool import MambaPool
from hybrid_serve.mem_cache.req_pool import ReqToTokenPool
from hybrid_serve.models.forward_batch import ForwardBatch


class PagedRequests:
    def __init__(
        self,
        shapes: Sequence[KVShape],
        page_size: int = 4,
        num_pages: int = 48,
        max_context: int = 64,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self.page_size, self.device = page_size, torch.device(device)
        self.req_pool = ReqToTokenPool(8, max_context, device)
        self.kv_pool = KVPool(num_pages, page_size, shapes, dtype, device)
        self.mamba_pool = MambaPool(1, [], dtype, device=device)
        self.kv_pool.alloc(3)  # pages a request never gets: its pages are not the first ones
        self.seq_len: dict[int, int] = {}  # req_slot -> tokens in the cache
        self.pages: dict[int, list[int]] = {}

    def new_request(self) -> int:
        slot = self.req_pool.alloc(1)[0]
        self.seq_len[slot], self.pages[slot] = 0, []
        return slot

    def _locs(self, slot: int, n: int) -> torch.Tensor:
        start, ps = self.seq_len[slot], self.page_size
        while len(self.pages[slot]) * ps < start + n:
            self.pages[slot] += self.kv_pool.alloc(1).tolist()
        pos = torch.arange(start, start + n)
        locs = torch.tensor(self.pages[slot])[pos // ps] * ps + pos % ps
        self.req_pool.req_to_token[slot, start : start + n] = locs.to(self.req_pool.req_to_token)
        return locs

    def batch(self, new: Sequence[tuple[int, int]], decode: bool = False) -> ForwardBatch:
        """A batch of `(req_slot, new tokens)` pairs, in that order; the new tokens take the next
        positions of each request (the caller feeds their hidden states in the same order)."""
        if decode:
            assert all(n == 1 for _, n in new), "a decode batch has one new token per request"
        out_loc, positions, prefix, extend = [], [], [], []
        for slot, n in new:
            start = self.seq_len[slot]
            out_loc.append(self._locs(slot, n))
            positions.append(torch.arange(start, start + n))
            prefix.append(start)
            extend.append(n)
            self.seq_len[slot] = start + n
        slots = [s for s, _ in new]
        seq_lens = [p + e for p, e in zip(prefix, extend, strict=True)]
        dev = self.device
        return ForwardBatch(
            phase="decode" if decode else "prefill",
            input_ids=torch.zeros(sum(extend), dtype=torch.int64, device=dev),
            positions=torch.cat(positions).to(dev),
            out_loc=torch.cat(out_loc).to(dev),
            req_slots=torch.tensor(slots, device=dev),
            mamba_slots=torch.zeros(len(slots), dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, device=dev),
            prefix_lens_cpu=prefix,
            extend_lens_cpu=extend,
            req_to_token=self.req_pool.req_to_token,
            kv_pool=self.kv_pool,
            mamba_pool=self.mamba_pool,
            max_seq_len=max(seq_lens),
        )
