"""Ling-3 (`bailing_hybrid`) from a block-FP8 checkpoint in inclusionAI/Ling-3.0-flash-fp8's
layout (`make_model.bailing_hybrid_preset.fp8_ignored`), its MTP layer included: what
`make-model --fp8` writes, the strict loader's reading of it, and parity with the bf16 twin of
the dequantized weights (`tests.models.fp8_twin`): identical parameters, main-model logits and
MTP outputs, at one rank and at two; two ranks' MTP outputs equal one rank's; and the matrices
kept in FP8 (the CUDA default, forced here on the CPU's torch references) serve the same
numbers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybrid_serve.make_model.fp8_writer import quantize
from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.models.fp8 import E4M3, Fp8Config
from hybrid_serve.models.loader import load_model
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.scheduler.model_runner import DecodeInput, ExtendInput, ModelRunner, RunnerConfig
from hybrid_serve.server.cli import main as cli_main
from tests.models.fp8_twin import write_dequantized
from tests.models.test_fp8_resident import assert_same_numbers, resident_names
from tests.models.test_triton_model import greedy
from tests.tp_harness import run_ranks
from tests.tp_workers import mtp_outputs

MTP = "model.layers.6."  # the tiny preset's MTP layer: 6 main layers, MLA at 2 and 5
IGNORED = ["lm_head", "b_proj", "2.attention.g_proj", "5.attention.g_proj", "6.attention.g_proj"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """`make-model --preset tiny-bailing-hybrid --fp8` and its bf16 dequantized twin."""
    root = tmp_path_factory.mktemp("ling3fp8")
    fp8 = root / "fp8"
    cli_main(
        ["make-model", "--preset", "tiny-bailing-hybrid", "--fp8", "--seed", "3", "--out", str(fp8)]
    )
    return fp8, write_dequantized(fp8, root / "twin")


def _expected_fp8(name: str, t: torch.Tensor) -> bool:
    """The release's rule, spelled out here: every 2-d linear or expert matrix is FP8 but the
    embedding, the LM head, the routers, KDA's beta projection and the MLA head gates."""
    if t.dim() != 2 or not name.endswith(".weight"):
        return False
    if name in ("model.word_embeddings.weight", "lm_head.weight"):
        return False
    if name.endswith((".mlp.gate.weight", ".attention.b_proj.weight")):
        return False
    layer = int(name.split(".")[2])
    return not (name.endswith(".attention.g_proj.weight") and layer in (2, 5, 6))


def test_make_model_writes_the_releases_fp8_layout(pair) -> None:
    fp8, twin = pair
    qc = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert qc == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": IGNORED,
    }
    tensors = load_file(str(fp8 / "model.safetensors"))
    plain = load_file(str(twin / "model.safetensors"))
    assert set(tensors) - set(plain) == {n for n in tensors if n.endswith("_scale_inv")}
    fp8_names = {n for n, t in tensors.items() if t.dtype == E4M3}
    assert fp8_names == {n for n, t in plain.items() if _expected_fp8(n, t)}
    assert {n + "_scale_inv" for n in fp8_names} == set(tensors) - set(plain)
    for name in (  # the MTP layer's matrices are FP8 like a main MLA + MoE layer's
        "eh_proj",
        "attention.q_proj",
        "attention.kv_a_proj_with_mqa",
        "attention.kv_b_proj",
        "attention.dense",
        "mlp.experts.7.down_proj",
        "mlp.shared_experts.up_proj",
    ):
        assert MTP + name + ".weight" in fp8_names, name
    assert tensors[MTP + "eh_proj.weight_scale_inv"].shape == (1, 2)  # [128, 256]
    assert tensors[MTP + "attention.kv_b_proj.weight_scale_inv"].shape == (2, 1)  # [256, 32]
    assert tensors["model.layers.0.attention.q_conv1d.weight"].dtype == torch.bfloat16
    ignores = Fp8Config.from_dict(qc).ignores
    assert ignores("model.layers.3.attention.b_proj") and ignores(MTP + "attention.g_proj")
    assert not ignores("model.layers.3.attention.g_proj")  # KDA's output gate is FP8
    assert not any(ignores(n.removesuffix(".weight")) for n in fp8_names)


def _copy(src: Path, dst: Path, edit) -> Path:
    """Checkpoint `src` copied to `dst` with its tensors edited by `edit`."""
    dst.mkdir()
    for item in src.iterdir():
        if item.suffix != ".safetensors":
            (dst / item.name).write_bytes(item.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _fp8_b_proj(t: dict) -> None:
    name = "model.layers.0.attention.b_proj.weight"
    t[name], t[name + "_scale_inv"] = quantize(t[name], (128, 128))


def test_the_loader_reads_the_layout_strictly(pair, tmp_path) -> None:
    fp8, _ = pair
    model = load_model(fp8, mtp=True)
    assert model.mtp is not None and model.mtp.eh_proj.weight.dtype == torch.bfloat16
    assert load_model(fp8).mtp is None  # without the head its FP8 layer is skipped, scales too
    scale = MTP + "mlp.experts.3.down_proj.weight_scale_inv"
    gone = _copy(fp8, tmp_path / "gone", lambda t: t.pop(scale))
    with pytest.raises(ValueError, match=re.escape(f"missing tensor {scale}")):
        load_model(gone, mtp=True)
    wrong = _copy(fp8, tmp_path / "b_proj", _fp8_b_proj)
    message = "model.layers.0.attention.b_proj.weight is FP8 but modules_to_not_convert"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_model(wrong, mtp=True)


@pytest.mark.parametrize("size", [1, 2])
def test_parameters_equal_the_twins_with_the_mtp_layer(pair, size) -> None:
    """Every rank's parameters (the head's too) are the twin's, bit for bit; TP shards are cut
    from the whole dequantized tensor, so a rank's slice need not follow the 128-row blocks."""
    fp8, twin = pair
    for rank in range(size):
        tp = ParallelContext(rank, size)
        a = load_model(fp8, "bfloat16", tp=tp, mtp=True)
        b = load_model(twin, "bfloat16", tp=tp, mtp=True)
        pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
        assert pa.keys() == pb.keys() and any(n.startswith("mtp.") for n in pa)
        for name, x in pa.items():
            assert x.dtype == pb[name].dtype and torch.equal(x, pb[name]), name


def _logits(path: Path, prompt: list[int], device: str = "cpu") -> torch.Tensor:
    """Prefill logits of `prompt` then one decode step's, at the checkpoint's dtype (bf16)."""
    runner = ModelRunner(
        load_model(path, device=device, mtp=True),
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


def test_logits_and_mtp_outputs_equal_the_twins(pair, tmp_path) -> None:
    """On the CPU the FP8 weights are dequantized at load (fp32 products, then the serving
    dtype): the twin's numbers, so its logits (bf16) and its MTP layer's outputs (served in fp32,
    extend then decode rows: judged by the fp32 twin, since a dequantized weight need not be a
    bf16 number) exactly."""
    fp8, twin = pair
    got, want = _logits(fp8, list(range(3, 40))), _logits(twin, list(range(3, 40)))
    assert got.shape == want.shape and torch.equal(got, want)
    assert torch.isfinite(got).all() and got.std() > 0
    twin32 = write_dequantized(fp8, tmp_path / "twin32", torch.float32)
    a = mtp_outputs(ParallelContext(), str(fp8), (5, 3), 0)
    b = mtp_outputs(ParallelContext(), str(twin32), (5, 3), 0)
    for key in ("extend", "decode"):
        assert torch.equal(a[key], b[key]) and a[key].std() > 0, key


def test_tensor_parallel_mtp_outputs_equal_one_ranks(pair) -> None:
    """Two ranks (gloo) serving the FP8 checkpoint: the head's outputs are one rank's, within
    the summation-order bound the bf16 head's TP test uses."""
    fp8, _ = pair
    one = mtp_outputs(ParallelContext(), str(fp8), (5, 3), 1)
    two = run_ranks(mtp_outputs, 2, str(fp8), (5, 3), 1)
    for key in ("extend", "decode"):
        torch.testing.assert_close(two[key], one[key], atol=1e-5, rtol=0)
    assert two["head_bytes"] < one["head_bytes"]


@pytest.fixture(scope="module")
def fp8_32(tmp_path_factory) -> Path:
    """The preset in 32 x 32 blocks, so that every width lands blocks whole or splits them."""
    return write_checkpoint(
        tmp_path_factory.mktemp("ling3fp8-32"),
        preset_config("tiny-bailing-hybrid"),
        seed=5,
        dtype=torch.bfloat16,
        fp8_block=(32, 32),
    )


def test_resident_fp8_serves_the_dequantized_numbers(fp8_32, kernels_mode) -> None:
    """The CUDA default (`fp8_resident`), forced on the CPU with the torch references: the
    matrices stay FP8, the MTP layer's included, except MLA's kv_b_proj, which the absorbed decode
    reads as per-head blocks of numbers (`Linear.keep_float`, as under weight-only quantization);
    tokens, logits and the head's outputs are the dequantize-at-load model's."""
    kernels_mode("torch")
    kept = load_model(fp8_32, "float32", fp8_resident=True, mtp=True)
    names = resident_names(kept)
    head = {"mtp.eh_proj.weight", "mtp.self_attn.q_proj.weight", "mtp.mlp.experts.gate_up_proj"}
    assert head <= names
    assert "model.layers.3.self_attn.f_proj.weight" in names
    assert not any(n.endswith("kv_b_proj.weight") for n in names)
    plain = load_model(fp8_32, "float32", mtp=True)
    assert_same_numbers(kept, plain)
    prompts = [list(range(3, 24)), [7, 8, 9]]
    tokens, logits = greedy(kept, prompts, "cpu")
    ref_tokens, ref_logits = greedy(plain, prompts, "cpu")
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() < 1e-4
    a = mtp_outputs(ParallelContext(), str(fp8_32), (5, 3), 0, fp8_resident=True)
    b = mtp_outputs(ParallelContext(), str(fp8_32), (5, 3), 0)
    for key in ("extend", "decode"):
        torch.testing.assert_close(a[key], b[key], atol=1e-4, rtol=0)


def test_triton_kernels_serve_resident_fp8(fp8_32, triton_device, kernels_mode) -> None:
    """The FP8 products through the Triton block GEMM and the FP8 fused MoE (the interpreter on
    the CPU) against the torch references on the same resident model."""
    dev = str(triton_device)
    kernels_mode("torch")
    kept = load_model(fp8_32, "float32", device=dev, fp8_resident=True, mtp=True)
    prompts = [list(range(3, 17)), [7, 8, 9]]
    ref_tokens, ref_logits = greedy(kept, prompts, dev)
    kernels_mode("triton", kept)
    assert kept.ops.linear.__module__ == "hybrid_serve.kernels.fp8_gemm_triton"
    tokens, logits = greedy(kept, prompts, dev)
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() < 1e-3


@pytest.mark.gpu
def test_fp8_on_cuda_stays_fp8_and_gives_its_bf16_twins_logits(pair) -> None:
    """CUDA's default load keeps the FP8 matrices resident (the MTP layer's too): each holds the
    twin's numbers before their rounding to bf16, and the logits are the twin's within the
    bound of the other FP8 CUDA test (bf16 rounding of the products)."""
    from hybrid_serve.kernels.fp8 import dequantize, is_fp8

    fp8, twin = pair
    a = load_model(fp8, "bfloat16", "cuda", mtp=True)
    b = load_model(twin, "bfloat16", "cuda", mtp=True)
    kept = 0
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        kept += is_fp8(x)
        got = dequantize(x, torch.bfloat16) if is_fp8(x) else x
        assert x.is_cuda and torch.equal(got, y), name
    assert kept > 0 and is_fp8(a.mtp.eh_proj.weight)
    del a, b
    got, want = _logits(fp8, list(range(3, 40)), "cuda"), _logits(twin, list(range(3, 40)), "cuda")
    assert (got - want).abs().max().item() < 0.05 * want.std().item()
