"""Decode batches through one seam: CUDA graphs on GPU (seed #24243), the decode plan on CPU.

A decode batch of n requests runs at the smallest captured size bs >= n (`--cuda-graph-bs` up
to `--cuda-graph-max-bs`, which is added; see `SchedulerConfig.decode_graph_sizes`); larger
batches, every batch with `--disable-cuda-graph`, and every batch where nothing is captured run
at their own size: a batch is never padded to a size without a graph. Padding rows
use request row 0, KV location 0, position 0 and Mamba slot 0, all reserved in their pools: a
padding row reads and writes only scratch memory and never a live request's state, and its
logits are dropped.

On CUDA each size is captured once at start-up over static input buffers (`torch.cuda.CUDAGraph`,
one shared memory pool, largest first); a step copies its inputs into the buffers of its size and
replays. Capturing needs a decode forward without host syncs or data-dependent shapes: the Triton
kernels are (they read lengths and slots on the device), and the MoE takes its static-shape path
while a stream is capturing (`models.layers.Experts`).

On CPU, batches of up to `models.cpu_decode.MAX_ROWS` rows (and `--cuda-graph-max-bs`) run the
step as one C++ call over the model's C++ ops (`models.cpu_decode.CpuDecodePlan`, bit-identical
to the eager step), unpadded, whenever the model and the kernel choice allow it; other batches
run eagerly at their own size, and `--disable-cuda-graph` turns the plan off too.
`static_buffers=True` runs the CUDA path's padded buffer filling eagerly, for tests.
"""

from __future__ import annotations

import logging

import torch

from models.cpu_decode import MAX_ROWS as MAX_PLAN_ROWS
from models.cpu_decode import CpuDecodePlan
from models.forward_batch import ForwardBatch
from scheduler.model_runner import DecodeInput, ModelRunner

logger = logging.getLogger(__name__)


class DecodeGraphRunner:
    def __init__(
        self,
        runner: ModelRunner,
        sizes: list[int],
        use_graphs: bool | None = None,
        static_buffers: bool = False,
    ) -> None:
        """`sizes`: the padded decode sizes (`SchedulerConfig.decode_graph_sizes`); on CPU the
        largest bounds the rows the decode plan runs."""
        self.runner = runner
        self.sizes = sorted(sizes)
        if use_graphs is None:  # the torch reference kernels sync with the host: no capture
            use_graphs = runner.device.type == "cuda" and runner.model.ops.backend != "torch"
        self.use_graphs = use_graphs
        self.batches: dict[int, ForwardBatch] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if self.use_graphs or static_buffers:
            self.batches = {bs: self._static_batch(bs) for bs in self.sizes}
        self.plan: CpuDecodePlan | None = None
        self.plan_rows = min(MAX_PLAN_ROWS, self.sizes[-1] if self.sizes else 0)
        if self.use_graphs:
            self.capture()
        elif runner.device.type == "cpu" and self.plan_rows and not static_buffers:
            self.plan = CpuDecodePlan.build(
                runner.model, runner.kv_pool, runner.mamba_pool, runner.req_pool.req_to_token
            )
            if self.plan is not None:
                logger.info("CPU decode batches of 1..%d rows run the decode plan", self.plan_rows)

    def padded_size(self, n: int) -> int | None:
        return next((bs for bs in self.sizes if bs >= n), None)

    # ---- running -------------------------------------------------------------------------
    def forward(self, items: list[DecodeInput], out_loc: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] for one decode step of `items` (KV already allocated at out_loc)."""
        n, runner = len(items), self.runner
        if self.plan is not None and n <= self.plan_rows:
            return self.plan(runner.build_decode(items, out_loc))  # at its own size
        bs = self.padded_size(n)
        batch = self.batches.get(bs) if bs is not None else None
        if batch is None:  # nothing captured for a size: padding would only add work
            return runner.forward(runner.build_decode(items, out_loc))[:n]
        self._fill(batch, items, out_loc)
        if bs in self.graphs:
            self.graphs[bs].replay()
            return self.outputs[bs][:n]
        return runner.forward(batch)[:n]

    def _fill(self, batch: ForwardBatch, items: list[DecodeInput], out_loc: torch.Tensor) -> None:
        """Copy one step's inputs into the static buffers; padding rows get the reserved 0s."""
        bs, n = batch.num_reqs, len(items)
        host = torch.zeros(5, bs, dtype=torch.int64)  # ids, positions, rows, slots, seq_lens
        host[0, :n] = torch.tensor([it.input_id for it in items])
        host[1, :n] = torch.tensor([it.seq_len for it in items])
        host[2, :n] = torch.tensor([it.req_slot for it in items])
        host[3, :n] = torch.tensor([it.mamba_slot for it in items])
        host[4] = host[1] + 1  # padding: seq_len 1 (position 0)
        dev = host.to(batch.input_ids.device, non_blocking=True)
        for dst, src in zip(
            (batch.input_ids, batch.positions, batch.req_slots, batch.mamba_slots, batch.seq_lens),
            dev,
            strict=True,
        ):
            dst.copy_(src)
        batch.out_loc[:n].copy_(out_loc)
        batch.out_loc[n:].zero_()
        batch.max_seq_len = max((it.seq_len + 1 for it in items), default=1)

    # ---- capture -------------------------------------------------------------------------
    def _static_batch(self, bs: int) -> ForwardBatch:
        runner, dev = self.runner, self.runner.device

        def zeros() -> torch.Tensor:
            return torch.zeros(bs, dtype=torch.int64, device=dev)

        return ForwardBatch(
            phase="decode",
            input_ids=zeros(),
            positions=zeros(),
            out_loc=zeros(),
            req_slots=zeros(),
            mamba_slots=zeros(),
            seq_lens=torch.ones(bs, dtype=torch.int64, device=dev),
            prefix_lens_cpu=[0] * bs,
            extend_lens_cpu=[1] * bs,
            req_to_token=runner.req_pool.req_to_token,
            kv_pool=runner.kv_pool,
            mamba_pool=runner.mamba_pool,
            max_seq_len=runner.config.max_context_len,  # a static bound; kernels read seq_lens
        )

    def capture(self) -> None:
        """Capture every size (largest first, one memory pool). The buffers hold padding rows
        while capturing, so warm-up and capture touch only the reserved slots."""
        runner, pool = self.runner, None
        side = torch.cuda.Stream()
        for bs in reversed(self.sizes):
            batch = self.batches[bs]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: Triton compilation, allocator growth
                    runner.forward(batch)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = runner.forward(batch)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)
