"""The KDA mixer (`models.kda_mixer`) against transformers' `KimiLinearDeltaAttention` (and, for
decode, Ling-3's `BailingHybridDeltaAttention`) on one random tiny config, fp32, through the
Mamba pool as the server drives it: ragged prefill from fresh slots, prefill continuing from the
pool's states, decode steps, a 4-row verify against 4 decode steps, and the states tracked at a
chunk boundary. transformers runs each whole sequence without a cache; our outputs for any span
of it must equal its outputs there."""

from __future__ import annotations

import pytest
import torch
from transformers import BailingHybridConfig, KimiLinearConfig
from transformers.models.bailing_hybrid.modeling_bailing_hybrid import (
    BailingHybridDeltaAttention,
)
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

from hybrid_serve.kernels import choose, reference_set
from hybrid_serve.mem_cache.mamba_pool import MambaPool
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.kda_mixer import KimiDeltaAttention
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.tp_shards import param_shards

HIDDEN, HEADS, HEAD_DIM, KC = 32, 2, 8, 4
ATOL = 1e-4


def tiny_config() -> KimiLinearConfig:
    return KimiLinearConfig(
        vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
        linear_attn_config={"num_heads": HEADS, "head_dim": HEAD_DIM, "short_conv_kernel_size": KC,
                            "kda_layers": [1], "full_attn_layers": [2]},
        rms_norm_eps=1e-5,
    )  # fmt: skip


def random_reference(seed: int = 0) -> KimiLinearDeltaAttention:
    torch.manual_seed(seed)
    ref = KimiLinearDeltaAttention(tiny_config(), layer_idx=0).float().eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1, 16).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif name.endswith("o_norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.3)
    return ref


def ours_from(ref: KimiLinearDeltaAttention, ops=None) -> KimiDeltaAttention:
    mixer = KimiDeltaAttention(tiny_config(), 0, ops=ops or reference_set())
    state = {k.removeprefix("forget_gate."): v for k, v in ref.state_dict().items()}
    mixer.load_state_dict(state, strict=True)
    return mixer.eval()


@torch.no_grad()
def reference(ref: KimiLinearDeltaAttention, x: torch.Tensor) -> torch.Tensor:
    """transformers' output for one whole sequence x [T, hidden], no cache."""
    return ref(x.unsqueeze(0))[0]


def batch(pool: MambaPool, phase: str, slots: list[int], lens: list[int], prefix: list[int],
          **extra) -> ForwardBatch:  # fmt: skip
    T, dev = sum(lens), pool.device
    return ForwardBatch(
        phase=phase, input_ids=torch.zeros(T, dtype=torch.int64, device=dev),
        positions=torch.zeros(T, dtype=torch.int64, device=dev),
        out_loc=torch.zeros(T, dtype=torch.int64, device=dev),
        req_slots=torch.arange(len(slots), device=dev), mamba_slots=torch.tensor(slots, device=dev),
        seq_lens=torch.tensor([p + n for p, n in zip(prefix, lens, strict=True)], device=dev),
        prefix_lens_cpu=list(prefix), extend_lens_cpu=list(lens),
        req_to_token=torch.zeros(1, 1, dtype=torch.int32, device=dev), kv_pool=None,
        mamba_pool=pool, **extra,
    )  # fmt: skip


def new_pool(mixer: KimiDeltaAttention, size: int = 12, device="cpu") -> MambaPool:
    return MambaPool(size, [mixer.state_shape], torch.float32, device=device)


def run_prefill(mixer, pool, xs: list[torch.Tensor], slots, starts, ends, **extra):
    """Prefill tokens [starts[i], ends[i]) of every sequence xs[i] as one ragged batch."""
    parts = [x[s:e] for x, s, e in zip(xs, starts, ends, strict=True)]
    lens = [e - s for s, e in zip(starts, ends, strict=True)]
    with torch.no_grad():
        out = mixer(torch.cat(parts), batch(pool, "prefill", slots, lens, starts, **extra))
    return out.split(lens)


KERNEL_SETS = ["torch", "cpp"]


def kernel_set(name: str):
    if name == "torch":
        return reference_set()
    from tests.kernels.cpp_required import require_cpp

    require_cpp()
    ops = choose("cpu")
    assert ops.backend == "cpp"
    return ops


@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_ragged_prefill_then_continued_prefill_match_transformers(kernels: str) -> None:
    ref = random_reference(1)
    mixer = ours_from(ref, kernel_set(kernels))
    lengths = [70, 5, 131]
    xs = [torch.randn(n, HIDDEN) for n in lengths]
    expect = [reference(ref, x) for x in xs]
    pool = new_pool(mixer)
    slots = pool.alloc(len(xs)).tolist()
    # first pieces from fresh slots, then the rest continuing from the pool's states
    cut = [33, 3, 64]
    first = run_prefill(mixer, pool, xs, slots, [0] * 3, cut)
    rest = run_prefill(mixer, pool, xs, slots, cut, lengths)
    for i in range(3):
        torch.testing.assert_close(first[i], expect[i][: cut[i]], atol=ATOL, rtol=0)
        torch.testing.assert_close(rest[i], expect[i][cut[i] :], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_decode_steps_match_transformers(kernels: str) -> None:
    ref = random_reference(2)
    mixer = ours_from(ref, kernel_set(kernels))
    prompt, steps = [9, 66], 5
    xs = [torch.randn(n + steps, HIDDEN) for n in prompt]
    expect = [reference(ref, x) for x in xs]
    pool = new_pool(mixer)
    slots = pool.alloc(2).tolist()
    run_prefill(mixer, pool, xs, slots, [0, 0], prompt)
    for j in range(steps):
        pos = [n + j for n in prompt]
        x = torch.stack([xs[i][p] for i, p in enumerate(pos)])
        with torch.no_grad():
            out = mixer(x, batch(pool, "decode", slots, [1, 1], pos))
        for i, p in enumerate(pos):
            torch.testing.assert_close(out[i], expect[i][p], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_a_four_row_verify_is_four_decode_steps(kernels: str) -> None:
    ref = random_reference(3)
    mixer = ours_from(ref, kernel_set(kernels))
    prompt, rows = [20, 7], 4
    xs = [torch.randn(n + rows, HIDDEN) for n in prompt]
    expect = [reference(ref, x) for x in xs]
    pool = new_pool(mixer, size=16)
    slots = pool.alloc(2).tolist()
    run_prefill(mixer, pool, xs, slots, [0, 0], prompt)
    # a copy of each request's state decodes the 4 tokens one at a time
    copies = pool.alloc(2).tolist()
    for src, dst in zip(slots, copies, strict=True):
        pool.conv_state[:, dst] = pool.conv_state[:, src]
        pool.ssm_state[:, dst] = pool.ssm_state[:, src]
    decoded, after = [], []
    for j in range(rows):
        pos = [n + j for n in prompt]
        x = torch.stack([xs[i][p] for i, p in enumerate(pos)])
        with torch.no_grad():
            decoded.append(mixer(x, batch(pool, "decode", copies, [1, 1], pos)))
        after.append((pool.conv_state[:, copies].clone(), pool.ssm_state[:, copies].clone()))
    step_slots = [pool.alloc(rows - 1).tolist() for _ in slots]
    verified = run_prefill(
        mixer, pool, xs, slots, prompt, [n + rows for n in prompt], mamba_step_slots_cpu=step_slots
    )
    # 1e-5 apart at most: the projections of 8 rows and of 2 round apart (the GEMMs' blocking)
    for i in range(2):
        one_by_one = torch.stack([decoded[j][i] for j in range(rows)])
        torch.testing.assert_close(verified[i], one_by_one, atol=1e-5, rtol=0)
        torch.testing.assert_close(verified[i], expect[i][prompt[i] :], atol=ATOL, rtol=0)
        for j in range(rows):
            slot = slots[i] if j == rows - 1 else step_slots[i][j]
            conv, ssm = after[j]
            torch.testing.assert_close(pool.conv_state[:, slot], conv[:, i], atol=1e-5, rtol=0)
            torch.testing.assert_close(pool.ssm_state[:, slot], ssm[:, i], atol=1e-5, rtol=0)


def ling_config() -> BailingHybridConfig:
    """transformers' Ling-3 config at the tiny sizes: KDA of HEADS heads of HEAD_DIM."""
    return BailingHybridConfig(
        vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=2, layer_group_size=2,
        num_attention_heads=HEADS, head_dim=HEAD_DIM, short_conv_kernel_size=KC,
        rms_norm_eps=1e-5, kda_safe_gate=True, kda_lower_bound=-5.0,
    )  # fmt: skip


@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_ling_decode_steps_match_transformers(kernels: str) -> None:
    """Ling-3's KDA (full-rank gates, the bounded forget gate: transformers'
    `BailingHybridDeltaAttention`) through prefill and decode steps, within ATOL."""
    torch.manual_seed(6)
    ref = BailingHybridDeltaAttention(ling_config(), layer_idx=0).float().eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            scale = {"A_log": 1.0, "dt_bias": 0.5}.get(name.rsplit(".", 1)[-1], 0.3)
            p.copy_(torch.randn_like(p) * scale + (1.0 if name.endswith("o_norm.weight") else 0))
    c = ling_config()
    mixer = KimiDeltaAttention(c, 0, ops=kernel_set(kernels), full_rank_gates=True,
                               gate_lower_bound=c.kda_lower_bound)  # fmt: skip
    state = {k.removeprefix("forget_gate."): v for k, v in ref.state_dict().items()}
    mixer.load_state_dict(state, strict=True)
    prompt, steps = [9, 66], 5
    xs = [torch.randn(n + steps, HIDDEN) for n in prompt]
    expect = [reference(ref, x) for x in xs]
    pool = new_pool(mixer)
    slots = pool.alloc(2).tolist()
    run_prefill(mixer, pool, xs, slots, [0, 0], prompt)
    for j in range(steps):
        pos = [n + j for n in prompt]
        x = torch.stack([xs[i][p] for i, p in enumerate(pos)])
        with torch.no_grad():
            out = mixer(x, batch(pool, "decode", slots, [1, 1], pos))
        for i, p in enumerate(pos):
            torch.testing.assert_close(out[i], expect[i][p], atol=ATOL, rtol=0)


def test_the_cpp_set_decodes_through_the_fused_op() -> None:
    """On the C++ set the mixer's decode is the one fused op (the CPU decode plan calls the same
    C++ function), with the layer's gate bound."""
    mixer = KimiDeltaAttention(ling_config(), 0, ops=kernel_set("cpp"), full_rank_gates=True,
                               gate_lower_bound=-5.0)  # fmt: skip
    op = mixer.decode_op()
    assert op.func.__module__ == "hybrid_serve.kernels.cpp_fused" and op.func.__name__ == (
        "kda_decode"
    )
    assert op.keywords == {"gate_lower_bound": -5.0}


def test_states_tracked_at_a_chunk_boundary_are_the_states_there() -> None:
    ref = random_reference(4)
    mixer = ours_from(ref)
    lengths = [100, 64, 30]
    xs = [torch.randn(n, HIDDEN) for n in lengths]
    pool = new_pool(mixer, size=16)
    slots, track = pool.alloc(3).tolist(), pool.alloc(3).tolist()
    offsets = [64, 64, 0]
    run_prefill(
        mixer, pool, xs, slots, [0] * 3, lengths,
        mamba_track_slots=torch.tensor(track), mamba_track_offsets_cpu=offsets,
    )  # fmt: skip
    alone = pool.alloc(2).tolist()
    run_prefill(mixer, pool, xs[:2], alone, [0, 0], [64, 64])
    for t, a in zip(track[:2], alone, strict=True):
        torch.testing.assert_close(pool.conv_state[:, t], pool.conv_state[:, a], atol=0, rtol=0)
        torch.testing.assert_close(pool.ssm_state[:, t], pool.ssm_state[:, a], atol=1e-5, rtol=0)
    # the tracked state continues exactly as the whole prefill does
    expect = reference(ref, xs[0])
    rest = run_prefill(mixer, pool, [xs[0]], [track[0]], [64], [100])[0]
    torch.testing.assert_close(rest, expect[64:], atol=ATOL, rtol=0)


def test_state_shape_and_tensor_parallel_shards() -> None:
    mixer = KimiDeltaAttention(tiny_config(), 0)
    shape = mixer.state_shape
    assert (shape.conv_dim, shape.conv_width) == (3 * HEADS * HEAD_DIM, KC - 1)
    assert shape.temporal == (HEADS, HEAD_DIM, HEAD_DIM)
    # rank 1 of 2 holds head 1: every parameter declared, shards the size of its parameters
    tp = ParallelContext(1, 2)
    half = KimiDeltaAttention(tiny_config(), 0, tp=tp)
    shards = param_shards(half, tiny_config())
    assert half.state_shape.temporal == (1, HEAD_DIM, HEAD_DIM)
    whole = dict(mixer.named_parameters())
    for name, p in half.named_parameters():
        shard = shards[name]
        if shard is None:
            assert p.shape == whole[name].shape, name
            continue
        assert sum(b - a for a, b in shard.ranges) == p.shape[shard.dim], name
        parts = [whole[name].narrow(shard.dim, a, b - a) for a, b in shard.ranges]
        assert torch.cat(parts, shard.dim).shape == p.shape, name
    d = HEAD_DIM
    assert shards["q_proj.weight"].ranges == ((d, 2 * d),)
    assert shards["A_log"].dim == 2 and shards["A_log"].ranges == ((1, 2),)
    conv = shards["conv1d.weight"].ranges
    assert conv == ((d, 2 * d), (3 * d, 4 * d), (5 * d, 6 * d))  # q, k, v of head 1


def scenario(mixer: KimiDeltaAttention, xs: list[torch.Tensor], device) -> list[torch.Tensor]:
    """Every output of a short serving life on `device`: ragged prefill with a tracked state,
    its continuation, a decode step and a 3-row verify; then the pool's tensors."""
    pool = new_pool(mixer, size=12, device=device)
    slots, track = pool.alloc(2).tolist(), pool.alloc(2).tolist()
    outs = list(run_prefill(
        mixer, pool, xs, slots, [0, 0], [66, 4],
        mamba_track_slots=torch.tensor(track, device=device), mamba_track_offsets_cpu=[64, 0],
    ))  # fmt: skip
    outs += run_prefill(mixer, pool, xs, slots, [66, 4], [69, 9])
    with torch.no_grad():
        x = torch.stack([xs[0][69], xs[1][9]])
        outs.append(mixer(x, batch(pool, "decode", slots, [1, 1], [69, 9])))
    steps = [pool.alloc(2).tolist() for _ in slots]
    outs += run_prefill(mixer, pool, xs, slots, [70, 10], [73, 13], mamba_step_slots_cpu=steps)
    return outs + [pool.conv_state, pool.ssm_state]


def test_the_triton_set_runs_the_mixer_as_the_torch_set(triton_device) -> None:
    """Every Triton op the mixer takes (conv, chunked and recurrent delta rule with the
    per-channel gate) on CUDA, or in the interpreter without it, against the torch references
    on the same device."""
    from hybrid_serve.kernels.kernel_set import triton_set

    ref = random_reference(5)
    xs = [
        torch.randn(73, HIDDEN, device=triton_device),
        torch.randn(13, HIDDEN, device=triton_device),
    ]
    torch_run = scenario(ours_from(ref, reference_set()).to(triton_device), xs, triton_device)
    ops = triton_set(triton_device)
    assert ops.chunk_gated_delta_rule.__module__ == "hybrid_serve.kernels.gated_delta_rule_triton"
    triton_run = scenario(ours_from(ref, ops).to(triton_device), xs, triton_device)
    for got, want in zip(triton_run, torch_run, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
