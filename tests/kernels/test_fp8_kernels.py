"""The block-FP8 weight-only GEMM (`kernels.fp8_gemm_triton`) against its dequantize-then-matmul
reference (`kernels.fp8_gemm`), and the resident FP8 format (`kernels.fp8.Fp8Weight`).

Without CUDA the Triton kernel runs in triton's interpreter at small sizes, with activations in
fp32 and fp16 (bf16 dots are wrong in the interpreter; the `gpu` tests take bf16 on CUDA). The
sides are not multiples of the 128 x 128 blocks, so every product crosses short tail blocks.
Tolerance: the reference rounds the dequantized weights to the activations' dtype and the
kernel does not, so they differ by at most that rounding, u * sum_k |x||w| with u the dtype's
unit roundoff (2^-24 fp32, 2^-11 fp16, 2^-8 bf16), plus the rounding of the output and K fp32
roundings of the sums; both are
checked to be that close to the exact (fp64) product too.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from hybrid_serve.kernels import fp8_gemm
from hybrid_serve.kernels.fp8 import E4M3, Fp8Weight, dequantize, grid_shape, is_fp8, weight_bytes
from hybrid_serve.kernels.kernel_set import triton_module
from hybrid_serve.kernels.linear import linear as reference_linear
from hybrid_serve.make_model.fp8_writer import quantize

GEMM = "fp8_gemm_triton"
UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def fp8_matrix(
    n: int, k: int, block: tuple[int, int], seed: int, lead: tuple[int, ...] = ()
) -> Fp8Weight:
    """A random matrix [*lead, n, k] quantized to block-FP8 by the checkpoint writer's rule,
    with block scales that vary by orders of magnitude."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(*lead, n, k, generator=gen)
    spread = torch.exp(2 * torch.randn(*lead, *grid_shape((n, k), block)[-2:], generator=gen))
    w = (
        w
        * spread.repeat_interleave(block[0], -2)[..., :n, :].repeat_interleave(block[1], -1)[
            ..., :k
        ]
    )
    q, s = quantize(w, block)
    return Fp8Weight(q, s, block)


def assert_within_rounding(
    out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor
) -> None:
    """out and ref within the activations' rounding of each other and of the exact product."""
    u, k = UNIT[x.dtype], x.shape[-1]
    exact = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    bound = (2 * u + k * 2.0**-24) * scale + 2 * u * exact.abs() + 1e-30  # + fp32 sums
    for got in (out, ref):
        err = (got.double() - exact).abs()
        assert (err <= bound).all(), (err / bound).max().item()
    assert ((out.double() - ref.double()).abs() <= 2 * bound).all()


def test_format_slices_experts_with_their_scales_and_counts_its_bytes() -> None:
    w = fp8_matrix(200, 70, (128, 32), seed=0, lead=(3,))
    assert is_fp8(w) and w.dtype == E4M3 and w.scale_inv.shape == (3, 2, 3)
    assert not w.requires_grad and isinstance(w, torch.nn.Parameter)
    e = w[1]
    assert is_fp8(e) and e.shape == (200, 70) and torch.equal(e.scale_inv, w.scale_inv[1])
    assert torch.equal(dequantize(e), dequantize(w)[1])
    assert not is_fp8(w[1, :10]) and not is_fp8(w.data)
    assert weight_bytes(w) == 3 * 200 * 70 + 3 * 2 * 3 * 4
    clone = copy.deepcopy(w)
    assert is_fp8(clone) and torch.equal(dequantize(clone), dequantize(w))
    with pytest.raises(ValueError, match="scales"):
        Fp8Weight(w.data, w.scale_inv[:, :1], (128, 32))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        Fp8Weight(w.data.float(), w.scale_inv, (128, 32))


def test_reference_is_the_product_of_the_dequantized_weights() -> None:
    w = fp8_matrix(130, 260, (128, 128), seed=1)
    x = torch.randn(5, 260)
    want = x @ dequantize(w).T
    torch.testing.assert_close(fp8_gemm.block_gemm(x, w.data, w.scale_inv, w.block), want)
    y = reference_linear(x.half(), w, torch.ones(130))
    assert y.dtype == torch.float16
    assert torch.equal(y, F.linear(x.half(), dequantize(w, torch.float16), torch.ones(130).half()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_block_gemm_matches_the_reference(triton_device, dtype, m) -> None:
    """N = 200, K = 300: two row blocks and three column blocks, both tails short."""
    gemm = triton_module(GEMM, triton_device)
    w = fp8_matrix(200, 300, (128, 128), seed=m)
    x = torch.randn(m, 300, generator=torch.Generator().manual_seed(10 + m)).to(dtype)
    q, s = w.data.to(triton_device), w.scale_inv.to(triton_device)
    out = gemm.block_gemm(x.to(triton_device), q, s, w.block)
    ref = fp8_gemm.block_gemm(x, w.data, w.scale_inv, w.block)
    assert out.shape == (m, 200) and out.dtype == dtype
    assert_within_rounding(out.cpu(), ref, x, dequantize(w))


@pytest.mark.parametrize("block", [(64, 32), (32, 48)])
def test_block_gemm_other_blocks(triton_device, block) -> None:
    """Blocks other than 128 x 128 (48 columns: K tiles of 16), fp16 activations."""
    gemm = triton_module(GEMM, triton_device)
    w = fp8_matrix(90, 100, block, seed=7)
    x = torch.randn(5, 100, generator=torch.Generator().manual_seed(3)).half()
    out = gemm.block_gemm(x.to(triton_device), w.data.to(triton_device),
                          w.scale_inv.to(triton_device), block)  # fmt: skip
    ref = fp8_gemm.block_gemm(x, w.data, w.scale_inv, block)
    assert_within_rounding(out.cpu(), ref, x, dequantize(w))


def test_linear_takes_fp8_and_plain_weights(triton_device) -> None:
    """The Triton set's `linear`: leading dims, bias, FP8 or plain weight, empty batches."""
    gemm = triton_module(GEMM, triton_device)
    dev = triton_device
    w = fp8_matrix(40, 150, (128, 128), seed=4)
    w = Fp8Weight(w.data.to(dev), w.scale_inv.to(dev), w.block)
    bias = torch.randn(40).to(dev)
    x = torch.randn(2, 3, 150).to(dev)
    out = gemm.linear(x, w, bias)
    assert out.shape == (2, 3, 40)
    torch.testing.assert_close(out, reference_linear(x, w, bias), atol=1e-4, rtol=1e-4)
    plain = torch.randn(40, 150).to(dev)
    assert torch.equal(gemm.linear(x, plain), reference_linear(x, plain))
    assert gemm.linear(x[:0], w).shape == (0, 3, 40)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 17, 256])
def test_block_gemm_bf16_on_cuda(m) -> None:
    """bf16 activations on the tensor cores, a real projection's shape (2048 -> 4096 + tail)."""
    gemm = triton_module(GEMM, torch.device("cuda"))
    w = fp8_matrix(4096 + 80, 2048, (128, 128), seed=m)
    x = torch.randn(m, 2048, generator=torch.Generator().manual_seed(m)).bfloat16()
    out = gemm.block_gemm(x.cuda(), w.data.cuda(), w.scale_inv.cuda(), w.block)
    ref = fp8_gemm.block_gemm(x.cuda(), w.data.cuda(), w.scale_inv.cuda(), w.block)
    assert_within_rounding(out.cpu(), ref.cpu(), x, dequantize(w))


# ----------------------------------------------------------------------------------------------
# routed experts in FP8
# ----------------------------------------------------------------------------------------------


def fp8_experts(experts_n: int, hidden: int, inter: int, block: tuple[int, int], seed: int):
    """Block-FP8 stacks gate_up [E, 2I, hidden] and down [E, hidden, I], values around 0.1."""
    gate_up = fp8_matrix(2 * inter, hidden, block, seed, lead=(experts_n,))
    down = fp8_matrix(hidden, inter, block, seed + 1, lead=(experts_n,))
    for w in (gate_up, down):  # scale the values to a transformer's weights (O(0.1))
        w.scale_inv.mul_(0.1 / dequantize(w).abs().mean())
    return gate_up, down


@pytest.mark.parametrize(
    ("tokens", "experts_n", "top_k", "hidden", "inter", "block", "dtype"),
    [
        (1, 8, 2, 160, 72, (128, 128), torch.float32),
        (3, 8, 2, 160, 72, (128, 128), torch.float16),
        (17, 16, 4, 96, 48, (32, 32), torch.float32),
        (17, 16, 4, 96, 48, (32, 32), torch.float16),
    ],
)
def test_fused_moe_fp8_experts(
    triton_device, tokens, experts_n, top_k, hidden, inter, block, dtype
) -> None:
    """Per-expert block scales on both grouped GEMMs: hidden and I not multiples of the block
    (tail blocks), gate and up halves sharing a block row where I is not a multiple of bn."""
    from hybrid_serve.kernels import experts

    dev = triton_device
    moe = triton_module("fused_moe_triton", dev)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(experts_n, generator=gen)[:top_k] for _ in range(tokens)])
    w = torch.rand(tokens, top_k, generator=gen)
    gate_up, down = fp8_experts(experts_n, hidden, inter, block, seed=tokens)
    on_dev = [Fp8Weight(t.data.to(dev), t.scale_inv.to(dev), t.block) for t in (gate_up, down)]
    out = moe.fused_experts(x.to(dev), ids.to(dev), w.to(dev), *on_dev).cpu()
    ref = experts.fused_experts(x, ids, w, gate_up, down)
    exact = experts.fused_experts(x.double(), ids, w.double(), dequantize(gate_up, torch.float64),
                                  dequantize(down, torch.float64))  # fmt: skip
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    tol = 1e-5 if dtype == torch.float32 else 4e-3  # fp16: the activations' and h's roundings
    norm = exact.abs().max().item()
    assert (out.double() - exact).abs().max().item() <= tol * norm
    assert (ref.double() - exact).abs().max().item() <= tol * norm
    assert (out.double() - ref.double()).abs().max().item() <= tol * norm


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64])
def test_fused_moe_fp8_bf16_on_cuda(tokens) -> None:
    """bf16 activations on the tensor cores, the 80B-A3B expert shape (hidden 2048, I 512, 64
    of its 512 experts, top-10), within bf16 rounding of the reference; then replayed from a
    CUDA graph (no host sync)."""
    from hybrid_serve.kernels import experts

    moe = triton_module("fused_moe_triton", torch.device("cuda"))
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 2048, generator=gen).bfloat16().cuda()
    ids = torch.stack([torch.randperm(64, generator=gen)[:10] for _ in range(tokens)]).cuda()
    w = torch.rand(tokens, 10, generator=gen).cuda()
    gate_up, down = fp8_experts(64, 2048, 512, (128, 128), seed=tokens)
    gate_up, down = (Fp8Weight(t.data.cuda(), t.scale_inv.cuda(), t.block) for t in (gate_up, down))
    out = moe.fused_experts(x, ids, w, gate_up, down)
    ref = experts.fused_experts(x, ids, w, gate_up, down)
    norm = ref.float().abs().max().item()
    assert (out.float() - ref.float()).abs().max().item() <= 1e-2 * norm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = moe.fused_experts(x, ids, w, gate_up, down)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)
