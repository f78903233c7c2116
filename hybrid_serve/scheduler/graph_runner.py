"""Decode batches through one seam: CUDA graphs on GPU (seed #24243), the decode plan on CPU.

A decode batch of n requests runs at the smallest captured size bs >= n (`decode_graph_sizes`);
larger batches, and every batch where nothing is captured (`--disable-cuda-graph`), run at their
own size: a batch is never padded to a size without a graph. Padding rows use request row 0, KV
location 0, position 0 and Mamba slot 0, all reserved in their pools: they touch only scratch
memory, never a live request's state, and their logits are dropped.

On CUDA each size is captured once at start-up over static input buffers (largest first, one
shared memory pool); a step copies its inputs into its size's buffers and replays. Capture needs a
decode forward without host syncs or data-dependent shapes (the Triton kernels read lengths and
slots on the device; the MoE takes its static-shape path while a stream captures).

On CPU, batches of up to `models.cpu_decode.MAX_ROWS` rows (and `--cuda-graph-max-bs`) run as one
C++ call over the model's C++ ops (`CpuDecodePlan`, bit-identical to the eager step), unpadded,
where the model and kernel choice allow (where they do not, `CpuDecodePlan.build` logs one
WARNING saying why); other batches run eagerly, and `--disable-cuda-graph` turns the plan off
too.
"""

from __future__ import annotations

import logging

import torch

from hybrid_serve.models.cpu_decode import MAX_ROWS as MAX_PLAN_ROWS
from hybrid_serve.models.cpu_decode import CpuDecodePlan
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.scheduler.model_runner import DecodeInput, ModelRunner

logger = logging.getLogger(__name__)


class DecodeGraphRunner:
    def __init__(
        self,
        runner: ModelRunner,
        sizes: list[int],
        use_graphs: bool | None = None,
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
        if self.use_graphs:
            self.batches = {bs: self._static_batch(bs) for bs in self.sizes}
        self.plan: CpuDecodePlan | None = None
        self.plan_rows = min(MAX_PLAN_ROWS, self.sizes[-1] if self.sizes else 0)
        if self.use_graphs:
            self.capture()
        elif runner.device.type == "cpu" and self.plan_rows:
            self.plan = CpuDecodePlan.build(
                runner.model, runner.kv_pool, runner.mamba_pool, runner.req_pool.req_to_token
            )
            if self.plan is not None:
                logger.info("CPU decode batches of 1..%d rows run the decode plan", self.plan_rows)

    def verify(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, final hidden) of every row of a speculative verify batch: through the
        decode plan on CPU (up to its rows), else the model's extend forward."""
        model = self.runner.model
        if self.plan is not None and batch.input_ids.numel() <= MAX_PLAN_ROWS:
            return self.plan.verify(batch)
        hidden = model.final_hidden(batch, every_row=True)
        return model.logits_from_hidden(hidden), hidden

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
        step = self.runner.build_decode(items, out_loc, pad_to=batch.num_reqs)
        for name in ("input_ids", "positions", "out_loc", "req_slots", "mamba_slots", "seq_lens"):
            getattr(batch, name).copy_(getattr(step, name))
        batch.max_seq_len = step.max_seq_len

    # ---- capture -------------------------------------------------------------------------
    def _static_batch(self, bs: int) -> ForwardBatch:
        """A batch of `bs` padding rows whose tensors a step's inputs are copied into."""
        empty = torch.empty(0, dtype=torch.int64, device=self.runner.device)
        batch = self.runner.build_decode([], empty, pad_to=bs)
        batch.max_seq_len = self.runner.config.max_context_len  # kernels read seq_lens
        return batch

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
