"""A longer soak of the HTTP server (issue 13): small pools, hostile-but-legal clients, two rounds.

It starts a server on a preset checkpoint with small pools (4 running requests, 512 KV tokens,
chunks of 64, 6 Mamba slots, `--schedule-conservativeness 0.01`, so that admission can run out of
KV mid-decode and retract, and idle sessions' Mamba slots are evicted), runs the workload of
`benchmarks/soak_workload.py` (streams, plain requests, disconnects, slow readers, aborts, tree
sessions, streaming sessions) for `--rounds` rounds, and after each reports: throughput (output
tokens and requests per second), p50/p99 latency of completed answers, failed checks,
retractions and aborts (from /metrics, the round's increase), the longest window without a token
while requests were in flight, the leak check once idle, and both processes' RSS (the API
process and the scheduler process it spawned). One JSON line per round on stdout, a table at the
end; exits 1 if a check failed or the leak check was not clean.

    python -m benchmarks.soak --preset tiny --requests 84 --clients 12 --rounds 2
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
import re
import signal
import socket
import subprocess
import tempfile
import time

import httpx

from benchmarks.soak_workload import percentile, run_round

logger = logging.getLogger("benchmarks.soak")
REPO = Path(__file__).resolve().parents[1]
POOL_FLAGS = [
    "--context-length", "512", "--max-running-requests", "4", "--max-total-tokens", "512",
    "--chunked-prefill-size", "64", "--max-mamba-cache-size", "6",
    "--schedule-conservativeness", "0.01",
]  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny", choices=("tiny", "small"))
    p.add_argument("--model-path", default=None, help="a checkpoint instead of the preset")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=84, help="workload items per round")
    p.add_argument("--clients", type=int, default=12, help="concurrent clients")
    p.add_argument("--max-new-tokens", type=int, default=64, help="outputs of 4 to this many")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the server")
    p.add_argument("--extra-flags", default="", help="more server flags, one string")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def scheduler_pid(api_pid: int) -> int | None:
    """The API process's child that runs `run_scheduler` (not multiprocessing's tracker)."""
    kids = Path(f"/proc/{api_pid}/task/{api_pid}/children").read_text().split()
    for kid in kids:
        cmdline = Path(f"/proc/{kid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        if "spawn_main" in cmdline:
            return int(kid)
    return None


def counters(metrics: str) -> dict[str, float]:
    """Retractions and aborts (summed over reasons) from a /metrics scrape."""
    out = {"retractions": 0.0, "aborts": 0.0}
    for line in metrics.splitlines():
        m = re.match(r"hybrid_serve_(retractions|aborted_requests)_total\{[^}]*\} (\S+)", line)
        if m:
            out["retractions" if m[1] == "retractions" else "aborts"] += float(m[2])
    return out


def wait_idle(http: httpx.Client, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        check = http.get("/get_server_info").json()["leak_check"]
        if check["idle"] or time.monotonic() > deadline:
            return check
        time.sleep(0.2)


def start_server(
    model_path: str, args: argparse.Namespace, log: Path
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "hybrid_serve.server", "--model-path", model_path, *POOL_FLAGS]
    cmd += [*args.extra_flags.split(), "--port", str(port), "--log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server not healthy in 300 s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    model_path = args.model_path
    if model_path is None:
        from hybrid_serve.server.model_path import default_model_path

        model_path = str(default_model_path(args.preset))
    log = Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
    proc, url = start_server(model_path, args, log)
    rows, ok = [], True
    try:
        with httpx.Client(base_url=url, timeout=300) as http:
            t0 = time.monotonic()  # the first forward loads kernels: kept out of the rounds
            warm = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
            assert http.post("/generate", json=warm).status_code == 200
            logger.info("warm-up request: %.1f s", time.monotonic() - t0)
            before = counters(http.get("/metrics").text)
            for k in range(args.rounds):
                res = run_round(
                    url, args.requests, args.clients, args.seed + k, args.max_new_tokens
                )
                check = wait_idle(http)
                after = counters(http.get("/metrics").text)
                sched = scheduler_pid(proc.pid)
                row = {
                    "round": k + 1,
                    "wall_s": round(res.wall_s, 1),
                    "http_requests": res.requests,
                    "completed": res.completed,
                    "output_tok_per_s": round(res.output_tokens / res.wall_s, 1),
                    "req_per_s": round(res.completed / res.wall_s, 2),
                    "p50_latency_s": round(percentile(res.latencies, 50), 2),
                    "p99_latency_s": round(percentile(res.latencies, 99), 2),
                    "longest_gap_s": round(res.longest_gap_s, 2),
                    "retractions": int(after["retractions"] - before["retractions"]),
                    "aborts": int(after["aborts"] - before["aborts"]),
                    "failed_checks": len(res.failures),
                    "leak_check_clean": check["idle"] and check["problems"] == [],
                    "api_rss_mb": round(rss_mb(proc.pid)),
                    "scheduler_rss_mb": round(rss_mb(sched)) if sched else None,
                }
                before = after
                rows.append(row)
                print(json.dumps(row), flush=True)
                for f in res.failures[:10]:
                    logger.error("check failed: %s", f)
                ok &= not res.failures and row["leak_check_clean"]
    finally:
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(60)
        if status != 0:
            logger.error("server exited %d; log %s", status, log)
            ok = False
    keys = list(rows[0]) if rows else []
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
