"""Benchmark scripts start both as `python benchmarks/x.py` and `python -m benchmarks.x` from
any directory (run as a file, `benchmarks/kernels.py` must not shadow the `kernels` package).
Two scripts are started both ways (each start imports torch: seconds); every other script must
carry the same sys.path line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for p in (REPO / "benchmarks").glob("*.py") if "__main__" in p.read_text())
ROOT_FIRST = "sys.path[0] = str(Path(__file__).resolve().parents[1])"


@pytest.mark.parametrize("name", ["gsm8k", "kernels"])
def test_script_runs_as_file_and_module(name, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    as_file = [sys.executable, str(REPO / "benchmarks" / f"{name}.py"), "--help"]
    out = subprocess.run(as_file, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "usage" in out.stdout, out.stderr[-2000:]
    as_module = [sys.executable, "-m", f"benchmarks.{name}", "--help"]
    out = subprocess.run(as_module, cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "usage" in out.stdout, out.stderr[-2000:]


def test_every_script_puts_the_repo_root_first():
    assert len(SCRIPTS) >= 5
    for path in SCRIPTS:
        assert ROOT_FIRST in path.read_text(), path.name
