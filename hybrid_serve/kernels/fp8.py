"""Block-FP8 matrices kept in FP8: the resident format, and its reference dequantization.

A block-FP8 matrix w [..., N, K] is its float8 e4m3 values q and one fp32 scale per block of
`block = (bn, bk)` rows x columns (the checkpoints' `weight_scale_inv`, shape
[..., ceil(N / bn), ceil(K / bk)]; a side that is not a multiple of the block ends in a
shorter block):

    w[..., n, k] = float(q[..., n, k]) * scale_inv[..., n // bn, k // bk]

`Fp8Weight` is such a matrix as ONE tensor, as `hybrid_serve.kernels.quant`'s formats are: an
`nn.Parameter` whose data are the e4m3 values (its dtype says the format) and which carries its
scales (`scale_inv`, a plain fp32 tensor on the same device) and `block`. Every op that takes a
weight therefore takes an FP8 one in its place: the references `widen` it (`dequantize`, in
fp32, then the activations' dtype: the numbers of the bf16 checkpoint the FP8 one stands for),
the Triton products read the e4m3 bytes and the scales and dequantize per block inside the
kernel (`kernels.fp8_gemm_triton`, `kernels.fused_moe_triton`), and indexing a stack of experts
with an integer (`w[e]`) gives expert e's matrix with its own scales. Anything else done to the
tensor (slicing, `.to`, arithmetic) sees the plain e4m3 values, without scales: the format is
made at load, on its device, and is not converted afterwards (`Module.to` would drop it).

The Triton products apply each block's scale to the fp32 partial sums of one K tile, so a K tile
lies inside one block: `bk` a multiple of `MIN_TILE_K` (`resident_block`); the 128 x 128 blocks
of the official releases are.
"""

from __future__ import annotations

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
MIN_TILE_K = 16  # the smallest K tile of a Triton dot


class Fp8Weight(nn.Parameter):
    """e4m3 values [..., N, K] (the tensor itself) with `scale_inv` [..., ceil(N/bn),
    ceil(K/bk)] fp32 and `block` (bn, bk): the module docstring's format."""

    scale_inv: torch.Tensor
    block: tuple[int, int]

    def __new__(
        cls, data: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
    ) -> Fp8Weight:
        if data.dtype != E4M3:
            raise ValueError(f"Fp8Weight holds float8_e4m3fn values, not {data.dtype}")
        want = grid_shape(tuple(data.shape), block)
        if tuple(scale_inv.shape) != want or scale_inv.dtype != torch.float32:
            raise ValueError(
                f"Fp8Weight {tuple(data.shape)} in {block[0]}x{block[1]} blocks needs fp32 "
                f"scales {want}, got {scale_inv.dtype} {tuple(scale_inv.shape)}"
            )
        if scale_inv.device != data.device:
            raise ValueError(f"Fp8Weight scales on {scale_inv.device}, values on {data.device}")
        self = super().__new__(cls, data, requires_grad=False)
        self.scale_inv, self.block = scale_inv, (int(block[0]), int(block[1]))
        return self

    def __getitem__(self, index):
        """An integer index of a leading (stack) dimension keeps the format: expert `e` of a
        stack [E, N, K] is the matrix [N, K] with its scales [nb, kb]. Other indices give the
        plain e4m3 values."""
        if isinstance(index, int) and self.dim() > 2:
            return Fp8Weight(self.data[index], self.scale_inv[index], self.block)
        return self.data[index]

    def __deepcopy__(self, memo: dict) -> Fp8Weight:
        if id(self) not in memo:
            memo[id(self)] = Fp8Weight(self.data.clone(), self.scale_inv.clone(), self.block)
        return memo[id(self)]

    def __repr__(self) -> str:
        return f"Fp8Weight(shape={tuple(self.shape)}, block={self.block}, device={self.device})"


def is_fp8(w: torch.Tensor) -> bool:
    """Whether `w` is a resident block-FP8 matrix (`Fp8Weight`)."""
    return isinstance(w, Fp8Weight)


def grid_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The block grid of a matrix of `shape`: its last two sides over `block`, rounded up."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def resident_block(block: tuple[int, int]) -> bool:
    """Whether matrices in `block`s can stay FP8 for the Triton products (see the module
    docstring): a block's columns hold a whole number of the smallest K tile."""
    return block[0] > 0 and block[1] > 0 and block[1] % MIN_TILE_K == 0


def tile_k(block_k: int, cap: int) -> int:
    """The K tile of a product over `block_k`-column blocks: the largest power of two that
    divides `block_k`, at most `cap` (at least MIN_TILE_K for a `resident_block`)."""
    return min(cap, block_k & -block_k)


def dequantize_blocks(
    values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """fp32 `values * scale_inv`, each scale broadcast over its block of the last two dims
    (the tail blocks shorter)."""
    rows, cols = values.shape[-2:]
    s = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    s = s.repeat_interleave(block[1], dim=-1)[..., :cols]
    return values.float() * s


def dequantize(w: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of `w` [..., N, K] in `dtype` (computed in fp32, rounded once)."""
    return dequantize_blocks(w.data, w.scale_inv, w.block).to(dtype)


def weight_bytes(p: torch.Tensor) -> int:
    """Bytes a parameter holds on its device: its elements, and an FP8 matrix's scales."""
    n = p.numel() * p.element_size()
    return n + p.scale_inv.numel() * p.scale_inv.element_size() if is_fp8(p) else n
