from __future__ import annotations

import os
import subprocess
import sys

from scheduler import omp_spin


def test_the_default_spin_count_is_set_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    omp_spin.apply_default_spin()  # torch is loaded in the test process: children still get it
    assert os.environ["GOMP_SPINCOUNT"] == str(omp_spin.DEFAULT_SPINCOUNT)
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    assert omp_spin.apply_default_spin() is False
    assert os.environ["GOMP_SPINCOUNT"] == "123"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert omp_spin.apply_default_spin() is False
    assert "GOMP_SPINCOUNT" not in os.environ


def test_the_cli_sets_it_before_torch_loads():
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = (
        "import os, sys\n"
        "from server import cli\n"
        "assert 'torch' not in sys.modules\n"
        "try:\n"
        "    cli.main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(os.environ.get('GOMP_SPINCOUNT'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == str(omp_spin.DEFAULT_SPINCOUNT)
