"""How long torch's OpenMP threads spin before they sleep, set before torch is imported.

torch's CPU wheels use GNU OpenMP. Between two parallel regions its idle threads spin
`GOMP_SPINCOUNT` times (300,000 by default, about a millisecond here) before they block. On a
machine whose cores are all in the team that is a trap: when anything else wants a core (the API
process answering streams, a benchmark client, another job), a spinning thread holds it while the
thread the region waits for sits in the run queue, and every parallel region of the decode step
can wait out a scheduler time slice. A short spin keeps the quiet-machine speed (the next region
usually starts within microseconds) and gives the core back quickly when it is contended
(measured: BENCHMARKS.md, issue 10). libgomp reads the variable once, when torch loads it, so
this runs at the top of the entry points, before anything imports torch; it changes nothing when
the user set `GOMP_SPINCOUNT` or `OMP_WAIT_POLICY` themselves, and children inherit it.
"""

from __future__ import annotations

import os
import sys

SPIN_ENV = "GOMP_SPINCOUNT"
DEFAULT_SPINCOUNT = 10_000


def apply_default_spin() -> bool:
    """Set `GOMP_SPINCOUNT` to `DEFAULT_SPINCOUNT` unless the user chose a spin count or wait
    policy. Returns whether this process's OpenMP will see it (not when torch is already
    imported; processes started later inherit it either way)."""
    if SPIN_ENV in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return False
    os.environ[SPIN_ENV] = str(DEFAULT_SPINCOUNT)
    return "torch" not in sys.modules
