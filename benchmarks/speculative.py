"""Speculative decoding (NEXTN, the MTP head) against plain decoding, on one engine pair.

Workload: waves of C requests submitted at once, each a prompt of `--prompt-len` random token ids
(`--dataset gsm8k`: a GSM8K test question as "Question: ...\nAnswer:", a different one for every
request of every wave, for a checkpoint trained on such text) and exactly `--output-len` greedy
new tokens; output throughput = C * output_len / wall time of the wave (prefill included). Rows,
interleaved in every repeat (medians of `--repeats`):

- `plain`: no speculation;
- `head`: NEXTN with the checkpoint's own head (its accept length is whatever the head earns: a
  random preset's head drafts almost nothing right);
- `p=X`: controlled acceptance, the machinery's cost at a known accept rate: the head still runs
  every draft step, then its drafts are replaced by the plain run's own continuation with each
  token corrupted with probability X (`override_drafts`, which tests use too).

Accept length = tokens landed per verify round (SGLang's completion_tokens / spec_verify_ct,
less the prefill's token); a step the draft-length policy (`scheduler/spec/policy.py`) decoded
plainly counts as a round. Every speculative wave's tokens are checked against the plain run's.
The checkpoint needs an MTP head (`hybrid-serve make-model --preset small --mtp`); without
`--model-path` one is written for `--preset` into a temporary directory.

Example: python -m benchmarks.speculative --preset small --concurrency 1,8,32 --steps 3
"""

from __future__ import annotations

import sys  # noqa: I001  (the repo root goes on sys.path before our packages are imported)
from pathlib import Path

if not __package__:  # run as `python benchmarks/x.py`: the repo root first, not benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import logging
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from hybrid_serve.scheduler.engine import Engine
from hybrid_serve.scheduler.request import Req
from hybrid_serve.scheduler.spec.worker import SpecWorker

logger = logging.getLogger("benchmarks.speculative")
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def _gsm8k_prompts(model_path: str, data_path: str, n: int) -> list[list[int]]:
    """The first `n` GSM8K test questions as "Question: ...\nAnswer:" token ids."""
    from transformers import AutoTokenizer

    from benchmarks.gsm8k_data import load_split

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows = load_split(data_path, "test")[:n]
    texts = [f"Question: {r['question']}\nAnswer:" for r in rows]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


def override_drafts(worker: SpecWorker, fn: Callable[[Req, list[int]], list[int]] | None) -> None:
    """Controlled acceptance: after the head drafts, each drafting request's n drafts become
    the first n of fn(req, its drafts), and a sampled request's q a point mass on each (they
    were not drawn); fn None: the head's own drafts again. The head's passes all still run."""
    head = worker.head
    head.__dict__.pop("draft", None)  # back to the class's own
    if fn is None:
        return
    draft, vocab = head.draft, worker.runner.model.config.vocab_size

    def overridden(reqs: list[Req], steps: list[list[int]]) -> None:
        draft(reqs, steps)
        for r, slots in zip(reqs, steps, strict=True):
            if slots:
                r.spec.drafts = list(fn(r, r.spec.drafts))[: len(slots)]
                if not r.params.is_greedy:
                    r.spec.q = [torch.nn.functional.one_hot(torch.tensor(d), vocab).float()
                                for d in r.spec.drafts]  # fmt: skip

    head.draft = overridden


def controlled(engine: Engine, known: dict[tuple, list[int]], p_bad: float | None, seed: int):
    """Set (or, with p_bad None, clear) the engine's draft override."""
    if p_bad is None:
        override_drafts(engine.scheduler.forward, None)
        return
    rng, vocab = random.Random(seed), engine.runner.model.config.vocab_size

    def override(req, drafts: list[int]) -> list[int]:
        done = len(req.output_ids)
        cont = known[tuple(req.prompt_ids)][done : done + len(drafts)]
        return [t if rng.random() >= p_bad else (t + 1 + rng.randrange(vocab - 1)) % vocab
                for t in cont]  # fmt: skip

    override_drafts(engine.scheduler.forward, override)


def wave(engine: Engine, prompts: list[list[int]], output_len: int) -> tuple[float, list, int]:
    """(tok/s, outputs, verify rounds) of one wave."""
    start = time.perf_counter()
    outs = engine.generate(prompts, {**GREEDY, "max_new_tokens": output_len})
    elapsed = time.perf_counter() - start
    assert engine.leak_report() == [], engine.leak_report()
    engine.flush_cache()
    rounds = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    return len(prompts) * output_len / elapsed, [o["output_ids"] for o in outs], rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="a checkpoint with an MTP head")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--steps", type=int, default=3, help="--speculative-num-steps")
    ap.add_argument(
        "--draft-quantization", default=None, help="--speculative-draft-model-quantization"
    )
    ap.add_argument(
        "--disable-by-batch-size", type=int, default=0,
        help="--speculative-disable-by-batch-size (0 here: speculate at every size)",
    )  # fmt: skip
    ap.add_argument("--accept", default="head,0,0.3,0.6", help="rows: head and/or p values")
    ap.add_argument("--dataset", choices=("random", "gsm8k"), default="random")
    ap.add_argument("--data-path", default="/work/shared/data/gsm8k", help="--dataset gsm8k")
    ap.add_argument("--prompt-len", type=int, default=32, help="--dataset random")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    if args.model_path is None:
        from hybrid_serve.make_model.presets import preset_config, write_checkpoint

        out = Path(tempfile.mkdtemp(prefix="spec-bench-"))
        config = {**preset_config(args.preset), "mtp_num_hidden_layers": 1}
        args.model_path = str(write_checkpoint(out, config, seed=0))
    conc = [int(c) for c in args.concurrency.split(",")]
    waves: dict[tuple[int, int], list[list[int]]] = {}  # (repeat, C) -> its prompts
    if args.dataset == "gsm8k":
        texts = iter(_gsm8k_prompts(args.model_path, args.data_path, args.repeats * sum(conc)))
        waves = {(r, c): [next(texts) for _ in range(c)] for r in range(args.repeats) for c in conc}
        args.prompt_len = max(len(p) for w in waves.values() for p in w)
    common = dict(
        max_running_requests=max(conc),
        max_total_tokens=max(conc) * (args.prompt_len + args.output_len + args.steps + 8),
        dtype=args.dtype,
        disable_radix_cache=True,  # every wave computes its prompts
    )
    plain = Engine(args.model_path, **common)
    spec = Engine(
        args.model_path,
        speculative_algorithm="NEXTN",
        speculative_num_steps=args.steps,
        speculative_draft_model_quantization=args.draft_quantization,
        speculative_disable_by_batch_size=args.disable_by_batch_size,
        **common,
    )
    vocab = plain.runner.model.config.vocab_size
    for e in (plain, spec):  # warm-up (kernels, the decode plan)
        wave(e, _prompts(2, args.prompt_len, vocab, 99), 8)
    rows = [None if a == "head" else float(a) for a in args.accept.split(",")]
    results: dict[str, list[float]] = {}
    accept: dict[str, list[float]] = {}
    shared: dict[str, list[float]] = {}  # the draft policy's estimate for fresh requests
    for rep in range(args.repeats):  # interleaved so that noise hits every row alike
        for c in conc:
            prompts = waves.get((rep, c)) or _prompts(c, args.prompt_len, vocab, rep)
            tps, expected, _ = wave(plain, prompts, args.output_len)
            results.setdefault(f"plain c={c}", []).append(tps)
            known = {tuple(p): e for p, e in zip(prompts, expected, strict=True)}
            for p_bad in rows:
                name = f"{'head' if p_bad is None else f'p={p_bad}'} c={c}"
                controlled(spec, known, p_bad, seed=rep)
                # each row's own acceptance history (as if it ran alone); the costs are shared
                policy = spec.scheduler.forward.policy
                policy.shared = shared.setdefault(name, [1.0] * args.steps)
                tps, outs, rounds = wave(spec, prompts, args.output_len)
                assert outs == expected, f"{name}: tokens differ from plain decoding"
                results.setdefault(name, []).append(tps)
                if rounds:  # (none where --disable-by-batch-size kept the wave plain)
                    accept.setdefault(name, []).append(c * (args.output_len - 1) / rounds)
                logger.info("rep %d %s: %.1f tok/s, %d verify rounds", rep, name, tps, rounds)
    table = {}
    for k, v in results.items():
        c = k.split("c=")[1]
        base = statistics.median(results[f"plain c={c}"])
        table[k] = {
            "median_tok_s": statistics.median(v),
            "speedup": statistics.median(v) / base,
            "accept_length": statistics.median(accept[k]) if k in accept else None,
            "runs": v,
        }
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs, {args.threads} threads")
    print(f"{'row':<18}{'median tok/s':>14}{'x plain':>9}{'accept len':>12}  runs")
    for k, v in table.items():
        acc = "" if v["accept_length"] is None else f"{v['accept_length']:.2f}"
        print(f"{k:<18}{v['median_tok_s']:>14.1f}{v['speedup']:>9.2f}{acc:>12}  "
              f"{', '.join(f'{x:.1f}' for x in v['runs'])}")  # fmt: skip
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "results": table}, f, indent=2)


if __name__ == "__main__":
    main()
