"""Weight-only quantized matrices (`--quantization int8|int4`): the formats, quantization from
float weights, and the reference dequantization. A quantized matrix is ONE tensor, its scales
kept at the end of each row as llama.cpp's blocks keep theirs, so every op that takes a weight
takes a quantized one in its place: the C++ kernels read the format by dtype
(`kernels/csrc/gemv.h`), the references `widen` it, and a stack of experts [E, N, ...] slices per
expert like any stack.

The formats' table (storage dtype, row layout, devices) is `hybrid_serve.kernels.weight_formats`.

int8 (torch.int8): symmetric, one scale per output row. w [..., N, K] is stored as [..., N, K + 4],
with

    scale[n] = max_k |w[n, k]| / 127   (1 for an all-zero row),   q = round(w / scale)

In row order, row n holds q[n, 0..K) then the 4 bytes of its fp32 scale (native byte order)
(`q8_rows`). As stored, the same bytes are laid out for the products once, here, as int4's are:
rows in tiles of TILE = 8, a tile's block b of ACT_BLOCK columns 256 bytes (the 8 rows' values
interleaved by quads of 4, what one VNNI dot against a broadcast quad of activations takes),
then the tile's last K % 32 columns row by row, then its 8 scales; the rows past the last whole
tile stay in row order (kernels/csrc/weights.h holds the byte map).

int4 (torch.uint8): symmetric, one bf16 scale per group of 32 along K (K a multiple of 32), the
4.5 bits per weight of llama.cpp's Q4_0 and its rule: a group's scale is d = -p / 8 for p its
element of largest magnitude (so p maps to -8 exactly), q = clamp(round(w / d), -8, 7). In row
order, row n is K / 2 bytes of groups of 16 (group g's element j in byte 16 g + j's low nibble,
element j + 16 in its high nibble, each stored as q + 8) followed by the K / 32 scales' bf16
bytes (`q4_rows`). As stored, the same bytes are laid out for the products once, here: rows in
tiles of TILE = 8, a tile's group g one block of 144 bytes (the 8 rows' nibbles interleaved by
quads of 4 elements, then their 8 scales), as llama.cpp's repacked Q4_0 interleaves its
blocks; the rows past the last whole tile stay in row order (kernels/csrc/weights.h holds the
byte map). The tensor keeps its shape [..., N, 9K/16] and its bytes. Groups of 32
keep the step fine (a group of 64 would save 0.25 bit per weight for a coarser step at every
group's extremes); bf16 scales widen with one shift and their rounding (< 0.4%) is small beside
the 4-bit step. The loader keeps int8 for a matrix whose K is not a multiple of 32 (as
llama-quantize falls back for rows that do not divide into blocks).

A quantized matrix multiplies activations rounded to int8 (`round_activations`), as llama.cpp's
Q8_0 and Q4_0 dot products multiply Q8_0 activations: per block of ACT_BLOCK values along K (a
shorter last block where K is not a multiple), d = max |x| / 127 in fp32 and q = round(x * (127 /
max |x|)), half to even. Every product of a quantized matrix, the references' (`linear`,
`experts`) and the C++ kernels' alike, is the dequantized weights times the rounded activations
(`q * d`): the C++ GEMV sums the integer products of each block exactly (int32) and scales each
block's sum (kernels/csrc/qgemv.h); the tiled GEMM multiplies the rounded values in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_serve.kernels import fp8
from hybrid_serve.kernels.weight_formats import (
    FORMATS,
    GROUP,
    QUANTIZATION_METHODS,
    SCALE_BYTES,
    format_of,
)

QMAX = 127
TILE = 8  # int8 and int4 rows per interleaved tile (weights.h's kTile)
ACT_BLOCK = 32  # activations per int8 scale in a quantized matrix's products
METHODS = QUANTIZATION_METHODS  # int8, int4 (hybrid_serve.kernels.weight_formats)
CPP_DTYPES = tuple(getattr(torch, f.dtype) for f in FORMATS if f.cpp)  # what the C++ reads


def is_quantized(w: torch.Tensor) -> bool:
    """Stored in a `--quantization` format (int8, int4)."""
    fmt = format_of(w)
    return fmt is not None and fmt.method


def in_features(w: torch.Tensor) -> int:
    """K of a weight [..., N, K] as stored, in any format (hybrid_serve.kernels.weight_formats)."""
    fmt = format_of(w)
    return w.shape[-1] if fmt is None else fmt.in_features(w.shape[-1])


def quantize(w: torch.Tensor, method: str, peak: torch.Tensor | None = None) -> torch.Tensor:
    """w in the format of `method`; int4 falls back to int8 where K is not a multiple of GROUP.
    `peak`: see `quantize_int8`."""
    if method == "int4" and w.shape[-1] % GROUP == 0:
        return quantize_int4(w)
    return quantize_int8(w, peak)


def row_peaks(w: torch.Tensor) -> torch.Tensor:
    """max_k |w[..., n, k]| in fp32, [..., N]."""
    return w.float().abs().amax(dim=-1)


def quantize_int8(w: torch.Tensor, peak: torch.Tensor | None = None) -> torch.Tensor:
    """w [..., N, K] (any float dtype) -> the int8 format [..., N, K + 4] (module docstring).
    The scales are computed in fp32 from `peak` [..., N], by default w's own `row_peaks` (a
    tensor-parallel shard of the columns passes the whole rows' peaks, so that its numbers are
    those of the whole matrix)."""
    wf = w.float()
    peak = wf.abs().amax(dim=-1) if peak is None else peak.float()
    scale = peak.unsqueeze(-1) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(wf / scale).clamp_(-QMAX, QMAX).to(torch.int8)
    tail = scale.contiguous().view(torch.int8)  # [..., N, 4]: the fp32 scale's bytes
    return _tiled8(torch.cat([q, tail], dim=-1))


def _tiled8(rows: torch.Tensor) -> torch.Tensor:
    """An int8 matrix in row order [..., N, K + 4] -> as stored (the module docstring)."""
    *lead, n, width = rows.shape
    k, t, d = width - SCALE_BYTES, n // TILE, len(lead)
    g, k32 = k // ACT_BLOCK, k // ACT_BLOCK * ACT_BLOCK
    head = rows[..., : t * TILE, :].reshape(*lead, t, TILE, width)
    q = head[..., :k32].reshape(*lead, t, TILE, g, 8, 4)  # [.., tile, row, block, quad, 4]
    q = q.permute(*range(d), d, d + 2, d + 3, d + 1, d + 4).reshape(*lead, t, 8 * k32)
    rest = head[..., k32:k].reshape(*lead, t, TILE * (k - k32))  # the short block, row by row
    sc = head[..., k:].reshape(*lead, t, TILE * SCALE_BYTES)
    tiles = torch.cat([q, rest, sc], dim=-1).reshape(*lead, t * TILE, width)
    return torch.cat([tiles, rows[..., t * TILE :, :]], dim=-2).contiguous()


def q8_rows(w: torch.Tensor) -> torch.Tensor:
    """A stored int8 matrix [..., N, K + 4] in row order: each row's K values then its fp32
    scale's bytes (the inverse of the tiling `quantize_int8` does)."""
    *lead, n, width = w.shape
    k, t, d = width - SCALE_BYTES, n // TILE, len(lead)
    g, k32 = k // ACT_BLOCK, k // ACT_BLOCK * ACT_BLOCK
    head = w[..., : t * TILE, :].reshape(*lead, t, TILE * width)
    q = head[..., : 8 * k32].reshape(*lead, t, g, 8, TILE, 4)  # [.., tile, block, quad, row, 4]
    q = q.permute(*range(d), d, d + 3, d + 1, d + 2, d + 4).reshape(*lead, t, TILE, k32)
    rest = head[..., 8 * k32 : 8 * k].reshape(*lead, t, TILE, k - k32)
    sc = head[..., 8 * k :].reshape(*lead, t, TILE, SCALE_BYTES)
    rows = torch.cat([q, rest, sc], dim=-1).reshape(*lead, t * TILE, width)
    return torch.cat([rows, w[..., t * TILE :, :]], dim=-2)


def quantize_int4(w: torch.Tensor) -> torch.Tensor:
    """w [..., N, K] (any float dtype, K a multiple of GROUP) -> the int4 format [..., N, 9K/16]
    (module docstring). The scales are computed in fp32, rounded to bf16, and q against the
    rounded scale."""
    *lead, n, k = w.shape
    if k % GROUP:
        raise ValueError(f"int4 needs K a multiple of {GROUP}, got {k}")
    g = w.float().reshape(*lead, n, k // GROUP, GROUP)
    peak = g.gather(-1, g.abs().argmax(-1, keepdim=True))
    d = (peak / -8).bfloat16().float()
    d = torch.where(d == 0, torch.ones_like(d), d)
    q = (torch.round(g / d).clamp_(-8, 7) + 8).to(torch.uint8)
    nibbles = q[..., : GROUP // 2] | (q[..., GROUP // 2 :] << 4)  # [..., N, K/32, 16]
    tail = d.squeeze(-1).bfloat16().contiguous().view(torch.uint8)  # [..., N, K/32 * 2]
    return _tiled(torch.cat([nibbles.reshape(*lead, n, k // 2), tail], dim=-1))


def _tiled(rows: torch.Tensor) -> torch.Tensor:
    """An int4 matrix in row order [..., N, 9K/16] -> as stored (the module docstring)."""
    *lead, n, width = rows.shape
    k, t = width * GROUP // (GROUP // 2 + 2), n // TILE
    g, d = k // GROUP, len(lead)
    head = rows[..., : t * TILE, :]
    nib = head[..., : k // 2].reshape(*lead, t, TILE, g, 4, 4)  # [.., tile, row, group, quad, 4]
    nib = nib.permute(*range(d), d, d + 2, d + 3, d + 1, d + 4).reshape(*lead, t, g, 128)
    sc = head[..., k // 2 :].reshape(*lead, t, TILE, g, 2).transpose(-3, -2)
    blocks = torch.cat([nib, sc.reshape(*lead, t, g, 2 * TILE)], dim=-1)
    return torch.cat([blocks.reshape(*lead, t * TILE, width), rows[..., t * TILE :, :]], dim=-2)


def q4_rows(w: torch.Tensor) -> torch.Tensor:
    """A stored int4 matrix [..., N, 9K/16] in row order: each row's K / 2 bytes of nibbles then
    its K / 32 bf16 scales' bytes (the inverse of the tiling `quantize_int4` does)."""
    *lead, n, width = w.shape
    k, t = width * GROUP // (GROUP // 2 + 2), n // TILE
    g, d = k // GROUP, len(lead)
    head = w[..., : t * TILE, :].reshape(*lead, t, g, 144)
    nib = head[..., :128].reshape(*lead, t, g, 4, TILE, 4)  # [.., tile, group, quad, row, 4]
    nib = nib.permute(*range(d), d, d + 3, d + 1, d + 2, d + 4).reshape(*lead, t * TILE, k // 2)
    sc = head[..., 128:].reshape(*lead, t, g, TILE, 2).transpose(-3, -2)
    rows = torch.cat([nib, sc.reshape(*lead, t * TILE, 2 * g)], dim=-1)
    return torch.cat([rows, w[..., t * TILE :, :]], dim=-2)


def scales(w: torch.Tensor) -> torch.Tensor:
    """The fp32 scales of a quantized matrix: [..., N] (int8) or [..., N, K / GROUP] (int4)."""
    if w.dtype == torch.uint8:
        return q4_rows(w)[..., in_features(w) // 2 :].contiguous().view(torch.bfloat16).float()
    return q8_rows(w)[..., -SCALE_BYTES:].contiguous().view(torch.float32).squeeze(-1)


def dequantize(w: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A quantized matrix -> its values w [..., N, K] in `dtype` (computed in fp32)."""
    if w.dtype == torch.uint8:
        *lead, n, _ = w.shape
        k = in_features(w)
        nib = q4_rows(w)[..., : k // 2].reshape(*lead, n, k // GROUP, GROUP // 2)
        q = torch.cat([nib & 15, nib >> 4], dim=-1).float() - 8  # [..., N, K/32, 32]
        return (q * scales(w).unsqueeze(-1)).reshape(*lead, n, k).to(dtype)
    q = q8_rows(w)[..., :-SCALE_BYTES].float()
    return (q * scales(w).unsqueeze(-1)).to(dtype)


def widen(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A weight stored in another form than the activations' dtype (bf16 under fp32 activations,
    quantized, or resident block-FP8: `kernels.fp8`) as a `dtype` tensor of its values; a weight
    already in `dtype` as it is."""
    if is_quantized(w):
        return dequantize(w, dtype)
    if fp8.is_fp8(w):
        return fp8.dequantize(w, dtype)
    return w if w.dtype == dtype else w.to(dtype)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (fp32) rounded to int8 per block of ACT_BLOCK along K (module docstring) and
    returned as the rounded values q * d in fp32, the C++ kernels' numbers exactly."""
    k = x.shape[-1]
    pad = -k % ACT_BLOCK
    xf = F.pad(x.float(), (0, pad)).unflatten(-1, (-1, ACT_BLOCK))  # [..., K/32, 32]
    peak = xf.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(peak > 0, torch.full_like(peak, QMAX).div(peak), 0.0)
    q = torch.round(xf * inv)  # half to even, as the kernels' round
    return (q * (peak / QMAX)).flatten(-2)[..., :k]
