"""One WARNING per process for each way start-up moves work off the fast kernels.

A choice that leaves a faster implementation unused where the code has one (the torch
references in place of the C++ or Triton kernels for some or all ops, the eager decode step in
place of the CPU decode plan) is logged through `warn_once`: at WARNING level, the first time its
key is seen in this process, with a message that names what runs slower, why, and the flag or
install that avoids it. The same key again logs nothing, so a process that builds several
models (tests, benchmarks) says each thing once. Choices a setting asked for by name are the
callers' to leave unlogged or to log; nothing here decides which choices are slow.
"""

from __future__ import annotations

import logging
import threading

_lock = threading.Lock()
_seen: set[str] = set()  # the keys warned about in this process


def warn_once(logger: logging.Logger, key: str, message: str, *args: object) -> bool:
    """Log `message % args` at WARNING on `logger` unless `key` was warned about before in
    this process; True when it logged."""
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
    logger.warning(message, *args)
    return True
