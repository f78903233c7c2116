"""The hybrid families' tiny presets and their judge: transformers' own model class, with the one
difference from the trained model patched where its port has one.

    tiny-nemotron-h           NemotronH: G = 8, chunk 128, MoE and MLP blocks, NoPE attention
    tiny-granite-4.0-h        Granite-4.0-H: G = 1, chunk 256, MoE + shared MLP, NoPE
    tiny-granite-4.0-h-dense  Granite-4.0-H without experts (the shared MLP alone)
    tiny-bamba                Bamba: G = 1, chunk 256, partial RoPE
    tiny-falcon-h1            Falcon-H1: attention and Mamba2 in every layer, muP multipliers,
                              G = 2, chunk 128
    tiny-olmo-hybrid          OLMo-Hybrid: Gated DeltaNet and attention layers
    tiny-lfm2                 LFM2: gated short-conv and RoPE attention layers (per-head q/k
                              norms), the MLP width by transformers' rounding rule
    tiny-lfm2-moe             LFM2-MoE: the same layers, dense MLPs then sigmoid-routed experts
                              with an expert bias (per-expert tensors, as released)
    tiny-lfm3                 LFM3: short-conv, full and sliding-window attention layers (per-kind
                              RoPE, a per-head output gate), sandwich norms
    tiny-kimi-linear          Kimi-Linear: KDA and NoPE MLA layers, a dense MLP then grouped
                              sigmoid-routed experts with a shared one (the release's names)

The judge is transformers as it stands: since 5.25 its NemotronH mixer applies the config's
time_step_limit (0, inf) as NVIDIA's code, vLLM, SGLang and we do (earlier ports clamped
dt >= time_step_min; tests/models/test_hybrid_families.py checks the reference no longer does).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from hybrid_serve.make_model.catalog import tiny_presets
from hybrid_serve.models.families import FAMILIES
from hybrid_serve.models.qwen3_next_config import Qwen3NextConfig

# the tiny presets of the family table's rows beyond Qwen's (those not read by Qwen3NextConfig)
FAMILY_PRESETS = tuple(
    name
    for family in FAMILIES
    if family.config_class != f"{Qwen3NextConfig.__module__}.Qwen3NextConfig"
    for name in tiny_presets(family)
)


def hf_reference(path):
    """transformers' model for the checkpoint at `path`, fp32, loaded without a missing or
    unexpected tensor."""
    hf, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), f"transformers did not load the checkpoint cleanly: {info}"
    return hf.eval()
