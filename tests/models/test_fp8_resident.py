"""Block-FP8 checkpoints kept in FP8 (`models.fp8_resident`): which matrices stay FP8, that they
hold exactly the numbers the dequantize-at-load path holds, under tensor parallelism and both
expert layouts, and that the model serves them (the torch references, and the Triton kernels in
the interpreter at the tiny preset's sizes).

On the CPU the loader dequantizes by default; `fp8_resident=True` forces the resident format so
that the CUDA path's loading and products are tested here. The tiny preset's widths (hidden 128,
head dims 32, expert width 64) are written in 32 x 32 blocks, so that every kind of placement
occurs: whole matrices, the gate and up halves of an expert stack, the regrouped Qwen3-Next
in_proj_qkvz, a rank's share of rows or columns.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybrid_serve.kernels.fp8 import Fp8Weight, dequantize, is_fp8, weight_bytes
from hybrid_serve.make_model.presets import preset_config, write_checkpoint, write_config_only
from hybrid_serve.models.fp8_resident import block_target
from hybrid_serve.models.loader import fp8_device, load_model
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.weight_map import Target
from hybrid_serve.scheduler.pool_sizing import pool_bytes
from tests.models.test_triton_model import greedy

BLOCK = (32, 32)


@pytest.fixture(scope="module")
def fp8_tiny(tmp_path_factory) -> Path:
    return write_checkpoint(
        tmp_path_factory.mktemp("fp8-32"),
        preset_config("tiny"),
        seed=5,
        dtype=torch.bfloat16,
        fp8_block=BLOCK,
    )


def resident_names(model) -> set[str]:
    return {n for n, p in model.named_parameters() if is_fp8(p)}


def assert_same_numbers(resident, dequantized) -> None:
    """Every parameter of `resident` (FP8 ones dequantized) equals `dequantized`'s."""
    params = dict(dequantized.named_parameters())
    for name, p in resident.named_parameters():
        got = dequantize(p) if is_fp8(p) else p.float()
        assert torch.equal(got, params[name].float()), name


def test_placements_land_on_whole_blocks_or_not_at_all() -> None:
    shape = (256, 96)
    assert block_target(shape, Target("w"), None, BLOCK, shape).index == ()
    half = block_target(shape, Target("w", (slice(64, 128),)), None, BLOCK, (192, 96))
    assert half.index == (slice(2, 4),)
    assert block_target(shape, Target("w", (slice(48, 128),)), None, BLOCK, (192, 96)) is None
    expert = block_target((50, 96), Target("w", (3, slice(50, 100))), None, BLOCK, (8, 100, 96))
    assert expert is None  # starts inside a block
    tail = block_target((50, 96), Target("w", (3, slice(0, 50))), None, BLOCK, (8, 50, 96))
    assert tail.index == (3, slice(0, 2))  # a short last block is whole
    from hybrid_serve.models.shard_loader import Shard

    cols = block_target(shape, Target("w"), Shard(1, ((32, 96),)), BLOCK, (256, 64))
    assert cols.shard == Shard(1, ((1, 3),))
    assert block_target(shape, Target("w"), Shard(1, ((16, 64),)), BLOCK, (256, 48)) is None

    def swap(w: torch.Tensor) -> torch.Tensor:  # the second 64 rows first
        return torch.cat([w[64:128], w[:64], w[128:]])

    moved = block_target(shape, Target("w", transform=swap), None, BLOCK, shape)
    assert moved.order.tolist() == [2, 3, 0, 1, 4, 5, 6, 7]
    assert (
        block_target(shape, Target("w", transform=lambda w: w.flip(0)), None, BLOCK, shape) is None
    )


def test_resident_matrices_hold_the_dequantized_numbers(fp8_tiny, caplog) -> None:
    resident = load_model(fp8_tiny, "float32", fp8_resident=False)
    with caplog.at_level("INFO", logger="hybrid_serve.models.loader"):
        kept = load_model(fp8_tiny, "float32", fp8_resident=True)
    names = resident_names(kept)
    leaves = {n.split(".", 3)[-1] for n in names}
    assert leaves == {
        "linear_attn.in_proj_qkvz.weight",  # regrouped per key head: whole blocks move
        "linear_attn.out_proj.weight",
        "mlp.experts.gate_up_proj",  # per-expert gate and up rows into one stack
        "mlp.experts.down_proj",
        "mlp.shared_expert.gate_proj.weight",
        "mlp.shared_expert.up_proj.weight",
        "mlp.shared_expert.down_proj.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
    }
    assert "matrices stay block-FP8" in caplog.text
    assert not resident_names(resident)  # what the CPU does by default
    assert not resident_names(load_model(fp8_tiny, "float32"))
    assert_same_numbers(kept, resident)
    w = dict(kept.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"]
    assert w.dtype == torch.float8_e4m3fn and w.scale_inv.shape == (4, 4, 4)
    assert weight_bytes(w) == w.numel() + 4 * 4 * 4 * 4


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_shards_stay_fp8(fp8_tiny, rank) -> None:
    """A rank's rows (q/k/v, gate/up) and columns (o_proj, out_proj, down) on whole blocks."""
    tp = ParallelContext(rank, 2)
    kept = load_model(fp8_tiny, "float32", tp=tp, fp8_resident=True)
    names = {n.split(".", 3)[-1] for n in resident_names(kept)}
    assert {"self_attn.o_proj.weight", "mlp.experts.down_proj", "mlp.experts.gate_up_proj"} <= names
    assert_same_numbers(kept, load_model(fp8_tiny, "float32", tp=tp))


def test_fused_expert_layout_and_qwen3_5_projections(tmp_path) -> None:
    path = write_checkpoint(
        tmp_path,
        preset_config("tiny-qwen3.5-moe"),
        dtype=torch.bfloat16,
        fp8_block=(32, 64),
        expert_layout="fused",
    )
    for tp in (None, ParallelContext(1, 2)):  # the rank's gate and up rows of the fused stack
        kept = load_model(path, "float32", tp=tp, fp8_resident=True)
        names = {n.split(".", 3)[-1] for n in resident_names(kept)}
        assert {"mlp.experts.gate_up_proj", "linear_attn.in_proj_qkvz.weight"} <= names
        assert_same_numbers(kept, load_model(path, "float32", tp=tp))


def test_resident_model_serves_its_dequantized_twins_numbers(fp8_tiny, kernels_mode) -> None:
    """The torch references widen each FP8 matrix per product: the same logits up to the
    experts' summation order (per-expert products in place of one grouped GEMM)."""
    kernels_mode("torch")
    prompts = [list(range(3, 24)), [7, 8, 9]]
    kept = load_model(fp8_tiny, "float32", fp8_resident=True)
    tokens, logits = greedy(kept, prompts, "cpu")
    ref_tokens, ref_logits = greedy(load_model(fp8_tiny, "float32"), prompts, "cpu")
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() < 1e-4


def test_triton_kernels_serve_resident_fp8(fp8_tiny, triton_device, kernels_mode) -> None:
    """Every FP8 product through the Triton block GEMM and the FP8 fused MoE (the interpreter
    on CPU, fp32 activations) against the torch references on the same resident model."""
    dev = str(triton_device)
    kernels_mode("torch")
    kept = load_model(fp8_tiny, "float32", device=dev, fp8_resident=True)
    prompts = [list(range(3, 24)), [7, 8, 9]]
    ref_tokens, ref_logits = greedy(kept, prompts, dev)
    kernels_mode("triton", kept)
    assert kept.ops.linear.__module__ == "hybrid_serve.kernels.fp8_gemm_triton"
    tokens, logits = greedy(kept, prompts, dev)
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() < 1e-3


def test_dummy_load_keeps_the_configs_fp8_matrices(tmp_path, fp8_tiny) -> None:
    """A config-only directory of the FP8 form (`make-model --config-only --fp8`): the
    quantization_config the FP8 checkpoint has, and random e4m3 matrices where its ignore list
    does not name them, counted at one byte (plus scales) by the pool sizing."""
    write_config_only(tmp_path, preset_config("tiny"), fp8_block=BLOCK)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc == json.loads((fp8_tiny / "config.json").read_text())["quantization_config"]
    dense = load_model(tmp_path, "bfloat16", load_format="dummy", fp8_resident=False)
    model = load_model(tmp_path, "bfloat16", load_format="dummy", fp8_resident=True)
    names = resident_names(model)
    assert any("experts.gate_up_proj" in n for n in names)
    assert not any(k in n for n in names for k in ("lm_head", "in_proj_ba", "mlp.gate."))
    for name, p in model.named_parameters():
        if name in names:
            w = dequantize(p)
            assert torch.isfinite(w).all() and 0.05 < w.std().item() < 0.2, name
    fp8_bytes = sum(weight_bytes(p) for n, p in model.named_parameters() if n in names)
    saved = sum(p.numel() for n, p in dense.named_parameters() if n in names)  # bf16: 2 B
    assert pool_bytes(model).weights == pool_bytes(dense).weights - 2 * saved + fp8_bytes


def test_fp8_stays_off_without_cuda_and_triton() -> None:
    from hybrid_serve.kernels import reference_set

    assert not fp8_device("cpu", reference_set())
    assert isinstance(Fp8Weight, type)


@pytest.mark.gpu
def test_dummy_fp8_config_stays_fp8_on_cuda_by_default(tmp_path) -> None:
    """`--load-format dummy` of an FP8 config on CUDA (what gpu_scale measures): FP8 matrices
    without asking, the Triton products, finite logits."""
    write_config_only(tmp_path, preset_config("tiny"), fp8_block=BLOCK)
    model = load_model(tmp_path, "bfloat16", "cuda", load_format="dummy")
    assert (
        resident_names(model)
        and model.ops.linear.__module__ == "hybrid_serve.kernels.fp8_gemm_triton"
    )
    tokens, logits = greedy(model, [list(range(3, 24)), [7, 8, 9]], "cuda")
    assert torch.isfinite(logits).all() and all(len(t) == 3 for t in tokens)
