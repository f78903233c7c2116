"""Block-FP8 checkpoints: the block arithmetic, the strict layout checks, and parity with the
bf16 checkpoint of the same dequantized weights (identical parameters, logits and tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybrid_serve.make_model.fp8_writer import quantize
from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.models.fp8 import E4M3, Fp8Config, dequantize, scale_shape
from hybrid_serve.models.loader import load_model
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.scheduler.engine import Engine
from hybrid_serve.scheduler.model_runner import DecodeInput, ExtendInput, ModelRunner, RunnerConfig
from tests.models.fp8_twin import write_dequantized

BLOCK = (128, 128)


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny preset in block-FP8 and its bf16 dequantized twin."""
    root = tmp_path_factory.mktemp("fp8")
    fp8 = write_checkpoint(
        root / "fp8", preset_config("tiny"), seed=5, dtype=torch.bfloat16, fp8_block=BLOCK
    )
    return fp8, write_dequantized(fp8, root / "twin")


def test_dequantize_broadcasts_each_scale_over_its_block_with_short_tails() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 70, 45, generator=gen)
    q, s = quantize(w, (32, 16))
    assert q.dtype == E4M3 and s.dtype == torch.float32
    assert s.shape == scale_shape(w.shape, (32, 16)) == (3, 3, 3)
    out = dequantize(q, s, (32, 16))
    for e in range(3):  # block by block, tails included
        for i in range(3):
            for j in range(3):
                rows, cols = slice(32 * i, 32 * (i + 1)), slice(16 * j, 16 * (j + 1))
                want = q[e, rows, cols].float() * s[e, i, j]
                assert torch.equal(out[e, rows, cols], want)
                amax = w[e, rows, cols].abs().max()
                assert torch.allclose(s[e, i, j], amax / 448)
    assert ((out - w).abs() <= w.abs() / 16 + 1e-3 * s.max()).all()  # e4m3: 3 mantissa bits


def test_quantize_round_trips_e4m3_values_and_zero_blocks() -> None:
    values = torch.tensor([448.0, -448.0, 1.0, 0.5, -0.015625, 0.0, 240.0, 3.5])
    w = torch.zeros(4, 200)
    w[1, :8] = values * 0.25
    q, s = quantize(w, BLOCK)
    assert s.tolist() == [[0.25, 1.0]]  # a block of zeros gets scale 1
    assert torch.equal(dequantize(q, s, BLOCK), w)


def test_ignore_list_matches_whole_name_components() -> None:
    cfg = Fp8Config(
        BLOCK, ("lm_head", "mlp.gate", "model.layers.0.linear_attn.in_proj_ba", "*.conv1d")
    )
    assert cfg.ignores("lm_head") and cfg.ignores("model.layers.3.mlp.gate")
    assert cfg.ignores("model.language_model.layers.1.mlp.gate")
    assert cfg.ignores("model.layers.0.linear_attn.in_proj_ba")
    assert cfg.ignores("model.layers.7.linear_attn.conv1d")
    assert not cfg.ignores("model.layers.3.mlp.gate_proj")
    assert not cfg.ignores("model.layers.10.linear_attn.in_proj_ba")
    assert not cfg.ignores("model.layers.3.mlp.shared_expert.up_proj")


@pytest.mark.parametrize(
    ("qc", "message"),
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt"),
        (
            {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [1, 1]},
            "activation_scheme",
        ),
    ],
)
def test_unsupported_quantization_configs_are_named(qc: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Fp8Config.from_dict(qc)


def test_preset_writes_the_official_layout(fp8_pair) -> None:
    fp8, twin = fp8_pair
    config = json.loads((fp8 / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == list(BLOCK)
    assert qc["fmt"] == "e4m3" and qc["activation_scheme"] == "dynamic"
    assert config["torch_dtype"] == "bfloat16"
    kept = set(qc["modules_to_not_convert"])
    assert {"lm_head", "model.embed_tokens", "model.layers.0.linear_attn.in_proj_ba"} <= kept
    assert {"model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate"} <= kept
    tensors = load_file(str(fp8 / "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        quantized = t.dtype == E4M3
        assert quantized == (name + "_scale_inv" in tensors), name
        assert quantized != (name.removesuffix(".weight") in kept), name
    assert tensors["model.layers.3.self_attn.q_proj.weight_scale_inv"].shape == (2, 1)
    assert "quantization_config" not in json.loads((twin / "config.json").read_text())
    assert not any(t.dtype == E4M3 for t in load_file(str(twin / "model.safetensors")).values())


def test_fp8_preset_files_are_deterministic(tmp_path, fp8_pair) -> None:
    again = write_checkpoint(
        tmp_path, preset_config("tiny"), seed=5, dtype=torch.bfloat16, fp8_block=BLOCK
    )
    for name in ("model.safetensors", "config.json"):
        assert (again / name).read_bytes() == (fp8_pair[0] / name).read_bytes()


def test_fp8_loads_the_dequantized_weights_close_to_the_original(tmp_path, fp8_pair) -> None:
    fp8, twin = fp8_pair
    model, ref = load_model(fp8, "bfloat16"), load_model(twin, "bfloat16")
    params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
    assert params.keys() == ref_params.keys()
    for name, p in params.items():
        assert p.dtype == ref_params[name].dtype and torch.equal(p, ref_params[name]), name
    plain = write_checkpoint(tmp_path, preset_config("tiny"), seed=5, dtype=torch.bfloat16)
    orig = dict(load_model(plain, "bfloat16").named_parameters())
    w, w0 = (
        params["model.layers.3.self_attn.o_proj.weight"],
        orig["model.layers.3.self_attn.o_proj.weight"],
    )
    assert not torch.equal(w, w0) and ((w - w0).float().norm() / w0.float().norm()) < 0.05


def _greedy(path: Path, prompts: list[list[int]], device: str = "cpu") -> list[list[int]]:
    engine = Engine(
        str(path),
        device=device,
        max_running_requests=4,
        max_total_tokens=1024,
        max_context_len=256,
    )
    try:
        outs = engine.generate(
            prompts, {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        )
        return [o["output_ids"] for o in outs]
    finally:
        engine.shutdown()


def test_fp8_serves_the_tokens_of_its_bf16_twin(fp8_pair) -> None:
    fp8, twin = fp8_pair
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in (5, 17, 40)]
    tokens = _greedy(fp8, prompts)
    assert tokens == _greedy(twin, prompts)
    assert all(len(t) == 12 for t in tokens) and len({tuple(t) for t in tokens}) == 3


def _logits(path: Path, prompt: list[int], device: str = "cpu") -> torch.Tensor:
    """Prefill logits of `prompt` then one decode step's, at the checkpoint's dtype (bf16)."""
    runner = ModelRunner(
        load_model(path, device=device),
        RunnerConfig(
            max_running_requests=2, max_total_tokens=256, max_context_len=128, device=device
        ),
    )
    req, slot = runner.req_pool.alloc(1)[0], int(runner.mamba_pool.alloc(1)[0])
    loc = runner.alloc_kv(req, 0, len(prompt))
    first = runner.forward(runner.build_prefill([ExtendInput(req, slot, 0, prompt)], [loc]))
    out_loc = runner.alloc_kv(req, len(prompt), 1)
    step = runner.forward(runner.build_decode([DecodeInput(req, slot, len(prompt), 7)], out_loc))
    return torch.cat([first, step])


def test_fp8_logits_equal_the_twins(fp8_pair) -> None:
    fp8, twin = fp8_pair
    prompt = list(range(3, 40))
    got, want = _logits(fp8, prompt), _logits(twin, prompt)
    assert got.shape == want.shape and torch.equal(got, want)
    assert torch.isfinite(got).all() and got.std() > 0


@pytest.mark.parametrize(
    ("kwargs", "fused"),
    [({"multimodal": True}, False), ({"expert_layout": "fused"}, True)],
)
def test_fp8_qwen3_5_wrapper_and_fused_experts_load_like_their_twins(
    tmp_path, kwargs, fused
) -> None:
    fp8 = write_checkpoint(
        tmp_path / "fp8",
        preset_config("tiny-qwen3.5-moe"),
        dtype=torch.bfloat16,
        fp8_block=(32, 64),
        **kwargs,
    )
    names = load_file(str(fp8 / "model.safetensors")).keys()
    layer = "model.language_model.layers.0" if kwargs.get("multimodal") else "model.layers.0"
    assert (f"{layer}.mlp.experts.gate_up_proj_scale_inv" in names) == fused
    assert f"{layer}.linear_attn.in_proj_qkv.weight_scale_inv" in names
    assert f"{layer}.linear_attn.in_proj_b.weight_scale_inv" not in names
    twin = write_dequantized(fp8, tmp_path / "twin")
    a, b = load_model(fp8, "bfloat16"), load_model(twin, "bfloat16")
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y), name


def test_tensor_parallel_shards_of_fp8_equal_the_twins(fp8_pair) -> None:
    fp8, twin = fp8_pair
    for rank in range(2):
        tp = ParallelContext(rank, 2)
        a, b = load_model(fp8, "bfloat16", tp=tp), load_model(twin, "bfloat16", tp=tp)
        for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
            assert torch.equal(x, y), name


@pytest.mark.gpu
def test_fp8_dequantized_on_cuda_equals_its_bf16_twin(fp8_pair) -> None:
    """With `fp8_resident=False` CUDA dequantizes at load as the CPU does: the twin's numbers."""
    fp8, twin = fp8_pair
    a = load_model(fp8, "bfloat16", "cuda", fp8_resident=False)
    b = load_model(twin, "bfloat16", "cuda")
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        assert x.is_cuda and torch.equal(x, y), name


@pytest.mark.gpu
def test_fp8_on_cuda_stays_fp8_and_serves_its_bf16_twins_tokens(fp8_pair) -> None:
    """By default CUDA keeps the FP8 matrices resident (the Triton block GEMM and FP8 experts):
    each holds the twin's numbers before their rounding to bf16; the logits are the twin's
    within bf16 rounding, and so are the greedy tokens (no near ties in these prompts)."""
    from hybrid_serve.kernels.fp8 import dequantize, is_fp8

    fp8, twin = fp8_pair
    a, b = load_model(fp8, "bfloat16", "cuda"), load_model(twin, "bfloat16", "cuda")
    kept = 0
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        kept += is_fp8(x)
        got = dequantize(x, torch.bfloat16) if is_fp8(x) else x
        assert x.is_cuda and torch.equal(got, y), name
    assert kept > 0 and a.ops.linear.__module__ == "hybrid_serve.kernels.fp8_gemm_triton"
    del a, b
    got, want = _logits(fp8, list(range(3, 40)), "cuda"), _logits(twin, list(range(3, 40)), "cuda")
    assert (got - want).abs().max().item() < 0.05 * want.std().item()
    prompts = [list(range(3, 3 + n)) for n in (6, 30)]
    assert _greedy(fp8, prompts, "cuda") == _greedy(twin, prompts, "cuda")
