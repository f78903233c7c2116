"""Time to first token with a long shared prefix, cached vs not cached (offline Engine).

A prefix P of `--prefix-len` random tokens is followed by a fresh `--suffix-len`-token question.
Uncached: the radix cache is flushed before each request. Cached, `no_buffer` (default): P was
served once before as a request of its own, so the tree holds the state after exactly P. Cached,
`--mamba-scheduler-strategy extra_buffer`: P was served once followed by a different question,
and the request reuses the snapshot at P's last chunk-aligned position (a multiple of 64) and
prefills the rest. With `--enable-hierarchical-cache`, also served from host memory: P was
served once as above, then the whole device tree was evicted (demoted to the host tier), so the
request loads P's KV and state back before prefilling its question. With `--hicache-storage-dir`
(which turns the host tier on), also served from storage: P was served once as above (written
through to the folder), then the whole tree was flushed (device and host), so the request
prefetches P from the files into host memory (`wait_complete`) and loads it back. Storage holds
states only at 64-token block ends, so use `extra_buffer` there (`no_buffer` stores the state at
P's own length only). TTFT = time from submission to the first streamed token. Medians.

Example: python -m benchmarks.prefix_ttft --preset small --prefix-len 2000
"""

from __future__ import annotations

import sys  # noqa: I001  (the repo root goes on sys.path before our packages are imported)
from pathlib import Path

if not __package__:  # run as `python benchmarks/x.py`: the repo root first, not benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import statistics
import time

import torch

from hybrid_serve.scheduler.engine import Engine


def ttft(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    stream = engine.generate_stream(prompt, {"max_new_tokens": 2, "temperature": 0.0})
    next(stream)
    elapsed = time.perf_counter() - start
    last = list(stream)[-1]
    return elapsed, last["meta_info"]["cached_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--suffix-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mamba-scheduler-strategy", default="no_buffer")
    ap.add_argument("--enable-hierarchical-cache", action="store_true")
    ap.add_argument("--hicache-storage-dir", default="", help="also measure a storage hit")
    args = ap.parse_args()
    storage = {}
    if args.hicache_storage_dir:
        args.enable_hierarchical_cache = True
        storage = {
            "hicache_storage_backend": "file",
            "hicache_storage_dir": args.hicache_storage_dir,
            "hicache_storage_prefetch_policy": "wait_complete",
        }
    torch.set_num_threads(args.threads)
    if args.model_path is None:
        from hybrid_serve.server.model_path import default_model_path

        args.model_path = str(default_model_path(args.preset))
    engine = Engine(
        args.model_path,
        max_running_requests=4,
        dtype="float32",
        max_total_tokens=4 * (args.prefix_len + args.suffix_len + 64),
        max_context_len=args.prefix_len + args.suffix_len + 64,
        mamba_scheduler_strategy=args.mamba_scheduler_strategy,
        enable_hierarchical_cache=args.enable_hierarchical_cache,
        **storage,
    )
    snapshots = args.mamba_scheduler_strategy != "no_buffer"
    vocab = engine.runner.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    ttft(engine, rand(8))  # warm-up
    cold, warm, hits, host, host_hits, stored, stored_hits = [], [], [], [], [], [], []
    for _ in range(args.repeats):
        prefix = rand(args.prefix_len)  # a new one each time: never in storage before its cold run
        engine.flush_cache()
        cold.append(ttft(engine, prefix + rand(args.suffix_len))[0])
        engine.flush_cache()
        first = prefix + rand(args.suffix_len) if snapshots else prefix  # P served once before
        engine.generate(first, {"max_new_tokens": 1})
        t, cached = ttft(engine, prefix + rand(args.suffix_len))
        warm.append(t)
        hits.append(cached)
        if args.enable_hierarchical_cache:
            engine.flush_cache()
            engine.generate(first, {"max_new_tokens": 1})
            tree = engine.scheduler.tree
            tree.evict(num_tokens=tree.total_size())  # everything demoted to host memory
            t, cached = ttft(engine, prefix + rand(args.suffix_len))
            host.append(t)
            host_hits.append(cached)
        if storage:
            engine.flush_cache()
            engine.generate(first, {"max_new_tokens": 1})  # written through to the folder
            engine.flush_cache()  # device and host tiers empty; the files stay
            t, cached = ttft(engine, prefix + rand(args.suffix_len))
            stored.append(t)
            stored_hits.append(cached)
    assert engine.leak_report() == []
    c, w = statistics.median(cold), statistics.median(warm)
    print(
        f"prefix {args.prefix_len} + question {args.suffix_len} tokens, {args.threads} threads, "
        f"{args.mamba_scheduler_strategy}"
    )
    print(
        f"TTFT uncached: {c * 1e3:.1f} ms   cached: {w * 1e3:.1f} ms   ratio: {w / c:.3f}   "
        f"cached_tokens: {statistics.median(hits):.0f}"
    )
    if host:
        h = statistics.median(host)
        print(
            f"TTFT from host memory: {h * 1e3:.1f} ms   ratio: {h / c:.3f}   "
            f"cached_tokens: {statistics.median(host_hits):.0f}"
        )
    if stored:
        f = statistics.median(stored)
        print(
            f"TTFT from storage: {f * 1e3:.1f} ms   ratio: {f / c:.3f}   "
            f"cached_tokens: {statistics.median(stored_hits):.0f}"
        )


if __name__ == "__main__":
    main()
