"""The decode step's kernels as ops torch.compile can call without tracing into them.

`scheduler.graph_runner` compiles the CPU decode forward with torch.compile (inductor). Dynamo
cannot trace the C++ kernels' in-place pool updates, the MoE's data-dependent expert loop or a
decode attention whose key length is read on the host, and writing into views of the pools
(`pool[layer][slots] = ...`) makes inductor copy whole pools every step. So:

- the C++ kernels' own ops (`torch.ops.hybrid_serve.*`) get fake (meta) implementations
  (`enable_cpp_in_graphs`, which `scheduler.cpu_compile` calls) and graphs call them directly:
  the GEMVs, the fused decode ops (MoE block, attention glue with its KV write, the GDN decode)
  and the GDN recurrent and conv updates; the in-place ones write the pool through a view of
  the layer (inductor passes the view; no pool copy, checked in its generated code);
- everything else here is a torch.library custom op with a fake implementation that takes a
  WHOLE pool tensor plus a layer index and mutates it in place (`mutates_args`, re-inplaced on
  graph inputs): KV store, decode attention, the routed experts, and the GDN updates when the
  C++ kernels are off. Their real implementations call the same dispatched functions the eager
  path calls (`kernels.*`, `models.layers.Experts.forward`).

A Python custom op costs several times a decode-sized GEMV per call, hence the direct C++ ops.
The model calls the wrappers below (`decode_*`, `store_kv`, `decode_attention`, `experts`;
`kernels.linear` traces `traced_linear`): outside compilation they call the dispatched kernels
directly (no op overhead), while tracing they emit the ops.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

import kernels
from kernels import dispatch

if TYPE_CHECKING:
    from mem_cache.kv_pool import KVPool
    from models.forward_batch import ForwardBatch

NS = "hybrid_serve_graph"
_in_graph: dict[str, bool] = {}  # "cpp": graphs call the C++ kernels' ops (enable_cpp_in_graphs)


# ---- Gated DeltaNet decode: conv window shift and recurrent update, in place on the pool -----
@torch.library.custom_op(f"{NS}::conv_update", mutates_args=("conv_pool",))
def _conv_update(
    x: torch.Tensor, conv_pool: torch.Tensor, layer: int, weight: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    return kernels.causal_conv1d_update(x, conv_pool[layer], weight, None, "silu", slots)


@_conv_update.register_fake
def _(x, conv_pool, layer, weight, slots):
    return torch.empty_like(x)


@torch.library.custom_op(f"{NS}::recurrent_update", mutates_args=("ssm_pool",))
def _recurrent_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_pool: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
) -> torch.Tensor:
    out, _ = kernels.fused_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=ssm_pool[layer], initial_state_indices=slots,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return out


@_recurrent_update.register_fake
def _(q, k, v, g, beta, ssm_pool, layer, slots):
    return v.new_empty(v.shape, dtype=q.dtype)


def decode_conv_update(
    x: torch.Tensor, conv_state: torch.Tensor, layer: int, weight: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """silu(causal conv1d) decode update of `conv_state[layer]` (the pool's whole [layers, ...]
    tensor) at `slots`; the same as `kernels.causal_conv1d_update` on that layer."""
    if torch.compiler.is_compiling():
        if _in_graph.get("cpp") and conv_state.dtype == torch.float32:  # the C++ op, in place
            return torch.ops.hybrid_serve.conv1d_update_pool(
                x.float().contiguous(), conv_state[layer], weight.float().contiguous(),
                slots.long().contiguous(), True,
            ).to(x.dtype)  # fmt: skip
        return torch.ops.hybrid_serve_graph.conv_update(x, conv_state, layer, weight, slots)
    return kernels.causal_conv1d_update(x, conv_state[layer], weight, None, "silu", slots)


def decode_recurrent_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
) -> torch.Tensor:
    """`kernels.fused_recurrent_gated_delta_rule` (qk l2-normalised) on `ssm_state[layer]` at
    `slots`, in place; returns the output [B, 1, HV, dv]."""
    if torch.compiler.is_compiling():
        if _in_graph.get("cpp") and ssm_state.dtype == torch.float32:  # the C++ op, in place
            q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
            return torch.ops.hybrid_serve.gdr_recurrent_pool(
                q, k, v, g, beta, ssm_state[layer], slots.long().contiguous(),
                q.shape[-1] ** -0.5, True,
            )  # fmt: skip
        return torch.ops.hybrid_serve_graph.recurrent_update(
            q, k, v, g, beta, ssm_state, layer, slots
        )
    out, _ = kernels.fused_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=ssm_state[layer], initial_state_indices=slots,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return out


# ---- attention decode: KV store and attention over the token-addressed KV pool ---------------
@torch.library.custom_op(f"{NS}::store_kv", mutates_args=("k_pool", "v_pool"))
def _store_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    layer: int,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    kernels.store_kv(k_pool[layer], v_pool[layer], loc, k, v)


@_store_kv.register_fake
def _(k_pool, v_pool, layer, loc, k, v):
    return None


@torch.library.custom_op(f"{NS}::decode_attention", mutates_args=())
def _decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    layer: int,
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    # the key length is read from seq_lens here, at run time, so no graph depends on it
    return kernels.decode_attention(
        q, k_pool[layer], v_pool[layer], req_to_token, req_slots, seq_lens, scale, None
    )


@_decode_attention.register_fake
def _(q, k_pool, v_pool, layer, req_to_token, req_slots, seq_lens, scale):
    return torch.empty_like(q)


def store_kv(pool: KVPool, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """`pool.set_kv(layer, loc, k, v)`; while compiling, one op on the pool's whole buffers."""
    if torch.compiler.is_compiling():
        torch.ops.hybrid_serve_graph.store_kv(pool.k_all, pool.v_all, layer, loc, k, v)
    else:
        pool.set_kv(layer, loc, k, v)


def decode_attention(
    q: torch.Tensor, batch: ForwardBatch, layer: int, scale: float
) -> torch.Tensor:
    """`kernels.decode_attention` of a decode batch over layer `layer` of its KV pool. While
    compiling the key length comes from `seq_lens` at run time: `batch.max_seq_len`, a host int
    that changes every step, is read only outside compilation (a graph would depend on it)."""
    if torch.compiler.is_compiling():
        return torch.ops.hybrid_serve_graph.decode_attention(
            q, batch.kv_pool.k_all, batch.kv_pool.v_all, layer, batch.req_to_token,
            batch.req_slots, batch.seq_lens, scale,
        )  # fmt: skip
    k_buf, v_buf = batch.kv_pool.get_kv(layer)
    return kernels.decode_attention(
        q, k_buf, v_buf, batch.req_to_token, batch.req_slots, batch.seq_lens, scale,
        batch.max_seq_len or None,
    )  # fmt: skip


# ---- dense layers ----------------------------------------------------------------------------
# In a graph the linear layers call the C++ GEMV op (`torch.ops.hybrid_serve.skinny_linear`)
# directly: a Python custom op costs several times the GEMV itself at decode sizes. The choice
# is `kernels.linear_cpp`'s (its row limits), taken while tracing.
def enable_cpp_in_graphs() -> bool:
    """Register fake implementations of the C++ kernels' ops, so graphs can call them, when the
    dispatcher uses those kernels on CPU; afterwards `traced_linear` calls them. True if so."""
    if "cpp" not in _in_graph:
        from kernels import cpp_build, dispatch

        ok = dispatch.use_cpp(torch.empty(0)) and cpp_build.available()
        if ok:
            torch.library.register_fake("hybrid_serve::skinny_linear")(_skinny_linear_fake)
            torch.library.register_fake("hybrid_serve::gdr_recurrent_pool")(_gdr_fake)
            torch.library.register_fake("hybrid_serve::conv1d_update_pool")(_conv_fake)
            torch.library.register_fake("hybrid_serve::gdn_decode")(_gdn_decode_fake)
            torch.library.register_fake("hybrid_serve::skinny_linear_multi")(_multi_fake)
            torch.library.register_fake("hybrid_serve::moe_decode")(_moe_decode_fake)
            torch.library.register_fake("hybrid_serve::attn_decode")(_attn_decode_fake)
        _in_graph["cpp"] = ok
    return _in_graph["cpp"]


def cpp_in_graphs() -> bool:
    """Whether `enable_cpp_in_graphs` ran and graphs call the C++ kernels' ops."""
    return bool(_in_graph.get("cpp"))


def cpp_ops():
    """The C++ kernels' ops for a `kernels.*_cpp` wrapper to call now: the loaded library
    eagerly, the op namespace while torch.compile traces once `enable_cpp_in_graphs` ran; None
    where the wrapper must run its reference (not built, or tracing without the fakes)."""
    if torch.compiler.is_compiling():
        return torch.ops.hybrid_serve if cpp_in_graphs() else None
    from kernels import cpp_build

    return cpp_build.load()


def fused_in_graphs() -> bool:
    """Whether graphs call the fused decode ops (MoE block, attention glue) as the eager step
    does: the C++ kernels are in graphs and the fusions are on (`HYBRID_SERVE_FUSIONS`). Their
    references follow the routing or read lengths on the host, which graphs cannot."""
    return cpp_in_graphs() and dispatch.fusions_enabled()


def fused_decode_here() -> bool:
    """Whether the model calls its fused decode ops now: eagerly always (each op then picks
    C++ or its reference), while torch.compile traces only when `fused_in_graphs`."""
    return not torch.compiler.is_compiling() or fused_in_graphs()


def _skinny_linear_fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


def _gdr_fake(q, k, v, g, beta, pool, indices, scale, l2norm):
    return v.new_empty(v.shape)


def _conv_fake(x, conv_state, weight, indices, silu):
    return x.new_empty(x.shape)


def _multi_fake(x, weights):
    return [x.new_empty(x.shape[0], w.shape[0]) for w in weights]


def _moe_decode_fake(x, *_):
    return torch.empty_like(x)


def _attn_decode_fake(qg, k, v, q_norm_w, k_norm_w, cos, sin, k_buf, v_buf, *rest):
    num_heads = rest[-3]
    return qg.new_empty(qg.shape[0], num_heads * q_norm_w.shape[0])


def _gdn_decode_fake(qkvz, ba, conv_state, conv_weight, ssm_state, A_log, dt_bias, norm_w, *_):
    return qkvz.new_empty(qkvz.shape[0], ssm_state.shape[1] * ssm_state.shape[3])


def traced_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What torch.compile traces for `kernels.linear`: the C++ GEMV op where `linear_cpp` would
    use it (fp32 activations, fp32 or bf16 weights, up to its row limit), else the reference."""
    from kernels.linear import linear as reference_linear
    from kernels.linear_cpp import SKINNY_ROWS

    wdt = weight.dtype
    if (
        not _in_graph.get("cpp")
        or x.dtype != torch.float32
        or wdt not in (torch.float32, torch.bfloat16)
        or weight.dim() != 2
    ):
        return reference_linear(x, weight, bias)
    K = x.shape[-1]
    M = x.numel() // K
    if M > SKINNY_ROWS:
        return reference_linear(x, weight, bias)
    y = torch.ops.hybrid_serve.skinny_linear(x.reshape(M, K).contiguous(), weight.contiguous())
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


# ---- routed experts --------------------------------------------------------------------------
# The op names its `Experts` module by a number (`number_experts`, called before compiling, in
# module order: a restarted server numbers alike and hits the FX graph cache). Weak references:
# a dropped model is not kept alive by compiled graphs that mention it.
_experts: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
KEY_ATTR = "graph_op_key"


def number_experts(model: nn.Module) -> None:
    """Give every `Experts` module of `model` a key for the `experts` op (once per module)."""
    for module in model.modules():
        if type(module).__name__ == "Experts" and not hasattr(module, KEY_ATTR):
            key = max(_experts, default=-1) + 1
            _experts[key] = module
            setattr(module, KEY_ATTR, key)


@torch.library.custom_op(f"{NS}::experts", mutates_args=())
def _experts_op(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, key: int
) -> torch.Tensor:
    return _experts[key](x, topk_ids, topk_w)


@_experts_op.register_fake
def _(x, topk_ids, topk_w, key):
    return torch.empty_like(x)


def experts(
    module: nn.Module, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor
) -> torch.Tensor:
    """`module(x, topk_ids, topk_w)` for a `models.layers.Experts`; one opaque op while compiling
    (its expert loop follows the routing, which a graph cannot), once `number_experts` ran."""
    key = getattr(module, KEY_ATTR, None)
    if key is None or not torch.compiler.is_compiling():
        return module(x, topk_ids, topk_w)
    return torch.ops.hybrid_serve_graph.experts(x, topk_ids, topk_w, key)


dispatch.TRACED["traced_linear"] = traced_linear
