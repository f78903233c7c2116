"""The `random` serving workload through transformers' `generate`, in static batches.

The prompts are exactly those of `benchmarks.serving --dataset random --token-ids` with the same
`--seed`, `--input-len`/`--output-len` (= `--random-input-len`/`--random-output-len`) and
`--random-range-ratio`, read from the same checkpoint. For each batch size B the prompts are cut
into consecutive static batches of B (the last may be smaller), left-padded, and generated
greedily with ignore_eos semantics: `min_new_tokens = max_new_tokens` = the longest output
length in the batch, so every row runs as long as the batch's longest (that is how a static batch
behaves); each row counts only its own output length. A request's latency is its batch's wall
time. Figures per batch size: request throughput, input/output/total token throughput over the
sum of batch times, and end-to-end latency (mean, median, p99).

Example: python -m benchmarks.hf_baseline --preset small --batch-size 1,8 --num-prompts 16
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
import time

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.serving_datasets import load_tokenizer, random_workload, usable_ids

logger = logging.getLogger("benchmarks.hf_baseline")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="checkpoint dir (default: --preset's)")
    p.add_argument("--preset", default="small", help="preset written to the cache if needed")
    p.add_argument("--batch-size", default="1,8", help="comma-separated static batch sizes")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=1.0)
    p.add_argument("--num-prompts", type=int, default=16, help="prompts per batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--output-file", default=None, help="write the JSON results here")
    return p.parse_args(argv)


def generate_batch(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    """Left-pad `prompts`, generate exactly `new_tokens` per row; returns wall seconds."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] == width + new_tokens, (out.shape, width, new_tokens)
    return elapsed


def run_batch_size(model, prompts, out_lens, batch_size: int, pad_id: int) -> dict:
    latencies: list[float] = []
    total = 0.0
    for i in tqdm(range(0, len(prompts), batch_size), desc=f"batch {batch_size}", leave=False):
        batch, outs = prompts[i : i + batch_size], out_lens[i : i + batch_size]
        elapsed = generate_batch(model, batch, max(outs), pad_id)
        total += elapsed
        latencies += [elapsed] * len(batch)
    n_in, n_out = sum(len(p) for p in prompts), sum(out_lens)
    lat_ms = np.asarray(latencies) * 1e3
    return {
        "batch_size": batch_size,
        "num_prompts": len(prompts),
        "duration_s": total,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(prompts) / total,
        "input_throughput": n_in / total,
        "output_throughput": n_out / total,
        "total_throughput": (n_in + n_out) / total,
        "mean_e2e_latency_ms": float(lat_ms.mean()),
        "median_e2e_latency_ms": float(np.median(lat_ms)),
        "p99_e2e_latency_ms": float(np.percentile(lat_ms, 99)),
    }


def main(argv: list[str] | None = None) -> dict:
    """Run every batch size; returns the report (also written to `--output-file`)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    if args.model_path is None:
        from hybrid_serve.server.model_path import default_model_path

        args.model_path = str(default_model_path(args.preset))
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(args.model_path)
    model = AutoModelForCausalLM.from_pretrained(
        args.model_path, dtype=getattr(torch, args.dtype), local_files_only=True
    ).eval()
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    prompts, out_lens = random_workload(
        usable_ids(tok),
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.random_range_ratio,
        args.seed,
    )
    generate_batch(model, prompts[:1], 2, pad_id)  # warm-up
    load_before = os.getloadavg()[0]
    rows = [
        run_batch_size(model, prompts, out_lens, int(b), pad_id)
        for b in args.batch_size.split(",")
        if b
    ]
    load = (load_before, os.getloadavg()[0])

    print(
        f"\ntransformers generate, {Path(args.model_path).name}, {args.dtype}, "
        f"{args.threads} threads, input {args.input_len}, output {args.output_len}, "
        f"load average {load[0]:.1f} -> {load[1]:.1f}"
    )
    print(
        f"{'batch':>6}{'prompts':>9}{'req/s':>9}{'out tok/s':>11}{'total tok/s':>13}"
        f"{'median ms':>11}"
    )
    for r in rows:
        print(
            f"{r['batch_size']:>6}{r['num_prompts']:>9}{r['request_throughput']:>9.2f}"
            f"{r['output_throughput']:>11.1f}{r['total_throughput']:>13.1f}"
            f"{r['median_e2e_latency_ms']:>11.0f}"
        )
    report = {
        "backend": "transformers-generate",
        "model_path": args.model_path,
        "torch": torch.__version__,
        "load_average": load,
        "args": vars(args),
        "results": rows,
    }
    if args.output_file:
        Path(args.output_file).write_text(json.dumps(report, indent=2) + "\n")
        logger.info("wrote %s", args.output_file)
    return report


if __name__ == "__main__":
    main()
