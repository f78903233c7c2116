"""Scheduler overhead per decode step, with the model replaced by a no-op of the same output shape.

Everything but the forward runs for real: batch building, KV allocation, padding, sampling
(over a [B, vocab] logits tensor of noise), finish checks and bookkeeping. Reported: median time
of a decode step at each batch size. `--sampling greedy` (the default) takes the argmax;
`--sampling full` samples every row with temperature, top-k, top-p, min-p and all three penalties.

Example: python -m benchmarks.scheduler_overhead --batch-sizes 1,16,64 --sampling full
"""

from __future__ import annotations

import sys  # noqa: I001  (the repo root goes on sys.path before our packages are imported)
from pathlib import Path

if not __package__:  # run as `python benchmarks/x.py`: the repo root first, not benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import itertools
import statistics
import time

import torch

from hybrid_serve.scheduler.engine import Engine

SAMPLED = {
    "temperature": 0.8,
    "top_k": 50,
    "top_p": 0.9,
    "min_p": 0.01,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.3,
    "repetition_penalty": 1.1,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sampling", choices=("greedy", "full"), default="greedy")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model_path is None:
        from hybrid_serve.server.model_path import default_model_path

        args.model_path = str(default_model_path("tiny"))
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    engine = Engine(
        args.model_path,
        max_running_requests=max(sizes),
        max_total_tokens=max(sizes) * (args.steps + 64),
        disable_cuda_graph=True,  # decode through runner.forward (the no-op), not the CPU plan
    )
    vocab = engine.runner.model.config.vocab_size
    real_forward = engine.runner.forward
    # logits made once per batch size (4 variants in turn): drawing them is not the step's cost
    noise = {bs: torch.randn(4, bs, vocab) for bs in sizes}
    turn = itertools.count()

    def no_op_forward(batch):
        if not batch.is_decode:
            return real_forward(batch)  # prefill stays real so the requests are set up honestly
        return noise[len(batch.extend_lens_cpu)][next(turn) % 4]

    engine.runner.forward = no_op_forward
    sched = engine.scheduler
    print(f"{'batch':>6}{'median ms/step':>16}{'p90 ms':>10}")
    for bs in sizes:
        params = {"max_new_tokens": args.steps + 2, "temperature": 0.0, "ignore_eos": True}
        if args.sampling == "full":
            params |= SAMPLED
        reqs = [
            engine.loop.make_req(engine._message(list(range(3, 19)), params)) for _ in range(bs)
        ]
        for r in reqs:
            sched.add_request(r)
        while sched.waiting or sched.chunked:
            sched.step()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            sched.step()
            times.append((time.perf_counter() - start) * 1e3)
        for r in reqs:
            sched.abort(r.rid)
        times.sort()
        print(f"{bs:>6}{statistics.median(times):>16.3f}{times[int(0.9 * len(times))]:>10.3f}")


if __name__ == "__main__":
    main()
