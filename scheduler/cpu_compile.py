"""The CPU decode step compiled with torch.compile (inductor): what `DecodeGraphRunner` does on
CPU where CUDA captures graphs.

Off by default (`SchedulerConfig.cpu_compile`): start-up then compiles (13 s from the cache,
50 s cold for batches 1-8 on a quiet 2-core machine, minutes per graph under load), and the
uncompiled step's CPU decode plan (`models.cpu_decode`) is as fast or faster on that machine:
engine at concurrency 1 fp32 44.3 tok/s against 37.5 compiled, bf16 61.7 against 57.3, level
at 8 (BENCHMARKS.md, issue 10, session 7). Before the plan, compiling paid up to ~8 rows and
lost beyond (x1.38 at 1, x0.93 at 64 in fp32, session 6); `--cuda-graph-max-bs 8` keeps the
graphs to those sizes.

`CompiledDecode` compiles `Qwen3NextForCausalLM.logits` for decode batches, either with a
dynamic batch dimension (`--cpu-compile dynamic`: a graph for batch 1, which dynamo always
specialises, and one with a symbolic batch size from 2 up, compiled at 2 and again at 9 in case
the C++ GEMV's 8-row limit splits it; no padding) or once per padded size (`--cpu-compile
per_size`, over static buffers like the CUDA graphs). Graphs call the C++ kernels' own ops
where the eager step would (`kernels.custom_ops.enable_cpp_in_graphs`): the GEMVs and the fused
decode ops (MoE block, attention glue, GDN decode, in place on the pools); without the C++
kernels, the MoE expert loop and decode attention are custom ops (`kernels.custom_ops`), and
inductor fuses the norms, rotary, routing and gating code around them. The kernel dispatcher
makes its choices before tracing (`kernels.dispatch.prime`): tracing cannot.

Compiling is slow (minutes per graph here, cold), so `DecodeGraphRunner` does
it at start-up for the sizes it will use, logging each, and the artefacts go to inductor's
caches under `CACHE_DIR` (`TORCHINDUCTOR_CACHE_DIR` overrides it): a restart reuses them and
only pays dynamo's tracing. While serving, a batch whose graph is missing runs eagerly rather
than compile (`torch.compiler.set_stance("eager_on_recompile")`).

Compiling needs a C++ compiler: without one, or when compiling fails, `DecodeGraphRunner` logs
one warning and runs eagerly.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kernels import custom_ops, dispatch
from kernels.linear_cpp import SKINNY_ROWS
from models.forward_batch import ForwardBatch
from models.qwen3_next import Qwen3NextForCausalLM

logger = logging.getLogger(__name__)

MODES = ("off", "dynamic", "per_size")
# dynamic mode compiles at these sizes: batch 1 (dynamo specialises it), then a symbolic-size
# graph, also run just past the C++ GEMV's row limit in case that limit guards the graph (in the
# measured run it did not: the 2-row graph served 9 without recompiling)
DYNAMIC_SIZES = (1, 2, SKINNY_ROWS + 1)
CACHE_DIR = Path.home() / ".cache" / "hybrid-serve" / "inductor"
COMPILERS = ("g++", "c++", "clang++")


def cxx_compiler() -> str | None:
    """Path of the C++ compiler inductor would use (`CXX`, else the usual names), or None."""
    names = (os.environ["CXX"],) if os.environ.get("CXX") else COMPILERS
    return next((p for p in map(shutil.which, names) if p), None)


def use_cache_dir() -> None:
    """Point inductor's on-disk caches (FX graphs, generated C++) at `CACHE_DIR` unless
    `TORCHINDUCTOR_CACHE_DIR` already names a place."""
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(CACHE_DIR)


class CompiledDecode:
    """`model.logits` compiled for decode batches. `compile(bs, batch)` compiles (or loads from
    the cache) the graph a batch of `bs` rows uses by running it once on `batch`, whose rows must
    be padding (they write only the reserved slots); `__call__` runs a compiled batch."""

    def __init__(self, model: Qwen3NextForCausalLM, mode: str) -> None:
        if mode not in MODES[1:]:
            raise ValueError(f"CompiledDecode mode must be dynamic or per_size, got {mode!r}")
        self.mode = mode
        self.sizes: set[int] = set()  # the sizes compiled at (dynamic: DYNAMIC_SIZES)
        # a batch without a graph while serving runs eagerly (tests make it fail instead)
        self.stance = "eager_on_recompile"
        use_cache_dir()
        custom_ops.number_experts(model)
        custom_ops.enable_cpp_in_graphs()  # graphs call the C++ kernels' ops where eager would
        self._device = next(model.parameters()).device
        if mode == "per_size":  # one graph per size, all on the same code object
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self._fn: Callable[[ForwardBatch], torch.Tensor] = torch.compile(
            model.logits, dynamic=None if mode == "dynamic" else False, fullgraph=True
        )

    @property
    def dynamic(self) -> bool:
        return self.mode == "dynamic"

    def covers(self, bs: int) -> bool:
        """Whether a padded batch of bs rows has a graph (per_size)."""
        return bs in self.sizes

    def compile(self, bs: int, batch: ForwardBatch) -> float:
        """Compile the graph for `bs` by running `batch` (all padding rows); seconds taken."""
        if self.dynamic and bs >= 2:  # a graph with a symbolic batch size
            for t in (batch.input_ids, batch.positions, batch.out_loc, batch.req_slots,
                      batch.mamba_slots, batch.seq_lens):  # fmt: skip
                torch._dynamo.mark_dynamic(t, 0)
        start = time.perf_counter()
        with torch.inference_mode():
            dispatch.prime(self._device)  # tracing cannot choose kernels (or build the C++ ones)
            self._fn(batch)
        self.sizes.add(bs)
        return time.perf_counter() - start

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        with torch.inference_mode(), torch.compiler.set_stance(self.stance):
            return self._fn(batch)
