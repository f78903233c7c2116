"""Nemotron 3 Super's MTP head (`models.nemotron_h_mtp`) on the tiny preset (latent MoE, one step
of attention then MoE, `mtp.layers.*` as released): the strict loader reads it, and
`mtp_hidden` equals an independent reference: the input fusion written here in plain torch from
the checkpoint tensors, the step's two blocks and its final norm run by transformers as a
two-block NemotronH model (transformers builds no head itself), on an extend batch of two
requests and on the decode rows that continue them (fp32, atol 1e-5). Two tensor-parallel ranks
give one rank's outputs."""

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
from hybrid_serve.models.step_bytes import weight_bytes_per_step
from tests.tp_harness import run_ranks
from tests.tp_workers import mtp_outputs

ATOL = 1e-5
LENS = (5, 3)
PRESET = "tiny-nemotron-3-super"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("super"), preset_config(PRESET), seed=3)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_the_head_is_the_checkpoints_and_leaves_the_rest_unchanged(ckpt, tmp_path) -> None:
    t = _tensors(ckpt)
    model = load_model(ckpt, dtype="float32", mtp=True)
    assert model.num_kv_layers == 2  # the main model's one attention block, the head's one
    first, last = model.mtp.layers
    assert torch.equal(first.eh_proj.weight, t["mtp.layers.0.eh_proj.weight"])
    assert torch.equal(last.final_layernorm.weight, t["mtp.layers.1.final_layernorm.weight"])
    assert torch.equal(
        last.mixer.fc1_latent_proj.weight, t["mtp.layers.1.mixer.fc1_latent_proj.weight"]
    )
    up = torch.stack([t[f"mtp.layers.1.mixer.experts.{e}.up_proj.weight"] for e in range(8)])
    assert torch.equal(last.mixer.experts.up_proj, up)
    plain = _tensors(
        write_checkpoint(tmp_path, {**preset_config(PRESET), "num_nextn_predict_layers": 0}, seed=3)
    )
    assert set(t) - set(plain) == {n for n in t if n.startswith("mtp.")}
    assert all(torch.equal(plain[n], t[n]) for n in plain)
    skipped = load_model(ckpt, dtype="float32")
    assert skipped.mtp is None and skipped.num_kv_layers == 1


def test_a_missing_head_tensor_is_named(ckpt, tmp_path) -> None:
    t = _tensors(ckpt)
    victim = "mtp.layers.1.mixer.experts.3.down_proj.weight"
    t.pop(victim)
    (tmp_path / "m").mkdir()
    for name in ("config.json", "generation_config.json"):
        (tmp_path / "m" / name).write_text((ckpt / name).read_text())
    save_file(t, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match=victim.replace(".", r"\.")):
        load_model(tmp_path / "m", dtype="float32", mtp=True)
    assert load_model(tmp_path / "m", dtype="float32").mtp is None  # skipped without the head


def test_two_steps_are_refused_for_the_head_only(tmp_path) -> None:
    cfg = {**preset_config(PRESET), "num_nextn_predict_layers": 2}
    path = write_checkpoint(tmp_path, cfg, seed=1)
    assert load_model(path, dtype="float32").mtp is None
    with pytest.raises(ValueError, match="num_nextn_predict_layers must be 1"):
        load_model(path, dtype="float32", mtp=True)


def _hf_blocks(path: Path, t: dict[str, torch.Tensor], out: Path):
    """transformers' NemotronH of the head's two blocks, with the step's final norm as its
    norm_f: what `final_layernorm(blocks(x))` is."""
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("hybrid_override_pattern", None)
    cfg.update(layers_block_type=["attention", "moe"], num_hidden_layers=2)
    cfg["num_nextn_predict_layers"] = 0
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    fusion = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight")
    blocks = {
        f"backbone.{n.removeprefix('mtp.')}": w
        for n, w in t.items()
        if n.startswith("mtp.layers.") and not n.endswith(fusion)
    }
    blocks |= {
        "backbone.embeddings.weight": t["backbone.embeddings.weight"],
        "backbone.norm_f.weight": t["mtp.layers.1.final_layernorm.weight"],
        "lm_head.weight": t["lm_head.weight"],
    }
    save_file(blocks, str(out / "model.safetensors"))
    hf, info = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    return hf.eval()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """NemotronH's RMSNorm in fp32: x / rms(x) * w."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference(hf, t, eps: float, ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """The head's y for one request's rows (positions 0..n-1)."""
    e = _rms(t["backbone.embeddings.weight"][ids], t["mtp.layers.0.enorm.weight"], eps)
    h = _rms(hidden, t["mtp.layers.0.hnorm.weight"], eps)
    x = torch.cat([e, h], dim=-1) @ t["mtp.layers.0.eh_proj.weight"].T
    with torch.no_grad():
        out = hf.model(inputs_embeds=x[None], position_ids=torch.arange(len(ids))[None])
    return out.last_hidden_state[0]


def test_mtp_hidden_equals_the_reference_on_extend_then_decode(ckpt, tmp_path) -> None:
    out = mtp_outputs(ParallelContext(), str(ckpt), LENS, 0)
    assert out["kv_layers"] == 2
    assert out["kv_written"] == [False, True]  # the head's attention writes its own pool layer
    t = _tensors(ckpt)
    hf = _hf_blocks(ckpt, t, tmp_path / "blocks")
    eps = hf.config.layer_norm_epsilon
    want = [_reference(hf, t, eps, i, h) for i, h in zip(out["ids"], out["hidden"], strict=True)]
    extend = torch.cat([w[:n] for w, n in zip(want, LENS, strict=True)])
    decode = torch.stack([w[n] for w, n in zip(want, LENS, strict=True)])
    torch.testing.assert_close(out["extend"], extend, atol=ATOL, rtol=0)
    torch.testing.assert_close(out["decode"], decode, atol=ATOL, rtol=0)


def test_tensor_parallel_head_equals_one_rank(ckpt) -> None:
    """Two ranks (gloo): the head's blocks sharded like the main model's, eh_proj, the norms and
    the latent projections whole."""
    one = mtp_outputs(ParallelContext(), str(ckpt), LENS, 1)
    two = run_ranks(mtp_outputs, 2, str(ckpt), LENS, 1)
    for key in ("extend", "decode"):
        torch.testing.assert_close(two[key], one[key], atol=1e-5, rtol=0)
    assert two["head_bytes"] < one["head_bytes"]


def test_step_weight_bytes_count_the_experts_a_step_touches(ckpt) -> None:
    """What the draft-length policy scales its timings by (`weight_bytes_per_step`): the main
    model's parameters once at 2 bytes, its 3 MoE blocks' experts as many as `rows` tokens are
    expected to touch (3 of 8 for one token), one embedding row per request; the head left out."""
    model = load_model(ckpt, dtype="float32", mtp=True)
    head = {id(p) for p in model.mtp.parameters()}
    main = [p for p in model.parameters() if id(p) not in head]
    per_expert, embed = 2 * 64 * 48, model.embed_tokens.weight
    stacks = 3 * 8 * per_expert
    dense = sum(p.numel() for p in main) - stacks - embed.numel()
    weights = weight_bytes_per_step(model)
    assert weights(1) == 2.0 * (dense + 3 * 3 * per_expert + 128)
    assert weights(1) < weights(4) < weights(64) < 2.0 * (dense + stacks + 64 * 128)


def test_make_model_mtp_adds_one_step_to_a_nemotron_h_preset(tmp_path, capsys) -> None:
    """`make-model --mtp` on Nemotron-3-Nano's tiny preset (MoE without a latent width): the
    config's `num_nextn_predict_layers` 1 and the release's `mtp.layers.*`, which load."""
    from hybrid_serve.server.cli import main as cli_main

    out = tmp_path / "m"
    cli_main(["make-model", "--preset", "tiny-nemotron-h", "--mtp", "--out", str(out)])
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    model = load_model(out, dtype="float32", mtp=True)
    assert model.mtp.layers[1].mixer.fc1_latent_proj is None and model.num_kv_layers == 2
    with pytest.raises(SystemExit):
        cli_main(["make-model", "--preset", "tiny-nemotron-h", "--fit-mtp", "--out", str(out)])
    assert "--fit-mtp fits Qwen3-Next and Qwen3.5 heads only" in capsys.readouterr().err
