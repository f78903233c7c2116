"""The block-FP8 layout is loaded strictly: each inconsistency is a one-line error naming it."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.models.fp8 import E4M3
from hybrid_serve.models.loader import load_model
from hybrid_serve.server.cli import main as cli_main

LAYER0 = "model.layers.0"


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fp8")
    cli_main(["make-model", "--preset", "tiny", "--out", str(out), "--fp8", "--seed", "2"])
    return out


def _copy(
    tmp_path: Path,
    src: Path,
    edit: Callable[[dict[str, torch.Tensor]], None] | None = None,
    config: Callable[[dict], None] | None = None,
) -> Path:
    """A copy of checkpoint `src` with its tensors and config.json edited in place."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    raw = json.loads((src / "config.json").read_text())
    if config is not None:
        config(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    tensors = load_file(str(src / "model.safetensors"))
    if edit is not None:
        edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_make_model_fp8_writes_a_loadable_block_fp8_checkpoint(fp8_dir) -> None:
    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    assert tensors[f"{LAYER0}.linear_attn.out_proj.weight"].dtype == E4M3
    assert tensors[f"{LAYER0}.linear_attn.in_proj_ba.weight"].dtype == torch.bfloat16
    model = load_model(fp8_dir)
    assert model.lm_head.weight.dtype == torch.bfloat16  # auto: the config's bf16


def _pop(name: str) -> Callable[[dict], None]:
    return lambda t: t.pop(name)


def _put(name: str, value: torch.Tensor) -> Callable[[dict], None]:
    return lambda t: t.update({name: value})


def _fp8_lm_head(t: dict) -> None:
    t["lm_head.weight"] = t["lm_head.weight"].to(E4M3)
    t["lm_head.weight_scale_inv"] = torch.ones(16, 1)


SCALE = f"{LAYER0}.linear_attn.out_proj.weight_scale_inv"
EXPERT_SCALE = "model.layers.5.mlp.experts.2.down_proj.weight_scale_inv"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_pop(SCALE), f"missing tensor {SCALE}"),
        (_pop(EXPERT_SCALE), f"missing tensor {EXPERT_SCALE}"),
        (
            _put(SCALE, torch.ones(2, 2)),
            f"{SCALE}: F32 (2, 2), expected a float tensor of shape (1, 1)",
        ),
        (_put(f"{LAYER0}.mlp.gate.weight_scale_inv", torch.ones(1, 1)), "which is not FP8"),
        (_put(f"{LAYER0}.mlp.nothing.weight_scale_inv", torch.ones(1, 1)), "has no weight"),
        (_fp8_lm_head, "lm_head.weight is FP8 but modules_to_not_convert"),
    ],
    ids=["scale", "expert-scale", "scale-shape", "scale-of-bf16", "orphan-scale", "ignored"],
)
def test_bad_fp8_layout_is_named(tmp_path, fp8_dir, edit, message) -> None:
    path = _copy(tmp_path, fp8_dir, edit)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_model(path)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (lambda c: c.pop("quantization_config"), "is FP8 but config.json has no quantization_co"),
        (lambda c: c["quantization_config"].pop("weight_block_size"), "weight_block_size"),
        (lambda c: c["quantization_config"].update(quant_method="gptq"), "'gptq'"),
    ],
    ids=["no-config", "per-tensor", "method"],
)
def test_bad_quantization_config_is_named(tmp_path, fp8_dir, config, message) -> None:
    with pytest.raises(ValueError, match=message):
        load_model(_copy(tmp_path, fp8_dir, config=config))


def test_unquantized_checkpoint_with_a_stray_scale_is_refused(tmp_path) -> None:
    plain = write_checkpoint(tmp_path / "plain", preset_config("tiny"))
    path = _copy(tmp_path / "copy", plain, _put(SCALE, torch.ones(1, 1)))
    with pytest.raises(ValueError, match=f"unexpected checkpoint tensor {SCALE}"):
        load_model(path)
