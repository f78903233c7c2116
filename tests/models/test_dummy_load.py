"""`--load-format dummy`: random weights from config.json alone, no weight file read.

End to end on the tiny preset's config.json alone (the real shapes' smallest, Qwen3.5-2B, needs
4 GB in bf16, beyond what a test may allocate); every real shape's config-only directory
is loaded on the meta device (its whole dummy-load path but the allocation); the peak memory of a
bf16 dummy load is about one copy of the weights, measured in a fresh process.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from hybrid_serve.make_model.presets import preset_config, write_config_only
from hybrid_serve.make_model.real_shapes import REAL_SHAPES
from hybrid_serve.models.loader import load_model
from hybrid_serve.models.step_bytes import param_groups
from hybrid_serve.scheduler.engine import Engine
from hybrid_serve.server.cli import main as cli_main
from tests.families import FAMILY_PRESETS
from tests.models.test_load_memory import measure_load_peak

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_config_only(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-config-only")
    cli_main(["make-model", "--preset", "tiny", "--config-only", "--out", str(out)])
    return out


def _no_weight_files(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a weight file was opened")

    monkeypatch.setattr("hybrid_serve.models.loader.safe_open", refuse)


def test_config_only_directory_has_no_weights(tiny_config_only):
    names = {p.name for p in tiny_config_only.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= names
    assert not [n for n in names if n.endswith(".safetensors")]
    assert json.loads((tiny_config_only / "config.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="--load-format dummy"):
        load_model(tiny_config_only)  # the default format needs weights


def test_config_only_tokenizer_round_trips(tiny_config_only):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_config_only)
    assert tok.decode(tok.encode("The answer is 42.")) == "The answer is 42."


def test_dummy_load_serves_tokens_through_the_engine(tiny_config_only, tmp_path, monkeypatch):
    """From a directory holding config.json and nothing else: token ids in, token ids out (the
    Engine loads a tokenizer only for text prompts)."""
    (tmp_path / "config.json").write_text((tiny_config_only / "config.json").read_text())
    _no_weight_files(monkeypatch)
    engine = Engine(
        str(tmp_path),
        load_format="dummy",
        dtype="float32",
        max_running_requests=2,
        max_total_tokens=256,
        max_context_len=128,
    )
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    outs = engine.generate([[5, 6, 7, 8, 9], [300, 301, 302]], greedy)
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [8, 8]
    assert all(0 <= t < 2048 for o in outs for t in o["output_ids"])
    again = engine.generate([5, 6, 7, 8, 9], greedy)
    assert again["output_ids"] == outs[0]["output_ids"]  # a model, not noise per call


def test_dummy_weights_follow_the_presets_init(tiny_config_only, monkeypatch):
    _no_weight_files(monkeypatch)
    model = load_model(tiny_config_only, dtype="float32", load_format="dummy")
    params = dict(model.named_parameters())
    a = params["model.layers.0.linear_attn.A_log"].exp()
    assert a.min() >= 1 - 1e-4 and a.max() <= 16 + 1e-3
    dt = torch.nn.functional.softplus(params["model.layers.1.linear_attn.dt_bias"])
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 0.1 * 1.001
    gate_up = params["model.layers.2.mlp.experts.gate_up_proj"]
    assert gate_up.mean().abs() < 0.01 and abs(gate_up.std().item() - 0.1) < 0.01
    conv = params["model.layers.0.linear_attn.conv1d.weight"]
    assert abs(conv.std().item() - 0.3) < 0.05
    norm1 = params["model.layers.0.linear_attn.norm.weight"]
    assert abs(norm1.mean().item() - 1) < 0.1
    norm0 = params["model.layers.3.self_attn.q_norm.weight"]
    assert norm0.abs().mean() < 0.2
    again = load_model(tiny_config_only, dtype="float32", load_format="dummy")
    assert all(torch.equal(p, params[n]) for n, p in again.named_parameters())


def test_serve_flag():
    from tests.serve_args import parse_serve_args

    _, runner, _ = parse_serve_args(["--model-path", "/x", "--load-format", "dummy"])
    assert runner.load_format == "dummy"
    with pytest.raises(ValueError, match="--load-format must be one of"):
        parse_serve_args(["--load-format", "pt"])


@pytest.mark.parametrize("name", sorted(REAL_SHAPES))
def test_every_real_shape_loads_dummy_on_meta(tmp_path, monkeypatch, name):
    _no_weight_files(monkeypatch)
    write_config_only(tmp_path, preset_config(name))
    model = load_model(tmp_path, dtype="bfloat16", device="meta", load_format="dummy")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    n = sum(p.numel() for p in model.parameters())
    assert n == param_groups(model.config).total


def test_dummy_bf16_load_peak_is_one_copy_of_the_weights(tmp_path, tiny_config_only):
    cfg = preset_config("tiny")
    cfg.update(hidden_size=512, vocab_size=4096, moe_intermediate_size=512, num_experts=8)
    path = write_config_only(tmp_path / "big", cfg)
    m = measure_load_peak(path, tiny_config_only, load_format="dummy")
    assert m["param_bytes"] > 40e6  # large enough for a copy to show against allocator noise
    assert m["peak_bytes"] < 1.1 * m["param_bytes"], m
    assert not math.isnan(m["peak_bytes"])


def test_tensor_parallel_shard_keeps_vocab_padding_rows_zero(tmp_path, monkeypatch):
    from hybrid_serve.models.parallel import ParallelContext

    _no_weight_files(monkeypatch)
    cfg = preset_config("tiny")
    cfg["vocab_size"] = 2047  # rank 1 of 2 holds 1023 real rows and one padding row
    write_config_only(tmp_path, cfg, dtype=torch.float32)
    model = load_model(tmp_path, tp=ParallelContext(1, 2), load_format="dummy")
    for table in (model.model.embed_tokens.weight, model.lm_head.weight):
        assert table.shape[0] == 1024
        assert not table[1023].any() and table[:1023].abs().sum(dim=1).all()


def test_server_refuses_a_checkpoint_without_tokenizer(tmp_path, tiny_config_only, capsys):
    (tmp_path / "config.json").write_text((tiny_config_only / "config.json").read_text())
    with pytest.raises(SystemExit):
        cli_main(["--model-path", str(tmp_path), "--load-format", "dummy"])
    assert "no tokenizer files" in capsys.readouterr().err


def test_generate_command_with_dummy_weights(tiny_config_only, caplog):
    caplog.set_level("INFO", logger="hybrid-serve")
    cli_main(
        ["generate", "--model-path", str(tiny_config_only), "--load-format", "dummy"]
        + ["--dtype", "float32", "--max-new-tokens", "4", "--ignore-eos"]
    )
    assert "+ 4 new tokens" in caplog.text


def module_kinds(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter's init kind as its module says it is initialised: a zero-centred norm
    (1 + w) around 0, a plain-weight or gated norm and Mamba2's D around 1, a convolution's
    weight "conv", A_log and dt_bias theirs, every other tensor "w"."""
    from hybrid_serve.models.kda_mixer import RMSNormSigmoidGated
    from hybrid_serve.models.layers import RMSNorm, RMSNormGated, RMSNormPlain
    from hybrid_serve.models.mamba2_mixer import Mamba2Mixer, RMSNormGateFirst
    from hybrid_serve.models.parallel_layers import ParallelRMSNormGateFirst

    plain = (RMSNormPlain, RMSNormGated, RMSNormGateFirst, ParallelRMSNormGateFirst)
    kinds = {}
    for prefix, module in model.named_modules():
        for name, _ in module.named_parameters(recurse=False):
            kind = name if name in ("A_log", "dt_bias") else "w"
            kind = "a_log" if kind == "A_log" else kind
            if isinstance(module, RMSNorm):
                kind = "norm0"
            elif isinstance(module, (*plain, RMSNormSigmoidGated)):
                kind = "norm1"
            elif isinstance(module, Mamba2Mixer) and name == "D":
                kind = "norm1"
            elif isinstance(module, torch.nn.Conv1d) and name == "weight":
                kind = "conv"
            kinds[f"{prefix}.{name}" if prefix else name] = kind
    return kinds


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3.5", *FAMILY_PRESETS])
def test_dummy_init_kinds_are_the_rows_and_the_presets(tmp_path, monkeypatch, preset):
    """The one set of init rules (`Family.init_kind`, the row's `init_rules`) gives every
    parameter of our model the kind its module is initialised by, and the presets' writer gives
    each tensor it shares with our model (the same name) that same kind."""
    from hybrid_serve.make_model.tensor_specs import model_specs
    from hybrid_serve.models.registry import config_family

    _no_weight_files(monkeypatch)
    cfg = preset_config(preset)
    write_config_only(tmp_path, cfg)
    model = load_model(tmp_path, dtype="float32", device="meta", load_format="dummy")
    family = config_family(model.config)
    expected = module_kinds(model)
    drawn = {name: family.init_kind(name) for name, _ in model.named_parameters()}
    assert drawn == {name: expected[name] for name in drawn}
    # under the stack's prefix (transformers' `model.` is NemotronH's `backbone.` here)
    written = {name.partition(".")[2]: kind for name, _, kind in model_specs(cfg)}
    ours = {name.partition(".")[2]: kind for name, kind in drawn.items()}
    shared = written.keys() & ours.keys()
    assert len(shared) > len(ours) // 2  # mostly transformers' own names
    assert {n: written[n] for n in shared} == {n: ours[n] for n in shared}
