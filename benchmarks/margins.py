"""How sure a checkpoint is of its next token: top-1 margins teacher-forced on held-out text.

A lossy mode flips a greedy token where its error exceeds the margin between the two most
likely tokens, so fidelity figures mean little without the margins they were measured at: a
random preset's are near-ties everywhere, a trained model's are not. For each checkpoint
(`--model-paths`, comma-separated; default: write `--preset`) every text of `--num-texts` GSM8K
test lines ("Question: ...\\nAnswer: ...", the form `make-model --train-text` trains on) is
prefilled once through the fp32 `Engine`'s runner, and at every position predicting a next
token of the text (`margin_stats`):

- quantiles of the top-1 probability, of the top-1 minus top-2 probability, and of the top-1
  minus top-2 logit (log-probability) gap; the share of positions whose top-1 probability is
  above 0.5 and above 0.9;
- how well the model knows the text: top-1 accuracy against the text's own next token and the
  mean negative log-likelihood (nats per token).

Example: python -m benchmarks.margins --model-paths $TRAINED,$RANDOM --num-texts 100 --threads 1
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
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hybrid_serve.scheduler.model_runner import ModelRunner

logger = logging.getLogger("benchmarks.margins")

QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
GAP_EDGES = (0.1, 1.0)  # logit-gap bins for `agreement_by_gap`: near-ties, close calls, clear


def quantiles(values: torch.Tensor) -> dict[str, float]:
    """`QUANTILES` of a 1-D tensor (linear interpolation), keyed "p10", "p25", ..."""
    q = torch.quantile(values.double(), torch.tensor(QUANTILES, dtype=torch.float64))
    return {f"p{round(100 * k)}": float(v) for k, v in zip(QUANTILES, q, strict=True)}


def margin_stats(logprobs: torch.Tensor, targets: torch.Tensor | None = None) -> dict:
    """Margins of next-token distributions `logprobs` [N, vocab] (log-softmaxed rows): see the
    module docstring; with `targets` [N] (the tokens that came next) also the top-1 accuracy
    and the mean negative log-likelihood."""
    top = logprobs.float().topk(2, dim=-1).values  # [N, 2], log p1 >= log p2
    p1, p2 = top[:, 0].exp(), top[:, 1].exp()
    gaps = top[:, 0] - top[:, 1]
    stats = {
        "positions": int(logprobs.shape[0]),
        "top1_prob": quantiles(p1),
        "top1_minus_top2_prob": quantiles(p1 - p2),
        "top1_minus_top2_logit": quantiles(gaps),
        "top1_prob_mean": float(p1.mean()),
        "share_top1_prob_above_0.5": float((p1 > 0.5).double().mean()),
        "share_top1_prob_above_0.9": float((p1 > 0.9).double().mean()),
    }
    if targets is not None:
        stats["top1_accuracy"] = float((logprobs.argmax(-1) == targets).double().mean())
        stats["nll_mean"] = float(-logprobs.gather(1, targets[:, None]).mean())
    return stats


def logit_gaps(logprobs: torch.Tensor) -> torch.Tensor:
    """[N] top-1 minus top-2 log-probability of each row of `logprobs` [N, vocab]."""
    top = logprobs.float().topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def agreement_by_gap(
    gaps: torch.Tensor, agree: torch.Tensor, edges: tuple[float, ...] = GAP_EDGES
) -> dict[str, dict[str, float]]:
    """Top-1 agreement `agree` [N] (bool) split by the reference's logit gap `gaps` [N] into the
    bins that `edges` (ascending) cut: for each bin its share of the positions and the
    agreement inside it (None where empty)."""
    bounds = [0.0, *edges, float("inf")]
    out = {}
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        inside = (gaps >= lo) & (gaps < hi)
        n = int(inside.sum())
        name = f"<{hi:g}" if lo == 0.0 else f">={lo:g}" if hi == float("inf") else f"{lo:g}-{hi:g}"
        out[name] = {
            "share": n / max(int(gaps.numel()), 1),
            "top1_agreement": float(agree[inside].double().mean()) if n else None,
        }
    return out


def all_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of one prefill of `ids` from an empty state (slots freed)."""
    from hybrid_serve.scheduler.model_runner import ExtendInput

    req = runner.req_pool.alloc(1)[0]
    slot = int(runner.mamba_pool.alloc(1)[0])
    loc = runner.alloc_kv(req, 0, len(ids))
    try:
        batch = runner.build_prefill(
            [ExtendInput(req, slot, 0, ids)], [loc], return_all_logits=True
        )
        return runner.forward(batch)
    finally:
        runner.free_kv(req, len(ids))
        runner.mamba_pool.free([slot])
        runner.req_pool.free(req)


def text_margins(path: str, texts: list[str], max_running_requests: int = 4) -> dict:
    """`margin_stats` of the checkpoint at `path` (fp32 `Engine`) over every next-token
    position of `texts`, each prefilled alone from an empty state."""
    from hybrid_serve.scheduler.engine import Engine

    engine = Engine(
        path, dtype="float32", max_running_requests=max_running_requests, max_context_len=4096
    )
    rows, targets = [], []
    with torch.inference_mode():
        for text in texts:
            ids = engine.tokenizer(text, add_special_tokens=False).input_ids
            rows.append(all_logits(engine.runner, ids)[:-1].log_softmax(-1))
            targets.append(torch.tensor(ids[1:]))
    return margin_stats(torch.cat(rows), torch.cat(targets))


def main(argv: list[str] | None = None) -> None:
    from benchmarks.gsm8k_data import load_split
    from benchmarks.model_forward import resolve_model_path

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-paths", help="comma-separated checkpoints (default: --preset's)")
    p.add_argument("--preset", default="small", help="preset to write when no --model-paths")
    p.add_argument("--rewrite-preset", action="store_true")
    p.add_argument("--data-path", default="/work/shared/data/gsm8k", help="GSM8K jsonl directory")
    p.add_argument("--num-texts", type=int, default=100, help="test lines, from the first")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    if args.model_paths:
        paths = args.model_paths.split(",")
    else:
        args.model_path = None
        paths = [str(resolve_model_path(args))]
    test = load_split(args.data_path, "test")[: args.num_texts]
    texts = [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in test]
    report: dict = {"texts": len(texts), "threads": args.threads, "models": {}}
    for path in paths:
        report["models"][path] = text_margins(path, texts)
        logger.info("%s: %s", path, json.dumps(report["models"][path]))
    report["load_average"] = os.getloadavg()[0]
    print(json.dumps(report, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
