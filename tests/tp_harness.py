"""Run a function on N tensor-parallel ranks (spawned processes, gloo on 127.0.0.1) and get
rank 0's result back; a rank that fails or overruns the time limit fails the caller."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import traceback

import torch


def _rank_main(fn, rank: int, size: int, addr: str, results, args: tuple) -> None:
    from hybrid_serve.models.parallel import init_process_group

    torch.set_num_threads(1)
    try:
        tp = init_process_group(rank, size, addr, timeout_s=120)
        out = fn(tp, *args)
        # pickled here: a tensor put on the queue as such would be shared memory that dies with
        # this process
        results.put((rank, "ok", pickle.dumps(out) if rank == 0 else None))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_ranks(fn, size: int, *args, timeout_s: float = 240.0):
    """fn(tp, *args) on every rank; rank 0's return value (picklable)."""
    from hybrid_serve.models.parallel import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, size, addr, results, args), daemon=True)
        for r in range(size)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, object]] = {}
    try:
        while len(got) < size:
            try:
                rank, status, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(
                    f"tensor-parallel ranks did not finish in {timeout_s}s"
                ) from None
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            got[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return pickle.loads(got[0][1])
