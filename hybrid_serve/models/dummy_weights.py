"""Random weights for `--load-format dummy`: each parameter filled in place, the presets' init.

`fill_dummy(model, family)` draws each parameter where it already lives (its device, its dtype:
the loader allocated it once, in the serving dtype), so peak memory is the model itself and no
weight file is read. Each parameter's init kind is its family row's (`Family.init_kind`: the
row's `init_rules` by name suffix, the one place that holds them), the kind the presets' writer
(`hybrid_serve.make_model.tensor_specs`) gives the tensor of that name, drawn by `fill`, which
the writer draws with too:

    "w"        matrices, embeddings, LM head                N(0, init_range)
    "norm0"    zero-centred RMSNorm weights (Qwen's)        N(0, 0.1)
    "norm1"    plain-weight norms, gated norms, Mamba2 D    1 + N(0, 0.1)
    "conv"     the convolutions' weights                    N(0, 0.3)
    "a_log"    A_log                                        log U(1, 16)
    "dt_bias"  dt_bias                                      softplus^-1(dt), dt = exp(U(log 1e-3,
                                                            log 1e-1))

A block-FP8 matrix kept in FP8 (`kernels.fp8.Fp8Weight`, `models.fp8_resident`) gets the same
N(0, init_range) as its values times its scales: e4m3 values drawn N(0, FP8_STD) (in fp32, one
leading index at a time, then rounded to e4m3) and every block scale init_range / FP8_STD.

The numbers are a pure function of (parameter shapes and order, dtype, device, seed): one
generator on the parameters' device draws them in `named_parameters()` order. They are not the
numbers of a preset checkpoint with the same seed (that one is drawn in fp32 on the CPU in
checkpoint-key order), only the same distributions.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hybrid_serve.kernels.fp8 import is_fp8
from hybrid_serve.models.families import Family

NORM_STD = 0.1  # the zero-centred norms' spread (and the GDN gated norm's, around 1)
CONV_STD = 0.3
FP8_STD = 16.0  # e4m3 values of a dummy FP8 matrix: well inside its +-448, fine steps near 0


def fill(param: torch.Tensor, kind: str, gen: torch.Generator, init_range: float) -> None:
    """`param` (fp32 or another float dtype) drawn in place from `gen` by init kind: "w" ~
    N(0, init_range), "norm0" ~ N(0, NORM_STD), "norm1" ~ N(1, NORM_STD), "conv" ~ N(0, CONV_STD),
    "a_log" = log U(1, 16), "dt_bias" = softplus^-1(dt), dt ~ logU(1e-3, 1e-1) (Mamba-2's: the
    decay stays moderate). The presets' writer draws its tensors with it too, so dummy weights
    and written checkpoints share every kind."""
    if kind == "w":
        param.normal_(0.0, init_range, generator=gen)
    elif kind == "norm0":
        param.normal_(0.0, NORM_STD, generator=gen)
    elif kind == "norm1":
        param.normal_(1.0, NORM_STD, generator=gen)
    elif kind == "conv":
        param.normal_(0.0, CONV_STD, generator=gen)
    elif kind in ("a_log", "dt_bias"):  # small per-head vectors: drawn in fp32, then cast
        x = torch.empty(param.shape, dtype=torch.float32, device=param.device)
        if kind == "a_log":
            x.uniform_(1.0, 16.0, generator=gen).log_()
        else:
            dt = x.uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp_()
            x = dt + torch.log(-torch.expm1(-dt))
        param.copy_(x)
    else:
        raise ValueError(f"unknown init kind {kind!r}")


def _fill_fp8(param: torch.Tensor, gen: torch.Generator, init_range: float) -> None:
    """An FP8 matrix's values N(0, FP8_STD) rounded to e4m3, its scales init_range / FP8_STD."""
    values = param.data
    rows = values.reshape(-1, *values.shape[-2:])  # [lead..., N, K] -> [L, N, K]
    for i in range(rows.shape[0]):
        x = torch.empty(rows.shape[1:], dtype=torch.float32, device=values.device)
        rows[i].copy_(x.normal_(0.0, FP8_STD, generator=gen))
    param.scale_inv.fill_(init_range / FP8_STD)


@torch.no_grad()
def fill_dummy(model: nn.Module, family: Family, seed: int = 0, init_range: float = 0.1) -> None:
    """Fill every parameter of `model` in place with the presets' init, each by its kind in
    `family`'s row (module docstring). A parameter shared by two names (tied embeddings) is
    drawn once."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():  # shared parameters are listed once
        if param.is_meta:  # shapes only (a model built to be measured, not run)
            continue
        gen = gens.get(param.device)
        if gen is None:
            gen = gens[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        if is_fp8(param):
            _fill_fp8(param, gen, init_range)
        else:
            fill(param.data, family.init_kind(name), gen, init_range)
