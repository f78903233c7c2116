"""`--quantization int8` on CPU: which matrices are quantized, the served model against
transformers on the dequantized checkpoint (the same numbers in fp32) through the scheduler's
paths, and its distance from the fp32 model on the tiny preset."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kernels.quant import dequantize, quantize_int8
from models.loader import load_model
from models.presets import preset_config, write_checkpoint
from scheduler.engine import Engine
from scheduler.model_runner import DecodeInput, ExtendInput, ModelRunner, RunnerConfig
from tests.hf_reference import hf_greedy
from tests.kernels.cpp_required import built  # noqa: F401  (skips without a compiler)

NEW = 10
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
KEPT = (
    "embed_tokens",
    "mlp.gate.weight",
    "shared_expert_gate",
    "norm",
    "conv1d",
    "A_log",
    "dt_bias",
)  # fmt: skip  (what the loader leaves unquantized)


def quantized_name(name: str, t: torch.Tensor) -> bool:
    return t.dim() >= 2 and not any(k in name for k in KEPT)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The tiny preset, and its twin whose matrices hold their int8 values (q * scale) in fp32:
    per-row scales are the same whether a checkpoint stores experts apart or stacked."""
    path = write_checkpoint(tmp_path_factory.mktemp("tiny"), preset_config("tiny"), seed=3)
    twin = tmp_path_factory.mktemp("dequantized")
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, twin / f.name)
    for f in path.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if quantized_name(name, t):
                tensors[name] = dequantize(quantize_int8(t)).to(t.dtype)
        save_file(tensors, twin / f.name)
    assert not json.loads((path / "config.json").read_text())["tie_word_embeddings"]
    return path, twin


def test_what_is_quantized(ckpts) -> None:
    model = load_model(ckpts[0], dtype="float32", quantization="int8")
    forms = {n: p.dtype for n, p in model.named_parameters()}
    int8 = {n for n, d in forms.items() if d == torch.int8}
    assert "lm_head.weight" in int8 and any("experts.gate_up_proj" in n for n in int8)
    assert any("shared_expert.down_proj" in n for n in int8)
    assert any("in_proj_ba" in n for n in int8) and any("self_attn.o_proj" in n for n in int8)
    for name, dtype in forms.items():
        assert (dtype == torch.int8) == (name in int8)
        if name not in int8:
            assert dtype == torch.float32, name
            assert any(k in name for k in KEPT), name
    with pytest.raises(ValueError, match="quantization 'int4'"):
        load_model(ckpts[0], quantization="int4")


def test_logits_match_the_dequantized_model(ckpts) -> None:
    """Prefill and decode logits of the int8 model equal those of the fp32 model on the
    dequantized twin up to summation order. Against the unquantized model they differ by the
    weights' rounding, which random weights amplify through the layers (bf16 matrices already
    move the tiny preset's logits by ~20%): the bound is at most 4x bf16's distance (measured
    1.8-2.6x; per weight int8 rounds ~5x coarser than bf16)."""
    prompt = torch.randint(3, 200, (33,), generator=torch.Generator().manual_seed(1)).tolist()
    int8, twin, full, bf16 = (
        logits(load_model(p, dtype=d, quantization=q), prompt)
        for p, d, q in ((ckpts[0], "float32", "int8"), (ckpts[1], "float32", None),
                        (ckpts[0], "float32", None), (ckpts[0], "bfloat16", None))
    )  # fmt: skip
    assert ((int8 - twin).norm() / twin.norm()).item() < 1e-5
    rel, rel_bf16 = (((x - full).norm() / full.norm()).item() for x in (int8, bf16))
    assert 0 < rel < 4 * rel_bf16, (rel, rel_bf16)


def logits(model, prompt: list[int]) -> torch.Tensor:
    """The prompt's last prefill logits, then one decode step's (token 5)."""
    runner = ModelRunner(model, RunnerConfig(max_running_requests=2, max_total_tokens=256))
    req, slot = runner.req_pool.alloc(1)[0], int(runner.mamba_pool.alloc(1)[0])
    loc = runner.alloc_kv(req, 0, len(prompt))
    first = runner.forward(runner.build_prefill([ExtendInput(req, slot, 0, prompt)], [loc]))
    out_loc = runner.alloc_kv(req, len(prompt), 1)
    step = runner.forward(runner.build_decode([DecodeInput(req, slot, len(prompt), 5)], out_loc))
    return torch.cat([first, step])


@pytest.mark.parametrize(
    "mode",
    [
        {"disable_radix_cache": True, "chunked_prefill_size": -1},
        {"mamba_scheduler_strategy": "no_buffer", "chunked_prefill_size": 16},
        {"mamba_scheduler_strategy": "extra_buffer", "chunked_prefill_size": 16},
    ],
)
def test_served_tokens_equal_transformers_on_the_twin(ckpts, mode) -> None:
    """Greedy tokens through the scheduler (prefix hits, chunked prefill, batched decode on the
    CPU decode plan) equal transformers' on the dequantized twin; the pools come back whole."""
    path, twin = ckpts
    hf = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(4)
    base = torch.randint(3, 200, (40,), generator=gen).tolist()
    prompts = [base, base + [7, 8, 9], base[:25] + [11] * 6, [5, 6, 7]]
    expected = hf_greedy(hf, prompts, NEW)
    engine = Engine(str(path), quantization="int8", max_running_requests=4,
                    max_total_tokens=2048, **mode)  # fmt: skip
    outs = [engine.generate(prompts[0], GREEDY)["output_ids"]]
    outs += [o["output_ids"] for o in engine.generate(prompts[1:], GREEDY)]
    assert outs == expected
    assert engine.leak_report() == []


def test_serve_flag() -> None:
    from server.args import parse_serve_args

    _, runner, _ = parse_serve_args(["--model-path", "/x", "--quantization", "int8"])
    assert runner.quantization == "int8"
    assert parse_serve_args(["--model-path", "/x"])[1].quantization is None
    with pytest.raises(ValueError, match="--quantization must be one of int8, got 'fp4'"):
        parse_serve_args(["--quantization", "fp4"])
    with pytest.raises(ValueError, match="--quantization int8 runs on the CPU only"):
        parse_serve_args(["--quantization", "int8", "--device", "cuda"])
