"""Gated full attention of one decode step after its projections, per layer: pure-torch
reference op.

    q, gate = per-head halves of qg;  q = rope(rms_norm(q));  k = rope(rms_norm(k))
    KV pool[out_loc] = k, v
    y = softmax(q k_cache^T * scale) v_cache * sigmoid(gate)        -> [T, nH * D]

RMSNorms are zero-centred (`kernels.rmsnorm.rms_norm`), RoPE is partial NeoX (`apply_rope`: the
first `rot` channels of a head rotate in pairs (j, j + rot/2)). The pool is the KV pool's whole
[layers, locs, nKV, D] buffers (`k_all`, `v_all`; `layer` picks one); keys of request t are read
at `req_to_token[req_slots[t], :seq_lens[t]]` after the new tokens are written, so a request
sees its own new token. This reference composes the unfused ops it is given (by default the
references of `rms_norm`, `store_kv` and `decode_attention`); `kernels.cpp_fused.attn_decode`
does it all in one C++ call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybrid_serve.kernels.attention import decode_attention, store_kv
from hybrid_serve.kernels.rmsnorm import rms_norm


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, rot] -> x with its first rot channels rotated."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


def attn_decode(
    qg: torch.Tensor,  # [T, nH * 2D]: per head D query channels, then D gate channels
    k: torch.Tensor,  # [T, nKV * D]
    v: torch.Tensor,  # [T, nKV * D]
    q_norm_w: torch.Tensor,  # [D]
    k_norm_w: torch.Tensor,  # [D]
    cos: torch.Tensor,  # [T, rot]
    sin: torch.Tensor,  # [T, rot]
    k_all: torch.Tensor,  # [layers, locs, nKV, D], written at out_loc
    v_all: torch.Tensor,
    layer: int,
    out_loc: torch.Tensor,  # [T]
    req_to_token: torch.Tensor,  # [rows, max_context]
    req_slots: torch.Tensor,  # [T]
    seq_lens: torch.Tensor,  # [T], the new token included
    num_heads: int,
    scale: float,
    eps: float,
    max_seq_len: int | None = None,  # max(seq_lens) when the caller knows it (no host sync)
    *,
    rms_norm: Callable = rms_norm,
    store_kv: Callable = store_kv,
    decode_attention: Callable = decode_attention,
) -> torch.Tensor:
    """Returns y [T, nH * D] in qg's dtype (ready for o_proj)."""
    T, (nKV, D) = qg.shape[0], k_all.shape[2:]
    q, gate = qg.view(T, num_heads, 2 * D).chunk(2, dim=-1)
    q = apply_rope(rms_norm(q, q_norm_w, eps), cos, sin)
    k = apply_rope(rms_norm(k.view(T, nKV, D), k_norm_w, eps), cos, sin)
    k_buf, v_buf = k_all[layer], v_all[layer]
    store_kv(k_buf, v_buf, out_loc.long(), k, v.view(T, nKV, D))
    o = decode_attention(q, k_buf, v_buf, req_to_token, req_slots, seq_lens, scale, max_seq_len)
    return o.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))
