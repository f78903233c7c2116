"""`make-model --train-text`: a preset trained on text is written back in its own layout, and
the project's loader serves exactly what transformers computes from it."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from make_model.presets import preset_config, write_checkpoint
from make_model.train_text import read_text, train_checkpoint
from models.loader import load_model
from scheduler.config import RunnerConfig
from scheduler.model_runner import ModelRunner
from tests.ragged_prefill import admit, ragged_prefill


def test_a_trained_preset_keeps_its_layout_and_serves_transformers_numbers(tmp_path):
    rows = [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
            for a in range(20) for b in range(3)]  # fmt: skip
    text = tmp_path / "train.jsonl"
    text.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_text(text).startswith("Question: What is 0 + 0?\nAnswer: 0 + 0 = 0\n#### 0\n\n")
    path = write_checkpoint(tmp_path / "ckpt", preset_config("tiny"), seed=1)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        before = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    result = train_checkpoint(path, text, minutes=0.05, seq_len=32, batch_size=2)
    assert result.steps >= 2 and result.loss_last < result.loss_first
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        after = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
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
