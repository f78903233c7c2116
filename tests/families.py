"""The hybrid families' tiny presets and their judge: transformers' own model class, with the one
difference from the trained model patched where its port has one.

    tiny-nemotron-h           NemotronH: G = 8, chunk 128, MoE and MLP blocks, NoPE attention
    tiny-granite-4.0-h        Granite-4.0-H: G = 1, chunk 256, MoE + shared MLP, NoPE
    tiny-granite-4.0-h-dense  Granite-4.0-H without experts (the shared MLP alone)
    tiny-bamba                Bamba: G = 1, chunk 256, partial RoPE
    tiny-falcon-h1            Falcon-H1: attention and Mamba2 in every layer, muP multipliers,
                              G = 2, chunk 128
    tiny-olmo-hybrid          OLMo-Hybrid: Gated DeltaNet and attention layers

Patched: NemotronH's torch path clamps dt >= time_step_min (HF PR #48989), where NVIDIA's code,
vLLM and SGLang (and we) apply the config's time_step_limit (0, inf). Granite, Bamba and
Falcon-H1 apply the limit as trained (no difference to patch).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

FAMILY_PRESETS = (
    "tiny-nemotron-h",
    "tiny-granite-4.0-h",
    "tiny-granite-4.0-h-dense",
    "tiny-bamba",
    "tiny-falcon-h1",
    "tiny-olmo-hybrid",
)


def patch_time_step_limit(hf) -> None:
    """transformers' NemotronH mixer clamps dt >= time_step_min in its torch path; the model as
    trained (and every serving peer) uses the config's limit, (0, inf). A no-op for the other
    families."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    for module in hf.modules():
        if isinstance(module, NemotronHMamba2Mixer):
            module.time_step_limit = tuple(hf.config.time_step_limit)


def hf_reference(path, patched: bool = True):
    """transformers' model for the checkpoint at `path`, fp32, loaded without a missing or
    unexpected tensor; with `patched`, as trained (module docstring)."""
    hf, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), f"transformers did not load the checkpoint cleanly: {info}"
    if patched:
        patch_time_step_limit(hf)
    return hf.eval()
