"""Ling-3's MTP layer (`models.bailing_hybrid_mtp`) on the tiny preset (`model.layers.{L}.*` as
released: the fusion, an MLA + MoE decoder layer, the output norm): the strict loader reads it in
place of skipping it, and `mtp_hidden` equals an independent reference: the input fusion written
here in plain torch from the checkpoint tensors, the decoder layer and the output norm run by
transformers as a one-layer `bailing_hybrid` model (transformers builds no head itself), on an
extend batch of two requests and on the decode rows that continue them (fp32, atol 1e-5). Two
tensor-parallel ranks give one rank's outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.models.loader import load_model
from hybrid_serve.models.parallel import ParallelContext
from tests.tp_harness import run_ranks
from tests.tp_workers import mtp_outputs

ATOL = 1e-5
LENS = (5, 3)
PRESET = "tiny-bailing-hybrid"
FUSION = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ling3"), preset_config(PRESET), seed=3)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _mtp(path: Path) -> str:
    """The checkpoint's prefix of the MTP layer: the decoder layer after the main ones."""
    return f"model.layers.{json.loads((path / 'config.json').read_text())['num_hidden_layers']}."


def test_the_layer_is_the_checkpoints_and_leaves_the_rest_unchanged(ckpt, tmp_path) -> None:
    t, mtp = _tensors(ckpt), _mtp(ckpt)
    model = load_model(ckpt, dtype="float32", mtp=True)
    assert model.num_kv_layers == 3  # the main model's two MLA layers, the head's one
    head = model.mtp
    assert torch.equal(head.eh_proj.weight, t[mtp + "eh_proj.weight"])
    assert torch.equal(head.final_layernorm.weight, t[mtp + "final_layernorm.weight"])
    assert torch.equal(head.self_attn.o_proj.weight, t[mtp + "attention.dense.weight"])
    assert torch.equal(head.mlp.gate.e_score_correction_bias, t[mtp + "mlp.gate.expert_bias"])
    up = torch.stack([t[f"{mtp}mlp.experts.{e}.up_proj.weight"] for e in range(8)])
    assert torch.equal(head.mlp.experts.gate_up_proj[:, up.shape[1] :], up)
    assert head.mlp.limit == head.mlp.shared_limit == 0.0  # the limit lists hold the main layers
    plain = _tensors(
        write_checkpoint(tmp_path, {**preset_config(PRESET), "num_nextn_predict_layers": 0}, seed=3)
    )
    assert set(t) - set(plain) == {n for n in t if n.startswith(mtp)}
    assert all(torch.equal(plain[n], t[n]) for n in plain)
    skipped = load_model(ckpt, dtype="float32")
    assert skipped.mtp is None and skipped.num_kv_layers == 2


def test_a_missing_layer_tensor_is_named(ckpt, tmp_path) -> None:
    t = _tensors(ckpt)
    victim = _mtp(ckpt) + "mlp.experts.3.down_proj.weight"
    t.pop(victim)
    (tmp_path / "m").mkdir()
    for name in ("config.json", "generation_config.json"):
        (tmp_path / "m" / name).write_text((ckpt / name).read_text())
    save_file(t, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match=victim.replace(".", r"\.")):
        load_model(tmp_path / "m", dtype="float32", mtp=True)
    assert load_model(tmp_path / "m", dtype="float32").mtp is None  # skipped without the head


def test_no_layer_or_two_are_refused_for_the_head_only(ckpt, tmp_path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    for n, match in ((0, "has no MTP layer"), (2, "num_nextn_predict_layers must be 1")):
        (tmp_path / str(n)).mkdir()
        (tmp_path / str(n) / "config.json").write_text(
            json.dumps({**cfg, "num_nextn_predict_layers": n})
        )
        with pytest.raises(ValueError, match=match):
            load_model(tmp_path / str(n), dtype="float32", load_format="dummy", mtp=True)


def _hf_layer(path: Path, t: dict[str, torch.Tensor], out: Path):
    """transformers' `bailing_hybrid` of the MTP layer's decoder layer alone (MLA + MoE, no
    SwiGLU limit), with the layer's output norm as its final norm: what
    `final_layernorm(layer(x))` is."""
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(
        num_hidden_layers=1, layer_types=["full_attention"], mlp_layer_types=["sparse"],
        expert_swiglu_limit_list=[0], share_expert_swiglu_limit_list=[0],
        num_nextn_predict_layers=0,
    )  # fmt: skip
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    mtp = _mtp(path)
    layer = {
        "model.layers.0." + n.removeprefix(mtp): w
        for n, w in t.items()
        if n.startswith(mtp) and not n.endswith(FUSION)
    }
    layer |= {
        "model.word_embeddings.weight": t["model.word_embeddings.weight"],
        "model.norm.weight": t[mtp + "final_layernorm.weight"],
        "lm_head.weight": t["lm_head.weight"],
    }
    save_file(layer, str(out / "model.safetensors"))
    hf, info = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    return hf.eval()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Ling's RMSNorm in fp32: x / rms(x) * w."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference(hf, t, mtp: str, ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """The head's y for one request's rows (positions 0..n-1)."""
    eps = hf.config.rms_norm_eps
    e = _rms(t["model.word_embeddings.weight"][ids], t[mtp + "enorm.weight"], eps)
    h = _rms(hidden, t[mtp + "hnorm.weight"], eps)
    x = torch.cat([e, h], dim=-1) @ t[mtp + "eh_proj.weight"].T
    with torch.no_grad():
        out = hf.model(inputs_embeds=x[None], position_ids=torch.arange(len(ids))[None])
    return out.last_hidden_state[0]


def test_mtp_hidden_equals_the_reference_on_extend_then_decode(ckpt, tmp_path) -> None:
    out = mtp_outputs(ParallelContext(), str(ckpt), LENS, 0)
    assert out["kv_layers"] == 3
    assert out["kv_written"] == [False, False, True]  # the head's MLA writes its own pool layer
    t, mtp = _tensors(ckpt), _mtp(ckpt)
    hf = _hf_layer(ckpt, t, tmp_path / "layer")
    want = [_reference(hf, t, mtp, i, h) for i, h in zip(out["ids"], out["hidden"], strict=True)]
    extend = torch.cat([w[:n] for w, n in zip(want, LENS, strict=True)])
    decode = torch.stack([w[n] for w, n in zip(want, LENS, strict=True)])
    torch.testing.assert_close(out["extend"], extend, atol=ATOL, rtol=0)
    torch.testing.assert_close(out["decode"], decode, atol=ATOL, rtol=0)


def test_tensor_parallel_head_equals_one_rank(ckpt) -> None:
    """Two ranks (gloo): the head's MLA heads and expert widths sharded like the main model's,
    eh_proj, the norms and the latent projections whole."""
    one = mtp_outputs(ParallelContext(), str(ckpt), LENS, 1)
    two = run_ranks(mtp_outputs, 2, str(ckpt), LENS, 1)
    for key in ("extend", "decode"):
        torch.testing.assert_close(two[key], one[key], atol=1e-5, rtol=0)
    assert two["head_bytes"] < one["head_bytes"]


def test_make_model_mtp_stores_the_layer_in_the_config(tmp_path) -> None:
    """`make-model --mtp` on the config-only Ling-3.0-flash shape (which otherwise counts no MTP
    layer): the config's `num_nextn_predict_layers` 1, which the config reader takes."""
    from hybrid_serve.models.bailing_hybrid_config import BailingHybridConfig
    from hybrid_serve.server.cli import main as cli_main

    out = tmp_path / "flash"
    cli_main(
        ["make-model", "--preset", "ling-3.0-flash", "--config-only", "--mtp", "--out", str(out)]
    )
    raw = json.loads((out / "config.json").read_text())
    assert raw["num_nextn_predict_layers"] == 1
    config = BailingHybridConfig.from_dict(raw)
    assert config.num_mtp_layers == 1 and config.mtp_weight_prefix == "model.layers.42."
