"""Training speed of `make-model --train-text` (`make_model.train_text.Trainer`) per setting.

Each setting `PRECISION:BATCHxSEQ` (e.g. `float32:8x256`, `bfloat16:4x128`; `:unfused` appended:
AdamW's per-tensor loop instead of its fused kernel, as before the fused one) loads the checkpoint
afresh in transformers' model class, runs `--warmup` untimed steps and `--steps` timed ones on
windows of the text (the same seeded windows for every setting of a shape), and reports seconds
per step, steps and tokens per second, the forward / backward / optimizer split, and the mean loss
of the timed steps (settings of one shape start from the same weights on the same windows, so
their losses compare the arithmetic). The learning rate is the peak, without warm-up or decay.

`--gdn` also times transformers' chunked gated delta rule alone (`torch_chunk_gated_delta_rule`,
forward and backward at one layer's shapes, under the setting's arithmetic) and reports its
share of a step's forward + backward for all the model's linear-attention layers together.

Example: OMP_NUM_THREADS=1 python -m benchmarks.train_speed --preset small --threads 1 \
             --settings float32:8x256,bfloat16:8x256,bfloat16:4x128 --steps 2 --gdn
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
import statistics
import time

import torch

from benchmarks.model_forward import resolve_model_path
from hybrid_serve.make_model.train_text import (
    Trainer,
    resolve_precision,
    sample_windows,
    tokenize_text,
)

logger = logging.getLogger("benchmarks.train_speed")


def parse_setting(text: str) -> tuple[str, int, int, bool]:
    """`PRECISION:BATCHxSEQ[:unfused]` -> (precision as resolved, batch, seq_len, fused)."""
    precision, shape, *rest = text.split(":")
    if rest not in ([], ["unfused"]):
        raise ValueError(f"setting {text!r}: PRECISION:BATCHxSEQ or PRECISION:BATCHxSEQ:unfused")
    batch, _, seq = shape.partition("x")
    return resolve_precision(precision), int(batch), int(seq), not rest


def gdn_seconds(config, batch: int, seq_len: int, precision: str, repeats: int = 3) -> float:
    """Median seconds of one forward + backward of transformers' chunked gated delta rule on
    random inputs of one linear-attention layer's shapes."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    gen = torch.Generator().manual_seed(0)
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim

    def leaf(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).requires_grad_()

    times = []
    for _ in range(repeats + 1):  # the first run warms up
        q, k = leaf(batch, seq_len, hk, dk), leaf(batch, seq_len, hk, dk)
        v = leaf(batch, seq_len, hv, dv)
        g, beta = leaf(batch, seq_len, hv, scale=0.1), leaf(batch, seq_len, hv)
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16"):
            out, _ = hf.torch_chunk_gated_delta_rule(
                q, k, v, g=-g.abs(), beta=beta.sigmoid(), use_qk_l2norm_in_kernel=True
            )
        out.float().square().mean().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", help="checkpoint directory (default: write --preset)")
    p.add_argument("--preset", default="small", help="preset to write when no --model-path")
    p.add_argument("--rewrite-preset", action="store_true")
    p.add_argument("--text", default="/work/shared/data/gsm8k/train.jsonl")
    p.add_argument("--settings", default="float32:8x256,bfloat16:8x256")
    p.add_argument("--steps", type=int, default=2, help="timed steps per setting")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per setting first")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--gdn", action="store_true", help="time the chunked gated delta rule alone")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(args)
    ids = tokenize_text(path, args.text)
    report: dict = {"model_path": str(path), "threads": args.threads, "settings": {}}
    for text in args.settings.split(","):
        precision, batch, seq_len, fused = parse_setting(text)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        trainer = Trainer(model, args.lr, precision, fused=fused)
        gen = torch.Generator().manual_seed(0)
        for _ in range(args.warmup):
            trainer.step(sample_windows(ids, batch, seq_len, gen))
        trainer.phases = dict.fromkeys(trainer.phases, 0.0)
        start = time.perf_counter()
        losses = [trainer.step(sample_windows(ids, batch, seq_len, gen)) for _ in range(args.steps)]
        per_step = (time.perf_counter() - start) / args.steps
        row = {
            "s_per_step": per_step,
            "steps_per_min": 60.0 / per_step,
            "tokens_per_s": batch * seq_len / per_step,
            **{f"{k}_s": v / args.steps for k, v in trainer.phases.items()},
            "mean_loss": statistics.mean(losses),
        }
        if args.gdn:
            layers = model.config.layer_types.count("linear_attention")
            gdn = layers * gdn_seconds(model.config, batch, seq_len, precision)
            row["gdn_s"] = gdn
            row["gdn_share_of_fwd_bwd"] = gdn / (row["forward_s"] + row["backward_s"])
        report["settings"][text] = row
        logger.info("%s: %s", text, ", ".join(f"{k} {v:.3g}" for k, v in row.items()))
        del trainer, model
    report["load_average"] = os.getloadavg()[0]
    print(json.dumps(report, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
