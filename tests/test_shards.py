"""tests/shards.py: every collected test runs in exactly one shard, dealt the same way by every
process, and the runner's status is the shards' first failure."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import shards

ROOT = Path(__file__).resolve().parents[1]


def test_parse_shard():
    assert shards.parse_shard("1/2") == (1, 2) and shards.parse_shard("3/3") == (3, 3)
    for bad in ("0/2", "3/2", "2", "a/b", "1/0", "-1/2", ""):
        with pytest.raises(ValueError):
            shards.parse_shard(bad)


def test_every_file_dealt_once_heaviest_first_to_the_lightest_shard(monkeypatch):
    monkeypatch.setattr(shards, "WEIGHTS", {"big.py": 100.0, "mid.py": 60.0})
    monkeypatch.setattr(shards, "SECONDS_PER_TEST", 1.0)
    tests = {"big.py": 2, "mid.py": 3, "a.py": 30, "b.py": 20, "c.py": 5, "d.py": 5}
    owner = shards.deal(tests, 2)
    assert set(owner) == set(tests) and set(owner.values()) == {0, 1}
    # big (100) -> 0; mid (60), a (30), b (20) -> 1 (110 in all); c (5), d (5) -> 0
    assert owner == {"big.py": 0, "mid.py": 1, "a.py": 1, "b.py": 1, "c.py": 0, "d.py": 0}
    assert shards.deal(dict(reversed(tests.items())), 2) == owner  # not by the order given
    assert set(shards.deal(tests, 1).values()) == {0}
    assert set(shards.deal(tests, 9).values()) == set(range(6))  # never more shards than files


def test_select_partitions_the_tests():
    files = ["x.py"] * 4 + ["y.py"] * 3 + ["z.py"] * 7 + ["w.py"]
    for n in (1, 2, 3, 5):
        picked = [shards.select(files, k, n) for k in range(1, n + 1)]
        assert all(sum(col) == 1 for col in zip(*picked, strict=True)), n
        for mask in picked:  # a file's tests stay together
            ran = {f for f, ok in zip(files, mask, strict=True) if ok}
            assert not ran & {f for f, ok in zip(files, mask, strict=True) if not ok}


def test_combined_status():
    assert shards.combined_status([0, 0]) == 0
    assert shards.combined_status([0, shards.NO_TESTS]) == 0
    assert shards.combined_status([shards.NO_TESTS, shards.NO_TESTS]) == shards.NO_TESTS
    assert shards.combined_status([shards.NO_TESTS, 1, 2]) == 1
    assert shards.combined_status([0, 2]) == 2


def test_the_runner_runs_every_test_once_and_reports_a_failing_shard(tmp_path):
    """Two shards over four files, one test failing: each test runs once, each file in one
    shard, and the runner's status is the failing shard's."""
    sizes = {"a": 5, "b": 2, "c": 3, "d": 1}
    for x, n in sizes.items():
        name = f"test_{x}.py"
        body = "".join(f"def test_{i}():\n    pass\n" for i in range(n))
        (tmp_path / name).write_text(body + ("def test_bad():\n    assert False\n" * (n == 2)))
    out = subprocess.run(
        [sys.executable, "-m", "tests.shards", "--shards", "2", "-p", "tests.conftest", "-v",
         "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-c", "/dev/null", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    first, sep, second = out.stdout.partition("---- shard 2/2 ----")
    assert sep, out.stdout
    line = re.compile(r"(test_\w\.py)::(test_\w+) (PASSED|FAILED)")
    ran = [line.findall(part) for part in (first, second)]
    every = [(f, t) for f, t, _ in ran[0] + ran[1]]
    assert sorted(every) == sorted(
        [(f"test_{x}.py", f"test_{i}") for x, n in sizes.items() for i in range(n)]
        + [("test_b.py", "test_bad")]
    ), out.stdout
    assert all(ran) and not {f for f, _, _ in ran[0]} & {f for f, _, _ in ran[1]}, out.stdout
    assert [r for part in ran for r in part if r[2] == "FAILED"] == [
        ("test_b.py", "test_bad", "FAILED")
    ]
