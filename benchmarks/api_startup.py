"""API-process start-up and memory of the server in one or more checkouts, run in turn.

For each checkout (a repository root; `--roots A B` interleaves them `--repeats` times): the time
to import `server.http_server, server.launch, server.cli` in a fresh interpreter, the time from
starting `python -m hybrid_serve.server` (tiny preset, 4 running requests, 4,096 KV tokens) to a
200 from /health, then after one short request both processes' RSS and whether the API process has
libtorch mapped. One JSON line per run.

    python -m benchmarks.api_startup --roots /work/main . --repeats 2
"""

from __future__ import annotations

import sys  # noqa: I001  (the repo root goes on sys.path before our packages are imported)
from pathlib import Path

if not __package__:  # run as `python benchmarks/x.py`: the repo root first, not benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import os
import signal
import subprocess
import time

import httpx

from benchmarks.soak import free_port, rss_mb

IMPORT = (
    "import time; t = time.perf_counter(); "
    "import hybrid_serve.server.http_server, hybrid_serve.server.launch, hybrid_serve.server.cli; "
    "print(time.perf_counter() - t)"
)


def measure(root: str) -> dict:
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run(
        [sys.executable, "-c", IMPORT], cwd=root, env=env, capture_output=True, text=True
    )
    import_s = float(out.stdout.strip())
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "hybrid_serve.server",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    cmd += ["--max-running-requests", "4", "--max-total-tokens", "4096"]
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server in {root} exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        healthy_s = time.perf_counter() - start
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 4}}
        httpx.post(f"{url}/generate", json=body, timeout=300).raise_for_status()
        kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        return {
            "root": root,
            "import_s": round(import_s, 2),
            "healthy_s": round(healthy_s, 1),
            "api_rss_mb": round(rss_mb(proc.pid)),
            "scheduler_rss_mb": round(max(rss_mb(int(k)) for k in kids)),
            "api_has_libtorch": "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text(),
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--roots", nargs="+", default=["."])
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    for _ in range(args.repeats):
        for root in args.roots:
            print(json.dumps(measure(str(Path(root).resolve()))), flush=True)


if __name__ == "__main__":
    main()
