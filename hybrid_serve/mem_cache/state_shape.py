"""What one recurrent layer keeps per sequence: the description the Mamba pool is built from.

Every recurrent mixer (Gated DeltaNet, Mamba2, ...) describes its per-layer state with one
`MambaStateShape` (SGLang keeps one `Mamba2StateShape` for GDN and Mamba2 alike):

    conv      [conv_dim, conv_width]   the last K-1 pre-convolution inputs, channel-first
    temporal  [*temporal]              the recurrent state: GDN (HV, dk, dv), Mamba2 (H, P, N);
                                       (0,) for a mixer whose state is its conv window alone
                                       (a short-conv mixer): the pool holds no element of it

The pools, their sizing and the host and storage tiers read only this description; they never
ask which family a layer belongs to. The model lists one shape per recurrent layer, in the dense
order its layers address the pool by.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch


@dataclass(frozen=True)
class MambaStateShape:
    """One recurrent layer's state shapes (this tensor-parallel rank's share of them)."""

    conv_dim: int  # channels of the short causal conv
    conv_width: int  # columns of conv state kept: conv kernel size - 1
    temporal: tuple[int, ...]  # the recurrent state of one sequence; (0,): none

    def __post_init__(self) -> None:
        if self.conv_dim < 1 or self.conv_width < 0:
            raise ValueError(
                f"bad conv state shape: conv_dim={self.conv_dim}, conv_width={self.conv_width}"
            )
        if not self.temporal or any(d < 0 for d in self.temporal):
            raise ValueError(f"bad temporal state shape {self.temporal}")

    @property
    def conv(self) -> tuple[int, int]:
        return self.conv_dim, self.conv_width

    def nbytes(self, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
        """Bytes of one sequence's state in this layer."""
        conv = self.conv_dim * self.conv_width * conv_dtype.itemsize
        return conv + math.prod(self.temporal) * ssm_dtype.itemsize


def state_bytes_per_slot(
    shapes: Sequence[MambaStateShape], conv_dtype: torch.dtype, ssm_dtype: torch.dtype
) -> int:
    """Bytes one pool slot occupies over all the layers `shapes` describe."""
    return sum(s.nbytes(conv_dtype, ssm_dtype) for s in shapes)


S = TypeVar("S")


def one_shape(shapes: Sequence[S], layers: str = "recurrent", kept: str = "state") -> S | None:
    """The one shape every layer has (None for no layers); a `ValueError` naming the first layer
    that differs ("`layers` layer i keeps `kept` ...") when they do (a pool stacks all its layers
    in one tensor per kind). The KV pool's layers are checked by the same rule (`kv_shape`)."""
    if not shapes:
        return None
    first = shapes[0]
    for i, s in enumerate(shapes):
        if s != first:
            raise ValueError(
                f"{layers} layer {i} keeps {kept} {s}, layer 0 {first}: one pool holds layers "
                f"of one {kept} shape"
            )
    return first


def common_shape(shapes: Sequence[MambaStateShape]) -> MambaStateShape | None:
    """`one_shape` of the recurrent layers' state shapes."""
    return one_shape(shapes)
