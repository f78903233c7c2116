"""Peak memory of loading a bf16 checkpoint as bf16: the parameters plus about one tensor, never
a second full-size copy (measured in a fresh process by sampling its anonymous RSS). The same
fresh process shows that loading imports neither torch._dynamo nor sympy: building on the meta
device through torch's init functions or `to_empty` would, seconds of every server start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from hybrid_serve.make_model.presets import preset_config, write_checkpoint

REPO = Path(__file__).resolve().parents[2]

MEASURE = """
import json, sys, threading, time
import torch
from hybrid_serve.models.loader import load_model

def anon_kb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

fmt = sys.argv[3]
load_model(sys.argv[2], dtype="bfloat16", load_format=fmt)  # one-time set-up outside
base = anon_kb()
peak, done = [base], []
def sample():
    while not done:
        peak[0] = max(peak[0], anon_kb())
        time.sleep(0.0005)
t = threading.Thread(target=sample, daemon=True)
t.start()
model = load_model(sys.argv[1], dtype="bfloat16", load_format=fmt)
done.append(1)
t.join()
peak[0] = max(peak[0], anon_kb())
nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
slow = [m for m in ("torch._dynamo", "sympy") if m in sys.modules]
print(json.dumps({"peak_bytes": (peak[0] - base) * 1024, "param_bytes": nbytes, "slow": slow}))
"""


def measure_load_peak(path: Path, warm: Path, load_format: str = "auto") -> dict:
    """Load `path` as bf16 in a fresh process (after `warm`, for the one-time set-up): the peak
    anonymous RSS the load added and the parameters' bytes."""
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path), str(warm), load_format],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_bf16_load_peak_under_1_1x_weights(tmp_path):
    cfg = preset_config("tiny")
    cfg.update(hidden_size=512, vocab_size=4096, moe_intermediate_size=512, num_experts=8)
    path = write_checkpoint(tmp_path / "big", cfg, seed=0, dtype=torch.bfloat16)
    warm = write_checkpoint(tmp_path / "tiny", preset_config("tiny"), seed=0, dtype=torch.bfloat16)
    m = measure_load_peak(path, warm)
    assert m["param_bytes"] > 40e6  # large enough for a copy to show against allocator noise
    assert m["peak_bytes"] < 1.1 * m["param_bytes"], m
    assert m["slow"] == [], "loading imported these"
