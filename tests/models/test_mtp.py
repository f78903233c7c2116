"""The multi-token-prediction head (`mtp.*`): presets write it (`make-model --mtp`), the strict
loader reads it (`load_model(mtp=True)`: float and block-FP8, per-expert and fused experts, the
multimodal wrapper, tensor-parallel shards, dummy weights, int8), and `mtp_hidden` equals an
independent reference: the head's input written here in plain torch from the checkpoint tensors,
its decoder layer and final norm run by transformers as a one-layer model, on an extend batch of
two requests and on the decode rows that continue them (fp32, atol 1e-5)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hybrid_serve.kernels.quant import is_quantized
from hybrid_serve.make_model.presets import preset_config, write_checkpoint, write_config_only
from hybrid_serve.models.fp8 import E4M3, dequantize
from hybrid_serve.models.loader import load_model
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.registry import read_config
from hybrid_serve.server.cli import main as cli_main
from tests.tp_harness import run_ranks
from tests.tp_workers import mtp_outputs

ATOL = 1e-5
BLOCK = (128, 128)
LENS = (5, 3)  # an extend batch of two requests, then one decode row for each


def _with_mtp(name: str) -> dict:
    return {**preset_config(name), "mtp_num_hidden_layers": 1}


@pytest.fixture(scope="module")
def next_moe(tmp_path_factory) -> Path:
    """The tiny Qwen3-Next preset (MoE, per-expert layout) with its head."""
    return write_checkpoint(tmp_path_factory.mktemp("next"), _with_mtp("tiny"), seed=3)


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    """The dense Qwen3.5 preset with its head, written through the CLI."""
    out = tmp_path_factory.mktemp("q35") / "m"
    cli_main(["make-model", "--preset", "tiny-qwen3.5", "--mtp", "--out", str(out)])
    return out


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory) -> Path:
    """The Qwen3.5 MoE preset with its head in the multimodal release layout, fused experts."""
    return write_checkpoint(
        tmp_path_factory.mktemp("q35mm"),
        _with_mtp("tiny-qwen3.5-moe"),
        seed=4,
        expert_layout="fused",
        multimodal=True,
    )


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _expected(t: dict[str, torch.Tensor], pname: str, num_experts: int) -> torch.Tensor:
    """Head parameter `pname` assembled from checkpoint tensors `t` (either expert layout)."""
    if pname in t:
        return t[pname]
    base = pname.rsplit(".", 1)[0]  # mtp.layers.0.mlp.experts
    if pname.endswith("gate_up_proj"):
        return torch.stack(
            [
                torch.cat([t[f"{base}.{e}.gate_proj.weight"], t[f"{base}.{e}.up_proj.weight"]])
                for e in range(num_experts)
            ]
        )
    return torch.stack([t[f"{base}.{e}.down_proj.weight"] for e in range(num_experts)])


def _assert_head_is_the_checkpoints(model, t: dict[str, torch.Tensor]) -> None:
    head = dict(model.mtp.named_parameters(prefix="mtp"))
    used = set()
    for pname, param in head.items():
        want = _expected(t, pname, model.config.num_experts)
        assert torch.equal(param.data, want.to(param.dtype)), pname
        used |= {n for n in t if n == pname or n.startswith(pname.rsplit(".", 1)[0] + ".")}
    assert used == {n for n in t if n.startswith("mtp.")}


@pytest.mark.parametrize("which", ["next_moe", "dense", "wrapped"])
def test_every_head_parameter_is_its_checkpoint_tensor(which, request) -> None:
    path = request.getfixturevalue(which)
    model = load_model(path, dtype="float32", mtp=True)
    assert model.num_kv_layers == len(model.config.full_attention_layers) + 1
    _assert_head_is_the_checkpoints(model, _tensors(path))


def test_the_head_leaves_the_rest_of_the_checkpoint_unchanged(tmp_path, next_moe) -> None:
    plain = _tensors(write_checkpoint(tmp_path, preset_config("tiny"), seed=3))
    with_head = _tensors(next_moe)
    assert set(with_head) - set(plain) == {n for n in with_head if n.startswith("mtp.")}
    assert all(torch.equal(plain[n], with_head[n]) for n in plain)


def test_multimodal_layout_holds_the_complete_head_at_top_level(wrapped) -> None:
    raw = json.loads((wrapped / "config.json").read_text())
    assert raw["text_config"]["mtp_num_hidden_layers"] == 1
    names = set(_tensors(wrapped))
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in names  # fused, as the main layers
    assert not any(n.startswith(("model.language_model.mtp", "model.mtp")) for n in names)


def test_missing_head_tensor_is_named_only_when_the_head_is_loaded(tmp_path, next_moe) -> None:
    victim = "mtp.layers.0.mlp.experts.1.up_proj.weight"
    tensors = _tensors(next_moe)
    tensors.pop(victim)
    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_text((next_moe / name).read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"missing tensor {victim.replace('.', '[.]')}"):
        load_model(tmp_path, mtp=True)
    assert load_model(tmp_path).mtp is None


def test_without_mtp_the_head_is_skipped_in_one_line(next_moe, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="hybrid_serve.models.loader"):
        model = load_model(next_moe)
    assert model.mtp is None and model.num_kv_layers == 2
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1 and "(mtp)" in lines[0]


def test_a_checkpoint_without_a_head_refuses_mtp(tmp_path) -> None:
    path = write_checkpoint(tmp_path, preset_config("tiny-qwen3.5"), multimodal=True)
    with pytest.raises(ValueError, match="no MTP head"):  # the stand-in is no head
        load_model(path, mtp=True)


# ---- the reference -----------------------------------------------------------------------------
def _rms0(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm in fp32: x / rms(x) * (1 + w)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.float())


def _hf_layer(path: Path, t: dict[str, torch.Tensor], out: Path):
    """transformers' model of one full-attention layer holding the head's layer (and mtp.norm
    as its final norm): what `norm(layer(x))` is."""
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(num_hidden_layers=1, layer_types=["full_attention"])
    cfg.pop("mtp_num_hidden_layers")
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    one = {
        f"model.{n.removeprefix('mtp.')}": w for n, w in t.items() if n.startswith("mtp.layers.")
    }
    one |= {
        "model.embed_tokens.weight": t["model.embed_tokens.weight"],
        "model.norm.weight": t["mtp.norm.weight"],
        "lm_head.weight": t["lm_head.weight"],
    }
    save_file(one, str(out / "model.safetensors"))
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def _reference(hf, t, eps: float, ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """The head's y for one request's rows (positions 0..n-1)."""
    e = _rms0(t["model.embed_tokens.weight"][ids], t["mtp.pre_fc_norm_embedding.weight"], eps)
    h = _rms0(hidden, t["mtp.pre_fc_norm_hidden.weight"], eps)
    x = torch.cat([e, h], dim=-1) @ t["mtp.fc.weight"].float().T
    with torch.no_grad():
        out = hf.model(inputs_embeds=x[None], position_ids=torch.arange(len(ids))[None])
    return out.last_hidden_state[0]


@pytest.mark.parametrize("which", ["next_moe", "dense"])
def test_mtp_hidden_equals_the_reference_on_extend_then_decode(which, request, tmp_path) -> None:
    path = request.getfixturevalue(which)
    out = mtp_outputs(ParallelContext(), str(path), LENS, 0)
    assert out["kv_layers"] == len(read_config(path).full_attention_layers) + 1
    assert out["kv_written"] == [False] * (out["kv_layers"] - 1) + [True]
    t = _tensors(path)
    hf = _hf_layer(path, t, tmp_path / "one-layer")
    eps = read_config(path).rms_norm_eps
    want = [_reference(hf, t, eps, i, h) for i, h in zip(out["ids"], out["hidden"], strict=True)]
    extend = torch.cat([w[:n] for w, n in zip(want, LENS, strict=True)])
    decode = torch.stack([w[n] for w, n in zip(want, LENS, strict=True)])
    torch.testing.assert_close(out["extend"], extend, atol=ATOL, rtol=0)
    torch.testing.assert_close(out["decode"], decode, atol=ATOL, rtol=0)


def test_tensor_parallel_head_equals_one_rank(next_moe) -> None:
    """Two ranks (gloo): the head's layer sharded like a main layer, fc and norms whole."""
    one = mtp_outputs(ParallelContext(), str(next_moe), LENS, 1)
    two = run_ranks(mtp_outputs, 2, str(next_moe), LENS, 1)
    for key in ("extend", "decode"):
        torch.testing.assert_close(two[key], one[key], atol=1e-5, rtol=0)
    assert two["head_bytes"] < 0.6 * one["head_bytes"]  # fc is whole: the layer dominates


def test_tensor_parallel_rank_reads_its_shard_of_the_head(next_moe) -> None:
    t = _tensors(next_moe)
    q = t["mtp.layers.0.self_attn.q_proj.weight"]
    down = _expected(t, "mtp.layers.0.mlp.experts.down_proj", 4)  # [E, hidden, I]
    for rank in (0, 1):
        model = load_model(next_moe, dtype="float32", tp=ParallelContext(rank, 2), mtp=True)
        head, layer = model.mtp, model.mtp.layers[0]
        assert torch.equal(head.fc.weight, t["mtp.fc.weight"])
        assert torch.equal(head.pre_fc_norm_hidden.weight, t["mtp.pre_fc_norm_hidden.weight"])
        rows, cols = q.shape[0] // 2, down.shape[2] // 2
        assert torch.equal(layer.self_attn.q_proj.weight, q[rank * rows : (rank + 1) * rows])
        assert torch.equal(layer.mlp.experts.down_proj, down[..., rank * cols : (rank + 1) * cols])


# ---- other layouts and load modes ---------------------------------------------------------------
def test_make_model_mtp_writes_the_head_into_the_config(dense) -> None:
    raw = json.loads((dense / "config.json").read_text())
    assert raw["mtp_num_hidden_layers"] == 1
    assert read_config(dense).mtp_num_hidden_layers == 1
    assert "mtp.layers.0.mlp.gate_proj.weight" in _tensors(dense)  # a dense preset's dense MLP


def test_main_and_head_expert_layouts_are_read_apart(tmp_path, wrapped) -> None:
    """Fused main experts with a per-expert head: each part's layout comes from its own names."""
    t = _tensors(wrapped)
    base = "mtp.layers.0.mlp.experts"
    gate_up, down = t.pop(f"{base}.gate_up_proj"), t.pop(f"{base}.down_proj")
    inter = down.shape[2]
    for e in range(gate_up.shape[0]):
        t[f"{base}.{e}.gate_proj.weight"] = gate_up[e, :inter].clone()
        t[f"{base}.{e}.up_proj.weight"] = gate_up[e, inter:].clone()
        t[f"{base}.{e}.down_proj.weight"] = down[e].clone()
    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_text((wrapped / name).read_text())
    save_file(t, str(tmp_path / "model.safetensors"))
    model = load_model(tmp_path, dtype="float32", mtp=True)
    assert torch.equal(model.mtp.layers[0].mlp.experts.gate_up_proj, gate_up)
    assert torch.equal(model.mtp.layers[0].mlp.experts.down_proj, down)


def test_block_fp8_head_loads_dequantized(tmp_path) -> None:
    """Our FP8 writer quantizes the head's layer like a main layer and keeps `mtp.fc` in bf16
    (as the Qwen3-Next FP8 release does); the loader serves the dequantized numbers."""
    path = write_checkpoint(
        tmp_path, _with_mtp("tiny"), seed=5, dtype=torch.bfloat16, fp8_block=BLOCK
    )
    t = _tensors(path)
    assert t["mtp.fc.weight"].dtype == torch.bfloat16
    for name in (
        "mtp.layers.0.self_attn.q_proj.weight",
        "mtp.layers.0.mlp.experts.2.up_proj.weight",
    ):
        assert t[name].dtype == E4M3 and f"{name}_scale_inv" in t
    ignored = json.loads((path / "config.json").read_text())["quantization_config"]
    assert {"mtp.fc", "mtp.layers.0.mlp.gate"} <= set(ignored["modules_to_not_convert"])
    deq = {
        n: dequantize(w, t[f"{n}_scale_inv"], BLOCK) if w.dtype == E4M3 else w.float()
        for n, w in t.items()
        if not n.endswith("_scale_inv")
    }
    _assert_head_is_the_checkpoints(load_model(path, dtype="float32", mtp=True), deq)
    assert load_model(path, dtype="float32").mtp is None  # FP8 head and scales skipped


def test_dummy_load_fills_the_head_after_the_model(tmp_path) -> None:
    write_config_only(tmp_path, _with_mtp("tiny"), dtype=torch.float32)
    model = load_model(tmp_path, dtype="float32", load_format="dummy", mtp=True)
    params = dict(model.named_parameters())
    plain = load_model(tmp_path, dtype="float32", load_format="dummy")
    assert all(torch.equal(p, params[n]) for n, p in plain.named_parameters())
    head = dict(model.mtp.named_parameters())
    assert all(p.abs().sum() > 0 for p in head.values())
    assert abs(head["fc.weight"].std().item() - 0.1) < 0.01
    assert head["norm.weight"].abs().mean() < 0.2  # zero-centred, like model.norm


def test_int8_quantizes_the_heads_matrices_but_not_its_routers(next_moe) -> None:
    model = load_model(next_moe, quantization="int8", mtp=True)
    head, layer = model.mtp, model.mtp.layers[0]
    for w in (head.fc.weight, layer.self_attn.o_proj.weight, layer.mlp.experts.gate_up_proj):
        assert is_quantized(w)
    assert not is_quantized(layer.mlp.gate.weight)
    assert not is_quantized(layer.mlp.shared_expert_gate.weight)
    exact = mtp_outputs(ParallelContext(), str(next_moe), LENS, 2)
    int8 = mtp_outputs(ParallelContext(), str(next_moe), LENS, 2, "int8")
    for key in ("extend", "decode"):  # the head runs on its int8 matrices: close, not equal
        err = (int8[key] - exact[key]).abs().max().item()
        assert 1e-4 < err < 0.1, (key, err)
