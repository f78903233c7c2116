"""What one tensor-parallel rank holds after loading: its parameter bytes and the growth of its
anonymous RSS while loading (peak, sampled every 0.5 ms), for the whole model and for each rank
of `--tp-size`. Each measure runs in a fresh process, which loads a warm-up checkpoint first so
that imports and one-time set-up stay outside it. A rank loads its shard without a process group
(loading needs no collective).

Example: python -m benchmarks.tp_load_memory --preset small --tp-size 2
"""

from __future__ import annotations

import sys  # noqa: I001  (the repo root goes on sys.path before our packages are imported)
from pathlib import Path

if not __package__:  # run as `python benchmarks/x.py`: the repo root first, not benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import os
import subprocess

REPO = Path(__file__).resolve().parents[1]

MEASURE = """
import json, sys, threading, time
from hybrid_serve.models.loader import load_model
from hybrid_serve.models.parallel import ParallelContext

def anon_kb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

path, warm, rank, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
load_model(warm, dtype="float32")
base = anon_kb()
peak, done = [base], []
def sample():
    while not done:
        peak[0] = max(peak[0], anon_kb())
        time.sleep(0.0005)
t = threading.Thread(target=sample, daemon=True)
t.start()
model = load_model(path, dtype="float32", tp=ParallelContext(rank, size))
done.append(1)
t.join()
peak[0] = max(peak[0], anon_kb())
nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"peak_bytes": (peak[0] - base) * 1024, "param_bytes": nbytes}))
"""


def measure(path: str, warm: str, rank: int, size: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, path, warm, str(rank), str(size)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tp-size", type=int, default=2)
    args = ap.parse_args()
    from hybrid_serve.server.model_path import default_model_path

    path = args.model_path or str(default_model_path(args.preset))
    warm = str(default_model_path("tiny"))
    whole = measure(path, warm, 0, 1)
    rows = [("tp=1", whole)]
    rows += [
        (f"tp={args.tp_size} rank {r}", measure(path, warm, r, args.tp_size))
        for r in range(args.tp_size)
    ]
    print(f"{'load':<16}{'param MB':>10}{'share':>8}{'peak anon RSS MB':>18}")
    for name, m in rows:
        share = m["param_bytes"] / whole["param_bytes"]
        param_mb, peak_mb = m["param_bytes"] / 1e6, m["peak_bytes"] / 1e6
        print(f"{name:<16}{param_mb:>10.1f}{share:>8.3f}{peak_mb:>18.1f}")


if __name__ == "__main__":
    main()
