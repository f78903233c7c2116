"""Every family's checkpoint in both spellings transformers knows, through our strict loader.

For each model_type a tiny model is built from transformers' own config class, and two files of
it are loaded by `load_model` and judged against transformers' own model loaded from that same
file (fp32 logits at every prompt position within 1e-4, and the same greedy tokens):

    saved     what transformers' `save_pretrained` writes: its conversion_mapping.py run
              backwards (the released layout for NemotronH, Granite-4.0-H, the experts of
              Qwen3-Next, Qwen3.5-MoE and LFM2-MoE, OLMo-Hybrid's norms; its own names
              elsewhere)
    released  the release's layout, written here from the model's state_dict by the inverse of
              conversion_mapping's rules for the model_type (`released_layout`; transformers
              itself must load it without a missing or unexpected tensor)

(LFM2 has no rule: both are transformers' names, with the conv layers' biases or without; LFM3
renames its attention gate, released as `self_attn.gate_proj`),
and the model's own state_dict names (transformers' internal layout) as a third file where they
differ from both. An extra tensor in each layout is refused with its name.

transformers 5.25's `save_pretrained` splits OLMo-Hybrid's joined conv into equal thirds, which
misnames its rows whenever the key and value widths differ (transformers reads its own file back,
as it only concatenates): the OLMo-Hybrid model here has key width 32 and value width 64, its
released file is split at the true widths, its saved file is refused by shape, and a second
OLMo-Hybrid with equal widths gives the saved file that loads.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hybrid_serve.models.loader import load_model
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.registry import model_class, read_config
from hybrid_serve.models.weight_map import checkpoint_map, is_skipped
from hybrid_serve.scheduler.config import RunnerConfig
from hybrid_serve.scheduler.model_runner import DecodeInput, ExtendInput, ModelRunner
from tests.hf_reference import hf_greedy

ATOL = 1e-4
PROMPT = [5, 71, 19, 200, 3, 88, 140, 7, 61, 233, 12]
DECODE_STEPS = 4
Tensors = dict[str, torch.Tensor]

_GDN = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=24,
    linear_conv_kernel_dim=4,
)
_ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
_QWEN = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    initializer_range=0.1,
    **_ATTENTION,
    **_GDN,
)
_QWEN_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)
_VISION = dict(
    depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
    num_position_embeddings=16,
)  # fmt: skip
_LFM3_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # its defaults: a full vocab's
_MAMBA = dict(
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=64,
)


# ---- the released layouts: conversion_mapping.py's rules for each model_type, run forwards ----
def _rename(sd: Tensors, pattern: str, repl: str) -> Tensors:
    return {re.sub(pattern, repl, k): v for k, v in sd.items()}


def _split_experts(sd: Tensors, fused: str, parts: tuple[str, ...]) -> Tensors:
    """Stacked experts `...{fused}` [E, k*I, ...] -> `...experts.{e}.{part}.weight`, the k parts'
    rows of entry e (qwen2_moe's and nemotron_h's MergeModulelist / Concatenate inverted)."""
    out = {}
    for name, w in sd.items():
        if not name.endswith(fused):
            out[name] = w
            continue
        base = name.removesuffix(fused)
        for e in range(w.shape[0]):
            for part, rows in zip(parts, w[e].chunk(len(parts), dim=0), strict=True):
                out[f"{base}experts.{e}.{part}.weight"] = rows.clone()
    return out


def _qwen2_moe(sd: Tensors) -> Tensors:
    sd = _split_experts(sd, "experts.gate_up_proj", ("gate_proj", "up_proj"))
    return _split_experts(sd, "experts.down_proj", ("down_proj",))


def _qwen3_5_text(sd: Tensors) -> Tensors:
    return _rename(sd, r"^model\.", "model.language_model.")


def _nemotron_h(sd: Tensors) -> Tensors:
    sd = _split_experts(_rename(sd, r"^model\.", "backbone."), "experts.up_proj", ("up_proj",))
    return _split_experts(sd, "experts.down_proj", ("down_proj",))


def _granitemoe(sd: Tensors) -> Tensors:
    sd = _rename(
        sd, r"block_sparse_moe\.experts\.gate_up_proj$", "block_sparse_moe.input_linear.weight"
    )
    sd = _rename(
        sd, r"block_sparse_moe\.experts\.down_proj$", "block_sparse_moe.output_linear.weight"
    )
    return _rename(sd, r"block_sparse_moe\.router\.weight$", "block_sparse_moe.router.layer.weight")


def _lfm2_moe(sd: Tensors) -> Tensors:
    sd = _split_experts(sd, "experts.gate_up_proj", ("w1", "w3"))
    return _split_experts(sd, "experts.down_proj", ("w2",))


def _lfm3(sd: Tensors) -> Tensors:
    return _rename(sd, r"\.self_attn\.g_proj\.", ".self_attn.gate_proj.")


def _olmo_hybrid(config) -> Callable[[Tensors], Tensors]:
    key = config.linear_num_key_heads * config.linear_key_head_dim
    value = config.linear_num_value_heads * config.linear_value_head_dim

    def released(sd: Tensors) -> Tensors:
        sd = _rename(sd, r"\.input_layernorm\.", ".attention_layer_norm.")
        sd = _rename(sd, r"\.post_attention_layernorm\.", ".feedforward_layer_norm.")
        out = {}
        for name, w in sd.items():
            if not name.endswith("linear_attn.conv1d.weight"):
                out[name] = w
                continue
            base = name.removesuffix("conv1d.weight")
            for part, rows in zip("qkv", w.split([key, key, value]), strict=True):
                out[f"{base}{part}_conv1d.weight"] = rows.clone()
        return out

    return released


def _kimi_linear(config) -> Callable[[Tensors], Tensors]:
    width = config.linear_num_heads * config.linear_head_dim

    def released(sd: Tensors) -> Tensors:
        sd = _rename(sd, r"\.self_attn\.forget_gate\.", ".self_attn.")
        sd = _rename(sd, r"\.mlp\.", ".block_sparse_moe.")
        sd = _split_experts(sd, "experts.gate_up_proj", ("w1", "w3"))
        sd = _split_experts(sd, "experts.down_proj", ("w2",))
        out = {}
        for name, w in sd.items():
            if not name.endswith("self_attn.conv1d.weight"):
                out[name] = w
                continue
            base = name.removesuffix("conv1d.weight")
            for part, rows in zip("qkv", w.split(width), strict=True):
                out[f"{base}{part}_conv1d.weight"] = rows.clone()
        return out

    return released


@dataclass
class Family:
    """A model_type: transformers' config and model classes, the tiny config's arguments, and
    the released layout of a state_dict (`released(config)` -> a function of it)."""

    config_class: str
    model_class: str
    kwargs: dict
    released: Callable = lambda config: lambda sd: sd
    hf_kwargs: dict = field(default_factory=dict)


FAMILIES = {
    "qwen3_next": Family(
        "Qwen3NextConfig", "Qwen3NextForCausalLM", {**_QWEN, **_QWEN_MOE, "intermediate_size": 96},
        lambda c: _qwen2_moe,
    ),
    "qwen3_5_text": Family(
        "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {**_QWEN, "intermediate_size": 96},
        lambda c: _qwen3_5_text,
    ),
    "qwen3_5_moe_text": Family(
        "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {**_QWEN, **_QWEN_MOE},
        lambda c: lambda sd: _qwen2_moe(_qwen3_5_text(sd)),
    ),
    "qwen3_5": Family(
        "Qwen3_5Config", "Qwen3_5ForConditionalGeneration",
        {"text_config": {**_QWEN, "intermediate_size": 96}, "vision_config": _VISION},
    ),
    "qwen3_5_moe": Family(
        "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration",
        {"text_config": {**_QWEN, **_QWEN_MOE}, "vision_config": _VISION},
        lambda c: _qwen2_moe,
    ),
    "nemotron_h": Family(
        "NemotronHConfig", "NemotronHForCausalLM",
        dict(
            vocab_size=256, hidden_size=64,
            layers_block_type=["mamba", "moe", "attention", "mlp", "mamba"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=8,
            mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=64,
            intermediate_size=96, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2,
            topk_group=1, routed_scaling_factor=2.0, initializer_range=0.1,
        ),
        lambda c: _nemotron_h,
    ),
    # Nemotron 3 Super's latent MoE: the experts in 24 of the 64 channels
    "nemotron_h_latent": Family(
        "NemotronHConfig", "NemotronHForCausalLM",
        dict(
            vocab_size=256, hidden_size=64,
            layers_block_type=["mamba", "moe", "attention", "moe"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=8,
            mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=64,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            moe_latent_size=24, moe_shared_expert_intermediate_size=48, n_group=1, topk_group=1,
            routed_scaling_factor=5.0, initializer_range=0.1,
        ),
        lambda c: _nemotron_h,
    ),
    "granitemoehybrid": Family(
        "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
        dict(
            vocab_size=256, hidden_size=64, num_hidden_layers=4,
            layer_types=["mamba", "attention", "mamba", "mamba"], num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=32, shared_intermediate_size=48,
            num_local_experts=4, num_experts_per_tok=2, position_embedding_type="nope",
            embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=0.5,
            attention_multiplier=0.0625, tie_word_embeddings=True, initializer_range=0.1, **_MAMBA,
        ),
        lambda c: _granitemoe,
    ),
    "bamba": Family(
        "BambaConfig", "BambaForCausalLM",
        dict(
            vocab_size=256, hidden_size=64, num_hidden_layers=4, attn_layer_indices=[1],
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
            initializer_range=0.1, **_MAMBA,
        ),
    ),
    "falcon_h1": Family(
        "FalconH1Config", "FalconH1ForCausalLM",
        dict(
            vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=96, initializer_range=0.1,
            mamba_d_ssm=128, lm_head_multiplier=2.0, embedding_multiplier=1.5,
            key_multiplier=0.5, **_MAMBA,
        ),
    ),
    "olmo_hybrid": Family(
        "OlmoHybridConfig", "OlmoHybridForCausalLM",
        dict(
            vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=96, linear_num_key_heads=2,
            linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=32,
            initializer_range=0.1, pad_token_id=0, eos_token_id=1,
        ),
        _olmo_hybrid,
    ),
    "lfm2": Family(
        "Lfm2Config", "Lfm2ForCausalLM",
        dict(
            vocab_size=256, hidden_size=64, num_hidden_layers=4, full_attn_idxs=[1, 3],
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
            block_multiple_of=48, initializer_range=0.1,
        ),
    ),
    # the conv layers' biases, explicit layer_types, the MLP width as given, no tied head
    "lfm2_conv_bias": Family(
        "Lfm2Config", "Lfm2ForCausalLM",
        dict(
            vocab_size=256, hidden_size=64, num_hidden_layers=3, conv_bias=True, conv_L_cache=4,
            layer_types=["conv", "full_attention", "conv"], num_attention_heads=4,
            num_key_value_heads=1, intermediate_size=80, block_auto_adjust_ff_dim=False,
            tie_word_embeddings=False, initializer_range=0.1,
        ),
    ),
    "lfm2_moe": Family(
        "Lfm2MoeConfig", "Lfm2MoeForCausalLM",
        dict(
            vocab_size=256, hidden_size=64, num_hidden_layers=4,
            layer_types=["conv", "full_attention", "conv", "conv"], num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=96, num_dense_layers=1, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, routed_scaling_factor=2.0,
            initializer_range=0.1,
        ),
        lambda c: _lfm2_moe,
    ),
    # both attention kinds (a window of 4 keys, shorter than PROMPT), the gate and sandwich norms
    "lfm3": Family(
        "Lfm3Config", "Lfm3ForCausalLM",
        dict(
            vocab_size=256, hidden_size=64, num_hidden_layers=4,
            layer_types=["conv", "sliding_attention", "conv", "full_attention"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
            conv_L_cache=3, intermediate_size=96, initializer_range=0.1, **_LFM3_IDS,
        ),
        lambda c: _lfm3,
    ),
    # without the gate and the sandwich norms, with every bias, no tied head
    "lfm3_plain": Family(
        "Lfm3Config", "Lfm3ForCausalLM",
        dict(
            vocab_size=256, hidden_size=64, num_hidden_layers=3,
            layer_types=["sliding_attention", "conv", "full_attention"], num_attention_heads=4,
            num_key_value_heads=1, head_dim=16, sliding_window=5, conv_bias=True,
            attention_bias=True, use_attention_gate=False, use_sandwich_norm=False,
            intermediate_size=80, tie_word_embeddings=False, initializer_range=0.1, **_LFM3_IDS,
        ),
    ),
    # KDA and MLA layers (q LoRA, attention biases), a dense MLP then grouped sigmoid-routed
    # experts with a shared one
    "kimi_linear": Family(
        "KimiLinearConfig", "KimiLinearForCausalLM",
        dict(
            vocab_size=256, hidden_size=64, num_hidden_layers=4,
            linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": 2,
                                "head_dim": 16, "short_conv_kernel_size": 4},
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, attention_bias=True,
            intermediate_size=96, first_k_dense_replace=1, num_experts=4,
            num_experts_per_token=2, moe_intermediate_size=32, num_shared_experts=1,
            num_expert_group=2, topk_group=1, routed_scaling_factor=2.0, initializer_range=0.1,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        ),
        _kimi_linear,
    ),
}  # fmt: skip
FAMILIES["olmo_hybrid_equal_widths"] = Family(
    "OlmoHybridConfig",
    "OlmoHybridForCausalLM",
    {**FAMILIES["olmo_hybrid"].kwargs, "linear_value_head_dim": 16},
    _olmo_hybrid,
)
# transformers' saved file of the OLMo-Hybrid above: its thirds of the 128 conv rows misname them
SAVED_REFUSED = {"olmo_hybrid": r"k_conv1d\.weight: shape \(43, 1, 4\), expected \(32, 1, 4\)"}
LAYOUTS = ("saved", "released", "internal")


def _write(path: Path, config_dir: Path, tensors: Tensors) -> Path:
    """A checkpoint directory of `tensors` with `config_dir`'s config files."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (config_dir / name).is_file():
            (path / name).write_text((config_dir / name).read_text())
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _state_dict(model) -> Tensors:
    """The model's state_dict, a tied LM head once (as the embedding)."""
    out, seen = {}, set()
    for name, w in model.state_dict().items():
        if w.data_ptr() in seen:
            continue
        seen.add(w.data_ptr())
        out[name] = w.detach().clone().contiguous()
    return out


@dataclass
class Files:
    """One tiny model's checkpoint in each layout, and its own logits for PROMPT."""

    family: str
    paths: dict[str, Path]
    logits: torch.Tensor


@pytest.fixture(scope="module", params=list(FAMILIES))
def files(request, tmp_path_factory) -> Files:
    """The three layouts of one tiny model of the family."""
    family = FAMILIES[request.param]
    config = getattr(transformers, family.config_class)(**family.kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, family.model_class)(config).eval()
    root = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(root / "saved")
    sd = _state_dict(model)
    text = config.get_text_config()
    paths = {
        "saved": root / "saved",
        "released": _write(root / "released", root / "saved", family.released(text)(sd)),
        "internal": _write(root / "internal", root / "saved", sd),
    }
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
    return Files(request.param, paths, logits)


def _transformers(family: Family, path: Path):
    """transformers' model class for the family, loaded from `path` without a missing or
    unexpected tensor."""
    cls = getattr(transformers, family.model_class)
    model, info = cls.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), f"transformers did not load {path.name} cleanly: {info}"
    return model.eval()


def _ours(path: Path) -> tuple[torch.Tensor, list[int]]:
    """Our logits at every prompt position and DECODE_STEPS greedy tokens."""
    model = load_model(path, dtype="float32")
    runner = ModelRunner(model, RunnerConfig(max_running_requests=2, max_total_tokens=256))
    req, slot = runner.req_pool.alloc(1)[0], runner.mamba_pool.alloc(1).tolist()[0]
    loc = runner.alloc_kv(req, 0, len(PROMPT))
    batch = runner.build_prefill([ExtendInput(req, slot, 0, PROMPT)], [loc], return_all_logits=True)
    logits = runner.forward(batch)
    tokens, seq = [int(logits[-1].argmax())], len(PROMPT)
    for _ in range(DECODE_STEPS - 1):
        loc = runner.alloc_kv(req, seq, 1)
        step = runner.forward(runner.build_decode([DecodeInput(req, slot, seq, tokens[-1])], loc))
        tokens.append(int(step[0].argmax()))
        seq += 1
    return logits, tokens


def _names(path: Path) -> set[str]:
    """The checkpoint's tensor names that are the model's (a wrapper's vision tower skipped)."""
    return {n for n in load_file(path / "model.safetensors") if not is_skipped(n)}


def _meta_model(path: Path):
    config = read_config(path)
    with torch.device("meta"):
        return model_class(config)(config)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_loads_with_transformers_logits(files, layout):
    """Our logits and greedy tokens are those of transformers' model loaded from the same file,
    and those are the built model's (the file holds the model, in its layout)."""
    family, path = FAMILIES[files.family], files.paths[layout]
    if layout == "internal" and _names(path) == _names(files.paths["saved"]):
        pytest.skip("save_pretrained writes transformers' own names here: the saved file")
    hf = _transformers(family, path)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(ref, files.logits, rtol=0, atol=1e-5)
    if layout == "saved" and files.family in SAVED_REFUSED:
        with pytest.raises(ValueError, match=SAVED_REFUSED[files.family]):
            load_model(path, dtype="float32")
        return
    logits, tokens = _ours(path)
    err = (logits - ref).abs().max().item()
    assert err < ATOL, f"{files.family} {layout}: max |dlogit| {err:.2e}"
    assert tokens == hf_greedy(hf, [PROMPT], DECODE_STEPS)[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unknown_tensor_is_refused_by_name(files, layout, tmp_path):
    """A tensor no spelling has, added to each layout, is an error naming it."""
    tensors = load_file(files.paths[layout] / "model.safetensors")
    first = min(n for n in tensors if ".layers.0." in n)
    extra = first.split(".layers.0.")[0] + ".layers.0.mlp.extra_proj.weight"
    tensors[extra] = torch.zeros(4, 4)
    path = _write(tmp_path / layout, files.paths[layout], tensors)
    with pytest.raises(ValueError, match=rf"unexpected checkpoint tensor {re.escape(extra)} \("):
        load_model(path, dtype="float32")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_missing_tensor_is_named_as_the_checkpoint_spells_it(files, layout):
    """Without any one of its tensors, each layout's table asks for exactly that tensor: the
    checkpoint's own spelling of it, also for a parameter none of whose names is left (told by
    the other layers' names)."""
    names = _names(files.paths[layout])
    model = _meta_model(files.paths[layout])
    assert set(checkpoint_map(model, names)) == names
    for victim in sorted(names):
        assert set(checkpoint_map(model, names - {victim})) == names, victim


@pytest.mark.parametrize(
    "files",
    [
        "qwen3_next", "qwen3_5_moe_text", "nemotron_h", "nemotron_h_latent", "granitemoehybrid",
        "olmo_hybrid", "lfm2_moe", "lfm3", "kimi_linear",
    ],
    indirect=True,
)  # fmt: skip
def test_two_spellings_of_a_tensor_are_refused(files, tmp_path):
    """The released and transformers' spellings of the same tensors in one file: one of them is
    unexpected."""
    released = load_file(files.paths["released"] / "model.safetensors")
    internal = load_file(files.paths["internal"] / "model.safetensors")
    both = set(released) ^ set(internal)
    path = _write(tmp_path / "both", files.paths["saved"], {**released, **internal})
    with pytest.raises(ValueError, match="unexpected checkpoint tensor") as error:
        load_model(path, dtype="float32")
    assert str(error.value).split()[3] in both


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_shards_for_two_ranks(files, layout):
    """Under tensor parallelism (2 ranks) every tensor of each layout, cut as its parameter's
    module declares (`models.tp_shards`), has exactly the shape of the part of the rank's
    parameter it fills."""
    path = files.paths[layout]
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys() if not is_skipped(n)}  # noqa: SIM118
    for rank in (0, 1):
        model = load_model(path, device="meta", load_format="dummy", tp=ParallelContext(rank, 2))
        params = dict(model.named_parameters())
        table = checkpoint_map(model, shapes)
        assert set(table) == set(shapes)
        for name, shape in shapes.items():
            target = table[name]
            shard = model.checkpoint_shard(name, target)
            dst = params[target.param][target.index]
            expected = list(shape)
            if shard is not None:
                expected[shard.dim] = sum(b - a for a, b in shard.ranges)
                dst = dst if shard.rows is None else dst[: shard.rows]
            assert tuple(dst.shape) == tuple(expected), (layout, rank, name)
