"""The suite on several cores: the test files dealt between N pytest processes run side by side.

Every test runs one torch thread (tests/conftest.py) and most wait on one process at a time, so
one pytest keeps about one core busy; `make test` runs `python -m tests.shards`, N processes of
`pytest --shard K/N` (N: TEST_SHARDS, default 2, the CI machine's cores).

Dealing (`deal`): each test file goes whole to one shard, so its module fixtures (a server, an
engine, a checkpoint and transformers' reference) are built once. Files go heaviest first, each
to the shard with the least weight so far; a file's weight is its seconds in WEIGHTS (measured on
the 2-core machine) or SECONDS_PER_TEST per test it holds. The weights only balance the shards: a
stale one makes one shard end earlier, and never changes which tests run. Every collected test is
in exactly one shard; `--shard` deselects the others (pytest reports them as deselected).

The runner passes its arguments to every shard (paths, -k, -x, ...), gives each its own
--basetemp, streams shard 1 and prints the others' output after it, and exits with the first
non-zero status (5, no test collected, only when no shard ran a test).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

NO_TESTS = 5  # pytest's exit status when nothing was collected (or all were deselected)
SECONDS_PER_TEST = 0.4
# seconds per file on the 2-core machine (`pytest --durations=0`, setup + call + teardown):
# the files over 10 s
WEIGHTS: dict[str, float] = {}


def parse_shard(text: str) -> tuple[int, int]:
    """`K/N` -> (K, N), 1 <= K <= N. Raises ValueError on anything else."""
    k, sep, n = text.partition("/")
    if not sep or not k.isdigit() or not n.isdigit() or not 1 <= int(k) <= int(n):
        raise ValueError(f"--shard wants K/N with 1 <= K <= N, got {text!r}")
    return int(k), int(n)


def deal(tests_per_file: dict[str, int], shards: int) -> dict[str, int]:
    """Each file's shard (0 .. shards-1): heaviest first to the lightest shard so far (ties: the
    lower shard), files of equal weight by path, so every process deals the same way."""
    weight = {f: WEIGHTS.get(f, SECONDS_PER_TEST * n) for f, n in tests_per_file.items()}
    load = [0.0] * shards
    out = {}
    for f in sorted(weight, key=lambda f: (-weight[f], f)):
        k = min(range(shards), key=lambda i: (load[i], i))
        out[f] = k
        load[k] += weight[f]
    return out


def select(files: Sequence[str], shard: int, shards: int) -> list[bool]:
    """For each test's file (`files`, one entry per collected test, relative to the repository
    root with '/'), whether it runs in `shard` (1-based) of `shards`."""
    owner = deal(Counter(files), shards)
    return [owner[f] == shard - 1 for f in files]


def combined_status(statuses: Iterable[int]) -> int:
    """The first failing status; NO_TESTS only when every shard collected nothing."""
    statuses = list(statuses)
    failed = [s for s in statuses if s not in (0, NO_TESTS)]
    if failed:
        return failed[0]
    return NO_TESTS if all(s == NO_TESTS for s in statuses) else 0


def run(shards: int, pytest_args: list[str]) -> int:
    """`pytest --shard K/N pytest_args` for every K at once; the combined exit status."""
    base = Path(tempfile.mkdtemp(prefix="hybrid-serve-shards-"))
    procs, logs = [], []
    try:
        for k in range(1, shards + 1):
            cmd = [sys.executable, "-m", "pytest", f"--shard={k}/{shards}"]
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
        print(f"\n---- shard {k}/{shards} ----", flush=True)
        sys.stdout.write((base / f"shard-{k}.log").read_text(errors="replace"))
    status = combined_status(statuses)
    print(f"\nshards' exit statuses: {statuses}", flush=True)
    if status in (0, NO_TESTS):
        shutil.rmtree(base, ignore_errors=True)
    else:
        print(f"(their temporary directories are kept in {base})", flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=int(os.environ.get("TEST_SHARDS", 2)))
    args, pytest_args = parser.parse_known_args(argv)
    if args.shards < 1:
        parser.error("--shards must be at least 1")
    if args.shards == 1:
        return subprocess.call([sys.executable, "-m", "pytest", *pytest_args])
    return run(args.shards, pytest_args)


if __name__ == "__main__":
    sys.exit(main())
