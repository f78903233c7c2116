"""The suite on several cores: N pytest processes side by side sharing out the test files.

Every test runs one torch thread (tests/conftest.py) and most wait on one process at a time, so
one pytest keeps about one core busy; `make test` runs `python -m tests.shards`, N pytest
processes over the same collection (N: TEST_SHARDS, default 2, the CI machine's cores).

Sharing out: the processes walk the same list of test files, heaviest first (a file's weight:
its seconds in WEIGHTS, else SECONDS_PER_TEST per test it holds), and each runs the next file no
process has claimed yet (a claim: creating the file's name in a folder the runner gives them all,
`--shard-claims`, which one process alone can do). So a process that drew slow files takes fewer,
whatever the weights say: they only put the long files first, and a stale weight never changes
which tests run. A file runs whole in one process (its module fixtures are built once); every
collected test runs in exactly one process. Each process reports its own tests, and says how
many ran elsewhere.

The runner passes its arguments to every process (paths, -k, -x, ...), gives each its own
--basetemp, streams the first and prints the others' output after it, and exits with the first
non-zero status (5, no test collected, only when no process ran a test).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
from _pytest.runner import runtestprotocol

NO_TESTS = 5  # pytest's exit status when nothing was collected (or all were deselected)
SECONDS_PER_TEST = 0.2
# the files that take longest, in rough seconds on the 2-core CI machine (from its slowest tests'
# durations and a profile of tests/server scaled to them): they go first. Only the order of the
# run depends on these, never which tests run.
WEIGHTS: dict[str, float] = {
    "tests/kernels/test_cpu_levels.py": 100,
    "tests/test_fresh_install.py": 55,
    "tests/scheduler/test_hybrid_families_prefix_cache.py": 50,
    "tests/scheduler/test_prefix_grid.py": 25,
    "tests/scheduler/test_hybrid_families_engine.py": 35,
    "tests/server/test_shutdown.py": 30,
    "tests/server/test_ownership.py": 30,
    "tests/scheduler/test_tensor_parallel_engine.py": 30,
    "tests/server/test_tool_formats_server.py": 30,
    "tests/models/test_tensor_parallel_families.py": 25,
    "tests/server/test_hicache_server.py": 25,
    "tests/server/test_security.py": 20,
    "tests/server/test_launch.py": 17,
    "tests/server/test_soak.py": 16,
    "tests/server/test_family_chat.py": 15,
    "tests/server/test_reasoning_server.py": 15,
    "tests/models/test_fp8_resident.py": 15,
    "tests/models/test_fp8_bailing_hybrid.py": 25,
    "tests/models/test_triton_model.py": 15,
    "tests/server/test_tp_server.py": 14,
    "tests/models/test_nemotron_h_triton.py": 12,
    "tests/server/test_ling3_server.py": 12,
    "tests/server/test_thinking_server.py": 12,
    "tests/models/test_tensor_parallel.py": 12,
    "tests/benchmarks/test_gpu_scale.py": 10,
    "tests/server/test_tools.py": 10,
    "tests/server/test_dp.py": 9,
    "tests/server/test_connections.py": 8,
    "tests/server/test_limits.py": 8,
    "tests/server/test_faults.py": 8,
    "tests/server/test_qwen3_5_server.py": 7,
}


def order_files(tests_per_file: dict[str, int]) -> list[str]:
    """The files heaviest first (ties: by path), the same list in every process."""
    weight = {f: WEIGHTS.get(f, SECONDS_PER_TEST * n) for f, n in tests_per_file.items()}
    return sorted(weight, key=lambda f: (-weight[f], f))


class Claims:
    """Which of `files` (one entry per collected test, in run order) this process runs, decided
    file by file as the run reaches them: the first process to create a file's entry in `folder`
    runs it. `ours(i)` for the test at index i; `next_ours(i)`, the index of the next test this
    process runs after i (claiming files on the way), None at the end."""

    def __init__(self, folder: Path, files: list[str]) -> None:
        self.folder, self.files = folder, files
        self.owned: dict[str, bool] = {}
        self.lost = Counter()  # tests per file another process runs

    def _claim(self, name: str) -> bool:
        if name not in self.owned:
            entry = self.folder / name.replace("/", "__")
            try:
                os.close(os.open(entry, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                self.owned[name] = True
            except FileExistsError:
                self.owned[name] = False
                self.lost[name] = self.files.count(name)
        return self.owned[name]

    def ours(self, i: int) -> bool:
        return self._claim(self.files[i])

    def next_ours(self, i: int) -> int | None:
        for j in range(i + 1, len(self.files)):
            if self.files[j] == self.files[i] or self.ours(j):
                return j
        return None


def run_order(files: list[str]) -> list[int]:
    """The indices of the tests (`files`: each one's file) in sharing order: file by file, the
    heaviest first, each file's tests in their collected order."""
    rank = {f: r for r, f in enumerate(order_files(Counter(files)))}
    return sorted(range(len(files)), key=lambda i: (rank[files[i]], i))


def combined_status(statuses: Iterable[int]) -> int:
    """The first failing status; NO_TESTS only when every process collected nothing."""
    statuses = list(statuses)
    failed = [s for s in statuses if s not in (0, NO_TESTS)]
    if failed:
        return failed[0]
    return NO_TESTS if all(s == NO_TESTS for s in statuses) else 0


def run(shards: int, pytest_args: list[str]) -> int:
    """`shards` pytest processes over `pytest_args`, sharing out the files; the combined exit
    status."""
    base = Path(tempfile.mkdtemp(prefix="hybrid-serve-shards-"))
    claims = base / "claims"
    claims.mkdir()
    procs, logs = [], []
    try:
        for k in range(1, shards + 1):
            cmd = [sys.executable, "-m", "pytest", "-p", "tests.shards", f"--shard-claims={claims}"]
            cmd += [f"--basetemp={base / f'shard-{k}'}", *pytest_args]
            if k == 1:  # streamed, so a long run shows progress
                procs.append(subprocess.Popen(cmd))
                continue
            log = (base / f"shard-{k}.log").open("w")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        statuses = [p.wait() for p in procs]
    except BaseException:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
        raise
    finally:
        for log in logs:
            log.close()
    for k in range(2, shards + 1):
        print(f"\n---- pytest process {k}/{shards} ----", flush=True)
        sys.stdout.write((base / f"shard-{k}.log").read_text(errors="replace"))
    status = combined_status(statuses)
    print(f"\nthe pytest processes' exit statuses: {statuses}", flush=True)
    if status in (0, NO_TESTS):
        shutil.rmtree(base, ignore_errors=True)
    else:
        print(f"(their temporary directories are kept in {base})", flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--shards", type=int, default=int(os.environ.get("TEST_SHARDS", 2)))
    args, pytest_args = parser.parse_known_args(argv)
    if args.shards < 1:
        parser.error("--shards must be at least 1")
    if args.shards == 1:
        return subprocess.call([sys.executable, "-m", "pytest", *pytest_args])
    return run(args.shards, pytest_args)


# ---- the plugin: `pytest -p tests.shards --shard-claims FOLDER` (the runner adds both) ----------


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shard-claims",
        default=None,
        help="a folder shared by the pytest processes of one `python -m tests.shards` run: each "
        "runs the test files it claims there first",
    )


@dataclass
class Sharing:
    """This process's part of the run: the tests in sharing order, each one's place in it, and
    the claims on their files."""

    items: list[pytest.Item]
    index: dict[int, int]  # id(item) -> its place in `items`
    claims: Claims


SHARING = pytest.StashKey[Sharing]()


@pytest.hookimpl(trylast=True)  # after pytest's own ordering by fixture
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    folder = config.getoption("--shard-claims")
    if folder is None:
        return
    files = [Path(os.path.relpath(item.path, config.rootpath)).as_posix() for item in items]
    order = run_order(files)
    items[:] = [items[i] for i in order]
    claims = Claims(Path(folder), [files[i] for i in order])
    config.stash[SHARING] = Sharing(list(items), {id(t): i for i, t in enumerate(items)}, claims)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """A test whose file another process claimed is passed over; one of ours runs as pytest
    runs it, its fixtures torn down for the next test this process runs (not the next in the
    list, which may be another's)."""
    sharing = item.config.stash.get(SHARING, None)
    if sharing is None:
        return None
    i, claims = sharing.index[id(item)], sharing.claims
    if claims.ours(i):
        after = claims.next_ours(i)
        following = None if after is None else sharing.items[after]
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        runtestprotocol(item, nextitem=following)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    # the progress counts this process's tests
    item.session.testscollected = len(sharing.items) - sum(claims.lost.values())
    return True


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    sharing = config.stash.get(SHARING, None)
    if sharing is not None and sharing.claims.lost:
        lost = sharing.claims.lost
        terminalreporter.write_line(
            f"{sum(lost.values())} tests in {len(lost)} files ran in the other pytest processes"
        )


if __name__ == "__main__":
    sys.exit(main())
