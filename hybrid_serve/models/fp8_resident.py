"""Block-FP8 checkpoints kept in FP8 on the device: which parameters stay FP8, and filling them.

A parameter stays FP8 (`kernels.fp8.Fp8Weight`: e4m3 values and the checkpoint's block scales,
one byte per weight) when every checkpoint tensor that fills it is FP8 and lands on whole
blocks of it; the loader then allocates it as e4m3 (on the meta model, so it is allocated once,
at one byte per weight) and copies the checkpoint's bytes and scales in unchanged. Landing on
whole blocks means, for each of its checkpoint tensors (`hybrid_serve.models.weight_map.Target`):

    index      a row slice of the parameter (Qwen3.5's in_proj_qkv / in_proj_z halves, an
               expert's gate or up rows) starts on a block row and ends on one or at the end
    transform  a reordering of rows (the grouped Qwen3-Next in_proj_qkvz) moves whole blocks
    shard      a tensor-parallel rank's ranges (`models.shard_loader`) start and end on blocks
               (or at the tensor's end, last), so its scales are whole rows/columns of the grid

Anything else (an expert width or a rank's share that splits a block) is dequantized at load as
before, parameter by parameter: such a model mixes FP8 and bf16 matrices, and every kernel takes
both. The 128 x 128 blocks of the Qwen3-Next and Qwen3.5 releases land whole everywhere at one
rank (hidden sizes, head dims and expert widths are multiples of 128).

`--load-format dummy` of a config with a block-FP8 `quantization_config` keeps FP8 the matrices
(linear layers and expert stacks) that no entry of its ignore list names and whose row slices
land on whole blocks; their values are random e4m3 (`fill_dummy`), so the memory is a real FP8
load's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hybrid_serve.kernels.fp8 import E4M3, Fp8Weight, grid_shape, resident_block
from hybrid_serve.models.fp8 import Fp8Checkpoint, Fp8Config, HeldTensor, module_of
from hybrid_serve.models.shard_loader import Shard, read_shard
from hybrid_serve.models.weight_map import Target


@dataclass(frozen=True)
class BlockTarget:
    """Where one FP8 checkpoint tensor's scales go in its parameter's block grid."""

    shard: Shard | None  # this rank's part of the scale grid (in blocks)
    order: torch.Tensor | None  # the transform's order of block rows (source block per block)
    index: tuple  # into the parameter's grid


def _block_order(perm: torch.Tensor, b: int) -> torch.Tensor | None:
    """For a row order `perm` (target row -> source row): the source block of each target
    block of `b` rows, or None when some block is not a whole source block moved as one."""
    rows, order = perm.numel(), []
    for start in range(0, rows, b):
        n, src = min(b, rows - start), int(perm[start])
        run = src + torch.arange(n)
        if src % b or min(b, rows - src) != n or not torch.equal(perm[start : start + n], run):
            return None
        order.append(src // b)
    return torch.tensor(order)


def block_target(
    shape: tuple[int, ...],
    target: Target,
    shard: Shard | None,
    block: tuple[int, int],
    param_shape: tuple[int, ...],
) -> BlockTarget | None:
    """The block-grid placement of a checkpoint tensor of `shape` going to `target` of a
    parameter of `param_shape` (this rank reading `shard` of it), or None when it does not land
    on whole blocks (module docstring)."""
    rank, piece = len(shape), list(shape)
    grid_shard = None
    if shard is not None:
        if shard.rows is not None or shard.dim < rank - 2:
            return None
        b = block[0] if shard.dim == rank - 2 else block[1]
        ranges = []
        for i, (lo, hi) in enumerate(shard.ranges):
            whole_end = hi == shape[shard.dim] and i == len(shard.ranges) - 1
            if lo % b or (hi % b and not whole_end):
                return None
            ranges.append((lo // b, -(-hi // b)))
        grid_shard = Shard(shard.dim, tuple(ranges))
        piece[shard.dim] = sum(hi - lo for lo, hi in shard.ranges)
    order = None
    if target.transform is not None:
        rows = torch.arange(piece[-2], dtype=torch.float64).unsqueeze(-1)  # [R, 1]: row ids
        order = _block_order(target.transform(rows).squeeze(-1).long(), block[0])
        if order is None:
            return None
    index = grid_index(target.index, param_shape, block)
    return None if index is None else BlockTarget(grid_shard, order, index)


def grid_index(index: tuple, param_shape: tuple[int, ...], block: tuple[int, int]) -> tuple | None:
    """`index` into a parameter of `param_shape` (integers into leading dims, a row slice) as
    the index of the same part of its block grid; None when the rows are not whole blocks."""
    out: list = []
    for dim, ix in enumerate(index):
        if isinstance(ix, int):
            out.append(ix)
            continue
        start, stop, _ = ix.indices(param_shape[dim])
        whole = start % block[0] == 0 and (stop % block[0] == 0 or stop == param_shape[dim])
        if dim != len(param_shape) - 2 or not whole:
            return None
        out.append(slice(start // block[0], -(-stop // block[0])))
    return tuple(out)


def plan(
    params: dict[str, nn.Parameter],
    matrices: set[str],
    table: dict[str, Target],
    checkpoint: Fp8Checkpoint,
    shard_of: Callable[[str], Shard | None],
) -> dict[str, BlockTarget]:
    """Checkpoint tensor -> its `BlockTarget`, for every tensor of a parameter that stays FP8:
    one of `matrices` (parameter names), every one of whose tensors is FP8 and lands on whole
    blocks."""
    block = checkpoint.config.block
    if not resident_block(block):
        return {}
    by_param: dict[str, dict[str, Target]] = {}
    for name, target in table.items():
        by_param.setdefault(target.param, {})[name] = target
    out: dict[str, BlockTarget] = {}
    for pname, entries in by_param.items():
        if pname not in matrices or not all(n in checkpoint.scales for n in entries):
            continue
        shape = tuple(params[pname].shape)
        found = {
            n: block_target(checkpoint.shapes[n], t, shard_of(n), block, shape)
            for n, t in entries.items()
        }
        if all(bt is not None for bt in found.values()):
            out.update(found)
    return out


def dummy_plan(
    params: dict[str, nn.Parameter],
    matrices: set[str],
    table: dict[str, Target],
    config: Fp8Config,
) -> set[str]:
    """The parameters a dummy load keeps FP8 for `config` (module docstring)."""
    if not resident_block(config.block):
        return set()
    by_param: dict[str, list[tuple[str, Target]]] = {}
    for name, target in table.items():
        by_param.setdefault(target.param, []).append((name, target))
    out = set()
    for pname, entries in by_param.items():
        if pname in matrices and all(
            not config.ignores(module_of(n))
            and grid_index(t.index, tuple(params[pname].shape), config.block) is not None
            for n, t in entries
        ):
            out.add(pname)
    return out


def make_resident(model: nn.Module, names: set[str]) -> None:
    """Store parameters `names` of the (meta) model in e4m3: allocated at one byte each."""
    for name in names:
        owner, leaf = _owner(model, name)
        setattr(owner, leaf, nn.Parameter(getattr(owner, leaf).data.to(E4M3), requires_grad=False))


def attach_scales(model: nn.Module, names: set[str], block: tuple[int, int]) -> None:
    """Give each e4m3 parameter of `names` (allocated on its device) its block scales (empty,
    fp32), as an `Fp8Weight` in its place."""
    for name in names:
        owner, leaf = _owner(model, name)
        values = getattr(owner, leaf).data
        scales = torch.empty(grid_shape(tuple(values.shape), block), device=values.device)
        setattr(owner, leaf, Fp8Weight(values, scales, block))


def read_resident(
    f, name: str, shard: Shard | None, target: Target, bt: BlockTarget, checkpoint: Fp8Checkpoint
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp32 scales) of FP8 checkpoint tensor `name` as its parameter holds them:
    this rank's part, reordered by the target's transform."""
    values = read_shard(f, name, shard)
    scales = read_shard(HeldTensor(checkpoint.scales[name]), name, bt.shard)
    if target.transform is not None:
        values = target.transform(values)
        scales = scales[bt.order]
    return values, scales


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, leaf = name.rpartition(".")
    return model.get_submodule(prefix), leaf
