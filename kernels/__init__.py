"""Kernels: each op has a pure-torch reference (`kernels/<family>.py`), a Triton version
(`kernels/<family>_triton.py`) and for some a C++ CPU version (`kernels/<family>_cpp.py`), all
with the same signature. The names exported here dispatch per call: Triton on CUDA tensors, C++
(where it exists and builds) or torch on CPU, or as forced by `HYBRID_SERVE_KERNELS` (see
`kernels.dispatch`)."""

from kernels import (
    attention,
    attn_step,
    causal_conv1d,
    experts,
    gated_delta_rule,
    gdn_step,
    linear,
    moe_step,
    multi_linear,
    rmsnorm,
)
from kernels.dispatch import dispatching

causal_conv1d_fn = dispatching(
    causal_conv1d.causal_conv1d_fn, "causal_conv1d_triton", "causal_conv1d_cpp"
)
causal_conv1d_update = dispatching(
    causal_conv1d.causal_conv1d_update, "causal_conv1d_triton", "causal_conv1d_cpp"
)
chunk_gated_delta_rule = dispatching(
    gated_delta_rule.chunk_gated_delta_rule, "gated_delta_rule_triton", "gated_delta_rule_cpp"
)
fused_recurrent_gated_delta_rule = dispatching(
    gated_delta_rule.fused_recurrent_gated_delta_rule,
    "gated_delta_rule_triton",
    "gated_delta_rule_cpp",
)
extend_attention = dispatching(attention.extend_attention, "attention_triton")
decode_attention = dispatching(attention.decode_attention, "attention_triton")
store_kv = dispatching(attention.store_kv, "attention_triton")
rms_norm_gated = dispatching(rmsnorm.rms_norm_gated, "rmsnorm_triton", "rmsnorm_cpp")
rms_norm = dispatching(rmsnorm.rms_norm, None, "rmsnorm_cpp", fusion=True)
fused_add_rmsnorm = dispatching(rmsnorm.fused_add_rmsnorm, None, "rmsnorm_cpp", fusion=True)
gdn_decode = dispatching(gdn_step.gdn_decode, None, "gdn_step_cpp", fusion=True)
moe_decode = dispatching(moe_step.moe_decode, None, "moe_step_cpp", fusion=True)
linear_multi = dispatching(multi_linear.linear_multi, None, "multi_linear_cpp", fusion=True)
attn_decode = dispatching(attn_step.attn_decode, None, "attn_step_cpp", fusion=True)
linear = dispatching(linear.linear, None, "linear_cpp")
routed_experts = dispatching(experts.routed_experts, None, "experts_cpp")

__all__ = [
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "extend_attention",
    "decode_attention",
    "store_kv",
    "rms_norm_gated",
    "rms_norm",
    "fused_add_rmsnorm",
    "gdn_decode",
    "moe_decode",
    "linear",
    "linear_multi",
    "routed_experts",
]
