"""Process-wide CPU settings that torch reads once, so they are set before torch is imported.

* OpenMP spin count. torch's CPU wheels use GNU OpenMP. Between two parallel regions its idle
  threads spin `GOMP_SPINCOUNT` times (300,000 by default) before they block. On a machine whose
  cores are all in the team that is a trap: when anything else wants a core (the API process
  answering streams, a benchmark client, another job), a spinning thread holds it while the
  thread the region waits for sits in the run queue, and every parallel region of the decode
  step can wait out a scheduler time slice. A short spin keeps the quiet-machine speed (the next
  region usually starts within microseconds) and gives the core back quickly when it is
  contended.
* Transparent huge pages. A decode step streams every weight matrix (and, at larger batches,
  the recurrent states) from memory once; with 4 KB pages that is a TLB miss every 4 KB. Linux
  backs memory with 2 MB pages only where the program asks (`transparent_hugepage=madvise`, the
  common default), and torch's CPU allocator asks, for allocations of 2 MB and more, when
  `THP_MEM_ALLOC_ENABLE=1` (c10's `alloc_cpu`); the weight stream then takes a TLB miss every
  2 MB instead of every 4 KB (`tests/server/test_cpu_env.py` checks torch honours the switch).

libgomp and c10 read their variable once, so `apply_cpu_defaults` runs at the top of the entry
points (the CLI, `benchmarks/`), before anything imports torch; it changes nothing the user set,
and child processes (data/tensor-parallel ranks) inherit it.
"""

from __future__ import annotations

import os
import sys

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
    """Ask torch's CPU allocator for transparent huge pages (`THP_MEM_ALLOC_ENABLE=1`) unless
    the user set the variable (to anything: `0` turns it off). Same return as above."""
    if THP_ENV in os.environ:
        return False
    os.environ[THP_ENV] = "1"
    return "torch" not in sys.modules


def apply_cpu_defaults() -> None:
    apply_default_spin()
    apply_default_thp()
