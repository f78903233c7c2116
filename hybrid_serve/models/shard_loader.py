"""A part of a tensor along one dimension (`Shard`), and reading only that part of a checkpoint
tensor (`read_shard`, with safetensors' `get_slice`), so no tensor-parallel rank ever
materialises a whole sharded tensor, let alone the model. Which part each rank reads is declared
by the modules that hold the parameters (`models.tp_shards`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Shard:
    """Read `ranges` of dimension `dim`, concatenated; `rows`: the parameter rows they fill
    (the vocab shards, whose padding rows are left at zero), or None: the whole target.
    `segments`: where the dimension is the concatenation of parts (a fused [Q|K|V|Z] projection,
    [gate | up] rows), each part's whole length, one per range, range i lying in part i; None:
    one part (a tensor filling a slice of the parameter along `dim` then needs them)."""

    dim: int
    ranges: Ranges
    rows: int | None = None
    segments: tuple[int, ...] | None = None


def read_shard(f, name: str, shard: Shard | None) -> torch.Tensor:
    """Tensor `name` of the open safetensors file `f`, or only its `shard`."""
    if shard is None:
        return f.get_tensor(name)
    piece = f.get_slice(name)
    lead = (slice(None),) * shard.dim
    parts = [piece[(*lead, slice(a, b))] for a, b in shard.ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=shard.dim)
