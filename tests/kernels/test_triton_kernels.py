"""Triton kernels against their torch references, on the same inputs.

Without CUDA the kernels run in triton's interpreter (see the `triton_device` fixture), which
is slow: shapes stay small, and `tl.dot` is exercised in fp32/fp16 only (bf16 dots are wrong in
the interpreter). Tolerances: relative RMS error 5e-3 for the chunked delta rule and 2e-3 for
the recurrent one (flash-linear-attention's), allclose at 1e-3 for conv and attention.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_serve.kernels import attention, causal_conv1d, experts, gated_delta_rule, rmsnorm
from hybrid_serve.kernels.causal_conv1d import PAD_SLOT_ID
from hybrid_serve.kernels.kernel_set import triton_module

CONV, GDR, ATTN, NORM, MOE = (
    "causal_conv1d_triton",
    "gated_delta_rule_triton",
    "attention_triton",
    "rmsnorm_triton",
    "fused_moe_triton",
)


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def cu_seqlens(lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *lengths], device=device).cumsum(0)


# ----------------------------------------------------------------------------------------------
# causal conv1d
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_causal_conv1d_fn(triton_device, dtype) -> None:
    dev = triton_device
    torch.manual_seed(0)
    dim, width, slots = 40, 4, 8
    lengths = [5, 1, 2, 11, 3, 2]
    cache = [6, 1, 3, 0, PAD_SLOT_ID, 4]
    has_init = [True, False, True, True, True, True]
    x = torch.randn(sum(lengths), dim, device=dev).to(dtype).t()  # channel-first view, as in GDN
    weight = torch.randn(dim, width, device=dev).to(dtype)
    bias = torch.randn(dim, device=dev).to(dtype)
    states = torch.randn(slots, dim, width - 1, device=dev).to(dtype)
    args = (
        cu_seqlens(lengths, dev),
        torch.tensor(cache, device=dev),
        torch.tensor(has_init, device=dev),
    )

    ref_states, tri_states = states.clone(), states.clone()
    ref = causal_conv1d.causal_conv1d_fn(x.float(), weight.float(), bias.float(), ref_states, *args)
    out = triton_module(CONV, dev).causal_conv1d_fn(x, weight, bias, tri_states, *args)

    assert out.dtype == dtype
    atol = 1e-3 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=1e-3)
    torch.testing.assert_close(tri_states, ref_states.to(dtype), atol=0, rtol=0)


def test_causal_conv1d_update(triton_device) -> None:
    dev = triton_device
    torch.manual_seed(1)
    dim, width, slots = 40, 4, 6
    weight, bias = torch.randn(dim, width, device=dev), torch.randn(dim, device=dev)
    states = torch.randn(slots, dim, width - 1, device=dev)
    conv = triton_module(CONV, dev)
    for indices in ([4, PAD_SLOT_ID, 0, 2], None):
        x = torch.randn(4, dim, device=dev)
        idx = None if indices is None else torch.tensor(indices, device=dev, dtype=torch.int32)
        ref_states, tri_states = states.clone(), states.clone()
        for act in ("silu", None):
            ref = causal_conv1d.causal_conv1d_update(x, ref_states, weight, bias, act, idx)
            out = conv.causal_conv1d_update(x, tri_states, weight, bias, act, idx)
            torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)
            torch.testing.assert_close(tri_states, ref_states, atol=0, rtol=0)
            if indices is not None:
                assert torch.equal(out[1], torch.zeros(dim, device=dev))  # the padded row


# ----------------------------------------------------------------------------------------------
# gated delta rule
# ----------------------------------------------------------------------------------------------


def gdr_inputs(T: int, H: int, HV: int, K: int, V: int, dtype, device, B: int = 1):
    """fla-style stress inputs: decays log-sigmoid(U)/n, n in 0.01..10, some exactly 0."""
    q = torch.randn(B, T, H, K)
    k = torch.randn(B, T, H, K)
    v = torch.randn(B, T, HV, V)
    pick = torch.tensor([0.01, 0.1, 1.0, 10.0])[torch.randint(0, 4, (B, T, HV))]
    g = (F.logsigmoid(torch.rand(B, T, HV)) / pick).masked_fill(torch.rand(B, T, HV) < 0.1, 0)
    beta = torch.rand(B, T, HV).sigmoid()
    return [x.to(device, dtype) for x in (q, k, v)] + [g.to(device), beta.to(device, dtype)]


@pytest.mark.parametrize(
    "offsets",
    [[0, 0, 64, 64], [0, 20, 27, 70], [1, 13, 0, 6]],
    ids=["chunk-aligned", "off-grid", "off-grid-short"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunk_gated_delta_rule_pool_and_tracking(triton_device, dtype, offsets) -> None:
    """Ragged prefill from pool states, final states in place, and snapshots into track slots:
    at chunk boundaries (a sequence's end, mid-sequence) and off them (a round starting off the
    64-token grid: the sequence's chunks then start early, their leading rows masked)."""
    dev = triton_device
    torch.manual_seed(2)
    H, HV, K, V = 1, 2, 16, 24
    lengths = [1, 20, 64, 70]
    q, k, v, g, beta = gdr_inputs(sum(lengths), H, HV, K, V, dtype, dev)
    pool = torch.randn(10, HV, K, V, device=dev)
    kw = dict(
        initial_state_indices=torch.tensor([3, 1, 7, 2], device=dev),
        cu_seqlens=cu_seqlens(lengths, dev),
        use_qk_l2norm_in_kernel=True,
        track_offsets=torch.tensor(offsets, device=dev),
        track_indices=torch.tensor([5, 6, 8, 9], device=dev),  # offset 0: untouched
    )

    ref_pool, tri_pool = pool.clone(), pool.clone()
    ref, _ = gated_delta_rule.chunk_gated_delta_rule(
        *(x.float() for x in (q, k, v, g, beta)), initial_state=ref_pool, **kw
    )
    out, none = triton_module(GDR, dev).chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=tri_pool, **kw
    )

    assert none is None and out.dtype == dtype
    assert rel_rms(out, ref) < 5e-3
    tracked = [slot for slot, off in zip((5, 6, 8, 9), offsets, strict=True) if off]
    for slot in (3, 1, 7, 2, *tracked):
        assert rel_rms(tri_pool[slot], ref_pool[slot]) < 5e-3, f"slot {slot}"
    untouched = [s for s in range(10) if s not in (3, 1, 7, 2, *tracked)]
    assert torch.equal(tri_pool[untouched], pool[untouched])
    assert not torch.equal(ref_pool[tracked], pool[tracked])  # the reference did snapshot


def test_chunk_gated_delta_rule_dense_batch(triton_device) -> None:
    """Dense [B, T] batch, plain initial state (never written), final state returned, GVA 1:1,
    no l2norm, explicit scale, chunk size 16."""
    dev = triton_device
    torch.manual_seed(3)
    q, k, v, g, beta = gdr_inputs(40, 2, 2, 16, 16, torch.float32, dev, B=2)
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    h0 = torch.randn(2, 2, 16, 16, device=dev)
    h0_before = h0.clone()
    kw = dict(scale=0.3, initial_state=h0, output_final_state=True, chunk_size=16)

    ref, ref_ht = gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    out, ht = triton_module(GDR, dev).chunk_gated_delta_rule(q, k, v, g, beta, **kw)

    assert rel_rms(out, ref) < 5e-3 and rel_rms(ht, ref_ht) < 5e-3
    assert torch.equal(h0, h0_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_recurrent_decode_with_padding(triton_device, dtype) -> None:
    """One token per row from the pool, a padded row (index -1): zero output, pool untouched."""
    dev = triton_device
    torch.manual_seed(4)
    H, HV, K, V = 2, 4, 16, 24
    q, k, v, g, beta = (x.transpose(0, 1) for x in gdr_inputs(4, H, HV, K, V, dtype, dev))
    pool = torch.randn(6, HV, K, V, device=dev)
    idx = torch.tensor([5, PAD_SLOT_ID, 1, 2], device=dev)
    live = [0, 2, 3]

    ref_pool, tri_pool = pool.clone(), pool.clone()
    ref, _ = gated_delta_rule.fused_recurrent_gated_delta_rule(
        *(x[live].float() for x in (q, k, v, g, beta)),
        initial_state=ref_pool,
        initial_state_indices=idx[live],
        use_qk_l2norm_in_kernel=True,
    )
    out, _ = triton_module(GDR, dev).fused_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=tri_pool, initial_state_indices=idx,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip

    assert out.shape == (4, 1, HV, V) and out.dtype == dtype
    assert rel_rms(out[live], ref) < 2e-3
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert rel_rms(tri_pool, ref_pool) < 2e-3
    assert torch.equal(tri_pool[[0, 3, 4]], pool[[0, 3, 4]])


def test_fused_recurrent_varlen_multi_token(triton_device) -> None:
    dev = triton_device
    torch.manual_seed(5)
    lengths = [3, 1, 6]
    q, k, v, g, beta = gdr_inputs(sum(lengths), 1, 2, 16, 24, torch.float32, dev)
    h0 = torch.randn(3, 2, 16, 24, device=dev)
    kw = dict(
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=cu_seqlens(lengths, dev),
        use_qk_l2norm_in_kernel=True,
    )

    ref, ref_ht = gated_delta_rule.fused_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    out, ht = triton_module(GDR, dev).fused_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)

    assert rel_rms(out, ref) < 2e-3 and rel_rms(ht, ref_ht) < 2e-3


# ----------------------------------------------------------------------------------------------
# attention, KV store, gated RMSNorm
# ----------------------------------------------------------------------------------------------


def paged_kv(seq_lens: list[int], slots: list[int], nKV: int, D: int, dtype, dev):
    """K/V of each request at scattered locations; unused locations hold large garbage."""
    rows, max_ctx = 8, 80
    req_to_token = torch.randperm(rows * max_ctx + 16)[: rows * max_ctx].reshape(rows, max_ctx)
    k_buf = 50 * torch.randn(rows * max_ctx + 16, nKV, D)
    v_buf = 50 * torch.randn(rows * max_ctx + 16, nKV, D)
    for slot, n in zip(slots, seq_lens, strict=True):
        locs = req_to_token[slot, :n]
        k_buf[locs], v_buf[locs] = torch.randn(n, nKV, D), torch.randn(n, nKV, D)
    return k_buf.to(dev, dtype), v_buf.to(dev, dtype), req_to_token.to(dev, torch.int32)


@pytest.mark.parametrize(
    ("dtype", "window"), [(torch.float32, 0), (torch.float16, 0), (torch.float32, 20)]
)
def test_extend_attention(triton_device, dtype, window) -> None:
    """With a window of 20 the 40-token prefill's second query block starts at key 13."""
    dev = triton_device
    torch.manual_seed(6)
    nKV, n_rep, D = 2, 2, 24  # D not a power of two: masked head dim
    prefix_lens, extend_lens, slots = [0, 37, 5], [40, 3, 1], [3, 0, 6]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    k_buf, v_buf, r2t = paged_kv(seq_lens, slots, nKV, D, dtype, dev)
    q = torch.randn(sum(extend_lens), nKV * n_rep, D, device=dev).to(dtype)
    args = (q, k_buf, v_buf, r2t, torch.tensor(slots, device=dev), prefix_lens, extend_lens)

    ref = attention.extend_attention(
        *(a.float() if a is q else a for a in args), D**-0.5, window=window
    )
    out = triton_module(ATTN, dev).extend_attention(*args, D**-0.5, window=window)

    atol = 1e-3 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=1e-3)


@pytest.mark.parametrize("window", [0, 50])
def test_decode_attention(triton_device, window) -> None:
    dev = triton_device
    torch.manual_seed(7)
    nKV, n_rep, D = 2, 3, 16
    seq_lens, slots = [1, 9, 70, 33], [6, 2, 0, 7]
    k_buf, v_buf, r2t = paged_kv(seq_lens, slots, nKV, D, torch.float32, dev)
    q = torch.randn(4, nKV * n_rep, D, device=dev)
    slots_t, seq_lens_t = torch.tensor(slots, device=dev), torch.tensor(seq_lens, device=dev)
    args = (q, k_buf, v_buf, r2t, slots_t, seq_lens_t)

    ref = attention.decode_attention(*args, 0.25, window=window)
    out = triton_module(ATTN, dev).decode_attention(*args, 0.25, max(seq_lens), window=window)

    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)


def test_store_kv(triton_device) -> None:
    dev = triton_device
    torch.manual_seed(8)
    k_buf, v_buf = torch.randn(20, 2, 24, device=dev), torch.randn(20, 2, 24, device=dev)
    loc = torch.tensor([7, 3, 19, 0], device=dev)
    k = torch.randn(4, 2, 24, device=dev, dtype=torch.float16)  # cast to the buffer dtype
    v = torch.randn(4, 2, 48, device=dev)[..., ::2]  # strided head dim: copied first
    ref_k, ref_v, tri_k, tri_v = k_buf.clone(), v_buf.clone(), k_buf.clone(), v_buf.clone()

    attention.store_kv(ref_k, ref_v, loc, k, v)
    triton_module(ATTN, dev).store_kv(tri_k, tri_v, loc, k, v)

    assert torch.equal(tri_k, ref_k) and torch.equal(tri_v, ref_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gated(triton_device, dtype) -> None:
    dev = triton_device
    torch.manual_seed(9)
    x = torch.randn(37, 24, device=dev).to(dtype)
    z = torch.randn(37, 24, device=dev).to(dtype)
    weight = torch.rand(24, device=dev) + 0.5  # fp32 weight, as a model loaded in fp32 holds

    ref = rmsnorm.rms_norm_gated(x, z, weight.to(dtype), 1e-6)
    out = triton_module(NORM, dev).rms_norm_gated(x, z, weight.to(dtype), 1e-6)

    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: one rounding step
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------------------------
# routed experts
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "experts_n", "top_k", "hidden", "inter"),
    [(1, 8, 2, 64, 32), (7, 16, 2, 48, 40), (40, 64, 4, 64, 96), (3, 512, 10, 32, 16)],
)
def test_fused_moe(triton_device, tokens, experts_n, top_k, hidden, inter) -> None:
    """Odd sizes (hidden and I not multiples of the blocks), experts with no tokens, an expert
    with more rows than a block, and 512 experts (most blocks of the static bound unused)."""
    dev = triton_device
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(dev)
    ids = torch.stack([torch.randperm(experts_n, generator=gen)[:top_k] for _ in range(tokens)])
    if tokens >= 40:
        ids[:, 0] = 3  # one expert takes every token: several blocks of one expert
    w = torch.rand(tokens, top_k, generator=gen).to(dev)
    gate_up = (torch.randn(experts_n, 2 * inter, hidden, generator=gen) * 0.1).to(dev)
    down = (torch.randn(experts_n, hidden, inter, generator=gen) * 0.1).to(dev)
    ids = ids.to(dev)
    moe = triton_module(MOE, dev)
    rows, block_expert = moe.align(ids, experts_n)
    assert rows.numel() == block_expert.numel() * moe.BLOCK_M
    assert sorted(rows[rows < tokens * top_k].tolist()) == list(range(tokens * top_k))
    out = moe.fused_experts(x, ids, w, gate_up, down)
    ref = experts.fused_experts(x, ids, w, gate_up, down)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    empty = moe.fused_experts(x[:0], ids[:0], w[:0], gate_up, down)
    assert empty.shape == (0, hidden)


# ----------------------------------------------------------------------------------------------
# GPU only
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_decode_kernels_replay_in_a_cuda_graph(triton_device) -> None:
    """The decode-path kernels (the routed experts among them) do not sync with the host:
    captured once, a replay on new inputs matches an eager call on the same inputs and pool
    contents."""
    dev = triton_device
    torch.manual_seed(10)
    gdr, conv, attn, moe = (triton_module(m, dev) for m in (GDR, CONV, ATTN, MOE))
    B, H, HV, K, dim = 4, 2, 4, 32, 64
    idx = torch.tensor([3, 1, PAD_SLOT_ID, 2], device=dev)
    pool, conv_pool = torch.randn(5, HV, K, K, device=dev), torch.randn(5, dim, 3, device=dev)
    weight = torch.randn(dim, 4, device=dev)
    k_buf, v_buf, r2t = paged_kv([5, 9, 1, 30], [0, 1, 2, 3], 2, 32, torch.float32, dev)
    slots, seq_lens = torch.arange(4, device=dev), torch.tensor([5, 9, 1, 30], device=dev)
    static = [torch.randn(B, 1, H, K, device=dev) for _ in range(2)] + [
        torch.randn(B, 1, HV, K, device=dev),
        -torch.rand(B, 1, HV, device=dev),
        torch.rand(B, 1, HV, device=dev),
        torch.randn(B, dim, device=dev),
        torch.randn(B, 4, 32, device=dev),
        torch.randn(B, 64, device=dev),  # the MoE's rows
        torch.rand(B, 2, device=dev),  # and their routing weights
    ]
    ids = torch.randint(0, 8, (B, 2), device=dev)
    gate_up, down = torch.randn(8, 64, 64, device=dev), torch.randn(8, 64, 32, device=dev)

    def step():
        q, k, v, g, beta, x, qa, xm, wm = static
        o, _ = gdr.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, initial_state=pool, initial_state_indices=idx,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        y = conv.causal_conv1d_update(x, conv_pool, weight, None, "silu", idx)
        a = attn.decode_attention(qa, k_buf, v_buf, r2t, slots, seq_lens, 0.2)
        return o, y, a, moe.fused_experts(xm, ids, wm, gate_up, down)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for t in static:
        t.copy_(torch.rand_like(t) - (t < 0).float())  # new inputs, keep the decays <= 0
    ids.copy_(torch.randint(0, 8, ids.shape, device=dev))  # other experts
    saved = pool.clone(), conv_pool.clone()
    graph.replay()
    replayed = [o.clone() for o in outs], pool.clone(), conv_pool.clone()
    pool.copy_(saved[0])
    conv_pool.copy_(saved[1])
    eager = step()
    for r, e in zip(replayed[0], eager, strict=True):
        torch.testing.assert_close(r, e)
    torch.testing.assert_close(replayed[1], pool)
    torch.testing.assert_close(replayed[2], conv_pool)


@pytest.mark.gpu
def test_chunk_gated_delta_rule_bf16(triton_device) -> None:
    dev = triton_device
    torch.manual_seed(11)
    lengths = [100, 64, 7]
    q, k, v, g, beta = gdr_inputs(sum(lengths), 2, 4, 128, 128, torch.bfloat16, dev)
    h0 = torch.randn(3, 4, 128, 128, device=dev)
    kw = dict(
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=cu_seqlens(lengths, dev),
        use_qk_l2norm_in_kernel=True,
    )
    ref, ref_ht = gated_delta_rule.chunk_gated_delta_rule(
        *(x.float() for x in (q, k, v, g, beta)), **kw
    )
    out, ht = triton_module(GDR, dev).chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    torch.testing.assert_close(out.float(), ref, atol=5e-2, rtol=1e-2)
    assert rel_rms(out, ref) < 5e-3 and rel_rms(ht, ref_ht) < 5e-3


@pytest.mark.gpu
def test_against_flash_linear_attention() -> None:
    """Our Triton ops against fla's on the same inputs (the small preset's shapes, bf16), through
    `benchmarks.kernels.fla_parity`: outputs and final states, relative to fla's largest value.
    Measured on an H200 with fla 0.6.0: 0, 5.2e-3 and 2.8e-5. Skips where fla is not installed
    (never on the CPU machines; carry its wheel to a GPU machine, see tests/gpu_check.sh)."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    from benchmarks.kernels import fla_parity

    rows = {row["kernel"]: row for row in fla_parity(torch.device("cuda"), small=False)}
    limits = {
        "causal_conv1d_fn": 1e-2,  # one bf16 rounding
        "chunk_gated_delta_rule": 2e-2,  # bf16 outputs, chunked sums in another order
        "fused_recurrent_gated_delta_rule": 1e-3,
    }
    assert set(rows) == set(limits)
    for name, limit in limits.items():
        assert "error" not in rows[name], rows[name]
        assert rows[name]["rel"] < limit, rows[name]
