"""`ModelRunner`: the model with its pools, and the only code that builds `ForwardBatch`es.

The runner owns the request pool, the KV pool (attention layers) and the Mamba pool (Gated
DeltaNet layers) sized from `RunnerConfig`. Callers (the scheduler, tests) own the slots they
allocate; the runner only turns host-side descriptions of a step into device tensors:

    prefill: ExtendInput(req_slot, mamba_slot, prefix_len, input_ids) per request
    decode:  DecodeInput(req_slot, mamba_slot, seq_len, input_id) per request

KV for the new tokens is allocated with `alloc_kv` (one request) or `alloc_decode_kv` (one token
for each of many requests), which record the locations in `req_to_token`; `free_kv` gives a
request's pages back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from hybrid_serve.mem_cache.kv_pool import KVPool
from hybrid_serve.mem_cache.mamba_pool import MambaPool
from hybrid_serve.mem_cache.req_pool import ReqToTokenPool
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.protocol import ServedModel
from hybrid_serve.scheduler.config import RunnerConfig
from hybrid_serve.scheduler.penalties import TokenCounts
from hybrid_serve.scheduler.pool_sizing import ssm_state_dtype
from hybrid_serve.scheduler.sampler import SampleOutput, Sampler
from hybrid_serve.scheduler.sampling_params import SamplingParams

T = TypeVar("T")

logger = logging.getLogger(__name__)


@dataclass
class ExtendInput:
    req_slot: int
    mamba_slot: int
    prefix_len: int  # tokens already in KV and in the state of mamba_slot
    input_ids: list[int]  # the new tokens to compute now
    track_offset: int = 0  # > 0: also leave the state after this many new tokens in track_slot
    track_slot: int = 0
    step_slots: list[int] | None = None  # verify: the state after each new token but the last


@dataclass
class DecodeInput:
    req_slot: int
    mamba_slot: int
    seq_len: int  # tokens already cached; the new token goes to position seq_len
    input_id: int


class ModelRunner:
    def __init__(self, model: ServedModel, config: RunnerConfig) -> None:
        self.model, self.config = model, config
        mc = model.local_config  # this rank's heads: its pools hold only their states
        device = torch.device(config.device)
        dtype = next(model.parameters()).dtype
        self.device = device
        self.req_pool = ReqToTokenPool(config.max_running_requests, config.max_context_len, device)
        num_pages = -(-config.max_total_tokens // config.page_size)
        self.kv_pool = KVPool(num_pages, config.page_size, model.kv_shapes, dtype, device)
        ssm_dtype = ssm_state_dtype(config, model)
        cpp_fp32 = model.ops.backend == "cpp" and model.ops.state_dtype == torch.float32
        if cpp_fp32 and ssm_dtype != torch.float32:  # the C++ recurrent ops read fp32 only
            raise ValueError(
                f"the model's kernels were chosen for {model.ops.state_dtype} recurrent states, "
                f"the pool holds {ssm_dtype}: load it with mamba_ssm_dtype as the runner's"
            )
        self.mamba_pool = MambaPool(
            config.mamba_slots,
            model.state_shapes,  # what each recurrent layer keeps per sequence
            conv_dtype=dtype,
            ssm_dtype=ssm_dtype,
            device=device,
            hidden_size=mc.hidden_size,
        )
        self.sampler = Sampler(tuple(mc.eos_token_ids))

    # ---- KV bookkeeping ------------------------------------------------------------------
    def alloc_kv(self, req_slot: int, prefix_len: int, extend_len: int) -> torch.Tensor | None:
        """Locations for positions [prefix_len, prefix_len + extend_len) of a request, written
        into its req_to_token row. New pages are drawn only where a position starts a page; the
        rest go into the request's last partial page. None (nothing changed) when short."""
        ps = self.config.page_size
        end = prefix_len + extend_len
        if end > self.config.max_context_len:
            raise ValueError(
                f"sequence of {end} tokens exceeds the context of {self.config.max_context_len}"
            )
        first_new_page = -(-prefix_len // ps)  # page index within the request
        n_new = -(-end // ps) - first_new_page
        pages = self.kv_pool.alloc(n_new) if n_new > 0 else torch.empty(0, dtype=torch.int64)
        if pages is None:
            return None
        row = self.req_pool.req_to_token[req_slot]
        if n_new > 0:
            locs = self.kv_pool.page_locs(pages)
            row[first_new_page * ps : (first_new_page + n_new) * ps] = locs.to(row)
        return row[prefix_len:end].long()

    def alloc_decode_kv(self, req_slots: list[int], positions: list[int]) -> torch.Tensor | None:
        """One location per request for its token at `positions[i]`, all or nothing (None when
        short). Page size 1 takes one bulk draw; larger pages go request by request."""
        if self.config.page_size > 1:
            locs = []
            for i, (slot, pos) in enumerate(zip(req_slots, positions, strict=True)):
                loc = self.alloc_kv(slot, pos, 1)
                if loc is None:  # undo the ones taken so far
                    for s, p in zip(req_slots[:i], positions[:i], strict=True):
                        if p % self.config.page_size == 0:
                            self.kv_pool.free(self.req_pages(s, p + 1)[-1:])
                    return None
                locs.append(loc)
            return torch.cat(locs)
        if max(positions, default=0) >= self.config.max_context_len:
            raise ValueError(f"a sequence exceeds the context of {self.config.max_context_len}")
        locs = self.kv_pool.alloc(len(req_slots))
        if locs is None:
            return None
        table = self.req_pool.req_to_token
        table[req_slots, positions] = locs.to(device=table.device, dtype=torch.int32)
        return locs

    def req_pages(self, req_slot: int, seq_len: int) -> torch.Tensor:
        """Pages holding positions [0, seq_len) of a request."""
        ps = self.config.page_size
        return self.req_pool.req_to_token[req_slot, :seq_len:ps].long() // ps

    def free_kv(self, req_slot: int, seq_len: int, keep: int = 0) -> None:
        """Free the pages of positions [keep, seq_len) (keep is page-aligned)."""
        assert keep % self.config.page_size == 0
        pages = self.req_pages(req_slot, seq_len)[keep // self.config.page_size :]
        if pages.numel():
            self.kv_pool.free(pages)

    # ---- batches -------------------------------------------------------------------------
    def build_prefill(
        self,
        items: list[ExtendInput],
        out_locs: list[torch.Tensor],
        return_all_logits: bool = False,
        logit_indices: list[int] | None = None,
        verify: bool = False,
    ) -> ForwardBatch:
        """A prefill batch; logits come for each request's last new token, or for every new
        token (return_all_logits), or for the packed token indices `logit_indices`. `verify`:
        a speculative verify batch, the recurrent layers stepping token by token and keeping
        the states in each item's `step_slots` (`ForwardBatch.mamba_step_slots_cpu`)."""

        def col(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        tracks = {}
        if verify:
            tracks = dict(mamba_step_slots_cpu=[it.step_slots or [] for it in items])
        elif any(it.track_offset for it in items):
            tracks = dict(
                mamba_track_slots=col([it.track_slot for it in items]),
                mamba_track_offsets_cpu=[it.track_offset for it in items],
            )
        return ForwardBatch(
            phase="prefill",
            input_ids=col([t for it in items for t in it.input_ids]),
            positions=col(
                [p for it in items for p in range(it.prefix_len, it.prefix_len + len(it.input_ids))]
            ),
            out_loc=torch.cat(out_locs).to(self.device),
            req_slots=col([it.req_slot for it in items]),
            mamba_slots=col([it.mamba_slot for it in items]),
            seq_lens=col([it.prefix_len + len(it.input_ids) for it in items]),
            prefix_lens_cpu=[it.prefix_len for it in items],
            extend_lens_cpu=[len(it.input_ids) for it in items],
            req_to_token=self.req_pool.req_to_token,
            kv_pool=self.kv_pool,
            mamba_pool=self.mamba_pool,
            return_all_logits=return_all_logits,
            logit_indices=None if logit_indices is None else col(logit_indices),
            **tracks,
        )

    def build_decode(
        self, items: list[DecodeInput], out_loc: torch.Tensor, pad_to: int | None = None
    ) -> ForwardBatch:
        """A decode batch; with pad_to, extra rows use request row 0, KV location 0, position 0
        and Mamba slot 0 (reserved in every pool), so they never touch a live request."""
        n = len(items)
        bs = pad_to or n
        assert bs >= n
        host = torch.zeros(5, bs, dtype=torch.int64)  # ids, positions, rows, slots, seq_lens
        if items:
            cols = [(it.input_id, it.seq_len, it.req_slot, it.mamba_slot) for it in items]
            host[:4, :n] = torch.tensor(cols).T
        host[4] = host[1] + 1
        ids, positions, rows, slots, seq_lens = host.to(self.device, non_blocking=True)
        pad = torch.zeros(bs - n, dtype=torch.int64, device=self.device)
        return ForwardBatch(
            phase="decode",
            input_ids=ids,
            positions=positions,
            out_loc=torch.cat([out_loc.to(self.device), pad]),
            req_slots=rows,
            mamba_slots=slots,
            seq_lens=seq_lens,
            prefix_lens_cpu=[it.seq_len for it in items] + [0] * (bs - n),
            extend_lens_cpu=[1] * bs,
            req_to_token=self.req_pool.req_to_token,
            kv_pool=self.kv_pool,
            mamba_pool=self.mamba_pool,
            max_seq_len=max((it.seq_len + 1 for it in items), default=1),
        )

    # ---- compute -------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [N, vocab] fp32 (padding rows included for padded decode batches)."""
        return self.model(batch)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        histories: list[tuple[list[int], list[int]]] | None = None,
        counts: list[TokenCounts | None] | None = None,
    ) -> SampleOutput:
        """Next tokens; with tensor parallelism rank 0 draws them (`first_rank_draws`)."""
        return self.first_rank_draws(
            lambda: self.sampler(logits[: len(params)], params, generators, histories, counts)
        )

    def first_rank_draws(self, draw: Callable[[], T]) -> T:
        """`draw()`, a random choice: with tensor parallelism run on rank 0 only (the request
        generators advance there) and its result, or its exception, given to every rank, so
        all ranks continue with the same tokens."""
        tp = self.model.tp
        if not tp.enabled:
            return draw()
        result: T | Exception | None = None
        if tp.is_first:
            try:
                result = draw()
            except Exception as e:  # raised on every rank alike, after the broadcast
                result = e
        result = tp.broadcast_object(result)
        if isinstance(result, Exception):
            raise result
        return result
