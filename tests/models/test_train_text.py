"""`make-model --train-text`: a preset trained on text is written back in its own layout, the
project's loader serves exactly what transformers computes from it, the forward runs in bf16
(autocast) or fp32 on fp32 master weights, the budget is minutes and/or steps, and `--fit-mtp`
after it fits the head on prompts cut from the same text."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from safetensors import safe_open

import hybrid_serve.make_model.mtp_fitting as mtp_fitting
from hybrid_serve.make_model.mtp_fitting import text_prompts
from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.make_model.train_text import (
    lr_scale,
    read_text,
    resolve_precision,
    sample_windows,
    tokenize_text,
    train_checkpoint,
)
from hybrid_serve.models.loader import load_model
from hybrid_serve.scheduler.config import RunnerConfig
from hybrid_serve.scheduler.model_runner import ModelRunner
from hybrid_serve.server.cli import main as cli_main
from tests.ragged_prefill import admit, ragged_prefill


def _text(tmp_path):
    rows = [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
            for a in range(20) for b in range(3)]  # fmt: skip
    text = tmp_path / "train.jsonl"
    text.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return text


def _tensors(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118


def test_a_trained_preset_keeps_its_layout_and_serves_transformers_numbers(tmp_path):
    text = _text(tmp_path)
    assert read_text(text).startswith("Question: What is 0 + 0?\nAnswer: 0 + 0 = 0\n#### 0\n\n")
    path = write_checkpoint(tmp_path / "ckpt", preset_config("tiny"), seed=1)
    before = _tensors(path)
    result = train_checkpoint(
        path, text, minutes=None, steps=30, seq_len=32, batch_size=2, precision="float32"
    )
    assert result.steps == 30 and result.tokens == 30 * 2 * 32 and result.precision == "float32"
    assert result.loss_last < result.loss_first
    assert set(result.phases) == {"forward", "backward", "optimizer"}
    after = _tensors(path)
    assert after.keys() == before.keys()  # the same names, per-expert matrices included
    assert all(after[n].dtype == before[n].dtype and after[n].shape == before[n].shape
               for n in after)  # fmt: skip
    moved = [n for n in after if not torch.equal(after[n], before[n])]
    assert any(".experts.0.gate_proj" in n for n in moved) and "model.embed_tokens.weight" in moved
    from transformers import AutoModelForCausalLM

    prompt = [5, 9, 17, 33, 12, 7, 40, 3]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1]
    runner = ModelRunner(load_model(path, dtype="float32"), RunnerConfig(max_running_requests=2))
    got = ragged_prefill(runner, [prompt], admit(runner, 1), chunk=None)[0]
    assert (got - want).abs().max().item() < 2e-4  # ours and transformers' fp32 runs


def test_a_bf16_forward_trains_fp32_master_weights(tmp_path):
    """Under autocast the loss still falls and the written fp32 values are not bf16-rounded
    (the optimizer updates fp32 weights; only the products round)."""
    path = write_checkpoint(tmp_path / "ckpt", preset_config("tiny"), seed=1)
    before = _tensors(path)
    result = train_checkpoint(
        path, _text(tmp_path), minutes=None, steps=30, seq_len=32, batch_size=2,
        precision="bfloat16",
    )  # fmt: skip
    assert result.precision == "bfloat16" and result.loss_last < result.loss_first
    after = _tensors(path)
    weight = "model.layers.0.mlp.shared_expert.up_proj.weight"
    assert after[weight].dtype == torch.float32 and not torch.equal(after[weight], before[weight])
    assert not torch.equal(after[weight], after[weight].bfloat16().float())


def test_precision_auto_follows_the_cpu():
    assert resolve_precision("auto", {"avx2", "avx512_bf16"}) == "bfloat16"
    assert resolve_precision("auto", {"avx2", "amx_bf16"}) == "bfloat16"
    assert resolve_precision("auto", {"avx2", "avx512f"}) == "float32"
    assert resolve_precision("float32", {"amx_bf16"}) == "float32"
    assert resolve_precision("bfloat16", set()) == "bfloat16"
    with pytest.raises(ValueError, match="choose one of"):
        resolve_precision("float16")


def test_budget_windows_and_schedule(tmp_path):
    path = write_checkpoint(tmp_path / "ckpt", preset_config("tiny"), seed=1)
    with pytest.raises(ValueError, match="budget"):
        train_checkpoint(path, _text(tmp_path), minutes=None, steps=None)
    ids = torch.arange(100, 200)
    w = sample_windows(ids, 5, 7, torch.Generator().manual_seed(3))
    assert w.shape == (5, 7) and torch.equal(w, w[:, :1] + torch.arange(7))  # slices of ids
    assert int(w.min()) >= 100 and int(w.max()) < 200
    assert torch.equal(w, sample_windows(ids, 5, 7, torch.Generator().manual_seed(3)))
    assert math.isclose(lr_scale(0, 0.0), 0.1) and math.isclose(lr_scale(9, 0.0), 1.0)
    assert math.isclose(lr_scale(50, 0.5), 0.5) and lr_scale(50, 1.0) == 0.0
    assert lr_scale(50, 0.25) > lr_scale(50, 0.75)


def test_text_prompts_are_windows_of_the_text():
    ids = torch.arange(1000, 1050)
    p = text_prompts(ids, 6, 8, seed=2)
    assert p.shape == (6, 8) and torch.equal(p, p[:, :1] + torch.arange(8))
    assert torch.equal(p, text_prompts(ids, 6, 8, seed=2))
    with pytest.raises(ValueError, match="fewer than a prompt"):
        text_prompts(ids[:5], 1, 8, seed=0)


def test_cli_trains_by_steps_then_fits_the_head_on_the_text(tmp_path, caplog, monkeypatch):
    text, out, seen = _text(tmp_path), tmp_path / "m", {}
    fit = mtp_fitting.fit_checkpoint

    def spy(path, **options):
        seen.update(options)
        return fit(path, **options)

    monkeypatch.setattr(mtp_fitting, "fit_checkpoint", spy)
    with caplog.at_level(logging.INFO):
        cli_main(
            ["make-model", "--preset", "tiny", "--out", str(out), "--train-text", str(text)]
            + ["--train-steps", "3", "--train-batch", "2", "--train-seq-len", "16"]
            + ["--train-precision", "float32", "--fit-mtp", "--fit-steps", "2"]
            + ["--fit-prompts", "4"]
        )
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("trained ")]
    assert len(lines) == 1 and "3 steps, 96 tokens" in lines[0] and "float32 forward" in lines[0]
    assert torch.equal(seen["text"], tokenize_text(out, text)) and seen["steps"] == 2
