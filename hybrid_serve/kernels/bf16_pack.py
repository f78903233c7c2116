"""bf16 matrices in K-pair panels: the layout the CPU's panel products read (kernels/csrc/
bpanel.h), made once from plain rows (`pack_bf16`) and read back as plain rows (`bf16_rows`).

A bf16 matrix w [..., N, K] keeps its shape, dtype and bytes; only the order of its elements
changes. Its rows are cut into panels of PANEL = 64 rows, the last panel holding the N % 64 rows
left over (a short panel of h < 64 rows; none where 64 divides N). A panel of h rows that starts
at row n0 occupies the elements [n0 K, (n0 + h) K) of the matrix, as its rows did in row order,
and holds

- for each pair p < K // 2, 2h elements: row i's (w[n0 + i, 2p], w[n0 + i, 2p + 1]) at 2hp + 2i,
  so a whole panel's pair is 256 bytes, 64 rows' (k, k + 1) pairs: 4 vectors of 16 bf16 pairs
  at AVX-512 (one `vdpbf16ps` against a broadcast pair of activations adds 16 outputs at once),
  and a one-row product reads a panel as one run of memory, pair after pair;
- then, for an odd K, the h values w[n0 + i, K - 1], row i at 2h (K // 2) + i.

Where the layout is used: under the bf16 route (`KernelSet.bf16_products`, chosen at load on
CPUs that multiply bf16 in hardware) every bf16 matrix on the CPU is panels (the loader packs
them: `models.loader.pack_matrices`); without the route (e.g. the widening fp32 products of an
AVX2 CPU) bf16 matrices stay in row order. `in_panels` is that rule, and `plain_rows` gives a
reader that takes rows (torch's products, per-head views) the rows either way.

So every panel boundary is a row boundary in both layouts: a range of whole panels (rows
[64 a, 64 b)) is the same range of elements packed or not, and slices as one. kernels/csrc/weights.h
holds the same byte map (`bpanel_index`; tests/kernels/test_bf16_pack.py checks the two agree).
"""

from __future__ import annotations

import torch

PANEL = 64  # rows per panel (weights.h's kPanel)


def _pack_panels(rows: torch.Tensor, h: int) -> torch.Tensor:
    """Whole panels of h rows in row order [..., T h, K] -> the same panels packed."""
    *lead, n, k = rows.shape
    t, k2 = n // h, k // 2
    tiles = rows.reshape(*lead, t, h, k)
    pairs = tiles[..., : 2 * k2].reshape(*lead, t, h, k2, 2).transpose(-3, -2)  # [.., t, p, h, 2]
    parts = [pairs.reshape(*lead, t, 2 * k2 * h)]
    if k % 2:
        parts.append(tiles[..., k - 1])  # [..., t, h]: the odd K's last column
    return torch.cat(parts, dim=-1).reshape(*lead, n, k)


def _unpack_panels(packed: torch.Tensor, h: int) -> torch.Tensor:
    """Whole packed panels of h rows [..., T h, K] -> the same rows in row order."""
    *lead, n, k = packed.shape
    t, k2 = n // h, k // 2
    flat = packed.reshape(*lead, t, h * k)
    pairs = flat[..., : 2 * k2 * h].reshape(*lead, t, k2, h, 2).transpose(-3, -2)  # [.., h, p, 2]
    parts = [pairs.reshape(*lead, t, h, 2 * k2)]
    if k % 2:
        parts.append(flat[..., 2 * k2 * h :].unsqueeze(-1))  # [..., t, h, 1]
    return torch.cat(parts, dim=-1).reshape(*lead, n, k)


def _by_panels(w: torch.Tensor, fn) -> torch.Tensor:
    n = w.shape[-2]
    whole = n // PANEL * PANEL
    parts = []
    if whole:
        parts.append(fn(w[..., :whole, :], PANEL))
    if n > whole:
        parts.append(fn(w[..., whole:, :], n - whole))
    if not parts:
        return w.clone()
    return torch.cat(parts, dim=-2).contiguous()


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """A bf16 matrix [..., N, K] in row order -> the same values in panels (module docstring):
    same shape, dtype and bytes, a new contiguous tensor."""
    if w.dtype != torch.bfloat16:
        raise TypeError(f"pack_bf16 takes a bf16 matrix, got {w.dtype}")
    return _by_panels(w, _pack_panels)


def pack_bf16_(w: torch.Tensor, chunk_bytes: int = 1 << 20) -> torch.Tensor:
    """`pack_bf16` in place, for the loader: a contiguous bf16 matrix [..., N, K] rewritten in
    panels in its own storage, one matrix of the stack and about `chunk_bytes` of whole panels
    at a time (a range of whole panels is the same elements in both orders), so packing a model
    holds one chunk beside its weights, not a copy of a matrix. Returns `w`."""
    if w.dtype != torch.bfloat16 or not w.is_contiguous():
        raise TypeError(f"pack_bf16_ takes a contiguous bf16 matrix, got {w.dtype}")
    n, k = w.shape[-2], w.shape[-1]
    step = max(1, chunk_bytes // max(1, 2 * k * PANEL)) * PANEL
    for m in w.reshape(-1, n, k):
        for r0 in range(0, n, step):
            part = m[r0 : r0 + step]
            part.copy_(pack_bf16(part))
    return w


def bf16_rows(w: torch.Tensor) -> torch.Tensor:
    """A panel-packed bf16 matrix [..., N, K] -> its rows in row order (the inverse of
    `pack_bf16`), for readers that take plain rows (torch's products, shards, dequantization)."""
    if w.dtype != torch.bfloat16:
        raise TypeError(f"bf16_rows takes a bf16 matrix, got {w.dtype}")
    return _by_panels(w, _unpack_panels)


def in_panels(w: torch.Tensor, bf16_products: bool) -> bool:
    """Whether `w` lies in panels under the one rule (module docstring): a bf16 tensor on the
    CPU where the bf16 route is on."""
    return bf16_products and w.dtype == torch.bfloat16 and w.device.type == "cpu"


def plain_rows(w: torch.Tensor, bf16_products: bool) -> torch.Tensor:
    """`w`'s rows in row order: unpacked (a new tensor) where `in_panels`, else `w` itself."""
    return bf16_rows(w) if in_panels(w, bf16_products) else w
