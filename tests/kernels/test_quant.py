"""Weight-only int8 and int4 (`kernels.quant`): the formats, the activations' rounding to int8,
and every C++ product that reads them against the dequantized weights times the rounded
activations (`round_activations`), at odd sizes (K not a multiple of the vector width or of the
activation blocks, N not of the tiles; int4's fallback to int8 where K does not divide into
groups), at the GEMV's row counts and the tiled GEMM's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_serve.kernels import cpp_fused, cpp_ops, experts, moe_step
from hybrid_serve.kernels.bf16_pack import pack_bf16
from hybrid_serve.kernels.quant import (
    GROUP,
    SCALE_BYTES,
    dequantize,
    in_features,
    quantize,
    quantize_int4,
    quantize_int8,
    round_activations,
    scales,
    widen,
)
from tests.kernels.cpp_required import built  # noqa: F401  (autouse)

ROWS = [1, 2, 5, 8, 9, 17, 40, 70]  # the GEMV's row counts (<= 8; int8/int4 <= 16 or
# 64 by level) and the tiled GEMM's
METHODS = ["int8", "int4"]


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-5) -> None:
    """Equal up to fp32 summation order (the kernels sum integers per block, the reference the
    products of the dequantized values)."""
    assert a.shape == b.shape
    err = ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
    assert err < tol, err


def test_format_round_trip() -> None:
    w = rand(7, 37) * torch.linspace(0.01, 3.0, 7)[:, None]  # rows of different ranges
    w[3] = 0.0  # an all-zero row: scale 1, all zeros back
    q = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == (7, 37 + SCALE_BYTES) and q.is_contiguous()
    assert in_features(q) == 37 == in_features(w)
    s = scales(q)
    torch.testing.assert_close(s, torch.where(w.abs().amax(1) > 0, w.abs().amax(1) / 127, 1.0))
    back = dequantize(q)
    assert back.shape == w.shape and torch.equal(back[3], torch.zeros(37))
    assert ((back - w).abs() <= s[:, None] / 2 + 1e-7).all()  # within half a step per element
    assert q[..., :37].abs().max() == 127  # each row's largest magnitude maps to 127
    # a stack [E, N, K] quantizes per row of each expert, and slices per expert
    stack = rand(3, 5, 11, seed=1)
    qs = quantize_int8(stack)
    assert torch.equal(qs[1], quantize_int8(stack[1]))
    assert widen(qs, torch.float32).shape == stack.shape
    assert widen(stack, torch.float32) is stack


def test_int4_format() -> None:
    w = rand(5, 96) * torch.linspace(0.01, 3.0, 5)[:, None]
    w[1, 32:64] = 0.0  # an all-zero group: scale 1, zeros back
    w[2, 5] = -9.0  # a group's peak is negative: it maps to -8 exactly, the scale positive
    q = quantize_int4(w)
    assert q.dtype == torch.uint8 and q.shape == (5, 96 // 2 + 96 // GROUP * 2)
    assert in_features(q) == 96
    s = scales(q)
    assert s.shape == (5, 3) and s[1, 1] == 1.0 and s[2, 0] > 0
    back = dequantize(q)
    assert back[2, 5] == -9.0  # scale 9/8, exact in bf16
    assert torch.equal(back[1, 32:64], torch.zeros(32))
    step = s.abs().repeat_interleave(GROUP, dim=1)
    err = (back - w).abs()
    assert (err <= step * 1.01).all()  # one step at most (a value of the peak's opposite sign
    assert (err <= step / 2 * 1.01).float().mean() > 0.95  # is clamped to 7); half a step else
    nib = q[:, :48]
    assert int((nib & 15).max()) <= 15 and int((nib >> 4).max()) <= 15
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(rand(3, 40))
    assert quantize(rand(3, 40), "int4").dtype == torch.int8  # the fallback
    stack = rand(3, 5, 64, seed=1)
    assert torch.equal(quantize_int4(stack)[2], quantize_int4(stack[2]))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", [(13, 37), (70, 96), (6, 8), (33, 256)])
def test_linear(rows: int, shape: tuple[int, int], method: str) -> None:
    n, k = shape
    w, x, b = rand(n, k, seed=rows), rand(rows, k, seed=99), rand(n, seed=5)
    q = quantize(w, method)
    want = F.linear(round_activations(x), dequantize(q), b)
    close(cpp_ops.linear(x, q, b), want)
    close(cpp_ops.linear(x.view(1, rows, k), q, b), want.view(1, rows, n))


@pytest.mark.parametrize("rows", [1, 3, 8, 12, 20])
def test_linear_multi_mixed_forms(rows: int) -> None:
    """int4, int8, bf16 and fp32 weights in one call, each as its own product gives it; the
    quantized ones alone (one GEMV region where the level's GEMV takes that many rows) give
    each one's own bits."""
    x = rand(rows, 64, seed=rows)
    ws = [quantize_int8(rand(19, 64, seed=1)), rand(7, 64, seed=2).bfloat16(), rand(30, 64, seed=3),
          quantize_int4(rand(11, 64, seed=4))]  # fmt: skip
    for y, w in zip(cpp_ops.linear_multi(x, ws, [None] * 4), ws, strict=True):
        xr = round_activations(x) if w.dtype in (torch.int8, torch.uint8) else x
        close(y, F.linear(xr, widen(w, torch.float32)))
    quantized = [ws[0], ws[3]]
    for y, w in zip(cpp_ops.linear_multi(x, quantized, [None] * 2), quantized, strict=True):
        assert torch.equal(y, cpp_ops.linear(x, w))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rows", [1, 6, 23, 70])
def test_routed_experts(rows: int, method: str) -> None:
    E, H, I = (5, 36, 22) if method == "int8" else (5, 64, 96)
    gate_up = quantize(rand(E, 2 * I, H, seed=1), method)
    down = quantize(rand(E, H, I, seed=2), method)
    gen = torch.Generator().manual_seed(rows)
    counts = torch.bincount(torch.randint(0, E, (rows,), generator=gen), minlength=E)
    xs = rand(rows, H, seed=3)
    want = rounded_experts(xs, gate_up, down, counts)
    close(cpp_ops.routed_experts(xs, gate_up, down, counts), want)
    close(experts.routed_experts(xs, gate_up, down, counts), want)  # the reference widens
    unrounded = experts.routed_experts(xs, dequantize(gate_up), dequantize(down), counts)
    assert not torch.allclose(unrounded, want, rtol=1e-4, atol=1e-4)  # the rounding is seen


def rounded_experts(xs, gate_up, down, counts) -> torch.Tensor:
    """The routed experts spelled out: each product the dequantized weights times its input
    rounded to int8."""
    ys, start = [], 0
    for e, n in enumerate(counts.tolist()):
        h = F.linear(round_activations(xs[start : start + n]), dequantize(gate_up[e]))
        gate, up = h.chunk(2, dim=-1)
        ys.append(F.linear(round_activations(F.silu(gate) * up), dequantize(down[e])))
        start += n
    return torch.cat(ys)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("tokens", [1, 4, 8, 9, 30])
def test_sparse_moe_block(tokens: int, method: str) -> None:
    """The fused MoE op on quantized experts and shared expert (fp32 router gates, as the loader
    keeps them) against the reference block, whose quantized products round their inputs."""
    E, H, I, Is = (6, 40, 18, 26) if method == "int8" else (6, 64, 32, 96)
    router, shared_gate = rand(E, H, seed=1), rand(1, H, seed=2)
    mats = [rand(E, 2 * I, H, seed=3), rand(E, H, I, seed=4), rand(Is, H, seed=5),
            rand(Is, H, seed=6), rand(H, Is, seed=7)]  # fmt: skip
    q = [quantize(m, method) for m in mats]
    x = rand(tokens, H, seed=tokens)
    args = lambda m: (router, m[0], m[1], shared_gate, *m[2:], 2, True)  # noqa: E731
    want = moe_step.sparse_moe(x, *args(q))
    got = cpp_fused.sparse_moe(x, *args(q), unfused=moe_step.sparse_moe)
    close(got, want)
    unrounded = moe_step.sparse_moe(x, *args([dequantize(t) for t in q]))
    assert not torch.allclose(unrounded, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("method", "bound"), [("int8", 1e-2), ("int4", 0.12)])
def test_quantization_error_is_bounded(method: str, bound: float) -> None:
    """Against the float weights the product's error is the weights' rounding: for Gaussian
    weights about 0.6% with int8's per-row scales and 9% with int4's groups of 32 (a step of
    peak / 8, the peak of 32 Gaussians ~2.1 sigma: step / sqrt(12) / sigma ~ 0.08)."""
    w, x = rand(256, 512, seed=1), rand(4, 512, seed=2)
    want = F.linear(x, w)
    err = (cpp_ops.linear(x, quantize(w, method)) - want).norm() / want.norm()
    assert bound / 20 < err.item() < bound, err.item()


def test_the_format_table_is_what_weights_h_reads():
    """kernels/weight_formats.py and kernels/csrc/weights.h describe the same layouts: the
    constants agree, and the C++ products take a matrix of every C++ format exactly when the
    activations have the K the table gives for its stored width."""
    import re

    from hybrid_serve.kernels import cpp_build, weight_formats

    header = (cpp_build.CSRC / "weights.h").read_text()
    const = dict(re.findall(r"constexpr int64_t (k\w+) = (\d+);", header))
    assert int(const["kScaleBytes"]) == weight_formats.SCALE_BYTES == SCALE_BYTES
    assert int(const["kQ4Group"]) == weight_formats.GROUP == GROUP
    assert weight_formats.get("int4").row_tail == 2  # one bf16 scale per group
    ops = cpp_build.load()
    x = rand(3, 96, seed=7)
    for fmt in weight_formats.FORMATS:
        w = rand(5, 96, seed=8)
        stored = quantize(w, fmt.name) if fmt.method else w.to(getattr(torch, fmt.dtype))
        assert weight_formats.format_of(stored) is fmt
        columns = 96 // 2 + 96 // GROUP * fmt.row_tail if fmt.name == "int4" else 96 + fmt.row_tail
        assert stored.shape[-1] == columns and in_features(stored) == 96
        if not fmt.cpp:
            continue
        close(ops.linear(x, stored), F.linear(round_activations(x) if fmt.method else x,
                                              widen(stored, torch.float32)))  # fmt: skip
        with pytest.raises(RuntimeError, match="shapes"):
            ops.linear(rand(3, 128), stored)


def test_int4_tiles_hold_the_row_bytes_where_weights_h_says() -> None:
    """The stored int4 matrix is its row-order bytes (`q4_rows`) rearranged: rows in tiles of
    TILE, a tile's group g one block of 144 bytes, byte 32 p + 4 r + i the row r's byte 4 p + i
    of that group, then the 8 rows' scales; the rows past the last tile in row order."""
    from hybrid_serve.kernels.quant import TILE, q4_rows

    n, k = 2 * TILE + 3, 96
    q = quantize_int4(rand(n, k, seed=4))
    rows = q4_rows(q)
    assert rows.shape == q.shape and torch.equal(rows.flatten().sort()[0], q.flatten().sort()[0])
    width = q.shape[1]
    for t, r, g, p, i in [(0, 0, 0, 0, 0), (1, 5, 2, 3, 1), (0, 7, 1, 2, 3)]:
        block = q[t * TILE : (t + 1) * TILE].flatten()[g * 144 : (g + 1) * 144]
        assert block[32 * p + 4 * r + i] == rows[t * TILE + r, 16 * g + 4 * p + i]
        scale = rows[t * TILE + r, k // 2 + 2 * g : k // 2 + 2 * g + 2]
        assert torch.equal(block[128 + 2 * r : 130 + 2 * r], scale)
    assert torch.equal(q[2 * TILE :], rows[2 * TILE :])  # the rows past the tiles
    assert width * TILE == k // GROUP * 144


def test_int8_tiles_hold_the_row_bytes_where_weights_h_says() -> None:
    """The stored int8 matrix is its row-order bytes (`q8_rows`) rearranged: rows in tiles of
    TILE, a tile's block b of 32 columns 256 bytes, byte 32 p + 4 r + i the row r's element
    32 b + 4 p + i; then the tile's last K % 32 columns row by row; then its 8 fp32 scales; the
    rows past the last tile in row order. A stack tiles each matrix on its own."""
    from hybrid_serve.kernels.quant import TILE, q8_rows

    n, k = 2 * TILE + 5, 100  # three blocks of 32 and a short one of 4
    w = rand(n, k, seed=4)
    q = quantize_int8(w)
    rows = q8_rows(q)
    assert rows.shape == q.shape and torch.equal(rows.flatten().sort()[0], q.flatten().sort()[0])
    assert torch.equal(rows[:, :k].float() * scales(q)[:, None], dequantize(q))
    full, t, width = k // 32 * 32, k % 32, k + SCALE_BYTES
    for tile, r, b, p, i in [(0, 0, 0, 0, 0), (1, 5, 2, 7, 1), (0, 7, 1, 3, 3)]:
        flat = q[tile * TILE : (tile + 1) * TILE].flatten()
        assert flat[256 * b + 32 * p + 4 * r + i] == rows[tile * TILE + r, 32 * b + 4 * p + i]
        assert torch.equal(flat[8 * full + r * t : 8 * full + (r + 1) * t],
                           rows[tile * TILE + r, full:k])  # fmt: skip
        assert torch.equal(flat[8 * k + 4 * r : 8 * k + 4 * r + 4], rows[tile * TILE + r, k:])
    assert torch.equal(q[2 * TILE :], rows[2 * TILE :])  # the rows past the tiles
    assert q.shape[1] * TILE == width * TILE
    stack = rand(3, n, k, seed=5)
    assert torch.equal(quantize_int8(stack)[1], quantize_int8(stack[1]))
    assert torch.equal(q8_rows(quantize_int8(stack))[1], q8_rows(quantize_int8(stack[1])))


@pytest.mark.parametrize("method", ["bfloat16", "bf16-panels", *METHODS])
@pytest.mark.parametrize("shape", [(43, 256), (21, 100), (5, 64), (40, 33)])
def test_resident_bytes_per_format(method: str, shape: tuple[int, int]) -> None:
    """A matrix's bytes in each format, whatever its layout for the products (tiles, a short
    last block, rows past the tiles, bf16's K-pair panels with a short last tile and an odd K's
    last column): bf16 2 per weight, int8 1 plus a 4-byte scale per row, int4 a half plus a
    2-byte scale per 32 (int8 where K does not divide into groups)."""
    n, k = shape
    w = rand(n, k)
    stored = {"bfloat16": w.bfloat16, "bf16-panels": lambda: pack_bf16(w.bfloat16())}.get(
        method, lambda: quantize(w, method)
    )()
    int8 = n * (k + SCALE_BYTES)
    want = {"bfloat16": 2 * n * k, "bf16-panels": 2 * n * k, "int8": int8,
            "int4": n * k // 2 + n * k // 16 if k % GROUP == 0 else int8}  # fmt: skip
    assert stored.nbytes == want[method] and stored.untyped_storage().nbytes() == want[method]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("n", "k"), [(8, 160), (21, 160), (40, 160), (21, 100), (43, 300)])
def test_gemv_rows_equal_the_gemm_rows(n: int, k: int, method: str) -> None:
    """The integer GEMV sums each row as the tiled GEMM does: the rows of a batch the GEMV takes
    (up to 8, 16 or 64 by level: qgemv.h's kQGemvRows) are the same bits as those rows
    among the GEMM's, tile rows and the rows past the tiles alike, and an int8 matrix's short
    last block too (int4 falls back to int8 where K % 32 != 0). The GEMV itself at 17-80 rows
    (several passes at every level) gives the GEMM's bits too."""
    q = quantize(rand(n, k, seed=n), method)
    x = rand(80, k, seed=3) * 2
    gemm = torch.ops.hybrid_serve.tiled_linear(x, q)
    for rows in (1, 3, 4, 5, 8, 9, 12, 15, 16, 17, 24, 40, 64, 65, 80):
        assert torch.equal(cpp_ops.linear(x[:rows].contiguous(), q), gemm[:rows]), rows
    for rows in (17, 33, 80):
        gemv = torch.ops.hybrid_serve.skinny_linear(x[:rows].contiguous(), q)
        assert torch.equal(gemv, gemm[:rows]), rows
