"""The family table: one row per supported model family, the one place that says which
`model_type`s / `architectures` a family reads, with which classes, under which weight names,
written by which presets and with which default chat template.

Everything here is plain data (no torch, no import of the classes it names), so the API process
and `make-model`'s argument parser can read it. Classes and preset dicts are named by dotted path
(`module.attribute`) and resolved by `resolve` when needed: the registry resolves the model and
config classes (`models.registry`), make_model resolves the preset modules (`make_model.catalog`);
the models package itself never resolves a make_model path.

A row reads:

    name           the family as the README's supported-models table names it
    types          its `model_type`s, each with its transformers architecture and the name rules
                   of transformers' conversion_mapping.py for it (`NameRules`, read both ways by
                   `models.weight_map`)
    model_class    the model class that builds it (dotted path)
    config_class   the frozen config class that reads its config.json (dotted path)
    preset_module  the make_model module whose `complete_config(config, extra)` completes its
                   presets' configs for transformers
    presets        the dicts (dotted paths, name -> config) that hold its presets; a dict shared by
                   several rows gives each row the presets of its model_types
    chat_template  make-model's default chat template (`make_model.chat_templates.TEMPLATES`)
    tool_call_format, reasoning_format
                   the formats the server's `--tool-call-parser auto` / `--reasoning-parser auto`
                   pick from that template (`server.formats`; reasoning None: none), as the
                   server serves the family's presets by default
    init_rules     the init kind by name suffix (first match, else "w": `Family.init_kind`) of
                   the tensors of transformers' own model for the config, built on the meta
                   device (the presets), and of our model's parameters (`--load-format dummy`)
    preset_rules   which kinds of `NameRules` the presets write in the released spelling (the
                   others stay as transformers names them)
    preset_extra   None, or the make_model function (dotted path) that declares the modules a
                   release holds beside transformers' model (Qwen's, NemotronH's and Ling-3's MTP
                   heads), built from transformers' own classes and drawn after the model's
                   tensors

`python -m hybrid_serve.models.families --markdown` prints the family and `model_type` columns of
the README's table.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from typing import Any

Rule = tuple[str, str]  # (the released spelling, transformers' own)


@dataclass(frozen=True)
class NameRules:
    """One model_type's entries of transformers' conversion_mapping.py, as data. Every rule is
    a (released, transformers') pair and reads both ways:

    prefixes  a leading name part (PrefixChange, or a WeightRenaming of the stack's prefix)
    renames   a name part anywhere in the name (WeightRenaming)
    stacked   (end of a stacked expert tensor's name, its per-expert parts): transformers'
              [E, k*I, ...] tensor, or the release's `experts.{e}.{part}.weight`, the k parts
              filling entry e's rows in order (MergeModulelist, Concatenate(dim=1) for k > 1)
    joined    (end of a joined tensor's name, ((end of a part's name, the config property
              giving its rows), ...)): transformers' one tensor, or the release's parts
              filling its rows in order (Concatenate(dim=0))
    """

    prefixes: tuple[Rule, ...] = ()
    renames: tuple[Rule, ...] = ()
    stacked: tuple[tuple[str, tuple[str, ...]], ...] = ()
    joined: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()


RULE_KINDS = ("prefixes", "renames", "stacked", "joined")


@dataclass(frozen=True)
class ModelType:
    """One config.json `model_type`: its transformers architecture and its name rules."""

    name: str
    architecture: str
    rules: NameRules = NameRules()


@dataclass(frozen=True)
class Family:
    """One row of the table (module docstring)."""

    name: str
    types: tuple[ModelType, ...]
    model_class: str
    config_class: str
    preset_module: str
    presets: tuple[str, ...]
    chat_template: str
    tool_call_format: str
    reasoning_format: str | None
    init_rules: tuple[tuple[str, str], ...]
    preset_rules: tuple[str, ...] = RULE_KINDS
    preset_extra: str | None = None

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.types)

    @property
    def architectures(self) -> tuple[str, ...]:
        return tuple(t.architecture for t in self.types)

    def init_kind(self, name: str) -> str:
        """The kind of the first `init_rules` suffix `name` ends with; "w" where none does (the
        kinds: `models.dummy_weights.fill`)."""
        return next((kind for suffix, kind in self.init_rules if name.endswith(suffix)), "w")

    def model_type(self, name: str) -> ModelType:
        """The row's entry for `name`; KeyError if the row has none."""
        for t in self.types:
            if t.name == name:
                return t
        raise KeyError(name)


QWEN2_MOE = (
    ("mlp.experts.gate_up_proj", ("gate_proj", "up_proj")),
    ("mlp.experts.down_proj", ("down_proj",)),
)
QWEN3_5_TEXT_PREFIX = (("model.language_model.", "model."),)
MAMBA2_INIT = (  # plain-weight norms and D around 1 (the Mamba2 hybrids' and OLMo-Hybrid's)
    (".A_log", "a_log"),
    (".dt_bias", "dt_bias"),
    ("conv1d.weight", "conv"),
    (".D", "norm1"),
    ("norm.weight", "norm1"),
    ("norm_f.weight", "norm1"),
)
LFM_INIT = ((".conv.conv.weight", "conv"), ("norm.weight", "norm1"))  # LFM2's and LFM3's
QWEN_INIT = (  # zero-centred norms, the GDN gated norm around 1
    (".A_log", "a_log"),
    (".dt_bias", "dt_bias"),
    ("conv1d.weight", "conv"),
    ("linear_attn.norm.weight", "norm1"),
    ("norm.weight", "norm0"),
    ("norm_embedding.weight", "norm0"),
    ("norm_hidden.weight", "norm0"),
)
_MM = "hybrid_serve.models"
_MK = "hybrid_serve.make_model"
_QWEN = dict(
    model_class=f"{_MM}.qwen3_next.Qwen3NextForCausalLM",
    config_class=f"{_MM}.qwen3_next_config.Qwen3NextConfig",
    preset_module=f"{_MK}.qwen3_next_preset",
    presets=(f"{_MK}.qwen3_next_preset.PRESETS", f"{_MK}.real_shapes.REAL_SHAPES"),
    init_rules=QWEN_INIT,
    preset_rules=("stacked",),  # the text model's prefix stays (a wrapper adds its own)
    preset_extra=f"{_MK}.qwen3_next_preset.mtp_head",
)
_MAMBA2 = dict(
    config_class=f"{_MM}.mamba2_hybrid_config.Mamba2HybridConfig",
    preset_module=f"{_MK}.mamba2_hybrid_preset",
    presets=(
        f"{_MK}.mamba2_hybrid_preset.MAMBA2_HYBRID_PRESETS",
        f"{_MK}.mamba2_hybrid_preset.MAMBA2_HYBRID_REAL_SHAPES",
    ),
    init_rules=MAMBA2_INIT,
)

FAMILIES: tuple[Family, ...] = (
    Family(
        name="Qwen3-Next",
        types=(ModelType("qwen3_next", "Qwen3NextForCausalLM", NameRules(stacked=QWEN2_MOE)),),
        chat_template="qwen3-next-instruct",
        tool_call_format="qwen25",
        reasoning_format=None,
        **_QWEN,
    ),
    Family(
        name="Qwen3.5 (dense)",
        types=(
            ModelType(
                "qwen3_5_text", "Qwen3_5ForCausalLM", NameRules(prefixes=QWEN3_5_TEXT_PREFIX)
            ),
            # the wrapper's language model always sits under model.language_model.: its text
            # model's prefix rule is scoped inside it
            ModelType("qwen3_5", "Qwen3_5ForConditionalGeneration"),
        ),
        chat_template="qwen3.5",
        tool_call_format="qwen3_coder",
        reasoning_format="qwen3",
        **_QWEN,
    ),
    Family(
        name="Qwen3.5 (MoE)",
        types=(
            ModelType(
                "qwen3_5_moe_text",
                "Qwen3_5MoeForCausalLM",
                NameRules(prefixes=QWEN3_5_TEXT_PREFIX, stacked=QWEN2_MOE),
            ),
            ModelType(
                "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", NameRules(stacked=QWEN2_MOE)
            ),
        ),
        chat_template="qwen3.5",
        tool_call_format="qwen3_coder",
        reasoning_format="qwen3",
        **_QWEN,
    ),
    Family(
        name="NemotronH",
        types=(
            ModelType(
                "nemotron_h",
                "NemotronHForCausalLM",
                NameRules(
                    prefixes=(("backbone.", "model."),),
                    stacked=(
                        ("mixer.experts.up_proj", ("up_proj",)),
                        ("mixer.experts.down_proj", ("down_proj",)),
                    ),
                ),
            ),
        ),
        model_class=f"{_MM}.nemotron_h.NemotronHForCausalLM",
        config_class=f"{_MM}.nemotron_h_config.NemotronHConfig",
        preset_module=f"{_MK}.nemotron_h_preset",
        presets=(
            f"{_MK}.nemotron_h_preset.NEMOTRON_H_PRESETS",
            f"{_MK}.nemotron_h_preset.NEMOTRON_H_REAL_SHAPES",
            f"{_MK}.nemotron_h_preset.NEMOTRON_H_SCALED",
        ),
        chat_template="nemotron-3-nano",
        tool_call_format="qwen3_coder",
        reasoning_format="qwen3",
        init_rules=MAMBA2_INIT,
        preset_extra=f"{_MK}.nemotron_h_preset.mtp_head",
    ),
    Family(
        name="Granite-4.0-H",
        types=(
            ModelType(
                "granitemoehybrid",
                "GraniteMoeHybridForCausalLM",
                NameRules(
                    renames=(
                        (
                            "block_sparse_moe.input_linear.weight",
                            "block_sparse_moe.experts.gate_up_proj",
                        ),
                        (
                            "block_sparse_moe.output_linear.weight",
                            "block_sparse_moe.experts.down_proj",
                        ),
                        ("block_sparse_moe.router.layer.weight", "block_sparse_moe.router.weight"),
                    )
                ),
            ),
        ),
        model_class=f"{_MM}.granite_moe_hybrid.GraniteMoeHybridForCausalLM",
        chat_template="granite-4.0",
        tool_call_format="qwen25",
        reasoning_format=None,
        **_MAMBA2,
    ),
    Family(
        name="Bamba",
        types=(ModelType("bamba", "BambaForCausalLM"),),  # transformers has no rule for it
        model_class=f"{_MM}.bamba.BambaForCausalLM",
        chat_template="qwen3-next-instruct",
        tool_call_format="qwen25",
        reasoning_format=None,
        **_MAMBA2,
    ),
    Family(
        name="Falcon-H1",
        types=(ModelType("falcon_h1", "FalconH1ForCausalLM"),),
        model_class=f"{_MM}.bamba.BambaForCausalLM",
        chat_template="qwen3-next-instruct",
        tool_call_format="qwen25",
        reasoning_format=None,
        **_MAMBA2,
    ),
    Family(
        name="OLMo-Hybrid",
        types=(
            ModelType(
                "olmo_hybrid",
                "OlmoHybridForCausalLM",
                NameRules(
                    renames=(
                        ("attention_layer_norm", "input_layernorm"),
                        ("feedforward_layer_norm", "post_attention_layernorm"),
                    ),
                    joined=(
                        (
                            "linear_attn.conv1d.weight",
                            (
                                ("linear_attn.q_conv1d.weight", "linear_key_dim"),
                                ("linear_attn.k_conv1d.weight", "linear_key_dim"),
                                ("linear_attn.v_conv1d.weight", "linear_value_dim"),
                            ),
                        ),
                    ),
                ),
            ),
        ),
        model_class=f"{_MM}.olmo_hybrid.OlmoHybridForCausalLM",
        config_class=f"{_MM}.olmo_hybrid_config.OlmoHybridConfig",
        preset_module=f"{_MK}.olmo_hybrid_preset",
        presets=(
            f"{_MK}.olmo_hybrid_preset.OLMO_HYBRID_PRESETS",
            f"{_MK}.olmo_hybrid_preset.OLMO_HYBRID_REAL_SHAPES",
        ),
        chat_template="qwen3-next-instruct",
        tool_call_format="qwen25",
        reasoning_format=None,
        init_rules=MAMBA2_INIT,
        # the release's layout as vLLM reads it: the conv split per q/k/v, the norms under
        # transformers' names
        preset_rules=("joined",),
    ),
    Family(
        name="LFM2",
        types=(
            ModelType("lfm2", "Lfm2ForCausalLM"),  # transformers has no rule for it
            ModelType(
                "lfm2_moe",
                "Lfm2MoeForCausalLM",
                NameRules(
                    stacked=(
                        ("feed_forward.experts.gate_up_proj", ("w1", "w3")),
                        ("feed_forward.experts.down_proj", ("w2",)),
                    )
                ),
            ),
        ),
        model_class=f"{_MM}.lfm2.Lfm2ForCausalLM",
        config_class=f"{_MM}.lfm2_config.Lfm2Config",
        preset_module=f"{_MK}.lfm2_preset",
        presets=(
            f"{_MK}.lfm2_preset.LFM2_PRESETS",
            f"{_MK}.lfm2_preset.LFM2_REAL_SHAPES",
            f"{_MK}.lfm2_preset.LFM2_FULL_SIZE",
        ),
        chat_template="lfm2",
        tool_call_format="pythonic",
        reasoning_format=None,
        init_rules=LFM_INIT,
    ),
    Family(
        name="LFM3",
        types=(
            ModelType(
                "lfm3",
                "Lfm3ForCausalLM",
                NameRules(renames=(("self_attn.gate_proj", "self_attn.g_proj"),)),
            ),
        ),
        model_class=f"{_MM}.lfm3.Lfm3ForCausalLM",
        config_class=f"{_MM}.lfm3_config.Lfm3Config",
        preset_module=f"{_MK}.lfm3_preset",
        presets=(f"{_MK}.lfm3_preset.LFM3_PRESETS", f"{_MK}.lfm3_preset.LFM3_REAL_SHAPES"),
        chat_template="lfm2",
        tool_call_format="pythonic",  # as LFM2's row: the lfm2 template's calls
        reasoning_format=None,
        init_rules=LFM_INIT,
    ),
    Family(
        name="Kimi-Linear",
        types=(
            ModelType(
                "kimi_linear",
                "KimiLinearForCausalLM",
                NameRules(
                    renames=(
                        ("self_attn.f_a_proj.", "self_attn.forget_gate.f_a_proj."),
                        ("self_attn.f_b_proj.", "self_attn.forget_gate.f_b_proj."),
                        ("self_attn.dt_bias", "self_attn.forget_gate.dt_bias"),
                        ("self_attn.A_log", "self_attn.forget_gate.A_log"),
                        (".block_sparse_moe.", ".mlp."),
                    ),
                    stacked=(
                        ("mlp.experts.gate_up_proj", ("w1", "w3")),
                        ("mlp.experts.down_proj", ("w2",)),
                    ),
                    joined=(
                        (
                            "self_attn.conv1d.weight",
                            tuple(
                                (f"self_attn.{x}_conv1d.weight", "linear_qkv_dim") for x in "qkv"
                            ),
                        ),
                    ),
                ),
            ),
        ),
        model_class=f"{_MM}.kimi_linear.KimiLinearForCausalLM",
        config_class=f"{_MM}.kimi_linear_config.KimiLinearConfig",
        preset_module=f"{_MK}.kimi_linear_preset",
        presets=(
            f"{_MK}.kimi_linear_preset.KIMI_LINEAR_PRESETS",
            f"{_MK}.kimi_linear_preset.KIMI_LINEAR_REAL_SHAPES",
            f"{_MK}.kimi_linear_preset.KIMI_LINEAR_BENCH_PRESETS",
        ),
        chat_template="kimi-linear",
        tool_call_format="kimi_k2",
        reasoning_format=None,
        init_rules=(
            (".A_log", "a_log"),
            (".dt_bias", "dt_bias"),
            ("conv1d.weight", "conv"),
            ("norm.weight", "norm1"),
        ),
    ),
    Family(
        name="Ling-3",
        types=(
            ModelType(
                "bailing_hybrid",
                "BailingHybridForCausalLM",
                NameRules(
                    prefixes=(("model.word_embeddings.", "model.embed_tokens."),),
                    # the renames inside self_attn first: `.attention.` is the last step
                    renames=(
                        ("self_attn.f_proj.", "self_attn.forget_gate.f_proj."),
                        ("self_attn.dt_bias", "self_attn.forget_gate.dt_bias"),
                        ("self_attn.A_log", "self_attn.forget_gate.A_log"),
                        (".self_attn.dense.", ".self_attn.o_proj."),
                        (".mlp.gate.expert_bias", ".mlp.gate.e_score_correction_bias"),
                        (".attention.", ".self_attn."),
                    ),
                    stacked=QWEN2_MOE,
                    joined=(
                        (
                            "conv1d.weight",
                            tuple((f"{x}_conv1d.weight", "linear_qkv_dim") for x in "qkv"),
                        ),
                    ),
                ),
            ),
        ),
        model_class=f"{_MM}.bailing_hybrid.BailingHybridForCausalLM",
        config_class=f"{_MM}.bailing_hybrid_config.BailingHybridConfig",
        preset_module=f"{_MK}.bailing_hybrid_preset",
        presets=(
            f"{_MK}.bailing_hybrid_preset.BAILING_HYBRID_PRESETS",
            f"{_MK}.bailing_hybrid_preset.BAILING_HYBRID_REAL_SHAPES",
        ),
        chat_template="ling-3",
        tool_call_format="ling3",
        reasoning_format="ling3",
        init_rules=(
            (".A_log", "a_log"),
            (".dt_bias", "dt_bias"),
            ("conv1d.weight", "conv"),
            ("norm.weight", "norm1"),
        ),
        preset_extra=f"{_MK}.bailing_hybrid_preset.mtp_head",
    ),
)

NAME_RULES: dict[str, NameRules] = {t.name: t.rules for f in FAMILIES for t in f.types}


def family_of_type(model_type: str) -> Family:
    """The row that reads `model_type`; ValueError for an unsupported one."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    known = ", ".join(t for f in FAMILIES for t in f.model_types)
    raise ValueError(f"unsupported architecture: model_type {model_type!r} (supported: {known})")


def types_read_by(config_class: str) -> tuple[str, ...]:
    """The model_types of the rows whose config class is `config_class` (a dotted path)."""
    return tuple(t for f in FAMILIES if f.config_class == config_class for t in f.model_types)


def resolve(path: str) -> Any:
    """The attribute a dotted path `module.attribute` names, its module imported on first use."""
    module, _, attribute = path.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


def markdown_rows() -> list[str]:
    """The README table's family and `model_type` cells, one `| name | types |` line a row."""
    return [f"| {f.name} | {', '.join(f'`{t}`' for t in f.model_types)} |" for f in FAMILIES]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--markdown", action="store_true", help="the README table's family / model_type cells"
    )
    args = parser.parse_args(argv)
    lines = markdown_rows() if args.markdown else [f.name for f in FAMILIES]
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
