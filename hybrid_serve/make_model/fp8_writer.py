"""Writing block-FP8 checkpoints (`hybrid_serve.models.fp8`'s layout): the presets' FP8 form.

`quantize_tensors` quantizes what the official Qwen3-Next / Qwen3.5 FP8 releases quantize: every
linear layer's and expert's matrix except the embedding, the LM head, the GDN `in_proj_ba` (or
`in_proj_b` / `in_proj_a`), the MoE router (`mlp.gate`), `shared_expert_gate` and the MTP head's
`mtp.fc` (SGLang reads that one as a plain bf16 `nn.Linear` from the Qwen3-Next FP8 release; the
head's decoder layer is quantized like a main layer); vectors and the conv weights stay as they
are. `quantization_config` lists every module left unquantized in `modules_to_not_convert`, as
those releases do.

A family whose release writes its own ignore list (`RELEASE_IGNORES`, by `model_type`: Ling-3's
abbreviated and rootless entries, `make_model.bailing_hybrid_preset.fp8_ignored`) has exactly
that list written, and the modules it names are kept unquantized too, matched as the loader
matches them (`models.fp8.Fp8Config.ignores`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from hybrid_serve.make_model.bailing_hybrid_preset import fp8_ignored as bailing_hybrid_ignored
from hybrid_serve.models.fp8 import E4M3, SCALE_SUFFIX, Fp8Config, module_of, scale_name

E4M3_MAX = 448.0  # the largest finite e4m3 value
KEPT_UNQUANTIZED = (
    "embed_tokens",
    "word_embeddings",  # Ling-3's embedding
    "lm_head",
    "in_proj_ba",
    "in_proj_b",
    "in_proj_a",
    "mlp.gate",
    "shared_expert_gate",
    "conv1d",
    "q_conv1d",  # Kimi-Linear's and Ling-3's KDA convs (3-d, never a linear layer's matrix)
    "k_conv1d",
    "v_conv1d",
    "mtp.fc",
)
FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# model_type -> its release's `modules_to_not_convert` for a checkpoint of these tensor names
RELEASE_IGNORES: dict[str, Callable[[Iterable[str]], tuple[str, ...]]] = {
    "bailing_hybrid": bailing_hybrid_ignored,
}


def release_ignores(model_type: str | None, names: Iterable[str]) -> tuple[str, ...] | None:
    """The ignore list the family's FP8 release writes for tensors `names`; None for the
    families whose releases list every unquantized module by its full name (Qwen's)."""
    rule = RELEASE_IGNORES.get(model_type or "")
    return None if rule is None else rule(names)


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scale_inv) with each block's largest magnitude mapped to 448; an all
    zero block gets scale 1. `dequantize` of the result is the weight rounded to e4m3 per block."""
    rows, cols = weight.shape[-2:]
    br, bc = block
    pad_r, pad_c = -rows % br, -cols % bc
    w = torch.nn.functional.pad(weight.float(), (0, pad_c, 0, pad_r))
    grid = w.reshape(*w.shape[:-2], w.shape[-2] // br, br, w.shape[-1] // bc, bc)
    amax = grid.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    s = scale.repeat_interleave(br, dim=-2)[..., :rows, :].repeat_interleave(bc, dim=-1)[..., :cols]
    q = (weight.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def is_quantized(name: str, tensor: torch.Tensor, ignored: tuple[str, ...] = ()) -> bool:
    """Whether the FP8 presets store checkpoint tensor `name` in FP8 (see the module docstring);
    `ignored`: the release's own ignore list, whose modules stay unquantized as well."""
    if tensor.dim() < 2 or not name.endswith((".weight", *FUSED_EXPERTS)):
        return False
    dotted = f".{module_of(name)}."
    if any(f".{kept}." in dotted for kept in KEPT_UNQUANTIZED):
        return False
    return not (ignored and Fp8Config((1, 1), ignored).ignores(module_of(name)))


def quantize_tensors(
    tensors: dict[str, torch.Tensor], block: tuple[int, int], model_type: str | None = None
) -> dict[str, torch.Tensor]:
    """`tensors` (in order) with each quantized matrix replaced by its e4m3 weight followed by its
    fp32 `_scale_inv`; the others are returned as given. `model_type`: the family, for its
    release's ignore list (`release_ignores`)."""
    ignored = release_ignores(model_type, tensors) or ()
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if is_quantized(name, t, ignored):
            out[name], out[scale_name(name)] = quantize(t, block)
        else:
            out[name] = t
    return out


def quantization_config(
    tensors: dict[str, torch.Tensor], block: tuple[int, int], model_type: str | None = None
) -> dict:
    """The `quantization_config` of a checkpoint holding `tensors` (final names, final dtypes):
    `modules_to_not_convert` is the family's release list (`release_ignores`), else every module
    with an unquantized tensor."""
    listed = release_ignores(model_type, tensors)
    if listed is None:
        kept = {
            module_of(n)
            for n, t in tensors.items()
            if t.dtype != E4M3 and not n.endswith(SCALE_SUFFIX)
        }
        listed = tuple(sorted(kept))
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": list(listed),
    }


def config_quantization(
    shapes: dict[str, tuple[int, ...]], block: tuple[int, int], model_type: str | None = None
) -> dict:
    """The `quantization_config` an FP8 checkpoint of these tensors (name -> shape, as
    `make_model.tensor_specs.checkpoint_shapes` lists them) would have, without any data: for a
    config-only directory served with dummy weights."""
    meta = {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in shapes.items()}
    ignored = release_ignores(model_type, meta) or ()
    return quantization_config(
        {n: t.to(E4M3) if is_quantized(n, t, ignored) else t for n, t in meta.items()},
        block,
        model_type,
    )
