"""When the CPU decode plan cannot replay a model's decode step, and what setting would let it.

The plan applies where the model's layers are of a kind a builder describes
(`plan_builders.BLOCKS`), its kernel set is the C++ one with its fused decode ops
(`kernels.kernel_set.cpp_set`), on one rank (no tensor parallelism), with no biases but the
Mamba2 convs', fp32 norms, states and KV, and fp32, bf16 or quantized matrices (`MATRIX_DTYPES`);
and over pools whose states and KV are contiguous fp32. `refusal` and `pools_refusal` say
(why not, the setting that would let a plan apply), or None where the plan applies; the last
clause is one of `NO_SETTING`, `C_KERNELS`, `DTYPES` or a flag.
"""

from __future__ import annotations

import torch

from hybrid_serve.kernels.quant import CPP_DTYPES
from hybrid_serve.kernels.settings import FUSIONS_ENV, KERNELS_ENV
from hybrid_serve.models.hybrid_lm import HybridForCausalLM
from hybrid_serve.models.layers import MLP, SparseMoE
from hybrid_serve.models.loader import matrices
from hybrid_serve.models.plan_builders import FAMILIES, block_builder, stack_layers
from hybrid_serve.models.qwen3_next_layers import Qwen3NextDecoderLayer

MATRIX_DTYPES = CPP_DTYPES  # `hybrid_serve.models.loader.matrices`; all else fp32

# The last clause of the WARNING a refused plan logs: what would let the plan apply.
NO_SETTING = "no setting avoids it: the plan does not cover this"
C_KERNELS = (
    f"{KERNELS_ENV}=auto or cpp with fp32 activations on the CPU (--dtype float32 or bfloat16) "
    "and the C++ kernels built"
)
DTYPES = "--dtype float32 or bfloat16, or --quantization int8 or int4"
PLAN_LOST = (
    "no CPU decode plan: %s; decode batches run the eager step, each op called from Python, "
    "which is slower than the plan's one C++ call; %s"
)


def refusal(model: HybridForCausalLM) -> tuple[str, str] | None:
    """(why no plan can replay `model`'s decode step, what setting would let one), or None when
    one can."""
    if block_builder(model) is None:
        layers = stack_layers(model)
        kinds = sorted({type(layer).__name__ for layer in layers}) if layers is not None else []
        named = f" of {', '.join(kinds)} layers" if kinds else ""
        why = f"a {type(model).__name__}{named}, which no block builder describes"
        return f"{why} (the plan replays {FAMILIES} layers)", NO_SETTING
    if model.ops.backend != "cpp" or not model.ops.fused:
        why = f"the {model.ops.backend} kernels{'' if model.ops.fused else ' without fusions'}"
        return why, f"{FUSIONS_ENV}=on" if model.ops.backend == "cpp" else C_KERNELS
    if model.tp.enabled:
        return "tensor parallelism (the output projections all-reduce)", "--tp-size 1"
    if next(model.parameters()).device.type != "cpu":
        return "not on the CPU", NO_SETTING
    matrix = {id(p) for p in matrices(model)} - {id(model.embed_tokens.weight)}
    for name, p in model.named_parameters():
        if not p.is_contiguous():
            return f"{name} is not contiguous", NO_SETTING
        if name.endswith(".bias") and not name.endswith("conv1d.bias"):
            return f"a bias ({name})", NO_SETTING
        if p.dtype not in (MATRIX_DTYPES if id(p) in matrix else (torch.float32,)):
            return f"{name} is {p.dtype}", DTYPES
    for layer in stack_layers(model):
        if isinstance(layer, Qwen3NextDecoderLayer) and type(layer.mlp) not in (SparseMoE, MLP):
            return f"a {type(layer.mlp).__name__} layer", NO_SETTING
    return None


def unsupported(model: HybridForCausalLM) -> str | None:
    """Why no plan can replay `model`'s decode step, or None when one can (`refusal`'s why)."""
    found = refusal(model)
    return None if found is None else found[0]


def pools_refusal(kv_pool, mamba_pool, req_to_token: torch.Tensor) -> tuple[str, str] | None:
    """(why the plan cannot run over these pools, what setting would let it), or None: the
    fused ops read fp32 states and KV in place."""
    for name, t in (("K", kv_pool.k_all), ("V", kv_pool.v_all), ("conv", mamba_pool.conv_state),
                    ("SSM", mamba_pool.ssm_state)):  # fmt: skip
        if t.dtype != torch.float32 or not t.is_contiguous():
            why = f"the {name} pool is {t.dtype}{'' if t.is_contiguous() else ', strided'}"
            if not t.is_contiguous():
                return why, NO_SETTING
            return why, "--mamba-ssm-dtype float32" if name == "SSM" else DTYPES
    if req_to_token.dtype not in (torch.int32, torch.int64):
        return f"req_to_token is {req_to_token.dtype}", NO_SETTING
    return None


def pools_unsupported(kv_pool, mamba_pool, req_to_token: torch.Tensor) -> str | None:
    """Why the plan cannot run over these pools, or None (`pools_refusal`'s why)."""
    found = pools_refusal(kv_pool, mamba_pool, req_to_token)
    return None if found is None else found[0]
