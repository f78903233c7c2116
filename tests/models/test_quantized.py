"""`--quantization int8|int4` on CPU: which matrices are quantized, the served model against
transformers on the dequantized checkpoint (the same numbers in fp32) through the scheduler's
paths, and its distance from the fp32 model on the tiny preset."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kernels.quant import GROUP, dequantize, in_features, quantize
from make_model.presets import preset_config, write_checkpoint
from models.loader import load_model
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
def tiny(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), preset_config("tiny"), seed=3)


@pytest.fixture(scope="module", params=["int8", "int4"])
def ckpts(request, tiny, tmp_path_factory):
    """(the tiny preset, its twin whose matrices hold their quantized values in fp32, the
    method): per-row scales and groups along K are the same whether a checkpoint stores experts
    apart or stacked, and whatever the row order of a fused projection."""
    path, method = tiny, request.param
    twin = tmp_path_factory.mktemp("dequantized")
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, twin / f.name)
    for f in path.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if quantized_name(name, t):
                tensors[name] = dequantize(quantize(t, method)).to(t.dtype)
        save_file(tensors, twin / f.name)
    assert not json.loads((path / "config.json").read_text())["tie_word_embeddings"]
    return path, twin, method


def test_what_is_quantized(ckpts) -> None:
    path, _, method = ckpts
    model = load_model(path, dtype="float32", quantization=method)
    forms = {n: p.dtype for n, p in model.named_parameters()}
    quantized = {n for n, d in forms.items() if d in (torch.int8, torch.uint8)}
    assert "lm_head.weight" in quantized and any("experts.gate_up_proj" in n for n in quantized)
    assert any("shared_expert.down_proj" in n for n in quantized)
    assert any("in_proj_ba" in n for n in quantized)
    assert any("self_attn.o_proj" in n for n in quantized)
    for name, dtype in forms.items():
        if name not in quantized:
            assert dtype == torch.float32, name
            assert any(k in name for k in KEPT), name
    if method == "int4":  # int8 exactly where K does not divide into groups of 32
        for name, p in model.named_parameters():
            if name in quantized:
                assert (p.dtype == torch.uint8) == (in_features(p) % GROUP == 0), name
        assert torch.uint8 in {forms[n] for n in quantized}
    with pytest.raises(ValueError, match="quantization 'int3'"):
        load_model(path, quantization="int3")


# How far the logits may move from the fp32 model's, as a multiple of bf16's distance: random
# weights amplify every rounding through the layers (bf16 matrices already move the tiny
# preset's logits by ~20%). Per weight int8 rounds ~5x coarser than bf16, int4 ~40x.
BOUND_VS_BF16 = {"int8": 4.0, "int4": 8.0}


def test_logits_match_the_dequantized_model(ckpts) -> None:
    """Prefill and decode logits of the quantized model equal those of the fp32 model on the
    dequantized twin up to summation order; against the unquantized model they differ by at
    most BOUND_VS_BF16 times bf16's distance."""
    path, twin_path, method = ckpts
    prompt = torch.randint(3, 200, (33,), generator=torch.Generator().manual_seed(1)).tolist()
    quant, twin, full, bf16 = (
        logits(load_model(p, dtype=d, quantization=q), prompt)
        for p, d, q in ((path, "float32", method), (twin_path, "float32", None),
                        (path, "float32", None), (path, "bfloat16", None))
    )  # fmt: skip
    assert ((quant - twin).norm() / twin.norm()).item() < 1e-5
    rel, rel_bf16 = (((x - full).norm() / full.norm()).item() for x in (quant, bf16))
    assert 0 < rel < BOUND_VS_BF16[method] * rel_bf16, (rel, rel_bf16)


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
    path, twin, method = ckpts
    hf = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(4)
    base = torch.randint(3, 200, (40,), generator=gen).tolist()
    prompts = [base, base + [7, 8, 9], base[:25] + [11] * 6, [5, 6, 7]]
    expected = hf_greedy(hf, prompts, NEW)
    engine = Engine(str(path), quantization=method, max_running_requests=4,
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
    with pytest.raises(ValueError, match="--quantization must be one of int8, int4, got 'fp4'"):
        parse_serve_args(["--quantization", "fp4"])
    with pytest.raises(ValueError, match="--quantization int8 runs on the CPU only"):
        parse_serve_args(["--quantization", "int8", "--device", "cuda"])


def test_session_turns_equal_transformers_on_the_twin(ckpts) -> None:
    """A three-turn session (each turn prefilling only its new tokens over the held state)
    gives transformers' greedy tokens on the dequantized twin for the whole context."""
    path, twin, method = ckpts
    hf = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(8)
    engine = Engine(str(path), quantization=method, max_running_requests=4,
                    max_total_tokens=2048)  # fmt: skip
    sid = engine.open_session(capacity_of_str_len=1000)
    context: list[int] = []
    rid = None
    for n in (30, 7, 12):
        new = torch.randint(3, 200, (n,), generator=gen).tolist()
        out = engine.generate(new, GREEDY, session_params={"id": sid, "rid": rid})
        expected = hf_greedy(hf, [context + new], NEW)[0]
        assert out["output_ids"] == expected
        context += new + expected
        rid = out["meta_info"]["id"]
    assert engine.close_session(sid)
    assert engine.leak_report() == []


def test_fp8_checkpoint_quantizes_its_dequantized_weights(tmp_path) -> None:
    """From a block-FP8 checkpoint, each quantized matrix is the quantization of the matrix the
    FP8 loader serves (dequantized, then the serving dtype)."""
    path = write_checkpoint(tmp_path, preset_config("tiny"), seed=5, dtype=torch.bfloat16,
                            fp8_block=(32, 64))  # fmt: skip
    plain = dict(load_model(path, dtype="bfloat16").named_parameters())
    for method in ("int8", "int4"):
        model = load_model(path, dtype="bfloat16", quantization=method)
        for name, p in model.named_parameters():
            if p.dtype in (torch.int8, torch.uint8):
                assert torch.equal(p, quantize(plain[name].detach(), method)), name
