"""Qwen3.5 text models: config reading, the strict loader on the new layouts, and greedy parity of
the whole Engine (radix cache on, each Mamba strategy) with transformers' Qwen3_5ForCausalLM /
Qwen3_5MoeForCausalLM. Logit-level parity per layout lives in test_parity.py."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.models.loader import load_model
from hybrid_serve.models.qwen3_next_config import Qwen3NextConfig
from hybrid_serve.models.registry import read_config
from hybrid_serve.scheduler.engine import Engine
from hybrid_serve.server.cli import main as cli_main
from tests.hf_reference import hf_greedy

GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
STRATEGIES = ("no_buffer", "extra_buffer", "extra_buffer_lazy")


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("q35"), preset_config("tiny-qwen3.5"), seed=4)


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    """(text-only checkpoint, the same weights in the multimodal release layout)."""
    cfg = preset_config("tiny-qwen3.5-moe")
    text = write_checkpoint(tmp_path_factory.mktemp("q35moe"), cfg, seed=4, expert_layout="fused")
    wrapped = write_checkpoint(
        tmp_path_factory.mktemp("q35moe-mm"), cfg, seed=4, expert_layout="fused", multimodal=True
    )
    return text, wrapped


def test_config_of_each_layout(dense, moe_pair):
    d = read_config(dense)
    assert (d.gdn_projections, d.weight_prefix, d.num_experts) == ("split", "model.", 0)
    assert not any(d.is_moe_layer(i) for i in range(d.num_hidden_layers))
    m = read_config(moe_pair[1])
    assert (m.gdn_projections, m.weight_prefix) == ("split", "model.language_model.")
    assert all(m.is_moe_layer(i) for i in range(m.num_hidden_layers))
    assert m.intermediate_size == 0 and m.norm_topk_prob
    text = read_config(moe_pair[0])
    assert dataclasses.replace(text, weight_prefix="model.language_model.") == m


def test_config_errors_name_the_field(moe_pair):
    raw = json.loads((moe_pair[1] / "config.json").read_text())
    del raw["text_config"]["num_experts"]
    with pytest.raises(ValueError, match="missing field 'num_experts'"):
        Qwen3NextConfig.from_dict(raw)
    with pytest.raises(ValueError, match="missing field 'text_config'"):
        Qwen3NextConfig.from_dict({"model_type": "qwen3_5"})
    raw = json.loads((moe_pair[1] / "config.json").read_text())
    raw["text_config"]["model_type"] = "qwen3_5_text"
    with pytest.raises(ValueError, match="text_config.model_type"):
        Qwen3NextConfig.from_dict(raw)


def _edit_weights(path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_loader_names_missing_and_extra_tensors(tmp_path):
    cfg = preset_config("tiny-qwen3.5-moe")
    path = write_checkpoint(tmp_path / "a", cfg, seed=1, multimodal=True)
    name = "model.language_model.layers.0.linear_attn.in_proj_z.weight"
    _edit_weights(path, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"missing tensor {name}"):
        load_model(path)
    path = write_checkpoint(tmp_path / "b", cfg, seed=1, multimodal=True)
    stray = "model.language_model.layers.0.linear_attn.in_proj_qkvz.weight"  # Next's layout
    _edit_weights(path, lambda t: t.__setitem__(stray, torch.zeros(4, 4)))
    with pytest.raises(ValueError, match=f"unexpected checkpoint tensor {stray}"):
        load_model(path)
    path = write_checkpoint(tmp_path / "c", preset_config("tiny-qwen3.5"), seed=1)
    expert = "model.layers.1.mlp.experts.0.gate_proj.weight"  # a dense model has no experts
    _edit_weights(path, lambda t: t.__setitem__(expert, torch.zeros(4, 4)))
    with pytest.raises(ValueError, match=f"unexpected checkpoint tensor {expert}"):
        load_model(path)


def test_vision_and_mtp_tensors_are_skipped_in_one_line(moe_pair, caplog):
    with caplog.at_level(logging.INFO, logger="hybrid_serve.models.loader"):
        load_model(moe_pair[1])
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1 and "model.visual" in lines[0] and "mtp" in lines[0]


def test_make_model_cli_writes_the_multimodal_layout(tmp_path):
    cli_main(["make-model", "--preset", "tiny-qwen3.5", "--out", str(tmp_path), "--multimodal"])
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5" and raw["text_config"]["model_type"] == "qwen3_5_text"
    assert read_config(tmp_path).weight_prefix == "model.language_model."


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("model", ["dense", "moe-multimodal"])
def test_engine_greedy_parity_with_radix_cache(dense, moe_pair, model, strategy):
    judge_path, served = (dense, dense) if model == "dense" else moe_pair
    gen = torch.Generator().manual_seed(8)
    shared = torch.randint(3, 2048, (140,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 2048, (n,), generator=gen).tolist() for n in (3, 30, 70)]
    hf = AutoModelForCausalLM.from_pretrained(judge_path, dtype=torch.float32).eval()
    expected = hf_greedy(hf, prompts, GREEDY["max_new_tokens"])
    engine = Engine(
        str(served),
        max_running_requests=8,
        max_total_tokens=4096,
        mamba_scheduler_strategy=strategy,
        mamba_track_interval=4,
    )
    first = engine.generate(prompts, GREEDY)
    assert [o["output_ids"] for o in first] == expected
    # Each prompt continued by half its answer: served from the cached prompt's state (every
    # strategy stores one there), it must go on with the other half.
    follow = [p + e[:5] for p, e in zip(prompts, expected, strict=True)]
    again = engine.generate(follow, {**GREEDY, "max_new_tokens": 5})
    assert [o["output_ids"] for o in again] == [e[5:] for e in expected]
    assert all(o["meta_info"]["cached_tokens"] >= 128 for o in again), [
        o["meta_info"]["cached_tokens"] for o in again
    ]
    assert engine.leak_report() == []
