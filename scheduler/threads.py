"""How many CPU threads torch's intra-op pool uses for the forward.

`--num-threads N` (RunnerConfig.num_threads) sets it; 0, the default, lets the server pick:
`OMP_NUM_THREADS` when the environment sets it (torch already honours it), otherwise the CPUs
this process may run on (its affinity mask, so `taskset` and cpusets count). The offline Engine
and the tests leave torch's own setting alone unless told.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


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
    n = num_threads or (default_num_threads() if pick_default else 0)
    if n > 0 and n != torch.get_num_threads():
        torch.set_num_threads(n)
    count = torch.get_num_threads()
    logger.info("torch uses %d CPU threads", count)
    return count
