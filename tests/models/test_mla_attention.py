"""MLA over the KV pool's latent rows (`models/mla_attention.py`) against transformers' own MLA
attention classes, on random tiny configs in fp32:

- Kimi-Linear's `KimiLinearAttention`: NoPE, `q_lora_rank` None;
- Ling's `BailingHybridAttention`: partial interleaved RoPE, `q_lora_rank` set, the sigmoid head
  gate and biases.

The module runs requests batched together over a paged pool: a prefill, an extend on the cached
prefix, then decode steps of several rows; and chunked prefill at a chunk size that divides
neither the page size nor the prompts. Its outputs match transformers' (one causal pass over each
whole sequence) at every position, the absorbed form (decode) equals the expanded form (prefill)
on the same batch, and two tensor-parallel ranks' partial outputs sum to the whole layer's.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers.models.bailing_hybrid.configuration_bailing_hybrid import BailingHybridConfig
from transformers.models.bailing_hybrid.modeling_bailing_hybrid import (
    BailingHybridAttention,
    BailingHybridRotaryEmbedding,
)
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

from hybrid_serve.kernels import KernelSet
from hybrid_serve.kernels.kernel_set import choose, cpp_ready, triton_set
from hybrid_serve.kernels.settings import KernelSettings
from hybrid_serve.models.layers import RotaryEmbedding
from hybrid_serve.models.mla_attention import MLAAttention
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.scheduler.config import RunnerConfig
from hybrid_serve.scheduler.pool_sizing import describe, pool_bytes
from tests.models.paged_batches import PagedRequests

THETA = 10000.0
DIMS = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16)


@dataclass
class Case:
    name: str
    config: object
    reference: torch.nn.Module
    rope: bool  # partial RoPE (bailing_hybrid); NoPE otherwise (Kimi-Linear)
    head_gate: bool


def make_case(name: str, seed: int = 0) -> Case:
    torch.manual_seed(seed)
    if name == "kimi_nope":  # v_head_dim < qk_head_dim
        config = KimiLinearConfig(
            **DIMS, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
        )
        ref, rope, gate = KimiLinearAttention(config, 3), False, False
    else:  # v_head_dim > qk_head_dim
        config = BailingHybridConfig(
            **DIMS, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=16,
            attention_bias=True, rope_theta=THETA,
        )  # fmt: skip
        ref, rope, gate = BailingHybridAttention(config, 5), True, True
    config._attn_implementation = "eager"
    with torch.no_grad():
        for pname, p in ref.named_parameters():
            if "layernorm" in pname:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    return Case(name, config, ref.eval(), rope, gate)


def build(case: Case, kv_layer: int = 1, tp: ParallelContext | None = None) -> MLAAttention:
    return MLAAttention.from_config(case.config, kv_layer, head_gate=case.head_gate, tp=tp)


def module_for(case: Case) -> MLAAttention:
    m = build(case)
    m.load_state_dict(case.reference.state_dict(), strict=True)
    return m


def cos_sin_for(case: Case, positions: torch.Tensor):
    if not case.rope:
        return None
    return RotaryEmbedding(case.config.qk_rope_head_dim, THETA).cos_sin(positions, torch.float32)


@torch.no_grad()
def reference_outputs(case: Case, x: torch.Tensor) -> torch.Tensor:
    """transformers' layer over one whole sequence x [L, hidden], causal: [L, hidden]."""
    L = x.shape[0]
    mask = torch.full((L, L), float("-inf")).triu(1)[None, None]
    kwargs = {}
    if case.rope:
        rotary = BailingHybridRotaryEmbedding(case.config)
        kwargs["position_embeddings"] = rotary(x[None], torch.arange(L)[None])
    out, _ = case.reference(x[None], attention_mask=mask, **kwargs)
    return out[0]


def pool_for(module: MLAAttention, page_size: int = 4, device: str = "cpu") -> PagedRequests:
    return PagedRequests([module.kv_shape] * 3, page_size=page_size, device=device)


@torch.no_grad()
def run_schedule(case, module, paged, xs, schedule):
    """Feed `schedule` (steps of (request index, new tokens) pairs; decode when every pair is
    one token and the step says so) through `module`; each request's outputs [L, hidden]."""
    slots = [paged.new_request() for _ in xs]
    done = [0] * len(xs)
    outs = [torch.empty_like(x) for x in xs]
    for step, decode in schedule:
        batch = paged.batch([(slots[r], n) for r, n in step], decode=decode)
        x = torch.cat([xs[r][done[r] : done[r] + n] for r, n in step])
        y = module(x, batch, cos_sin_for(case, batch.positions))
        off = 0
        for r, n in step:
            outs[r][done[r] : done[r] + n] = y[off : off + n]
            done[r] += n
            off += n
    assert done == [len(x) for x in xs]
    return outs


def chunked(lengths: list[int], chunk: int) -> list:
    """Prefill rounds of at most `chunk` tokens per request, all requests batched each round."""
    steps, done = [], [0] * len(lengths)
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        left = [n - d for d, n in zip(done, lengths, strict=True)]
        step = [(r, min(chunk, n)) for r, n in enumerate(left) if n > 0]
        steps.append((step, False))
        done = [d + dict(step).get(r, 0) for r, d in enumerate(done)]
    return steps


CASES = ["kimi_nope", "bailing_rope_gate"]
SCHEDULES = {
    # prefill, extend on the cached prefix, then two decode steps of both rows
    "prefix_then_decode": ([11, 7], [([(0, 5), (1, 3)], False), ([(0, 4), (1, 2)], False)]
                           + [([(0, 1), (1, 1)], True)] * 2),
    # chunks of 5 (page size 4: chunks and pages cross), then three rows decoding
    "chunked_then_decode": ([10, 9, 6], chunked([7, 6, 3], 5) + [([(0, 1), (1, 1), (2, 1)], True)]
                            * 3),
}  # fmt: skip


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("name", CASES)
def test_matches_transformers(name, schedule):
    case = make_case(name)
    module = module_for(case)
    lengths, steps = SCHEDULES[schedule]
    xs = [torch.randn(n, case.config.hidden_size) for n in lengths]
    got = run_schedule(case, module, pool_for(module), xs, steps)
    for x, y in zip(xs, got, strict=True):
        torch.testing.assert_close(y, reference_outputs(case, x), atol=1e-5, rtol=1e-4)


def test_rotary_angles_are_transformers():
    case = make_case("bailing_rope_gate")
    pos = torch.arange(9)
    cos, sin = BailingHybridRotaryEmbedding(case.config)(torch.zeros(1, 9, 4), pos[None])
    ours = cos_sin_for(case, pos)
    torch.testing.assert_close(ours[0], cos[0], atol=0, rtol=0)
    torch.testing.assert_close(ours[1], sin[0], atol=0, rtol=0)


@pytest.mark.parametrize("name", CASES)
@torch.no_grad()
def test_absorbed_equals_expanded(name):
    """One contract, two forms: on an extend batch over a cached prefix and on a decode batch,
    the absorbed attention (W_UK into q, W_UV after) equals the expanded one within 1e-5."""
    case = make_case(name)
    module = module_for(case)
    paged = pool_for(module)
    a, b = paged.new_request(), paged.new_request()
    H = case.config.hidden_size
    batches = [
        (paged.batch([(a, 6), (b, 3)]), False),  # prefill
        (paged.batch([(a, 5), (b, 4)]), True),  # extend on cached prefixes
        (paged.batch([(a, 1), (b, 1)], decode=True), True),
        (paged.batch([(a, 1), (b, 1)], decode=True), True),
    ]
    for batch, compare in batches:
        x = torch.randn(len(batch.out_loc), H)
        q = module.write_latent(x, batch, cos_sin_for(case, batch.positions))
        expanded = module.attend_expanded(q, batch)
        absorbed = module.attend_absorbed(q, batch)
        assert expanded.shape == (len(x), case.config.num_attention_heads, module.v_head_dim)
        if compare:
            torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=1e-5)


@dataclass(frozen=True)
class NoReduce(ParallelContext):
    """A rank that returns its partial sums instead of all-reducing them (summed by the test)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


@torch.no_grad()
def test_tensor_parallel_heads_split_latent_whole():
    """Two ranks, each with its shards of the whole layer's parameters (as `tp_shards`
    declares them) and its own pool: their latent rows equal the whole layer's (replicated), and
    their partial outputs sum to its output, at prefill and decode."""
    case = make_case("bailing_rope_gate")
    case.config.attention_bias = False  # a row-parallel bias is added on every rank here
    whole = build(case)
    torch.manual_seed(1)
    for p in whole.parameters():
        p.copy_(0.3 * torch.randn_like(p))
    ranks = [build(case, tp=NoReduce(r, 2)) for r in range(2)]
    for m in ranks:
        shards = m.tp_shards(case.config)
        assert set(shards) == {n for n, _ in m.named_parameters()}
        for pname, p in m.named_parameters():
            full, shard = whole.get_parameter(pname), shards[pname]
            if shard is None:
                p.copy_(full)
            else:
                parts = [full.narrow(shard.dim, a, b - a) for a, b in shard.ranges]
                p.copy_(torch.cat(parts, shard.dim))
    pools = [pool_for(m) for m in (whole, *ranks)]
    slots = [[p.new_request(), p.new_request()] for p in pools]
    for step, decode in [([(0, 6), (1, 3)], False), ([(0, 1), (1, 1)], True)]:
        x = torch.randn(sum(n for _, n in step), case.config.hidden_size)
        outs = []
        for m, paged, s in zip((whole, *ranks), pools, slots, strict=True):
            batch = paged.batch([(s[r], n) for r, n in step], decode=decode)
            outs.append(m(x, batch, cos_sin_for(case, batch.positions)))
        torch.testing.assert_close(outs[1] + outs[2], outs[0], atol=1e-5, rtol=1e-4)
        for paged in pools[1:]:
            assert torch.equal(paged.kv_pool.k_all, pools[0].kv_pool.k_all)


class LatentStub(torch.nn.Module):
    """The part of a served model pool sizing reads, with two MLA layers (no recurrent ones)."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(build(case, kv_layer=i) for i in range(2))
        self.config = self.local_config = case.config
        self.state_shapes = ()

    @property
    def kv_shapes(self):
        return tuple(m.kv_shape for m in self.layers)


def test_start_up_line_gives_latent_bytes_per_token():
    """The pool sizing's per-token bytes are the latent rows' (r + rope per layer), and the
    start-up line names the layout beside what the expanded K and V would take."""
    case = make_case("kimi_nope")
    sizes = pool_bytes(LatentStub(case))
    assert sizes.kv_per_token == 2 * (16 + 4) * 4
    line = describe(RunnerConfig(max_total_tokens=1000), sizes)
    assert f"1000 tokens x {2 * 20 * 4} B (2 layers, MLA: one latent row of 20 values" in line
    assert "expanded K and V would hold 72 (3.6x)" in line  # 4 heads x (12 K + 6 V)


def kernel_set(name: str, request) -> KernelSet:
    if name == "triton":
        return triton_set(request.getfixturevalue("triton_device"))
    settings = KernelSettings(backend="cpp")
    if not cpp_ready(settings):  # no compiler (a failed build raises)
        pytest.skip("the C++ kernels cannot be built here")
    return choose("cpu", torch.float32, settings)


@pytest.mark.parametrize("ops_name", ["cpp", "triton"])
@pytest.mark.parametrize("name", CASES)
def test_kernel_sets_match_transformers(name, ops_name, request):
    """The C++ set (its linears; attention on the references) and the Triton set (in the
    interpreter on CPU): chunked prefill at chunk 5 over pages of 4, then three decode rows."""
    ops = kernel_set(ops_name, request)
    case = make_case(name)
    module = module_for(case)
    for m in module.modules():
        if hasattr(m, "ops"):
            m.ops = ops
    device = request.getfixturevalue("triton_device") if ops_name == "triton" else "cpu"
    module.to(device)
    lengths, steps = SCHEDULES["chunked_then_decode"]
    xs = [torch.randn(n, case.config.hidden_size) for n in lengths]
    got = run_schedule(case, module, pool_for(module, device=device), [x.to(device) for x in xs],
                       steps)  # fmt: skip
    for x, y in zip(xs, got, strict=True):
        torch.testing.assert_close(y.cpu(), reference_outputs(case, x), atol=1e-5, rtol=1e-4)
