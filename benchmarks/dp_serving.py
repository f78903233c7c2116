"""Data parallel over HTTP: throughput of `--dp-size 1` vs `--dp-size 2`, and the cache hit rate
of a shared-prefix workload under `cache_aware` vs `round_robin` routing.

Starts three servers on the same checkpoint, every replica with `--num-threads` threads (default
1: on a CPU host the replicas split the cores): dp=1, dp=2 cache_aware and dp=2 round_robin. They
stay up together (an idle server costs no CPU) and the runs are interleaved: each round runs
every workload on every server in turn, so machine noise falls on all of them alike. Workloads
(`benchmarks/serving.py`, token-id prompts, streaming):

- random: `--num-prompts` prompts of `--input-len` tokens, `--output-len` output tokens each, at
  most `--max-concurrency` in flight;
- shared-prefix: `--gsp-num-groups` system prompts of `--gsp-system-prompt-len` tokens, each with
  `--gsp-prompts-per-group` questions, after /flush_cache, `--gsp-concurrency` in flight.

First `--warmup-rounds` rounds run the same workloads untimed (on CPU each replica compiles its
decode graphs per batch size on first use, so a cold round measures compilation). Prints one
markdown table of medians over `--rounds` and appends every timed record to `--output-file`.

Example: python -m benchmarks.dp_serving --model-path ~/.cache/hybrid-serve/small --rounds 3
"""

from __future__ import annotations

import sys  # noqa: I001  (the repo root goes on sys.path before our packages are imported)
from pathlib import Path

if not __package__:  # run as `python benchmarks/x.py`: the repo root first, not benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import os
import socket
import statistics
import subprocess
import time

import httpx

from benchmarks import serving

SERVERS = {  # name -> extra flags
    "dp=1": ["--dp-size", "1"],
    "dp=2 cache_aware": ["--dp-size", "2", "--load-balance-method", "cache_aware"],
    "dp=2 round_robin": ["--dp-size", "2", "--load-balance-method", "round_robin"],
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--model-path", required=True)
    a("--num-threads", type=int, default=1, help="torch threads per replica")
    a("--rounds", type=int, default=3)
    a("--warmup-rounds", type=int, default=1, help="untimed rounds first (compilation)")
    a("--num-prompts", type=int, default=32)
    a("--input-len", type=int, default=32)
    a("--output-len", type=int, default=64)
    a("--max-concurrency", type=int, default=16)
    a("--gsp-num-groups", type=int, default=4)
    a("--gsp-prompts-per-group", type=int, default=8)
    a("--gsp-system-prompt-len", type=int, default=512)
    a("--gsp-question-len", type=int, default=32)
    a("--gsp-concurrency", type=int, default=4)
    a("--server-args", default="--mamba-scheduler-strategy extra_buffer", help="for all servers")
    a("--output-file", default=None)
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    args: argparse.Namespace, flags: list[str], log: Path
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "hybrid_serve.server",
        "--model-path",
        args.model_path,
        "--port",
        str(port),
    ]
    cmd += ["--num-threads", str(args.num_threads), "--log-level", "warning"]
    cmd += [*args.server_args.split(), *flags]
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": repo}
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"a server exited early (status {proc.returncode})")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not healthy in {timeout} s")


def workloads(args: argparse.Namespace, url: str) -> dict[str, list[str]]:
    common = ["--base-url", url, "--tokenizer", args.model_path, "--token-ids", "--no-progress"]
    return {
        "random": [
            *common,
            *("--dataset", "random", "--num-prompts", str(args.num_prompts)),
            *("--random-input-len", str(args.input_len)),
            *("--random-output-len", str(args.output_len)),
            *("--max-concurrency", str(args.max_concurrency), "--warmup-requests", "2"),
        ],
        "shared-prefix": [
            *common,
            *("--dataset", "shared-prefix", "--gsp-num-groups", str(args.gsp_num_groups)),
            *("--gsp-prompts-per-group", str(args.gsp_prompts_per_group)),
            *("--gsp-system-prompt-len", str(args.gsp_system_prompt_len)),
            *("--gsp-question-len", str(args.gsp_question_len), "--gsp-output-len", "8"),
            *("--max-concurrency", str(args.gsp_concurrency), "--flush-cache"),
        ],
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    servers = {
        name: start_server(args, flags, logs / f"dp_serving_{i}.log")
        for i, (name, flags) in enumerate(SERVERS.items())
    }
    results: dict[tuple[str, str], list[dict]] = {}
    try:
        for proc, url in servers.values():
            wait_healthy(proc, url)
        for r in range(-args.warmup_rounds, args.rounds):
            for name, (_, url) in servers.items():
                for work, wargs in workloads(args, url).items():
                    rec = serving.main(wargs)
                    if r < 0:
                        continue
                    rec.update(server=name, round=r, load=os.getloadavg()[0])
                    results.setdefault((name, work), []).append(rec)
                    if args.output_file:
                        with open(args.output_file, "a", encoding="utf-8") as f:
                            f.write(json.dumps(rec) + "\n")
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            proc.wait(60)
    print_table(results)


def print_table(results: dict[tuple[str, str], list[dict]]) -> None:
    def med(recs: list[dict], key: str) -> float:
        return statistics.median(r[key] or 0.0 for r in recs)

    print(
        "\n| server | random: output tok/s | random: median TTFT | shared-prefix: cache hit "
        "rate | shared-prefix: median TTFT | load (1-min) |"
    )
    print("|---|---|---|---|---|---|")
    for name in SERVERS:
        rnd, gsp = results[(name, "random")], results[(name, "shared-prefix")]
        print(
            f"| {name} | {med(rnd, 'output_throughput'):.1f} | "
            f"{med(rnd, 'median_ttft_ms'):.0f} ms | {med(gsp, 'cache_hit_rate'):.3f} | "
            f"{med(gsp, 'median_ttft_ms'):.0f} ms | "
            f"{statistics.median(r['load'] for r in rnd + gsp):.1f} |"
        )


if __name__ == "__main__":
    main()
