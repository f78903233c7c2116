"""Weight-only quantized matrices (`--quantization int8`): the format, quantization from float
weights, and the reference dequantization.

int8: symmetric, one scale per output row. A matrix w [..., N, K] is stored as ONE int8 tensor
[..., N, K + 4] whose row n holds q[n, 0..K) followed by the 4 bytes of its fp32 scale (native
byte order), with

    scale[n] = max_k |w[n, k]| / 127   (1 for an all-zero row),   q = round(w / scale[n])
    w[n, k] ~ q[n, k] * scale[n]

Keeping the scale in the row, as llama.cpp's blocks keep theirs, makes a quantized matrix one
tensor: every op that takes a weight takes a quantized one in its place (the C++ kernels read the
format by dtype, `kernels/csrc/gemv.h`; the references `widen` it), and stacks of experts
[E, N, K + 4] slice per expert like any stack. Products sum the integers (exact in fp32) and scale
each output once.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # an fp32 scale at the end of each int8 row
QMAX = 127
METHODS = ("int8",)
CPP_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.int8)  # what the C++ kernels read


def is_quantized(w: torch.Tensor) -> bool:
    return w.dtype == torch.int8


def in_features(w: torch.Tensor) -> int:
    """K of a weight [..., N, K] as stored, quantized or not."""
    return w.shape[-1] - SCALE_BYTES if is_quantized(w) else w.shape[-1]


def quantize_int8(w: torch.Tensor) -> torch.Tensor:
    """w [..., N, K] (any float dtype) -> the int8 format [..., N, K + 4] (module docstring).
    The scales are computed in fp32 from w's own values."""
    wf = w.float()
    scale = wf.abs().amax(dim=-1, keepdim=True) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(wf / scale).clamp_(-QMAX, QMAX).to(torch.int8)
    tail = scale.contiguous().view(torch.int8)  # [..., N, 4]: the fp32 scale's bytes
    return torch.cat([q, tail], dim=-1).contiguous()


def scales(w: torch.Tensor) -> torch.Tensor:
    """The fp32 scales [..., N] of an int8-format matrix."""
    return w[..., -SCALE_BYTES:].contiguous().view(torch.float32).squeeze(-1)


def dequantize(w: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An int8-format matrix [..., N, K + 4] -> q * scale [..., N, K] in `dtype` (computed in
    fp32)."""
    q = w[..., :-SCALE_BYTES].float()
    return (q * scales(w).unsqueeze(-1)).to(dtype)


def widen(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A weight stored in another form than the activations' dtype (bf16 under fp32 activations,
    or int8-format) as a `dtype` tensor of its values; a weight already in `dtype` as it is."""
    if is_quantized(w):
        return dequantize(w, dtype)
    return w if w.dtype == dtype else w.to(dtype)
