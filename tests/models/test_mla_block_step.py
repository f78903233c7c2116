"""The C++ block step's MLA kind (kernels/csrc/block_attention.cpp, `models.plan_blocks.Blocks.mla`)
in the forms the Kimi-Linear preset does not reach: `q_lora_rank` set, partial interleaved RoPE
and the sigmoid head gate (Ling's `bailing_hybrid` attention), alone and together. One pre-norm
MLA block, then the final norm and the LM head, over a paged pool of latent rows: decode steps
of 1, 4 and 16 rows (the GEMV's rows and the tiled GEMM's) through `BlockStep.forward` give the
eager module's logits and latent rows bit for bit, with fp32 and bf16 matrices."""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.kernels import KernelSettings, choose
from hybrid_serve.kernels.rmsnorm import rms_norm_plain
from hybrid_serve.mem_cache.req_pool import ReqToTokenPool
from hybrid_serve.models import plan_blocks
from hybrid_serve.models.layers import RMSNormPlain, RotaryEmbedding
from hybrid_serve.models.mla_attention import MLAAttention
from tests.kernels.cpp_required import built  # noqa: F401  (autouse)
from tests.models.paged_batches import PagedRequests

HIDDEN, VOCAB, THETA, EPS = 48, 40, 10000.0, 1e-6
REQUESTS = 16


def make_module(q_lora: bool, rope: bool, gate: bool, dtype: torch.dtype, ops) -> MLAAttention:
    torch.manual_seed(int(q_lora) + 2 * int(rope) + 4 * int(gate))
    m = MLAAttention(
        HIDDEN, 4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=12, kv_layer=1, q_lora_rank=12 if q_lora else None, head_gate=gate,
        scale=0.3, ops=ops,
    )  # fmt: skip
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "layernorm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    for module in m.modules():  # the matrices in `dtype`, as a checkpoint loads them
        if hasattr(module, "keep_float"):
            module.weight.data = module.weight.data.to(dtype)
    return m


def paged(module: MLAAttention) -> PagedRequests:
    p = PagedRequests([module.kv_shape] * 2, num_pages=80)
    p.req_pool = ReqToTokenPool(REQUESTS + 1, 64, "cpu")
    return p


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("q_lora", "rope", "gate"),
    [(True, True, True), (True, False, False), (False, True, False), (False, False, True)],
)
@torch.no_grad()
def test_mla_block_equals_the_eager_module_bit_for_bit(q_lora, rope, gate, dtype):
    ops = choose("cpu", settings=KernelSettings(bf16_products="off"))
    module = make_module(q_lora, rope, gate, dtype, ops)
    norm, final = RMSNormPlain(HIDDEN, EPS, ops), RMSNormPlain(HIDDEN, EPS, ops)
    norm.weight.data = 1 + 0.2 * torch.randn(HIDDEN)
    final.weight.data = 1 + 0.2 * torch.randn(HIDDEN)
    head = (0.3 * torch.randn(VOCAB, HIDDEN)).to(dtype)
    rotary = RotaryEmbedding(module.rope, THETA) if rope else None
    blocks = plan_blocks.Blocks()
    blocks.block(plan_blocks.PRE, plan_blocks.MLA, plan_blocks.NO_MLP)
    blocks.sublayer_norm(norm)
    blocks.mla(module, rope)
    step = torch.classes.hybrid_serve.BlockStep(
        blocks.tensors, blocks.ints, blocks.floats, final.weight, EPS, head, False
    )
    eager_pool, plan_pool = paged(module), paged(module)
    slots = [(eager_pool.new_request(), plan_pool.new_request()) for _ in range(REQUESTS)]
    prompt = [3 + i % 5 for i in range(REQUESTS)]
    prefill = [(s, n) for (s, _), n in zip(slots, prompt, strict=True)]
    x = torch.randn(sum(prompt), HIDDEN)
    for pool in (eager_pool, plan_pool):  # the same prefix in both pools (expanded form)
        batch = pool.batch(prefill)
        angles = None if rotary is None else rotary.cos_sin(batch.positions, torch.float32)
        module(norm(x), batch, angles)
    assert torch.equal(eager_pool.kv_pool.k_all, plan_pool.kv_pool.k_all)
    for rows in (1, 4, REQUESTS, 4):
        x = torch.randn(rows, HIDDEN)
        a = eager_pool.batch([(e, 1) for e, _ in slots[:rows]], decode=True)
        b = plan_pool.batch([(p, 1) for _, p in slots[:rows]], decode=True)
        angles = None if rotary is None else rotary.cos_sin(a.positions, torch.float32)
        h = x + module(norm(x), a, angles)
        eager = ops.linear(rms_norm_plain(h, final.weight, EPS), head)
        cos, sin = (t.contiguous() for t in angles) if angles else (x.new_empty(0),) * 2
        empty = torch.empty(0)
        plan = step.forward(
            x, cos, sin, b.kv_pool.k_all, b.kv_pool.v_all, empty, empty, b.mamba_slots,
            b.out_loc.long(), b.req_to_token, b.req_slots.long(), b.seq_lens.long(),
            b.max_seq_len,
        )  # fmt: skip
        assert torch.equal(plan, eager), rows
        assert torch.equal(plan_pool.kv_pool.k_all, eager_pool.kv_pool.k_all), rows
