"""Process-wide CPU settings that torch reads once, so they are set before torch is imported.

* OpenMP spin count: idle GNU OpenMP threads spin `GOMP_SPINCOUNT` times (300,000 by default)
  between parallel regions. When anything else wants a core (the API process, a benchmark
  client), a spinning thread holds it while the thread a region waits for sits in the run queue.
  A short spin keeps the quiet-machine speed and gives the core back quickly under contention.
* Transparent huge pages: a decode step streams every weight from memory; with
  `THP_MEM_ALLOC_ENABLE=1` torch's CPU allocator asks for 2 MB pages (`madvise`) for allocations
  of 2 MB and more, one TLB miss per 2 MB instead of per 4 KB (`tests/server/test_cpu_env.py`).

`apply_cpu_defaults` runs at the top of the entry points (the CLI, `benchmarks/`), before torch
is imported; it changes nothing the user set, and child processes (ranks) inherit it.

* Torch's intra-op threads (`configure_threads`): `--num-threads N` sets them; 0, the default,
  lets the server pick `OMP_NUM_THREADS` when set, else the CPUs this process may run on (its
  affinity mask). The offline Engine and the tests leave torch's own setting alone unless told.
* `die_with_parent`: a spawned process (the scheduler, a tensor-parallel rank) never outlives
  the process that started it, even while it is still loading the model.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

logger = logging.getLogger(__name__)

SPIN_ENV = "GOMP_SPINCOUNT"
DEFAULT_SPINCOUNT = 10_000
THP_ENV = "THP_MEM_ALLOC_ENABLE"


def apply_default_spin() -> bool:
    """Set `GOMP_SPINCOUNT` to `DEFAULT_SPINCOUNT` unless the user chose a spin count or wait
    policy. Returns whether this process's OpenMP will see it (not when torch is already
    imported; processes started later inherit it either way)."""
    if SPIN_ENV in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return False
    os.environ[SPIN_ENV] = str(DEFAULT_SPINCOUNT)
    return "torch" not in sys.modules


def apply_default_thp() -> bool:
    """Set `THP_MEM_ALLOC_ENABLE=1` unless the user set it (`0` turns it off); returns as above."""
    if THP_ENV in os.environ:
        return False
    os.environ[THP_ENV] = "1"
    return "torch" not in sys.modules


def apply_cpu_defaults() -> None:
    apply_default_spin()
    apply_default_thp()


def default_num_threads() -> int:
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity API on this platform
        return max(1, os.cpu_count() or 1)


def configure_threads(num_threads: int, *, pick_default: bool) -> int:
    """Set torch's thread count to `num_threads`, or when it is 0 and `pick_default`, to
    `default_num_threads()`. Returns the count in effect."""
    import torch

    n = num_threads or (default_num_threads() if pick_default else 0)
    if n > 0 and n != torch.get_num_threads():
        torch.set_num_threads(n)
    count = torch.get_num_threads()
    logger.info("torch uses %d CPU threads", count)
    return count


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the process that started it dies. The kernel ties
    it to the thread that spawned this one, so spawn from a thread that lives as long as its
    process (the main thread; `TPGroup.start` runs on the thread that owns the group)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
