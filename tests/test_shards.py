"""tests/shards.py: the files in the same order in every process, each claimed by one process
alone, every collected test run exactly once, and the runner's status the first failure."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests import shards

ROOT = Path(__file__).resolve().parents[1]


def test_files_go_heaviest_first(monkeypatch):
    monkeypatch.setattr(shards, "WEIGHTS", {"big.py": 100.0, "mid.py": 60.0})
    monkeypatch.setattr(shards, "SECONDS_PER_TEST", 1.0)
    tests = {"c.py": 5, "a.py": 30, "mid.py": 3, "d.py": 5, "big.py": 2, "b.py": 70}
    assert shards.order_files(tests) == ["big.py", "b.py", "mid.py", "a.py", "c.py", "d.py"]
    files = ["c.py", "a.py", "big.py", "a.py", "big.py", "c.py"]
    assert shards.run_order(files) == [2, 4, 1, 3, 0, 5]  # file by file, in collected order


def test_each_file_is_claimed_by_one_process_alone(tmp_path):
    files = ["x.py"] * 3 + ["y.py"] * 2 + ["z.py"] * 4 + ["w.py"]
    first, second = shards.Claims(tmp_path, files), shards.Claims(tmp_path, files)
    assert first.ours(0) and first.ours(2)  # x: the first to ask
    assert not second.ours(1) and second.next_ours(2) == 3  # y is the next file free
    assert second.ours(3) and not first.ours(4)
    assert first.next_ours(2) == 5  # passes over y (second's) to claim z
    assert second.next_ours(4) == 9 and not first.ours(9)  # w: second's, z: first's
    assert first.next_ours(8) is None
    assert first.lost == {"y.py": 2, "w.py": 1} and second.lost == {"x.py": 3, "z.py": 4}
    assert {p.name for p in tmp_path.iterdir()} == {"x.py", "y.py", "z.py", "w.py"}


def test_combined_status():
    assert shards.combined_status([0, 0]) == 0
    assert shards.combined_status([0, shards.NO_TESTS]) == 0
    assert shards.combined_status([shards.NO_TESTS, shards.NO_TESTS]) == shards.NO_TESTS
    assert shards.combined_status([shards.NO_TESTS, 1, 2]) == 1
    assert shards.combined_status([0, 2]) == 2


def test_the_runner_runs_every_test_once_and_reports_a_failing_process(tmp_path):
    """Two processes over five files, one test failing, a module fixture per file that fails
    when set up a second time: each test runs once, each file in one process with its fixture set
    up once, and the runner's status is the failing process's."""
    (tmp_path / "conftest.py").write_text(
        "import pytest\n"
        "@pytest.fixture(scope='module')\n"
        "def once(request, tmp_path_factory):\n"
        "    mark = tmp_path_factory.getbasetemp().parent / request.module.__name__\n"
        "    assert not mark.exists(), 'set up twice'\n"
        "    mark.write_text('')\n"
    )
    sizes = {"a": 5, "b": 2, "c": 3, "d": 1, "e": 4}
    for x, n in sizes.items():
        body = "".join(f"def test_{i}(once):\n    pass\n" for i in range(n))
        bad = "def test_bad():\n    assert False\n" if x == "b" else ""
        (tmp_path / f"test_{x}.py").write_text(body + bad)
    out = subprocess.run(
        [sys.executable, "-m", "tests.shards", "--shards", "2", "-v", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), "-c", "/dev/null", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    kept = re.search(r"directories are kept in (\S+)\)", out.stdout)
    assert kept, out.stdout  # a failed run keeps them (for its logs); this one is expected
    shutil.rmtree(kept.group(1))
    assert out.returncode == 1, out.stdout + out.stderr
    first, sep, second = out.stdout.partition("---- pytest process 2/2 ----")
    assert sep, out.stdout
    line = re.compile(r"(test_\w\.py)::(test_\w+) (PASSED|FAILED|ERROR)")
    ran = [line.findall(part) for part in (first, second)]
    every = [(f, t) for f, t, _ in ran[0] + ran[1]]
    want = [(f"test_{x}.py", f"test_{i}") for x, n in sizes.items() for i in range(n)]
    assert sorted(every) == sorted([*want, ("test_b.py", "test_bad")]), out.stdout
    # which process takes which file depends on their pace; that each file goes to one does not
    assert not {f for f, _, _ in ran[0]} & {f for f, _, _ in ran[1]}, out.stdout
    failed = [r for part in ran for r in part if r[2] != "PASSED"]
    assert failed == [("test_b.py", "test_bad", "FAILED")], out.stdout
    assert "ran in the other pytest processes" in first + second


def test_a_process_passes_over_files_claimed_elsewhere(tmp_path):
    """One process, the other's claim made beforehand: pkg_a/test_a runs, pkg_a/test_b (claimed)
    is passed over, pkg_b/test_c runs. pkg_a's package fixture is torn down before pkg_b's test
    (the next test this process runs, not pkg_a/test_b), and each file's module fixture is set
    up once and torn down before the next file's."""
    events = tmp_path / "events"
    for pkg, files in (("pkg_a", {"test_a": 5, "test_b": 4}), ("pkg_b", {"test_c": 3})):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
        (tmp_path / pkg / "conftest.py").write_text(
            "import pytest\n"
            f"def log(text):\n    open({str(events)!r}, 'a').write(text + '\\n')\n"
            "@pytest.fixture(scope='package', autouse=True)\n"
            f"def pkg():\n    log('+{pkg}')\n    yield\n    log('-{pkg}')\n"
            "@pytest.fixture(scope='module', autouse=True)\n"
            "def mod(request):\n    log('+' + request.module.__name__)\n    yield\n"
            "    log('-' + request.module.__name__)\n"
        )
        for name, n in files.items():
            body = "".join(f"def test_{i}():\n    pass\n" for i in range(n))
            (tmp_path / pkg / f"{name}.py").write_text(body)
    claims = tmp_path / "claims"
    claims.mkdir()
    (claims / "pkg_a__test_b.py").write_text("")  # the other process's
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.shards", f"--shard-claims={claims}", "-q",
         "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-c", "/dev/null", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "8 passed" in out.stdout and "4 tests in 1 files ran in the other" in out.stdout
    assert events.read_text().split() == [
        "+pkg_a", "+pkg_a.test_a", "-pkg_a.test_a", "-pkg_a",
        "+pkg_b", "+pkg_b.test_c", "-pkg_b.test_c", "-pkg_b",
    ]  # fmt: skip
    assert sorted(p.name for p in claims.iterdir()) == [
        "pkg_a__test_a.py", "pkg_a__test_b.py", "pkg_b__test_c.py"
    ]  # fmt: skip
