"""Our server beside llama.cpp's on the same checkpoint, over HTTP: output tok/s by concurrency,
for each of our modes and each GGUF, medians of alternating rounds.

Every round starts each server in turn (ours with `--dtype` / `--quantization` per `--ours`
mode, then `llama-server` per `--gguf`; the order reverses every other round, so drift hits
both), runs one wave per concurrency C (`benchmarks.serving`: `--num-prompts-factor` * C
streaming `/v1/completions` requests of `--prompt-len` random token ids, exactly
`--output-len` greedy tokens with `ignore_eos`, C in flight, one warm-up request first) and
stops it. Only one server runs at a time, each with `--threads` threads. With `--prefill-len N`
each server then also prefills one prompt of N random token ids (a new one every round, so no
prefix cache hits) for one output token: prefill tok/s = N / that request's latency.
llama-server splits its `-c` context between its `-np` slots (one per request in flight), so each
slot gets room for the longest request (`--prefill-len` included).

The GGUFs come from llama.cpp's own converter and `llama-quantize` on the same checkpoint
(`reference/cpu-anchors.md`): `convert_hf_to_gguf.py $M --outtype bf16 --no-mtp`, then
`llama-quantize m-bf16.gguf m-Q8_0.gguf Q8_0` (and Q4_0).

Example: python -m benchmarks.llama_cpp --model-path $SMALL --ours bfloat16,int8,int4 \\
    --llama-server $LL/llama-server --gguf bf16=m-bf16.gguf,q8_0=m-Q8_0.gguf,q4_0=m-Q4_0.gguf
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
import tempfile

from benchmarks import serving
from benchmarks.cpu_tables import _free_port, launched

logger = logging.getLogger("benchmarks.llama_cpp")
QUANTIZED = ("int8", "int4")  # our modes that are --quantization (loaded through bf16)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="the checkpoint (and its tokenizer)")
    p.add_argument("--ours", default="bfloat16,int8,int4", help="float32, bfloat16, int8, int4")
    p.add_argument("--llama-server", required=True, help="path of llama.cpp's llama-server")
    p.add_argument("--gguf", default="", help="comma-separated NAME=PATH of GGUF files")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--num-prompts-factor", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prefill-len", type=int, default=0, help="also time one N-token prefill")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json-out")
    return p.parse_args(argv)


def commands(args: argparse.Namespace, port: int) -> dict[str, list[str]]:
    """Each server's command line, by column name."""
    max_c = max(int(c) for c in args.concurrency.split(","))
    cmds = {}
    for mode in args.ours.split(","):
        cmd = [sys.executable, "-m", "hybrid_serve.server", "--model-path", args.model_path]
        cmd += ["--dtype", "bfloat16", "--quantization", mode] if mode in QUANTIZED else [
            "--dtype", mode]  # fmt: skip
        cmd += ["--num-threads", str(args.threads), "--max-running-requests", str(max_c)]
        cmds[f"ours {mode}"] = [*cmd, "--port", str(port), "--log-level", "warning"]
    for item in filter(None, args.gguf.split(",")):
        name, path = item.split("=", 1)
        cmds[f"llama {name}"] = [
            args.llama_server, "-m", path, "-t", str(args.threads), "-np", str(max_c),
            "-c", str(max_c * (max(args.prompt_len + args.output_len, args.prefill_len) + 64)),
            "--port", str(port),
        ]  # fmt: skip
    return cmds


def wave(url: str, args: argparse.Namespace, c: int, seed: int) -> float:
    n = args.num_prompts_factor * c
    argv = [
        "--base-url", url, "--tokenizer", args.model_path, "--dataset", "random", "--token-ids",
        "--num-prompts", str(n), "--max-concurrency", str(c), "--seed", str(seed),
        "--random-input-len", str(args.prompt_len), "--random-output-len", str(args.output_len),
        "--random-range-ratio", "1.0", "--warmup-requests", "1", "--no-progress",
    ]  # fmt: skip
    record = serving.main(argv)
    if record["completed"] != n:
        raise RuntimeError(f"wave at concurrency {c}: {record['error_samples']}")
    return record["output_throughput"]


def prefill(url: str, args: argparse.Namespace, seed: int) -> float:
    """Prefill tok/s of one `--prefill-len` prompt: its length over the latency of a request for
    one token (a stream of one token may carry it in its last chunk, so not the TTFT)."""
    argv = [
        "--base-url", url, "--tokenizer", args.model_path, "--dataset", "random", "--token-ids",
        "--num-prompts", "1", "--max-concurrency", "1", "--seed", str(1000 + seed),
        "--random-input-len", str(args.prefill_len), "--random-output-len", "1",
        "--random-range-ratio", "1.0", "--warmup-requests", "0", "--no-progress",
    ]  # fmt: skip
    record = serving.main(argv)
    if record["completed"] != 1:
        raise RuntimeError(f"prefill of {args.prefill_len} tokens: {record['error_samples']}")
    return args.prefill_len / (record["mean_e2e_latency_ms"] / 1e3)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    conc = [int(c) for c in args.concurrency.split(",")]
    port = _free_port()
    cmds = commands(args, port)
    runs: dict[str, dict[int, list[float]]] = {name: {c: [] for c in conc} for name in cmds}
    prefills: dict[str, list[float]] = {name: [] for name in cmds}
    loads = []
    logs = Path(tempfile.mkdtemp(prefix="llama_cpp_sbs_"))
    for r in range(args.rounds):
        for name in cmds if r % 2 == 0 else reversed(cmds):
            with launched(cmds[name], port, logs / f"{name.replace(' ', '_')}.log") as url:
                for c in conc:
                    tps = wave(url, args, c, seed=r)
                    runs[name][c].append(tps)
                    logger.info("round %d %s C=%d: %.1f tok/s", r, name, c, tps)
                if args.prefill_len:
                    prefills[name].append(prefill(url, args, seed=r))
                    logger.info("round %d %s prefill: %.1f tok/s", r, name, prefills[name][-1])
            loads.append(os.getloadavg()[0])
    med = {n: {c: statistics.median(v) for c, v in by_c.items()} for n, by_c in runs.items()}
    print(f"{args.threads} threads, {args.rounds} rounds, load {min(loads):.1f}-{max(loads):.1f}")
    print("| output tok/s | " + " | ".join(cmds) + " |")
    print("|---" * (len(cmds) + 1) + "|")
    for c in conc:
        cells = [f"{med[n][c]:,.1f} ({', '.join(f'{x:.1f}' for x in runs[n][c])})" for n in cmds]
        print(f"| C={c} | " + " | ".join(cells) + " |")
    if args.prefill_len:
        cells = [f"{statistics.median(v):,.1f} ({', '.join(f'{x:.1f}' for x in v)})"
                 for v in prefills.values()]  # fmt: skip
        print(f"| prefill {args.prefill_len} tok/s | " + " | ".join(cells) + " |")
    pairs = [("ours int8", "ours bfloat16"), ("ours int8", "llama q8_0"),
             ("ours int4", "ours bfloat16"), ("ours int4", "llama q4_0"),
             ("ours bfloat16", "llama bf16"), ("ours bfloat16", "ours float32")]  # fmt: skip
    for a, b in pairs:
        if a in med and b in med:
            ratios = ", ".join(f"C={c} {med[a][c] / med[b][c]:.2f}x" for c in conc)
            if args.prefill_len:
                pa, pb = (statistics.median(prefills[n]) for n in (a, b))
                ratios += f", prefill {pa / pb:.2f}x"
            print(f"{a} / {b}: {ratios}")
    report = {"args": vars(args), "runs": runs, "median": med, "prefill": prefills, "load": loads}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
