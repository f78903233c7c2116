"""Causal GQA softmax attention over a token-addressed KV buffer: pure-torch reference ops.

Keys and values of request `r` at positions 0..seq_len-1 live at
`k_buffer[req_to_token[req_slot_r, :seq_len]]`. Callers write the new tokens' K/V into the
buffer *before* calling, so a request attends to its cached prefix and its new tokens alike.
Shapes: q [T, nH, D]; buffers [locs, nKV, D]; nH is a multiple of nKV (query head h reads KV
head h // (nH // nKV)). With a sliding `window` W > 0 (transformers' `sliding_window`), the
query at position p sees only the keys at positions p - W + 1 .. p; 0 (the default): all of
them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def extend_attention(
    q: torch.Tensor,  # [T, nH, D] new tokens of all requests, packed
    k_buffer: torch.Tensor,  # [locs, nKV, D]
    v_buffer: torch.Tensor,  # [locs, nKV, D]
    req_to_token: torch.Tensor,  # [rows, max_context]
    req_slots: torch.Tensor,  # [N]
    prefix_lens: list[int],  # cached tokens per request
    extend_lens: list[int],  # new tokens per request (sum == T)
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Prefill: new token i of request r sees positions 0..prefix_len_r + i (the last `window`
    of them with a window)."""
    out = torch.empty_like(q)
    n_rep = q.shape[1] // k_buffer.shape[1]
    slots = req_slots.tolist()
    start = 0
    for slot, prefix, extend in zip(slots, prefix_lens, extend_lens, strict=True):
        seq = prefix + extend
        locs = req_to_token[slot, :seq].long()
        k = k_buffer[locs].transpose(0, 1)  # [nKV, seq, D]
        v = v_buffer[locs].transpose(0, 1)
        qi = q[start : start + extend].transpose(0, 1)  # [nH, extend, D]
        # query i sits at absolute position prefix + i: mask keys beyond it
        mask = torch.ones(extend, seq, dtype=torch.bool, device=q.device).tril(prefix)
        if window > 0:  # and keys more than window - 1 positions back
            mask &= ~torch.ones_like(mask).tril(prefix - window)
        o = F.scaled_dot_product_attention(
            qi.unsqueeze(0),
            k.repeat_interleave(n_rep, 0).unsqueeze(0).to(q.dtype),
            v.repeat_interleave(n_rep, 0).unsqueeze(0).to(q.dtype),
            attn_mask=mask,
            scale=scale,
        )[0]
        out[start : start + extend] = o.transpose(0, 1)
        start += extend
    return out


def decode_attention(
    q: torch.Tensor,  # [B, nH, D] one token per request
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B] including the new token
    scale: float,
    max_seq_len: int | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Decode: every request's single query attends to all of its seq_len keys (the last
    `window` of them with a window; batched)."""
    B, nH, D = q.shape
    nKV = k_buffer.shape[1]
    L = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    locs = req_to_token[req_slots, :L].long()  # [B, L]
    pos = torch.arange(L, device=q.device).unsqueeze(0)
    valid = pos < seq_lens.unsqueeze(1)  # [B, L]
    if window > 0:
        valid &= pos >= seq_lens.unsqueeze(1) - window
    k = k_buffer[locs].to(q.dtype).permute(0, 2, 1, 3)  # [B, nKV, L, D]
    v = v_buffer[locs].to(q.dtype).permute(0, 2, 1, 3)
    qg = q.reshape(B, nKV, nH // nKV, D)  # [B, nKV, g, D]
    scores = (qg @ k.transpose(-1, -2)).float() * scale  # [B, nKV, g, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1).to(q.dtype)
    return (probs @ v).reshape(B, nH, D)


def store_kv(
    k_buffer: torch.Tensor,  # [locs, nKV, D], written in place
    v_buffer: torch.Tensor,  # [locs, nKV, D], written in place
    loc: torch.Tensor,  # [N] int token locations
    k: torch.Tensor,  # [N, nKV, D]
    v: torch.Tensor,  # [N, nKV, D]
) -> None:
    """k_buffer[loc] = k and v_buffer[loc] = v, cast to the buffer dtype. All tensors on one
    device; repeated locations get one of their rows."""
    loc = loc.long()
    k_buffer.index_copy_(0, loc, k.to(k_buffer.dtype))
    v_buffer.index_copy_(0, loc, v.to(v_buffer.dtype))
