"""Offline output throughput: our `Engine` at several concurrencies beside transformers `generate`.

Workload (issue 3's figures): `--num-prompts`-free waves of C requests submitted at once, each a
prompt of `--prompt-len` random token ids and exactly `--output-len` new tokens (ignore_eos,
greedy). Output throughput = C * output_len / wall time of the wave (prefill included). The
transformers baseline runs `generate` on static batches of the same prompts in the same process
(eos disabled, so every row produces output_len tokens). Medians over `--repeats` waves.

Variants of ours, interleaved in every repeat: `--variants float32:torch,float32:auto,
bfloat16:auto,int8:auto` (dtype `:` `HYBRID_SERVE_KERNELS` backend: bf16 weights on CPU; int8 and
int4 the `--quantization` matrices, loaded through bf16; the eager torch references against the C++
CPU kernels), each optionally `:` `plan` (the default, as the
server: small decode batches run the CPU decode plan, `models.cpu_decode`, where the kernel set
allows it) or `eager` (`--disable-cuda-graph`: no decode plan), then optionally `:`
`HYBRID_SERVE_BF16_PRODUCTS` (`auto`, `on`, `off`: the bf16 matrices' products in bf16 from 16
rows, or exact; default the environment's); one engine and one row each (the kernel set is
chosen once, when the engine loads the model).

Example: python -m benchmarks.engine_throughput --preset small --concurrency 1,8,32,64
Real shapes with dummy weights (no transformers baseline: it needs weight files):
         python -m benchmarks.engine_throughput --model-path /tmp/q35-2b --load-format dummy \
             --variants bfloat16:auto --concurrency 1,16 --hf-batch ''
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

from hybrid_serve.kernels.settings import BF16_PRODUCTS_ENV, KERNELS_ENV
from hybrid_serve.scheduler.engine import Engine

logger = logging.getLogger("benchmarks.engine_throughput")


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def parse_variant(text: str) -> tuple[str, ...]:
    """dtype:kernels[:plan|eager[:auto|on|off]] -> (dtype, kernels, step, bf16 products or "");
    a wrong count of parts gives another length."""
    parts = text.split(":")
    return tuple(parts + ["plan", ""][len(parts) - 2 :]) if len(parts) >= 2 else tuple(parts)


def run_engine(engine: Engine, prompts: list[list[int]], output_len: int) -> float:
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o["output_ids"]) == output_len for o in outs)
    assert engine.leak_report() == [], engine.leak_report()
    engine.flush_cache()
    return len(prompts) * output_len / elapsed


def run_hf(model, prompts: list[list[int]], output_len: int) -> float:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=output_len,
            do_sample=False,
            eos_token_id=None,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + output_len
    return len(prompts) * output_len / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--hf-batch", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--variants",
        default="float32:auto",
        help="comma-separated dtype:kernels pairs, e.g. float32:torch,float32:auto,bfloat16:auto",
    )
    ap.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "dummy"),
        help="dummy: random weights from config.json alone (real shapes, make-model --config-only)",
    )
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    if args.model_path is None:
        from hybrid_serve.server.model_path import default_model_path

        args.model_path = str(default_model_path(args.preset))
    conc = [int(c) for c in args.concurrency.split(",")]
    variants = [parse_variant(v) for v in args.variants.split(",")]
    if any(len(v) != 4 for v in variants):
        ap.error("--variants: dtype:kernels[:plan|eager[:auto|on|off]]")
    if any(comp not in ("plan", "eager") for _, _, comp, _ in variants):
        ap.error("--variants: the decode step after dtype:kernels is plan or eager")
    if any(bf16 not in ("", "auto", "on", "off") for *_, bf16 in variants):
        ap.error("--variants: the bf16 products after dtype:kernels:step are auto, on or off")
    engines = {}
    for variant in dict.fromkeys(variants):
        d, mode, comp, bf16 = variant
        env = {KERNELS_ENV: mode, **({BF16_PRODUCTS_ENV: bf16} if bf16 else {})}
        before = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # read once, when the engine loads the model
        try:
            engines[variant] = Engine(
                args.model_path,
                max_running_requests=max(conc),
                dtype="bfloat16" if d in ("int8", "int4") else d,
                quantization=d if d in ("int8", "int4") else None,
                max_total_tokens=max(conc) * (args.prompt_len + args.output_len + 8),
                disable_cuda_graph=comp == "eager",
                load_format=args.load_format,
            )
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    engine = next(iter(engines.values()))
    vocab = engine.runner.model.config.vocab_size
    hf = None
    hf_batches = [int(b) for b in args.hf_batch.split(",") if b]
    if hf_batches:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32).eval()
    for e in engines.values():  # warm-up (tokenizer, kernels)
        run_engine(e, _prompts(2, args.prompt_len, vocab, 99), 4)
    if hf is not None:
        run_hf(hf, _prompts(1, args.prompt_len, vocab, 99), 4)
    results: dict[str, list[float]] = {}
    for rep in range(args.repeats):  # interleave ours and transformers so noise hits both
        for c in conc:
            for variant in variants:
                prompts = _prompts(c, args.prompt_len, vocab, rep)
                tps = run_engine(engines[variant], prompts, args.output_len)
                label = " ".join(part for part in variant if part)
                name = f"ours {label} c={c}" if len(variants) > 1 else f"ours c={c}"
                results.setdefault(name, []).append(tps)
                logger.info("rep %d %s: %.1f tok/s", rep, name, tps)
        for b in hf_batches:
            tps = run_hf(hf, _prompts(b, args.prompt_len, vocab, rep), args.output_len)
            results.setdefault(f"transformers batch={b}", []).append(tps)
            logger.info("rep %d transformers batch=%d: %.1f tok/s", rep, b, tps)
    table = {k: {"median_tok_s": statistics.median(v), "runs": v} for k, v in results.items()}
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs, {args.threads} threads")
    print(f"{'config':<42}{'median tok/s':>14}  runs")
    for k, v in table.items():
        print(f"{k:<42}{v['median_tok_s']:>14.1f}  {', '.join(f'{x:.1f}' for x in v['runs'])}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "results": table}, f, indent=2)


if __name__ == "__main__":
    main()
