"""A CPU roofline: this machine's limits, and our decode steps (and llama.cpp's) against them.

The machine (`benchmarks.roofline_peaks`, whose docstring names exactly what each ceiling runs):
- read bandwidth: `torch.sum` over a `--bandwidth-mib` MiB fp32 buffer on `--threads` threads,
  median of `--repeats`, at the start; and the same probe again (median of 3) right after
  every concurrency's timed steps, because a shared VM's memory bandwidth drifts by up to 2x
  over minutes: each row's fraction of the read bandwidth is against the probe beside it;
- peak rates of fp32 FMA, bf16 dot (`vdpbf16ps`) and int8 dot (VNNI `vpdpbusd`, else AVX2's
  maddubs/madd): register-resident C++ probes on `--threads` threads, the hardware's issue rate
  of that instruction (not our kernels' rate); a kind this CPU has no probe for is reported as
  not measured (AMX has none: on an AMX host the bf16/int8 ceilings are the AVX-512 ones, and
  torch's bf16 products, which use AMX there, can pass them).

Our decode, per weight format (`--formats`: float32, bfloat16, int8 and int4, the last two the
`--quantization` matrices loaded through bf16) at each concurrency C (`--concurrency`): C
requests with `--context-len` random cached tokens each, prefilled once; every timed step
decodes one token for each from exactly that state (`benchmarks.model_forward.ours_decode`)
through `DecodeGraphRunner` as the server runs it (the C++ decode plan up to its rows, else the
eager step); step time = median of `--repeats` steps after `--warmup`. tok/s = C / step time.

Per step, counted from the loaded model's own tensors and pools (the decomposition of
`hybrid_serve.models.step_bytes`, which assumes one weight dtype; a CPU load keeps embeddings,
norms and caches in fp32, and the quantized formats carry their scales, so the stored bytes are
summed instead):

    bytes   weights: every parameter a step reads once (the LM head, norms, routers, shared
            experts, dense layers; the embedding when tied to the LM head) + one embedding row
            per request + per MoE layer the expected distinct routed experts of the batch,
            E (1 - (1 - k/E)^C), times one expert's bytes
            kv: C x context x K and V bytes of a token in every attention layer
            state: 2 x C x one request's recurrent state (conv windows and states, read and
            written back)
    FLOPs   2 per parameter a token touches (a matrix weight enters one multiply-add; the few
            norm weights, conv taps and per-head scalars count alike; the embedding row is a
            lookup: none), its top-k experts per MoE layer included
            + attention: 4 x query heads x head_dim x (context + 1) per attention layer (QK^T and
            PV over the cached keys and its own)
            + recurrent state: per state element, 7 for Gated DeltaNet (decay, k read-out,
            rank-1 update, q read-out) and 5 for Mamba2 (decay, update, C read-out)
            Softmax, norms' reductions, activations and routing are not counted.

Each row: bytes and FLOPs per token (a step's over C), the arithmetic intensity (FLOPs / byte),
the achieved bandwidth (bytes per step / step time) as a fraction of the read bandwidth probed
beside the row (the start's probe where there is none), and the
achieved FLOP/s as a fraction of the ceiling of the instruction the step's products run on at C
rows (`ceiling_kind`: fp32 FMA for float32; bf16 dot for bf16 matrices at `BF16_ROWS` rows and
more where the kernel set multiplies bf16 in hardware, else fp32 FMA, the weights widened;
int8 dot for int8/int4, whose matrices, routed experts included, multiply int8-rounded
activations in integer dot products at every row count (the GEMV, then qgemm.h's GEMM; the
routed experts through the GEMV at every decode size); fp32 FMA wherever the torch references
run). A step whose
bytes fit in the last-level cache is marked "(in LLC)": its reads may not come from memory, and
its fraction of the read bandwidth can pass 1 (the tiny preset's weights do fit).

llama.cpp (optional: `--llama-server PATH --gguf NAME=FILE,...`, NAME one of our formats or
llama.cpp's f32, bf16, q8_0, q4_0, and its format among `--formats`): each GGUF is served by
`llama-server` (`benchmarks.llama_cpp.commands`) and measured with that module's waves
(`llama_cpp.wave`: `--num-prompts-factor` x C streaming requests of `--prompt-len` random token
ids and `--output-len` greedy tokens, C in flight) at the same concurrencies, median of
`--llama-rounds`. Its tok/s is HTTP output throughput (its prefill and the HTTP path included, so
a lower bound of its decode rate), placed at our bytes and FLOPs per token of the matching
format, against the peak ggml's products of that format run at any batch
(`roofline_llama.LLAMA_CEILING`).
Without the flags there are no llama.cpp rows (the table says so).

Our rows come first: their table is printed, and `--json-out` and `--plot` (our points only)
written, before any llama-server starts; llama.cpp's rows then follow in a second table and both
files are written again with them. A llama-server that exits or never answers /health (a GGUF
it cannot load), or fails during its waves, becomes a note (`llama_cpp_failures`: llama.cpp's
own error line and its log's last lines) instead of rows; the other GGUFs go on, and the run
ends normally with our rows kept.

`--plot FILE.png` draws the roofline (matplotlib, the `bench` extra); `--json-out` writes all.
The figures of a shared machine drift: compare rows of one run.

Example: python -m benchmarks.roofline --preset small --threads 2 --plot roofline.png
"""

from __future__ import annotations

import sys  # noqa: I001  (the repo root goes on sys.path before our packages are imported)
from pathlib import Path

if not __package__:  # run as `python benchmarks/x.py`: the repo root first, not benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import gc
import json
import logging
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass

import torch

from benchmarks import roofline_peaks
from benchmarks.model_forward import ours_decode
from benchmarks.roofline_llama import (
    LLAMA_MEASURED,
    LLAMA_PENDING,
    NO_LLAMA,
    llama_points,
    parse_gguf,
)
from benchmarks.roofline_peaks import n_threads
from hybrid_serve.kernels import cpp_build, cpu_levels
from hybrid_serve.kernels.cpp_ops import BF16_ROWS
from hybrid_serve.kernels.quant import in_features
from hybrid_serve.models.gated_delta_net import GatedDeltaNet
from hybrid_serve.models.mamba2_mixer import Mamba2Mixer
from hybrid_serve.models.step_bytes import StepBytes, expected_experts
from hybrid_serve.scheduler.build import load_runner_model
from hybrid_serve.scheduler.config import SchedulerConfig
from hybrid_serve.scheduler.graph_runner import DecodeGraphRunner
from hybrid_serve.scheduler.model_runner import ModelRunner, RunnerConfig

logger = logging.getLogger("benchmarks.roofline")

FORMATS = ("float32", "bfloat16", "int8", "int4")
QUANTIZED = ("int8", "int4")  # --quantization matrices, loaded through bf16
# FLOPs per recurrent-state element per token, by mixer (module docstring)
STATE_FLOPS: tuple[tuple[type, int], ...] = ((GatedDeltaNet, 7), (Mamba2Mixer, 5))
BESIDE_REPEATS = 3  # sums per read-bandwidth probe beside a row (module docstring)
PLOT_NEEDS = "roofline: --plot needs matplotlib: pip install matplotlib"
# the CPU features the report lists: those the probes look at
PROBE_FEATURES = frozenset().union(*roofline_peaks.PROBES.values()) | roofline_peaks.AMX


# ---- bytes and FLOPs of a decode step -------------------------------------------------------
@dataclass(frozen=True)
class ModelCosts:
    """What one decode step of a loaded model reads and computes, grouped by how it scales with
    the batch (module docstring). Bytes are the stored tensors' (scales included); parameters
    are logical (a quantized row of K values counts K)."""

    dense_bytes: int  # read once per step (LM head included; the embedding when tied)
    dense_params: int  # their parameters that products touch (no untied embedding)
    embedding_row_bytes: int  # one input-embedding row; 0 when tied to the LM head
    expert_bytes: float  # one routed expert of one MoE layer
    expert_params: float
    moe_layers: int
    num_experts: int
    top_k: int
    kv_bytes_per_token: int  # K and V of one token in every attention layer
    attention_layers: int
    attention_width: int  # query heads x head_dim of one attention layer
    state_bytes: int  # one request's recurrent state over every layer
    state_flops: int  # FLOPs per token on the recurrent states


@dataclass(frozen=True)
class StepFlops:
    matmul: float
    attention: float
    state: float

    @property
    def total(self) -> float:
        return self.matmul + self.attention + self.state


def logical_params(t: torch.Tensor) -> int:
    """Values a stored tensor holds: a quantized matrix's rows count K each (its scales none)."""
    if t.dim() == 0:
        return 1
    return t.numel() // t.shape[-1] * in_features(t)


def state_flops_per_element(mixer: torch.nn.Module) -> int:
    """`STATE_FLOPS` of a recurrent mixer; 2 (one multiply-add) for a kind not listed."""
    for kind, flops in STATE_FLOPS:
        if isinstance(mixer, kind):
            return flops
    logger.warning("no state FLOPs for %s: 2 per element counted", type(mixer).__name__)
    return 2


def model_costs(model: torch.nn.Module, kv_pool, mamba_pool) -> ModelCosts:
    """`ModelCosts` of a loaded model (no tensor parallelism) and its runner's pools: routed
    experts are the parameters of modules whose class name ends in "Experts" (stacks [E, ...]);
    an MTP head (`mtp.*`) is not read by a decode step."""
    expert_mods = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    expert_ids = {id(p) for m in expert_mods for p in m.parameters()}
    embed = model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    dense_bytes = dense_params = 0
    for name, p in model.named_parameters():
        if id(p) in expert_ids or name.startswith("mtp.") or (p is embed and not tied):
            continue
        dense_bytes += p.nbytes
        dense_params += logical_params(p)
    num_experts = next(expert_mods[0].parameters()).shape[0] if expert_mods else 0
    stacks = [p for m in expert_mods for p in m.parameters()]
    per = len(expert_mods) * num_experts or 1
    config = getattr(model, "local_config", model.config)
    mixers = [m for m in model.modules() if hasattr(m, "state_shape")]
    state_flops = sum(
        math.prod(m.state_shape.temporal) * state_flops_per_element(m) for m in mixers
    )
    return ModelCosts(
        dense_bytes=dense_bytes,
        dense_params=dense_params,
        embedding_row_bytes=0 if tied else embed.nbytes // embed.shape[0],
        expert_bytes=sum(p.nbytes for p in stacks) / per,
        expert_params=sum(logical_params(p) for p in stacks) / per,
        moe_layers=len(expert_mods),
        num_experts=num_experts,
        top_k=getattr(config, "num_experts_per_tok", 0) if expert_mods else 0,
        kv_bytes_per_token=kv_pool.bytes_per_token,
        attention_layers=kv_pool.num_layers,
        attention_width=config.num_attention_heads * kv_pool.shape.k_dim,
        state_bytes=mamba_pool.bytes_per_slot if mamba_pool.num_layers else 0,
        state_flops=state_flops,
    )


def decode_bytes(c: ModelCosts, batch: int, context: int) -> StepBytes:
    """Bytes one decode step of `batch` requests with `context` cached tokens each must move."""
    experts = c.moe_layers * expected_experts(c.num_experts, c.top_k, batch) * c.expert_bytes
    weights = c.dense_bytes + batch * c.embedding_row_bytes + experts
    kv = batch * context * c.kv_bytes_per_token
    return StepBytes(float(weights), float(kv), float(2 * batch * c.state_bytes))


def decode_flops(c: ModelCosts, batch: int, context: int) -> StepFlops:
    """FLOPs of one decode step of `batch` requests with `context` cached tokens each."""
    params = c.dense_params + c.moe_layers * c.top_k * c.expert_params
    attention = 4 * c.attention_layers * c.attention_width * (context + 1)
    return StepFlops(2.0 * batch * params, float(batch * attention), float(batch * c.state_flops))


def ceiling_kind(fmt: str, rows: int, backend: str, bf16_products: bool) -> str:
    """The peak (`roofline_peaks.KINDS`) the products of a `fmt` matrix run at `rows` rows
    (module docstring; the C++ `hs::linear`'s choice by rows)."""
    if backend != "cpp" or fmt == "float32":
        return "fp32_fma"
    if fmt == "bfloat16":
        return "bf16_dot" if bf16_products and rows >= BF16_ROWS else "fp32_fma"
    return "int8_dot"


def fraction(value: float, limit: float | None) -> float | None:
    """value / limit, None where the limit was not measured."""
    return value / limit if limit else None


def roofline_row(
    who: str,
    fmt: str,
    concurrency: int,
    step_s: float,
    costs: ModelCosts,
    context: int,
    ceilings: dict[str, roofline_peaks.Ceiling],
    kind: str,
    cache_bytes: int | None = None,
    read_bw: float | None = None,
) -> dict:
    """One point: `concurrency` tokens per `step_s` seconds at `costs`' bytes and FLOPs, against
    the read bandwidth and ceiling `kind` of `ceilings`. `step_fits_cache`: whether the step's
    bytes fit in `cache_bytes` (the last-level cache: its reads may then come from there, and
    the fraction of the memory read bandwidth can pass 1); None where that size is unknown.
    `read_bw`: the read bandwidth probed beside this row, which the bandwidth fraction is
    against (None: the start's, `ceilings["read_bandwidth"]`)."""
    step_bytes = decode_bytes(costs, concurrency, context)
    flops = decode_flops(costs, concurrency, context)
    bandwidth = step_bytes.total / step_s
    flop_rate = flops.total / step_s
    return {
        "who": who,
        "format": fmt,
        "concurrency": concurrency,
        "step_ms": step_s * 1e3,
        "tok_s": concurrency / step_s,
        "bytes_per_step": asdict(step_bytes) | {"total": step_bytes.total},
        "bytes_per_token": step_bytes.total / concurrency,
        "flops_per_step": asdict(flops) | {"total": flops.total},
        "flops_per_token": flops.total / concurrency,
        "intensity": flops.total / step_bytes.total,
        "bandwidth": bandwidth,
        "read_bandwidth_beside": read_bw,
        "bandwidth_fraction": fraction(bandwidth, read_bw or ceilings["read_bandwidth"].rate),
        "flop_s": flop_rate,
        "ceiling": kind,
        "ceiling_fraction": fraction(flop_rate, ceilings[kind].rate),
        "step_fits_cache": None if cache_bytes is None else step_bytes.total <= cache_bytes,
    }


# ---- measuring ------------------------------------------------------------------------------
def load_format(path: Path, fmt: str, max_c: int, context: int, load: str) -> ModelRunner:
    """A runner of `path` in weight format `fmt` with pools for `max_c` requests of `context`
    cached tokens plus one, each with a live and a snapshot state slot."""
    cfg = RunnerConfig(
        max_running_requests=max_c + 1,
        max_total_tokens=max_c * (context + 1) + 64,
        max_context_len=context + 1,
        mamba_cache_size=2 * max_c + 1,
        dtype="bfloat16" if fmt in QUANTIZED else fmt,
        quantization=fmt if fmt in QUANTIZED else None,
        load_format=load,
    )
    return ModelRunner(load_runner_model(str(path), cfg), cfg)


def time_decode(
    runner: ModelRunner,
    conc: list[int],
    context: int,
    warmup: int,
    repeats: int,
    seed: int,
    probe: Callable[[], float] | None = None,
) -> dict[int, tuple[str, list[float], float | None]]:
    """Per concurrency C: (the path the step ran: "plan" or "eager", every timed step's
    seconds, `probe()`'s read bandwidth right after them or None without a probe), steps as
    the server runs them (module docstring)."""
    graphs = DecodeGraphRunner(runner, SchedulerConfig().decode_graph_sizes(max(conc)))
    vocab = runner.model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    out = {}
    with torch.inference_mode():
        for c in conc:
            contexts = torch.randint(vocab, (c, context), generator=gen)
            make, free = ours_decode(runner, contexts, torch.randint(vocab, (c,), generator=gen),
                                     graphs)  # fmt: skip
            times = []
            for i in range(warmup + repeats):
                run, _ = make()  # restores the cached state: off the clock
                start = time.perf_counter()
                run()
                if i >= warmup:
                    times.append(time.perf_counter() - start)
            free()
            path = "plan" if graphs.plan is not None and c <= graphs.plan_rows else "eager"
            out[c] = (path, times, probe() if probe else None)
    return out


# ---- output ---------------------------------------------------------------------------------
def _rate(value: float | None, unit: str) -> str:
    return "not measured" if value is None else f"{value / 1e9:,.1f} {unit}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


ROW_HEAD = ("| who | format | C | path | ms/step | tok/s | MB/token | MFLOP/token | FLOP/B "
            "| GB/s | read BW beside | of read BW | GFLOP/s | ceiling | of ceiling |")  # fmt: skip


def print_rows(rows: list[dict]) -> None:
    """Roofline rows as one markdown table."""
    print(ROW_HEAD + "\n" + "|---" * ROW_HEAD.count(" | ") + "|---|")
    for r in rows:
        path = r.get("step_path", "HTTP")
        print(
            f"| {r['who']} | {r['format']} | {r['concurrency']} | {path} | {r['step_ms']:.2f} "
            f"| {r['tok_s']:,.1f} | {r['bytes_per_token'] / 1e6:.3f} "
            f"| {r['flops_per_token'] / 1e6:.3f} | {r['intensity']:.2f} "
            f"| {r['bandwidth'] / 1e9:.2f} | {_rate(r.get('read_bandwidth_beside'), 'GB/s')} "
            f"| {_share(r['bandwidth_fraction'])}"
            f"{' (in LLC)' if r['step_fits_cache'] else ''} "
            f"| {r['flop_s'] / 1e9:.2f} | {r['ceiling']} | {_share(r['ceiling_fraction'])} |"
        )


def print_llama(report: dict) -> None:
    """llama.cpp's part of `main`'s report, after ours: its rows as a second table (none: the
    note), then one line per failed GGUF with llama.cpp's own error line."""
    if report["llama_cpp"]:
        print(f"\nllama.cpp on {report['model']['name']} ({report['llama_cpp_note']})")
        print_rows(report["llama_cpp"])
    else:
        print(f"\nllama.cpp: {report['llama_cpp_note']}")
    for f in report["llama_cpp_failures"]:
        when = "to start" if f["stage"] == "start" else "during its waves"
        print(f"llama.cpp {f['gguf']} ({f['file']}): llama-server failed {when}: {f['error']}")


def print_report(report: dict) -> None:
    """Our part of `main`'s report, as markdown: the host, the ceilings and our rows."""
    host = report["host"]
    print(f"\n{host['cpu']} ({host['machine']}), {n_threads(host['threads'])}, C++ level "
          f"{host['cpu_level']}, torch {host['torch']}, load average "
          f"{host['load_average'][0]:.1f} -> {host['load_average'][1]:.1f} on "
          f"{host['cpus']} CPUs")  # fmt: skip
    print("\n| ceiling | rate | what ran |\n|---|---|---|")
    for key, c in report["ceilings"].items():
        unit = "GB/s" if c["unit"] == "B/s" else "G op/s"
        what = "; ".join(filter(None, (c["what"], c["note"])))
        print(f"| {key} | {_rate(c['rate'], unit)} | {what} |")
    print(f"\n{report['model']['name']}, context {report['model']['context_len']} tokens")
    print_rows(report["ours"])
    if any(r["step_fits_cache"] for r in report["ours"]):
        print("\n(in LLC): the step's bytes fit in the last-level cache, so its reads may not "
              "come from memory")  # fmt: skip


def read_bandwidths(report: dict) -> list[float]:
    """Every read-bandwidth probe of a report: the start's, then those beside its rows."""
    rows = report["ours"] + report["llama_cpp"]
    beside = [r["read_bandwidth_beside"] for r in rows if r.get("read_bandwidth_beside")]
    return [report["ceilings"]["read_bandwidth"]["rate"], *beside]


def plot_roofline(report: dict, path: str | Path) -> None:
    """The roofline as a PNG: log-log FLOP/s against FLOPs/byte, the read-bandwidth slope (the
    median of the run's probes: the start's and those beside the rows) capped by each measured
    peak, ours (filled markers, joined by C) and llama.cpp's (hollow)
    for each format, each point labelled with its C."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bw = statistics.median(read_bandwidths(report))
    peaks = {k: c["rate"] for k, c in report["ceilings"].items() if k != "read_bandwidth"}
    peaks = {k: v for k, v in peaks.items() if v}
    points = report["ours"] + report["llama_cpp"]
    xs = [p["intensity"] for p in points] + [v / bw for v in peaks.values()]
    lo, hi = min(xs) / 3, max(xs) * 3
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(9, 6))
    ax.plot(grid, [bw * x for x in grid], "k--", lw=1, label=f"read {bw / 1e9:.1f} GB/s")
    for i, (kind, peak) in enumerate(sorted(peaks.items(), key=lambda kv: kv[1])):
        ax.plot(grid, [min(bw * x, peak) for x in grid], color=f"C{7 + i % 3}", lw=1.5,
                label=f"{kind} {peak / 1e9:.0f} G op/s")  # fmt: skip
    colors = {fmt: f"C{i}" for i, fmt in enumerate(FORMATS)}
    for who, style in (("ours", "o-"), ("llama_cpp", "s--")):
        for fmt in FORMATS:
            rows = [r for r in report[who] if r["format"] == fmt]
            if not rows:
                continue
            name = f"ours {fmt}" if who == "ours" else rows[0]["who"]
            ax.plot([r["intensity"] for r in rows], [r["flop_s"] for r in rows], style,
                    color=colors[fmt], mfc=colors[fmt] if who == "ours" else "none",
                    label=name)  # fmt: skip
            for r in rows:
                ax.annotate(f"C={r['concurrency']}", (r["intensity"], r["flop_s"]),
                            textcoords="offset points", xytext=(4, -10), fontsize=7)  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs / byte read)")
    ax.set_ylabel("FLOP/s")
    host = report["host"]
    ax.set_title(f"{report['model']['name']}: decode, context {report['model']['context_len']}"
                 f" - {host['cpu']}, {n_threads(host['threads'])}")  # fmt: skip
    ax.grid(True, which="both", lw=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cpu_name() -> str:
    """The first processor's model name from /proc/cpuinfo (else platform.processor())."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---- the command line -----------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--model-path", help="checkpoint directory (default: --preset written to a temp dir)")
    a("--preset", default="small", help="make-model preset when no --model-path")
    a("--load-format", default="auto", choices=("auto", "dummy"),
      help="dummy: random weights from config.json alone (real shapes)")  # fmt: skip
    a("--formats", default=",".join(FORMATS), help=f"weight formats, of {', '.join(FORMATS)}")
    a("--concurrency", default="1,4,16,64")
    a("--context-len", type=int, default=128, help="cached tokens per request at every step")
    a("--threads", type=int, default=2)
    a("--repeats", type=int, default=7, help="timed runs of every measurement (medians)")
    a("--warmup", type=int, default=2, help="untimed decode steps first, per concurrency")
    a("--bandwidth-mib", type=int, default=1024, help="read-bandwidth buffer (>> caches)")
    a("--probe-seconds", type=float, default=0.2, help="least wall time of one peak-rate run")
    a("--seed", type=int, default=0)
    a("--llama-server", help="llama.cpp's llama-server (with --gguf): its rows")
    a("--gguf", default="", help="NAME=FILE,... (NAME: our format or f32, bf16, q8_0, q4_0)")
    a("--llama-rounds", type=int, default=1, help="llama.cpp waves per C (median)")
    a("--prompt-len", type=int, default=32, help="llama.cpp waves' prompt tokens")
    a("--output-len", type=int, default=64, help="llama.cpp waves' output tokens")
    a("--num-prompts-factor", type=int, default=2, help="llama.cpp waves: requests per C")
    a("--plot", help="write the roofline here (PNG; needs matplotlib)")
    a("--json-out", help="write everything here")
    args = p.parse_args(argv)
    formats = args.formats.split(",")
    if not formats or set(formats) - set(FORMATS):
        p.error(f"--formats: comma-separated, of {', '.join(FORMATS)}")
    try:
        if min(int(c) for c in args.concurrency.split(",")) < 1:
            raise ValueError
    except ValueError:
        p.error("--concurrency: comma-separated positive integers")
    if bool(args.llama_server) != bool(args.gguf):
        p.error("--llama-server and --gguf go together")
    try:
        parse_gguf(args.gguf, formats)
    except ValueError as e:
        p.error(str(e))
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit(PLOT_NEEDS) from None
    return args


def write_outputs(report: dict, args: argparse.Namespace) -> None:
    """`--plot` and `--json-out` of `report` as it stands (rewritten when llama.cpp's rows come)."""
    if args.plot:
        plot_roofline(report, args.plot)
        logger.info("wrote %s", args.plot)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
        logger.info("wrote %s", args.json_out)


def main(argv: list[str] | None = None) -> dict:
    """Measure ours, print their tables and write `--plot` and `--json-out`; then, with the
    llama.cpp flags, its rows (or failure notes): printed after ours, both files rewritten.
    Returns the report."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    conc = [int(c) for c in args.concurrency.split(",")]
    formats = args.formats.split(",")
    load_before = os.getloadavg()[0]
    ceilings = {"read_bandwidth": roofline_peaks.read_bandwidth(args.bandwidth_mib, args.repeats)}
    ceilings |= roofline_peaks.measure_peaks(args.threads, args.probe_seconds, args.repeats)
    llc = roofline_peaks.last_level_cache_bytes()

    def probe() -> float:
        return roofline_peaks.read_bandwidth(args.bandwidth_mib, BESIDE_REPEATS).rate

    with ExitStack() as stack:
        if args.model_path:
            path = Path(args.model_path)
        else:
            from hybrid_serve.make_model.presets import write_preset

            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="roofline-"))
            logger.info("writing preset %s to %s", args.preset, tmp)
            path = write_preset(args.preset, Path(tmp) / args.preset)
        ours, costs = [], {}
        for fmt in formats:
            runner = load_format(path, fmt, max(conc), args.context_len, args.load_format)
            costs[fmt] = model_costs(runner.model, runner.kv_pool, runner.mamba_pool)
            ops = runner.model.ops
            timed = time_decode(runner, conc, args.context_len, args.warmup, args.repeats,
                                args.seed, probe)  # fmt: skip
            for c, (step_path, times, bw) in timed.items():
                kind = ceiling_kind(fmt, c, ops.backend, ops.bf16_products)
                row = roofline_row("ours", fmt, c, statistics.median(times), costs[fmt],
                                   args.context_len, ceilings, kind, llc, bw)  # fmt: skip
                ours.append(row | {"step_path": step_path, "step_s_runs": times})
            del runner
            gc.collect()
        level = cpp_build.loaded_level()
        report = {
            "args": vars(args),
            "host": {
                "cpu": cpu_name(),
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "last_level_cache_bytes": llc,
                "threads": args.threads,
                "cpu_level": level.name if level else None,
                "features": sorted(cpu_levels.host_features() & PROBE_FEATURES),
                "torch": torch.__version__,
                "load_average": [load_before, os.getloadavg()[0]],
            },
            "ceilings": {k: c.as_dict() for k, c in ceilings.items()},
            "model": {
                "name": path.name,
                "path": str(path) if args.model_path else None,
                "preset": None if args.model_path else args.preset,
                "context_len": args.context_len,
                "costs": {fmt: asdict(c) for fmt, c in costs.items()},
            },
            "ours": ours,
            "llama_cpp": [],
            "llama_cpp_note": LLAMA_PENDING if args.llama_server else NO_LLAMA,
            "llama_cpp_failures": [],
        }
        print_report(report)
        write_outputs(report, args)  # ours kept whatever llama.cpp does next
        if not args.llama_server:
            print_llama(report)
            return report

        def make_row(who: str, fmt: str, c: int, step_s: float, ceiling: str,
                     beside: float | None) -> dict:  # fmt: skip
            llc = roofline_peaks.last_level_cache_bytes()
            return roofline_row(who, fmt, c, step_s, costs[fmt], args.context_len, ceilings,
                                ceiling, llc, beside)  # fmt: skip

        llama, failures = llama_points(args, path, conc, make_row, probe)
    report["llama_cpp"], report["llama_cpp_failures"] = llama, failures
    report["llama_cpp_note"] = LLAMA_MEASURED if llama else "no rows: every llama-server failed"
    report["host"]["load_average"][1] = os.getloadavg()[0]
    print_llama(report)
    write_outputs(report, args)
    return report


if __name__ == "__main__":
    main()
