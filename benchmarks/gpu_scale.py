"""Real-size serving on one CUDA GPU with dummy weights, beside the HBM roofline.

    python -m benchmarks.gpu_scale [--out DIR]     on a CUDA machine (JSON + markdown to DIR)
    python -m benchmarks.gpu_scale --dry-run       anywhere: the roofline bytes only

Cases (hybrid_serve/make_model/real_shapes.py, `--load-format dummy`, bf16, CUDA graphs captured):
  qwen3.5-35b-a3b          the whole model (69 GB of bf16 weights)
  qwen3-next-80b-a3b       16 of its 48 layers (12 GDN + 4 attention, the 3:1 pattern kept):
                           the whole model holds 159 GB of bf16 weights, more than one H100 or
                           H200 has
  qwen3-next-80b-a3b FP8   the whole model as the FP8 release holds it on CUDA: its matrices
                           stay block-FP8 (models/fp8_resident.py), 80 GB with the scales, the
                           Triton block GEMM and FP8 experts multiplying them

Per case: the dummy load's time and the whole start-up (load, pools, graph capture), the pool
sizes, decode tok/s at batch 1, 16, 64, 256 (prompts of 128 random tokens, 256 output tokens;
decode time = the run with 256 output tokens minus the same batch's run with 1), prefill tok/s
of one 8192-token prompt, TTFT of an 8192-token cached prefix plus 16 new tokens (in-process, no
HTTP), and each decode step beside its roofline: bytes the step must read (models/step_bytes.py,
at the decode's mean context of 256 tokens) over the device's bandwidth, as the fraction
roofline / measured. A batch whose pools do not fit beside the weights is reported as skipped,
with the largest batch that fits.

--dry-run prints, for every real shape (and the 80B-A3B in FP8) and batch, the bytes per step and
the roofline step time and tok/s at H100 SXM (3.35 TB/s) and H200 (4.8 TB/s) bandwidth, whether
the pools of that batch fit on an 80 GB H100 and on a 141 GB H200 beside the weights (no batch of
the whole 80B-A3B in bf16 does: its weights alone exceed either device); then the memory plan of
the 80B-A3B on one H200 in bf16 and in FP8, from the model the loader builds (on the meta device,
`--load-format dummy`) and the server's own pool sizing (scheduler/pool_sizing.py): the weights'
bytes, the pool budget at --mem-fraction-static 0.9, the bytes per KV token and per Mamba slot,
and the KV tokens and Mamba slots of this benchmark's largest batch that fits.
"""

from __future__ import annotations

import sys  # noqa: I001  (the repo root goes on sys.path before our packages are imported)
from pathlib import Path

if not __package__:  # run as `python benchmarks/x.py`: the repo root first, not benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import gc
import json
import os
import random
import tempfile
import time

import torch

from hybrid_serve.make_model.fp8_writer import config_quantization
from hybrid_serve.make_model.presets import checkpoint_shapes, complete_config, write_config_only
from hybrid_serve.make_model.real_shapes import REAL_SHAPES, real_shape_config
from hybrid_serve.models.fp8 import Fp8Config
from hybrid_serve.models.qwen3_next_config import Qwen3NextConfig
from hybrid_serve.models.step_bytes import (
    decode_step_bytes,
    kv_bytes_per_token,
    param_groups,
    state_bytes_per_request,
)

BANDWIDTH = {"H100 SXM": 3.35e12, "H200": 4.8e12}  # bytes / s, the vendors' HBM figures
CASES = (  # (real shape, layers kept or None: all, FP8)
    ("qwen3.5-2b", None, False),
    ("qwen3.5-35b-a3b", None, False),
    ("nemotron-3-nano-30b-a3b", None, False),
    ("qwen3-next-80b-a3b", 16, False),
    ("qwen3-next-80b-a3b", None, True),
)
BATCHES = (1, 16, 64, 256)
PROMPT, OUTPUT, LONG, SUFFIX = 128, 256, 8192, 16
CONTEXT = PROMPT + OUTPUT // 2  # the decode's mean cached length
FRACTION = 0.9  # --mem-fraction-static: weights + pools
H100_BYTES = 85.0e9  # an "80 GB" H100 as torch reports it (79.2 GiB)
H200_BYTES = 141.0e9  # the H200's "141 GB" (torch reports about 150e9: this plan is the tighter)
FP8_BLOCK = (128, 128)  # the official FP8 releases' weight_block_size


def case_config(name: str, layers: int | None, fp8: bool = False) -> dict:
    """Real shape `name` (cut to `layers`) as a complete config.json, in bf16; with `fp8`, with
    the quantization_config of its block-FP8 release."""
    raw = real_shape_config(name, layers)
    cfg = complete_config(raw, dtype=torch.bfloat16)
    if fp8:
        cfg["quantization_config"] = config_quantization(checkpoint_shapes(raw), FP8_BLOCK)
    return cfg


def model_config(name: str, layers: int | None) -> Qwen3NextConfig:
    return Qwen3NextConfig.from_dict(case_config(name, layers))


def fp8_config(name: str, layers: int | None) -> Fp8Config:
    return Fp8Config.from_dict(case_config(name, layers, fp8=True)["quantization_config"])


def label(name: str, layers: int | None, fp8: bool = False) -> str:
    return name + " FP8" * fp8 + (f" ({layers} layers)" if layers else "")


def max_batch(
    c: Qwen3NextConfig, device_bytes: float, slack: int = 8, fp8: Fp8Config | None = None
) -> int:
    """Largest batch (<= 256) whose Mamba slots, KV and request rows fit in FRACTION of the
    device beside the weights (bf16, or with `fp8` its block-FP8 matrices at one byte), with
    room for one LONG + SUFFIX prompt and `slack` cached states."""
    room = FRACTION * device_bytes - param_groups(c, fp8).resident_bytes()
    per_req = state_bytes_per_request(c) + 2 * c.hidden_size
    room -= slack * per_req + (LONG + SUFFIX) * kv_bytes_per_token(c)
    per_req += (PROMPT + OUTPUT) * kv_bytes_per_token(c) + 4 * (LONG + 2 * SUFFIX)
    return max(0, min(max(BATCHES), int(room // per_req)))


def dry_run() -> list[dict]:
    rows = []
    names = [(n, None, False) for n in REAL_SHAPES] + [c for c in CASES if c[1] or c[2]]
    for name, layers, fp8 in names:
        c = model_config(name, layers)
        quant = fp8_config(name, layers) if fp8 else None
        fits = {dev: max_batch(c, size, fp8=quant) for dev, size in DEVICES.items()}
        for b in BATCHES:
            step = decode_step_bytes(c, b, CONTEXT, fp8=quant)
            rows.append(
                {
                    "model": label(name, layers, fp8),
                    "batch": b,
                    "weights_gb": step.weights / 1e9,
                    "kv_gb": step.kv / 1e9,
                    "state_gb": step.state / 1e9,
                    "total_gb": step.total / 1e9,
                    **{f"{dev} ms": 1e3 * step.seconds(bw) for dev, bw in BANDWIDTH.items()},
                    **{f"{dev} tok/s": b / step.seconds(bw) for dev, bw in BANDWIDTH.items()},
                    **{f"fits_{dev.lower()}": b <= fits[dev] for dev in DEVICES},
                }
            )
    return rows


DEVICES = {"H100": H100_BYTES, "H200": H200_BYTES}


def memory_plan(name: str, layers: int | None, fp8: bool, device_bytes: float) -> dict:
    """What one device of `device_bytes` holds for this case: the weights of the model the
    loader builds (meta device, dummy weights, FP8 matrices kept FP8 when `fp8`) and the pools
    the server's sizing gives the rest of FRACTION of the device, for this benchmark's largest
    batch that fits (`max_batch`; the pools of one request where none does)."""
    from hybrid_serve.models.loader import load_model
    from hybrid_serve.scheduler.config import RunnerConfig
    from hybrid_serve.scheduler.pool_sizing import GB, pool_bytes, size_pools

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(case_config(name, layers, fp8)))
        model = load_model(tmp, "bfloat16", device="meta", load_format="dummy", fp8_resident=fp8)
    sizes = pool_bytes(model)
    quant = fp8_config(name, layers) if fp8 else None
    batch = max_batch(model.config, device_bytes, fp8=quant)
    plan = {
        "model": label(name, layers, fp8),
        "device_gb": device_bytes / GB,
        "weights_gb": sizes.weights / GB,
        "pool_budget_gb": (FRACTION * device_bytes - sizes.weights) / GB,
        "kv_bytes_per_token": sizes.kv_per_token,
        "mamba_slot_mb": sizes.mamba_per_slot / 1e6,
        "batch": batch,
    }
    if plan["pool_budget_gb"] <= 0:
        return {**plan, "fits": False, "why": "the weights alone exceed the fraction"}
    cfg = RunnerConfig(
        max_running_requests=max(batch, 1),
        max_context_len=LONG + 2 * SUFFIX,
        mamba_cache_size=max(batch, 1) + 8,
        pool_memory_gb=plan["pool_budget_gb"],
    )
    try:
        cfg = size_pools(cfg, sizes)
    except ValueError as e:  # the weights leave too little for the pools
        return {**plan, "fits": False, "why": str(e)}
    kv, mamba = cfg.max_total_tokens * sizes.kv_per_token, cfg.mamba_slots * sizes.mamba_per_slot
    return {
        **plan,
        "fits": True,
        "kv_tokens": cfg.max_total_tokens,
        "kv_pool_gb": kv / GB,
        "mamba_slots": cfg.mamba_slots,
        "mamba_pool_gb": mamba / GB,
    }


def _prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def _timed(engine, prompts, new_tokens: int) -> float:
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run_case(name: str, layers: int | None, fp8: bool, workdir: Path, bandwidth: float) -> dict:
    import hybrid_serve.scheduler.build as build_module
    from hybrid_serve.kernels.fp8 import is_fp8, weight_bytes
    from hybrid_serve.scheduler.engine import Engine

    loads: list[float] = []

    def timed_load(*args, **kwargs):  # the dummy load's own time, inside the Engine's start-up
        start = time.perf_counter()
        model = load_model(*args, **kwargs)
        torch.cuda.synchronize()
        loads.append(time.perf_counter() - start)
        return model

    c = model_config(name, layers)
    quant = fp8_config(name, layers) if fp8 else None
    block = FP8_BLOCK if fp8 else None
    path = write_config_only(workdir / label(name, None, fp8), real_shape_config(name, layers),
                             fp8_block=block)  # fmt: skip
    top = max_batch(c, torch.cuda.get_device_properties(0).total_memory, fp8=quant)
    batches = [b for b in BATCHES if b <= top]
    name = label(name, None, fp8)
    if not batches:
        return {"model": name, "layers": c.num_hidden_layers, "skipped": "weights do not fit"}
    load_model = build_module.load_model
    build_module.load_model = timed_load
    start = time.perf_counter()
    try:
        engine = Engine(
            str(path),
            load_format="dummy",
            dtype="bfloat16",
            device="cuda",
            mem_fraction_static=FRACTION,
            max_running_requests=max(batches),
            max_context_len=LONG + 2 * SUFFIX,
            mamba_cache_size=max(batches) + 8,
            chunked_prefill_size=LONG,
            max_prefill_tokens=LONG + SUFFIX,
            cuda_graph_bs=tuple(batches),
            cuda_graph_max_bs=max(batches),
        )
    finally:
        build_module.load_model = load_model
    out: dict = {"model": name, "layers": c.num_hidden_layers, "load_s": loads[0]}
    model = engine.runner.model
    out["weights_gb"] = sum(weight_bytes(p) for p in model.parameters()) / 1e9
    out["fp8_matrices"] = sum(is_fp8(p) for p in model.parameters())
    out["startup_s"] = time.perf_counter() - start  # load, pools and graph capture
    cfg = engine.runner.config
    out["pools"] = {"kv_tokens": cfg.max_total_tokens, "mamba_slots": cfg.mamba_slots}
    rng = random.Random(0)
    # warm-up: the kernels compile on their first decode and first long prefill
    _timed(engine, _prompts(rng, 1, PROMPT, c.vocab_size), 8)
    _timed(engine, _prompts(rng, 1, LONG, c.vocab_size), 1)
    out["decode"] = []
    for b in BATCHES:
        if b not in batches:
            out["decode"].append({"batch": b, "skipped": f"pools fit up to batch {top}"})
            continue
        first = _timed(engine, _prompts(rng, b, PROMPT, c.vocab_size), 1)
        full = _timed(engine, _prompts(rng, b, PROMPT, c.vocab_size), OUTPUT)
        step_s = (full - first) / (OUTPUT - 1)
        roof = decode_step_bytes(c, b, CONTEXT, fp8=quant).seconds(bandwidth)
        out["decode"].append(
            {"batch": b, "tok_s": b / step_s, "step_ms": 1e3 * step_s, "roofline": roof / step_s}
        )
    (long,) = _prompts(rng, 1, LONG, c.vocab_size)
    out["prefill_8k_tok_s"] = LONG / _timed(engine, [long], 1)
    suffix = _prompts(rng, 1, SUFFIX, c.vocab_size)[0]
    out["ttft_cached_8k_ms"] = 1e3 * _timed(engine, [long + suffix], 1)
    del engine
    gc.collect()  # the next case needs the memory back
    torch.cuda.empty_cache()
    return out


def markdown(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))  # every row's keys, in order
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        values = [r.get(k, "") for k in keys]
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in values]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="roofline bytes only (no GPU)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu-scale"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        rows = dry_run()
        plans = [memory_plan("qwen3-next-80b-a3b", None, fp8, H200_BYTES) for fp8 in (False, True)]
        table = markdown(rows) + "\nMemory plan on one H200 (141 GB):\n\n" + markdown(plans)
        print(table)
        (out / "gpu_scale_dry_run.json").write_text(json.dumps(rows, indent=1))
        (out / "gpu_scale_memory_plan.json").write_text(json.dumps(plans, indent=1))
        (out / "gpu_scale_dry_run.md").write_text(table)
        return
    if not torch.cuda.is_available():
        sys.exit("gpu_scale: no CUDA device (use --dry-run for the roofline bytes)")
    device = torch.cuda.get_device_name(0)
    bandwidth = next((bw for d, bw in BANDWIDTH.items() if d.split()[0] in device), None)
    if bandwidth is None:
        sys.exit(f"gpu_scale: no bandwidth figure for {device} (benchmarks/gpu_scale.BANDWIDTH)")
    results = {"device": device, "bandwidth": bandwidth, "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name, layers, fp8 in CASES:
            results["cases"].append(run_case(name, layers, fp8, Path(tmp), bandwidth))
    rows = []
    for case in results["cases"]:
        for d in case.get("decode", []):
            rows.append(
                {
                    "model": f"{case['model']} ({case['layers']} layers)",
                    "weights_gb": case["weights_gb"],
                    "fp8_matrices": case["fp8_matrices"],
                    "load_s": case["load_s"],
                    "startup_s": case["startup_s"],
                    "kv_tokens": case["pools"]["kv_tokens"],
                    "mamba_slots": case["pools"]["mamba_slots"],
                    "batch": d["batch"],
                    "decode_tok_s": d.get("tok_s", d.get("skipped")),
                    "roofline_fraction": d.get("roofline", ""),
                    "prefill_8k_tok_s": case["prefill_8k_tok_s"],
                    "ttft_cached_8k_ms": case["ttft_cached_8k_ms"],
                }
            )
    table = f"{device}, {bandwidth / 1e12:.2f} TB/s\n\n" + markdown(rows)
    print(table)
    (out / "gpu_scale.json").write_text(json.dumps(results, indent=1))
    (out / "gpu_scale.md").write_text(table)


if __name__ == "__main__":
    main()
