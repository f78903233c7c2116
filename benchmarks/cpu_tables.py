"""Issue 10's CPU tables in one run: engine and HTTP output tok/s by concurrency and dtype,
2,000-token prefill tok/s, and transformers `generate` beside them, medians of interleaved runs.

Every repeat runs, in this order: for each dtype, `Engine` waves of C greedy requests at each
concurrency C (prompt `--prompt-len` random ids, exactly `--output-len` new tokens, as in
`benchmarks.engine_throughput`) and one `--prefill-len`-token prompt with one new token
(prefill tok/s = prompt length / wall time); then transformers `generate` at `--hf-batch`
batch sizes and one transformers forward of the long prompt; then, for each dtype, the same
waves over HTTP (`benchmarks.serving`, streaming `/v1/completions`, token-id prompts, one wave
of C requests at concurrency C) against a `python -m hybrid_serve.server` started once per dtype for
the whole run (idle servers sleep). Everything uses `--threads` torch threads.

Duration: a calibration wave after the warm-up gives an estimate that is printed before the
timed run, and again after the first repeat; a repeat is not started when the elapsed time plus
one repeat would pass `--max-minutes` (the table says how many repeats it holds). `--quick`
shrinks everything for an end-to-end check (~3-6 minutes on a quiet 2-core machine).
The markdown table goes to `--markdown-out` (and stdout), all runs to `--json-out`.

Example: python -m benchmarks.cpu_tables --markdown-out cpu_tables.md
         python -m benchmarks.cpu_tables --quick
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
import signal
import socket
import statistics
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
import torch

from benchmarks import serving
from benchmarks.engine_throughput import _prompts, run_engine, run_hf
from hybrid_serve.scheduler.engine import Engine

logger = logging.getLogger("benchmarks.cpu_tables")
REPO = Path(__file__).resolve().parents[1]
QUICK = {
    "concurrency": "1,8",
    "output_len": 8,
    "prefill_len": 256,
    "repeats": 1,
    "hf_batch": "8",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--model-path", default=None, help="checkpoint dir (default: --preset's, written if needed)")
    a("--preset", default="small")
    a("--dtypes", default="float32,bfloat16")
    a("--concurrency", default="1,8,32,64")
    a("--prompt-len", type=int, default=32)
    a("--output-len", type=int, default=64)
    a("--prefill-len", type=int, default=2000)
    a("--hf-batch", default="1,8", help="transformers generate batch sizes ('' for none)")
    a("--repeats", type=int, default=3)
    a("--threads", type=int, default=2)
    a("--no-http", action="store_true", help="engine, prefill and transformers only")
    a("--max-minutes", type=float, default=120.0, help="no repeat starts past this budget")
    a("--quick", action="store_true", help=f"a reduced end-to-end check, as defaults: {QUICK}")
    a("--markdown-out", default=None)
    a("--json-out", default=None)
    args = p.parse_args(argv)
    if args.quick:  # QUICK replaces the defaults; flags given explicitly still win
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    return args


# ---- the HTTP side ---------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(model_path: str, dtype: str, threads: int, max_running: int, log: Path) -> Iterator[str]:
    """A `python -m hybrid_serve.server` on 127.0.0.1 for the whole run; yields its URL."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "hybrid_serve.server",
        "--model-path",
        model_path,
        "--dtype",
        dtype,
    ]
    cmd += ["--num-threads", str(threads), "--max-running-requests", str(max_running)]
    cmd += ["--port", str(port), "--log-level", "warning"]
    with launched(cmd, port, log) as url:
        yield url


@contextmanager
def launched(cmd: list[str], port: int, log: Path) -> Iterator[str]:
    """Run `cmd` (an HTTP server listening on 127.0.0.1:`port`, from the repo root), wait for its
    /health to answer 200 (at most 300 s), yield its URL, and stop it (SIGINT, then SIGKILL
    after 30 s) on the way out."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy in 300 s:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        proc.send_signal(2)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_http(url: str, model_path: str, args: argparse.Namespace, c: int, seed: int) -> float:
    argv = [
        "--base-url", url, "--tokenizer", model_path, "--dataset", "random", "--token-ids",
        "--num-prompts", str(c), "--max-concurrency", str(c), "--seed", str(seed),
        "--random-input-len", str(args.prompt_len), "--random-output-len", str(args.output_len),
        "--warmup-requests", "1", "--no-progress",
    ]  # fmt: skip
    record = serving.main(argv)
    if record["completed"] != c:
        raise RuntimeError(f"HTTP wave at concurrency {c}: {record['error_samples']}")
    return record["output_throughput"]


# ---- prefill -----------------------------------------------------------------------------------
def prefill_engine(engine: Engine, prompt: list[int]) -> float:
    start = time.perf_counter()
    engine.generate([prompt], {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True})
    elapsed = time.perf_counter() - start
    engine.flush_cache()
    return len(prompt) / elapsed


def prefill_hf(model, prompt: list[int]) -> float:
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    with torch.inference_mode():
        model(ids, attention_mask=torch.ones_like(ids), use_cache=True)
    return len(prompt) / (time.perf_counter() - start)


# ---- the run ---------------------------------------------------------------------------------
def estimate_minutes(args, conc, dtypes, hf_batches, rate1: float, rate8: float) -> float:
    """Seconds of one repeat from calibration rates (tok/s at 1 and 8 requests), assuming no
    gain past 8 requests (pessimistic) and HTTP 1.5x slower than the engine."""
    per_dtype = sum(c * args.output_len / (rate1 if c == 1 else rate8) for c in conc)
    per_dtype += args.prefill_len / (4 * rate8)
    hf = sum(b * args.output_len / (rate1 / 2 if b == 1 else rate8 / 3) for b in hf_batches)
    http = 0.0 if args.no_http else 1.5 * per_dtype
    return (len(dtypes) * (per_dtype + http) + hf) / 60


def markdown(args, conc, results, reps: int, load: list[float], minutes: float) -> str:
    med = {k: statistics.median(v) for k, v in results.items() if v}
    lines = [
        f"CPU tables: preset {args.preset}, {args.threads} threads, prompt {args.prompt_len}, "
        f"output {args.output_len} tokens, greedy; "
        f"medians of {reps} interleaved repeat(s); "
        f"load average {min(load):.1f}-{max(load):.1f} on {os.cpu_count()} CPUs; "
        f"{minutes:.1f} min.",
        "",
        "| output tok/s | " + " | ".join(f"C={c}" for c in conc) + " |",
        "|---|" + "---|" * len(conc),
    ]
    for side in ("engine", "HTTP"):
        for d in args.dtypes.split(","):
            cells = [med.get(f"{side} {d} c={c}") for c in conc]
            if any(x is not None for x in cells):
                row = " | ".join("-" if x is None else f"{x:.1f}" for x in cells)
                lines.append(f"| {side} {d} | {row} |")
    for b in [int(b) for b in args.hf_batch.split(",") if b]:  # in the column C = batch
        cells = [f"{med[f'hf batch={b}']:.1f}" if c == b else "-" for c in conc]
        lines.append(f"| transformers generate batch {b} (fp32) | {' | '.join(cells)} |")
    base = med.get("hf batch=8")
    if base:
        for side in ("engine", "HTTP"):
            cells = [med.get(f"{side} float32 c={c}") for c in conc]
            if any(x is not None for x in cells):
                row = " | ".join("-" if x is None else f"{x / base:.2f}x" for x in cells)
                lines.append(f"| {side} float32 / transformers batch 8 | {row} |")
    lines += ["", f"| prefill of a {args.prefill_len}-token prompt | tok/s |", "|---|---|"]
    for d in args.dtypes.split(","):
        lines.append(f"| ours {d} | {med[f'prefill {d}']:.1f} |")
    lines.append(f"| transformers forward (fp32) | {med['prefill hf']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # servers are stopped on the way out
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("benchmarks.serving").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    if args.model_path is None:
        from hybrid_serve.server.model_path import default_model_path

        args.model_path = str(default_model_path(args.preset))
    conc = [int(c) for c in args.concurrency.split(",")]
    dtypes = args.dtypes.split(",")
    hf_batches = [int(b) for b in args.hf_batch.split(",") if b]
    max_tokens = max(max(conc) * (args.prompt_len + args.output_len + 8), args.prefill_len + 64)
    engines = {
        d: Engine(
            args.model_path,
            max_running_requests=max(conc),
            dtype=d,
            max_total_tokens=max_tokens,
        )
        for d in dtypes
    }
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32).eval()
    vocab = next(iter(engines.values())).runner.model.config.vocab_size
    for e in engines.values():  # warm-up (kernels, allocator)
        run_engine(e, _prompts(2, args.prompt_len, vocab, 99), 4)
    run_hf(hf, _prompts(1, args.prompt_len, vocab, 99), 4)
    first = engines[dtypes[0]]
    rate1 = run_engine(first, _prompts(1, args.prompt_len, vocab, 98), 8)
    rate8 = run_engine(first, _prompts(8, args.prompt_len, vocab, 98), 8)
    per_rep = estimate_minutes(args, conc, dtypes, hf_batches, rate1, rate8)
    logger.info(
        "calibration: %.1f tok/s at 1, %.1f at 8; estimated %.1f min per repeat, %.1f min for "
        "%d repeats (no repeat starts past --max-minutes %.0f)",
        rate1, rate8, per_rep, per_rep * args.repeats, args.repeats, args.max_minutes,
    )  # fmt: skip
    long_prompt = _prompts(1, args.prefill_len, vocab, 7)[0]
    results: dict[str, list[float]] = {}
    load: list[float] = []
    reps = 0
    with ExitStack() as stack:
        urls = {}
        if not args.no_http:
            for d in dtypes:
                log = Path(os.environ.get("TMPDIR", "/tmp")) / f"cpu_tables_server_{d}.log"
                urls[d] = stack.enter_context(
                    server(args.model_path, d, args.threads, max(conc), log)
                )
        for rep in range(args.repeats):
            elapsed = (time.monotonic() - t0) / 60
            if rep and elapsed + per_rep > args.max_minutes:
                logger.warning("stopping after %d repeats: the budget is spent", rep)
                break
            rep_start = time.monotonic()
            load.append(os.getloadavg()[0])

            def add(name: str, value: float, rep: int = rep) -> None:
                results.setdefault(name, []).append(value)
                logger.info("rep %d %s: %.1f tok/s", rep, name, value)

            for d, engine in engines.items():
                for c in conc:
                    prompts = _prompts(c, args.prompt_len, vocab, rep)
                    add(f"engine {d} c={c}", run_engine(engine, prompts, args.output_len))
                add(f"prefill {d}", prefill_engine(engine, long_prompt))
            for b in hf_batches:
                prompts = _prompts(b, args.prompt_len, vocab, rep)
                add(f"hf batch={b}", run_hf(hf, prompts, args.output_len))
            add("prefill hf", prefill_hf(hf, long_prompt))
            for d, url in urls.items():
                for c in conc:
                    add(f"HTTP {d} c={c}", run_http(url, args.model_path, args, c, rep))
            reps += 1
            if rep == 0:
                per_rep = (time.monotonic() - rep_start) / 60
                logger.info(
                    "one repeat took %.1f min: about %.1f min to go",
                    per_rep, per_rep * (args.repeats - 1),
                )  # fmt: skip
    minutes = (time.monotonic() - t0) / 60
    table = markdown(args, conc, results, reps, load, minutes)
    print(table)
    if args.markdown_out:
        Path(args.markdown_out).write_text(table)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "repeats": reps, "runs": results}, f, indent=2)
    return table


if __name__ == "__main__":
    main()
