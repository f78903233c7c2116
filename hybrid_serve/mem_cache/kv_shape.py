"""What one attention layer keeps per token: the description the KV pool is built from.

Every attention layer describes its cache row with one `KVShape`, as every recurrent layer
describes its state with a `MambaStateShape` (`mem_cache/state_shape.py`). Two layouts:

    heads   MHA / GQA: K [heads, k_dim] and V [heads, v_dim] per token (k_dim == v_dim today)
    latent  MLA: one row of kv_lora_rank + qk_rope_head_dim values per token (the normalized
            compressed KV, then the roped shared key), stored as K [1, row]; V has no columns,
            because the values are read from the same row (v_dim == 0)

The pool, its sizing, the radix cache and the host and storage tiers read only this
description: they copy K and V rows of whatever width it gives and never ask which family or
which attention a layer is. Under tensor parallelism a shape is this rank's share (its KV heads;
a latent row is whole on every rank). The model lists one shape per KV-pool layer, in the dense
order its attention layers address the pool by.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybrid_serve.mem_cache.state_shape import one_shape


@dataclass(frozen=True)
class KVShape:
    """One attention layer's per-token cache row (this tensor-parallel rank's share)."""

    heads: int  # KV heads held per token (1 for a latent row)
    k_dim: int  # K's width per head, or the latent row's width
    v_dim: int  # V's width per head; 0 for a latent row (its values live in the K row)
    expanded: int = 0  # latent only: the K and V values per token its row stands for (logs)

    def __post_init__(self) -> None:
        if self.heads < 1 or self.k_dim < 1 or self.v_dim < 0 or self.expanded < 0:
            raise ValueError(f"bad KV shape {self}")
        if self.latent and self.heads != 1:
            raise ValueError(f"a latent KV row is one head, got {self.heads}")

    @classmethod
    def mha(cls, num_kv_heads: int, head_dim: int) -> KVShape:
        """K and V of `num_kv_heads` heads of `head_dim` each (MHA, GQA, MQA)."""
        return cls(num_kv_heads, head_dim, head_dim)

    @classmethod
    def latent_row(
        cls, kv_lora_rank: int, qk_rope_head_dim: int, num_heads: int, k_head_dim: int,
        v_head_dim: int,
    ) -> KVShape:  # fmt: skip
        """MLA's row of `kv_lora_rank + qk_rope_head_dim`; `num_heads` query heads with K of
        `k_head_dim` (nope + rope) and V of `v_head_dim` is what expanding it gives."""
        expanded = num_heads * (k_head_dim + v_head_dim)
        return cls(1, kv_lora_rank + qk_rope_head_dim, 0, expanded)

    @property
    def latent(self) -> bool:
        return self.v_dim == 0

    @property
    def values_per_token(self) -> int:
        return self.heads * (self.k_dim + self.v_dim)

    def nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of one token's row(s) in this layer."""
        return self.values_per_token * dtype.itemsize

    def describe(self) -> str:
        """The layout in words, for the start-up log."""
        if self.latent:
            return (
                f"MLA: one latent row of {self.k_dim} values per layer, where the expanded "
                f"K and V would hold {self.expanded} ({self.expanded / self.k_dim:.1f}x)"
            )
        return f"MHA/GQA: {self.heads} KV heads x ({self.k_dim} K + {self.v_dim} V) per layer"


def kv_bytes_per_token(shapes: Sequence[KVShape], dtype: torch.dtype) -> int:
    """Bytes one token occupies in the KV pool over all the layers `shapes` describe."""
    return sum(s.nbytes(dtype) for s in shapes)


def common_kv_shape(shapes: Sequence[KVShape]) -> KVShape | None:
    """The one shape every attention layer has (`state_shape.one_shape`'s rule)."""
    return one_shape(shapes, "attention", "KV")
