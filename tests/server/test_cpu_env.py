from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from hybrid_serve.scheduler import cpu_env


def test_the_default_spin_count_is_set_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cpu_env.apply_default_spin()  # torch is loaded in the test process: children still get it
    assert os.environ["GOMP_SPINCOUNT"] == str(cpu_env.DEFAULT_SPINCOUNT)
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    assert cpu_env.apply_default_spin() is False
    assert os.environ["GOMP_SPINCOUNT"] == "123"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert cpu_env.apply_default_spin() is False
    assert "GOMP_SPINCOUNT" not in os.environ


def test_huge_pages_are_asked_for_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv(cpu_env.THP_ENV, raising=False)
    cpu_env.apply_default_thp()
    assert os.environ[cpu_env.THP_ENV] == "1"
    monkeypatch.setenv(cpu_env.THP_ENV, "0")
    assert cpu_env.apply_default_thp() is False
    assert os.environ[cpu_env.THP_ENV] == "0"


def _clean_env() -> dict[str, str]:
    unset = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", cpu_env.THP_ENV)
    return {k: v for k, v in os.environ.items() if k not in unset}


def test_the_cli_sets_both_before_torch_loads():
    code = (
        "import os, sys\n"
        "from hybrid_serve.server import cli\n"
        "assert 'torch' not in sys.modules\n"
        "try:\n"
        "    cli.main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('THP_MEM_ALLOC_ENABLE'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == f"{cpu_env.DEFAULT_SPINCOUNT} 1"


def _thp_mode() -> str | None:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else None


@pytest.mark.skipif(_thp_mode() != "madvise", reason="needs Linux THP in madvise mode")
@pytest.mark.parametrize("enabled", ["0", "1"])
def test_torch_honours_the_huge_page_switch(enabled):
    """Under `madvise` (the common default) a 64 MB tensor gets huge pages only when the switch
    this module sets is on: it is one torch still reads."""
    code = (
        "import re, torch\n"
        "def huge_kb():\n"
        "    text = open('/proc/self/smaps_rollup').read()\n"
        "    return int(re.search(r'AnonHugePages:\\s+(\\d+)', text).group(1))\n"
        "before = huge_kb()\n"
        "x = torch.ones(64 << 20, dtype=torch.uint8)\n"
        "print(huge_kb() - before)\n"
    )
    env = {**_clean_env(), cpu_env.THP_ENV: enabled}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    gained_kb = int(out.stdout.strip().splitlines()[-1])
    assert (gained_kb >= 32 << 10) if enabled == "1" else (gained_kb == 0)
