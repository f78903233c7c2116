"""Fidelity of the lossy CPU modes against fp32: `--dtype bfloat16` with exact products on the
bf16 weights (`bfloat16`: bf16 matrices, fp32 everything else, `HYBRID_SERVE_BF16_PRODUCTS=off`),
the same with the bf16 route (`bf16-products`: matrices at every row count multiply
activations rounded to bf16, `HYBRID_SERVE_BF16_PRODUCTS=on`, on any CPU) and
`--quantization int8|int4` (quantized matrices, loaded through bf16; their few bf16 matrices, the
routers' gates, as the environment's `HYBRID_SERVE_BF16_PRODUCTS` says).

Every mode loads the same checkpoint in one process and serves the same GSM8K completion prompts
(`--num-shots` worked examples, then a test question) through the offline Engine, greedy, with
exactly `--max-new-tokens` output tokens. Reported per mode (`--modes`):

- greedy agreement: the share of requests whose output equals fp32's token for token, the
  mean position of the first differing token, and the share of output tokens before it;
- per-token KL(p_fp32 || p_mode) and top-1 agreement at fp32's output positions, on the paths
  `--kl-path` names (comma-separated):
  - `teacher-forced` (the default): one prefill of prompt + fp32 output through each model's
    runner, logits at every output position (`benchmarks.margins.all_logits`);
  - `decode`: each model's own decode steps, every step fed fp32's token, the requests decoded
    together in groups of `--decode-batch-sizes` (cycled; the GEMV's rows, up to 8, and the
    GEMM's beyond) through the Engine's decode seam (`benchmarks.decode_kl`): the logits
    predicting fp32's output tokens 1 to n-1, under `decode_path` per mode (beside the
    teacher-forced figures at those positions when both paths run), with the group
    sizes and fp32's own top-1 against its greedy output (1.0 where decoding is batch
    invariant) under the report's `decode_path`.

Beside them, `float32_margins`: the margins those figures were measured at, fp32's top-1
probability and top-1 minus top-2 gaps at the same positions (`benchmarks.margins.margin_stats`;
`benchmarks.margins` measures them on held-out text instead of the model's own output), and per
mode the top-1 agreement split by fp32's logit gap there (near-ties under 0.1, 0.1-1, 1 and
over: `benchmarks.margins.agreement_by_gap`).

SGLang's bar for its own kernels is a mean KL under 0.002. On random-weight presets logit
margins are small and every rounding is amplified through the layers, so these figures
overstate what a trained model loses.

Example: python -m benchmarks.fidelity --preset small --num-prompts 100 \
             --modes bfloat16,bf16-products,int8,int4 --kl-path teacher-forced,decode
"""

from __future__ import annotations

import sys  # noqa: I001  (the repo root goes on sys.path before our packages are imported)
from pathlib import Path

if not __package__:  # run as `python benchmarks/x.py`: the repo root first, not benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import logging
import os
import statistics
import time

import torch

from benchmarks.decode_kl import divergence, forced_decode_logprobs, group_sizes
from benchmarks.gsm8k_data import build_prompts, load_split
from benchmarks.margins import agreement_by_gap, all_logits, logit_gaps, margin_stats
from benchmarks.model_forward import resolve_model_path
from hybrid_serve.kernels import cpu_levels
from hybrid_serve.kernels.settings import BF16_PRODUCTS_ENV
from hybrid_serve.scheduler.engine import Engine

logger = logging.getLogger("benchmarks.fidelity")

# mode -> (Engine arguments, HYBRID_SERVE_BF16_PRODUCTS while it loads; None: the environment's)
MODES = {
    "bfloat16": ({"dtype": "bfloat16"}, "off"),
    "bf16-products": ({"dtype": "bfloat16"}, "on"),
    "int8": ({"dtype": "bfloat16", "quantization": "int8"}, None),
    "int4": ({"dtype": "bfloat16", "quantization": "int4"}, None),
}


def load_engine(path: str, mode: str, opts: dict) -> Engine:
    """The engine of `mode` (any other name: that dtype), its kernels chosen under the mode's
    bf16 products setting (read once, when the engine loads the model)."""
    args, products = MODES.get(mode, ({"dtype": mode}, None))
    before = os.environ.get(BF16_PRODUCTS_ENV)
    if products is not None:
        os.environ[BF16_PRODUCTS_ENV] = products
    try:
        return Engine(path, **opts, **args)
    finally:
        if before is None:
            os.environ.pop(BF16_PRODUCTS_ENV, None)
        else:
            os.environ[BF16_PRODUCTS_ENV] = before


KL_PATHS = ("teacher-forced", "decode")


def kl_figures(refs: list[torch.Tensor], gots: list[torch.Tensor]) -> dict:
    """Per-token KL(ref || got) and top-1 agreement over every row of the paired
    log-probability tensors, the agreement also split by the reference's logit gap."""
    pairs = [divergence(r, g) for r, g in zip(refs, gots, strict=True)]
    kls = torch.cat([kl for kl, _ in pairs]).tolist()
    top1 = torch.cat([agree for _, agree in pairs])
    return {
        "positions": len(kls),
        "kl_mean": statistics.mean(kls),
        "kl_median": statistics.median(kls),
        "kl_p99": sorted(kls)[int(0.99 * (len(kls) - 1))],
        "top1_agreement": float(top1.double().mean()),
        "top1_agreement_by_fp32_logit_gap": agreement_by_gap(logit_gaps(torch.cat(refs)), top1),
    }


def teacher_forced(engine: Engine, prompts: list[list[int]], outs: list[list[int]]) -> list:
    """Per request, the log-probabilities predicting each token of `outs` from one prefill of
    prompt + output (all but its last token) through the engine's runner."""
    return [
        all_logits(engine.runner, prompt + out[:-1])[len(prompt) - 1 :].log_softmax(-1)
        for prompt, out in zip(prompts, outs, strict=True)
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", help="checkpoint directory (default: write --preset)")
    p.add_argument("--preset", default="small", help="preset to write when no --model-path")
    p.add_argument("--rewrite-preset", action="store_true")
    p.add_argument("--data-path", default="/work/shared/data/gsm8k", help="GSM8K jsonl directory")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--num-shots", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--modes", default="bfloat16", help=f"comma-separated: {', '.join(MODES)}")
    p.add_argument("--kl-path", default="teacher-forced", help=f"comma-separated: {KL_PATHS}")
    p.add_argument(
        "--decode-batch-sizes", default="8,16", help="decode path: requests decoded together"
    )
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    modes, paths = args.modes.split(","), args.kl_path.split(",")
    if unknown := set(modes) - MODES.keys():
        p.error(f"--modes: unknown {', '.join(sorted(unknown))} (choose {', '.join(MODES)})")
    if unknown := set(paths) - set(KL_PATHS):
        p.error(f"--kl-path: unknown {', '.join(sorted(unknown))} (choose {', '.join(KL_PATHS)})")
    sizes = [int(x) for x in args.decode_batch_sizes.split(",")]
    if max(sizes) > args.max_running_requests:
        p.error("--decode-batch-sizes: a size exceeds --max-running-requests")
    torch.set_num_threads(args.threads)
    path = str(resolve_model_path(args))

    train, test = load_split(args.data_path, "train"), load_split(args.data_path, "test")
    texts = build_prompts(train, test[: args.num_prompts], args.num_shots)
    opts = dict(max_running_requests=args.max_running_requests, max_context_len=4096)
    engines = {m: load_engine(path, m, opts) for m in ["float32", *modes]}
    prompts = [engines["float32"].tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    sp = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
    outputs, wall = {}, {}
    for d, engine in engines.items():
        start = time.perf_counter()
        outputs[d] = [r["output_ids"] for r in engine.generate(prompts, sp)]
        wall[d] = time.perf_counter() - start

    n_out = args.max_new_tokens
    for engine in engines.values():
        engine.flush_cache()  # the radix cache holds the finished requests' slots
    report = {
        "model_path": path,
        "prompts": len(prompts),
        "mean_prompt_tokens": statistics.mean(len(x) for x in prompts),
        "max_new_tokens": n_out,
        "generate_wall_s": wall,
        "threads": args.threads,
        "kl_paths": paths,
        "cpu_multiplies_bf16": cpu_levels.multiplies_bf16(),
    }
    fp32_out = outputs["float32"]

    groups = group_sizes(len(prompts), sizes)  # the decode path's batches

    def decoded(engine: Engine) -> list[torch.Tensor]:
        return forced_decode_logprobs(engine.scheduler.graph_runner, prompts, fp32_out, sizes)

    with torch.inference_mode():
        refs = teacher_forced(engines["float32"], prompts, fp32_out) if paths != ["decode"] else []
        if refs:  # the logits that predict each of fp32's output tokens
            report["float32_margins"] = margin_stats(torch.cat(refs))
        if "decode" in paths:
            dec_refs = decoded(engines["float32"])
            agree = [
                (r.argmax(-1) == torch.tensor(o[1:])).double()
                for r, o in zip(dec_refs, fp32_out, strict=True)
            ]
            report["decode_path"] = {
                "batch_sizes": groups,
                "float32_top1_is_its_greedy_output": float(torch.cat(agree).mean()),
                "float32_margins": margin_stats(torch.cat(dec_refs)),
            }
        for mode in modes:
            first_diff = [
                next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), n_out)
                for a, b in zip(fp32_out, outputs[mode], strict=True)
            ]
            report[mode] = {
                "bf16_products": engines[mode].runner.model.ops.bf16_products,
                "greedy_identical": sum(f == n_out for f in first_diff) / len(first_diff),
                "mean_first_divergence": statistics.mean(first_diff),
                "tokens_before_divergence": sum(first_diff) / (n_out * len(first_diff)),
            }
            if refs:
                tf_gots = teacher_forced(engines[mode], prompts, fp32_out)
                report[mode] |= kl_figures(refs, tf_gots)
            if "decode" in paths:
                gots, at = decoded(engines[mode]), 0
                figures = kl_figures(dec_refs, gots)
                figures["decode_plan"] = engines[mode].scheduler.graph_runner.plan is not None
                for size in groups:
                    part = kl_figures(dec_refs[at : at + size], gots[at : at + size])
                    figures.setdefault("by_batch", []).append(
                        {"rows": size, "kl_mean": part["kl_mean"], "top1": part["top1_agreement"]}
                    )
                    at += size
                if refs:  # teacher-forced at the decode path's positions (all but the first)
                    same = kl_figures([r[1:] for r in refs], [g[1:] for g in tf_gots])
                    figures["teacher_forced_same_positions"] = {
                        "kl_mean": same["kl_mean"],
                        "top1": same["top1_agreement"],
                    }
                report[mode]["decode_path"] = figures
    report["load_average"] = os.getloadavg()[0]
    print(json.dumps(report, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
