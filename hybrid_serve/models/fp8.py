"""Block-quantized FP8 checkpoints: the layout of the official `-FP8` Qwen3-Next / Qwen3.5 releases
and of inclusionAI's Ling-3.0-flash-fp8.

On disk (config.json's `quantization_config`: `quant_method: "fp8"`, `fmt: "e4m3"`,
`activation_scheme: "dynamic"`, `weight_block_size: [br, bc]`, and `modules_to_not_convert`, also
read under vLLM's name `ignored_layers`), a quantized matrix `X.weight` [..., R, C] is stored as
float8 e4m3 next to `X.weight_scale_inv` [..., ceil(R/br), ceil(C/bc)] (a stacked tensor `X`
without the `.weight` suffix: `X_scale_inv`), and

    w[..., r, c] = float(X.weight[..., r, c]) * X.weight_scale_inv[..., r // br, c // bc]

(the tail blocks of a side that is not a multiple of the block are simply shorter). Everything
else (embeddings, norms, the GDN conv / A_log / dt_bias / small b,a projections, the MoE router
and shared-expert gate, usually the LM head, and the MTP head's `mtp.fc`) is stored unquantized;
the MTP head's decoder layer is quantized like a main layer. Ling-3.0-flash-fp8 is the same
format with its own ignore list, abbreviated (`b_proj`) and rootless (`5.attention.g_proj`)
entries, which `Fp8Config.ignores` matches as runs of whole name components, as vLLM's suffix mode
does; its MTP layer (`model.layers.{L}.*`) is FP8 like a main layer
(`make_model.bailing_hybrid_preset.fp8_ignored` gives the sources).

`Fp8Checkpoint.open` checks that layout strictly before any data is read: every FP8 tensor has
its scale, with the block grid's shape; every scale has an FP8 weight; no module named by the
ignore list is quantized; only block-FP8 e4m3 with dynamic activations is accepted. Each failure
is a `ValueError` whose one line names the tensor or field.

Serving: on CUDA with the Triton kernels the matrices stay FP8 where their blocks land whole
(`models.fp8_resident`, `kernels.fp8`: the products dequantize per block inside the kernel).
Everywhere else, and for the matrices that do not land whole, `Fp8Checkpoint.read` dequantizes at
load (in fp32, then cast to the serving dtype as any checkpoint tensor is). That is exact with
respect to the bf16 checkpoint holding the dequantized numbers (the same fp32 products, the same
rounding to bf16), so there an FP8 checkpoint serves token for token what its dequantized twin
serves, and every CPU kernel is unchanged. Writing FP8 checkpoints (quantizing, the
`quantization_config` written) is `hybrid_serve/make_model/fp8_writer.py`'s.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open

from hybrid_serve.kernels.fp8 import E4M3, dequantize_blocks  # noqa: F401 (E4M3: re-exported)
from hybrid_serve.models.base_config import read_json
from hybrid_serve.models.shard_loader import Shard, read_shard
from hybrid_serve.models.weight_map import is_skipped

dequantize = dequantize_blocks  # fp32 weight * scale_inv per block: the checkpoints' rule
SCALE_SUFFIX = "_scale_inv"
_FLOAT_DTYPES = ("F32", "BF16", "F16")


def scale_name(weight: str) -> str:
    """The block-scale tensor of weight `weight` (`X.weight` -> `X.weight_scale_inv`)."""
    return weight + SCALE_SUFFIX


def module_of(name: str) -> str:
    """The module a tensor belongs to: `a.b.weight` -> `a.b`; other names are their own."""
    return name.removesuffix(".weight")


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The block grid of a weight of `shape`: its last two sides divided by `block`, rounded up."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


@dataclass(frozen=True)
class Fp8Config:
    """`quantization_config` of a block-FP8 checkpoint."""

    block: tuple[int, int]
    ignored: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, qc: dict) -> Fp8Config:
        """Read a `quantization_config`; anything but block-FP8 e4m3 with dynamic activations
        is a `ValueError` naming the field."""
        method = qc.get("quant_method")
        if method != "fp8":
            raise ValueError(f"config.json: unsupported quantization quant_method {method!r}")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"config.json: unsupported FP8 fmt {qc['fmt']!r} (only e4m3)")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(
                f"config.json: unsupported FP8 activation_scheme {qc['activation_scheme']!r} "
                "(only dynamic)"
            )
        block = qc.get("weight_block_size")
        if not (isinstance(block, list | tuple) and len(block) == 2 and min(block) > 0):
            raise ValueError(
                "config.json: quantization_config needs weight_block_size [rows, cols] "
                "(per-tensor FP8 is not supported)"
            )
        ignored = [*(qc.get("modules_to_not_convert") or []), *(qc.get("ignored_layers") or [])]
        return cls((int(block[0]), int(block[1])), tuple(ignored))

    def ignores(self, module: str) -> bool:
        """Whether `module` is named by the ignore list: an entry equal to it, to a module it
        lies inside, or to a run of whole name components of it (`lm_head`, `mlp.gate`, never
        `mlp.gate_proj`); entries with `*` are glob patterns over the whole name."""
        parts = module.split(".")
        for j, part in enumerate(parts):  # a run ending at component j
            for entry in self._by_last.get(part, ()):
                if j + 1 >= len(entry) and tuple(parts[j + 1 - len(entry) : j + 1]) == entry:
                    return True
        return any(fnmatch.fnmatchcase(module, e) for e in self._patterns)

    @cached_property
    def _by_last(self) -> dict[str, list[tuple[str, ...]]]:
        """The plain entries' components, by their last component."""
        out: dict[str, list[tuple[str, ...]]] = {}
        for e in self.ignored:
            if "*" not in e:
                parts = tuple(e.split("."))
                out.setdefault(parts[-1], []).append(parts)
        return out

    @cached_property
    def _patterns(self) -> tuple[str, ...]:
        return tuple(e for e in self.ignored if "*" in e)


class HeldTensor:
    """A tensor standing in for an open safetensors file (so `read_shard` can slice it)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensor

    def get_slice(self, name: str) -> torch.Tensor:
        return self.tensor


@dataclass
class Fp8Checkpoint:
    """A checked block-FP8 checkpoint: its config and every FP8 weight's scale (loaded)."""

    config: Fp8Config
    scales: dict[str, torch.Tensor]  # FP8 weight name -> its scale_inv tensor
    shapes: dict[str, tuple[int, ...]]  # FP8 weight name -> its shape on disk

    @property
    def scale_names(self) -> set[str]:
        return {scale_name(n) for n in self.scales}

    def read(self, f, name: str, shard: Shard | None) -> torch.Tensor:
        """Checkpoint tensor `name` of the open file `f` (its `shard`), dequantized to fp32 when
        it is an FP8 weight. The whole FP8 tensor is read: block boundaries need not line up
        with a tensor-parallel rank's slice."""
        scale = self.scales.get(name)
        if scale is None:
            return read_shard(f, name, shard)
        weight = f.get_tensor(name)
        return read_shard(HeldTensor(dequantize(weight, scale, self.config.block)), name, shard)

    @classmethod
    def open(cls, path: Path, where: dict[str, Path], mtp: bool = False) -> Fp8Checkpoint | None:
        """Check the FP8 layout of checkpoint `path` (`where`: tensor name -> file) from the
        headers, the MTP head's tensors included when `mtp` (else they are skipped, as the
        loader skips them); None for a checkpoint without `quantization_config` and without FP8
        tensors."""
        raw = read_json(path / "config.json")
        qc = raw.get("quantization_config")
        names = [n for n in where if not is_skipped(n, mtp)]
        meta: dict[str, tuple[str, tuple[int, ...]]] = {}
        for file in sorted(set(where[n] for n in names)):
            with safe_open(str(file), framework="pt") as f:
                for n in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if n in where and not is_skipped(n, mtp):
                        piece = f.get_slice(n)
                        meta[n] = (piece.get_dtype(), tuple(piece.get_shape()))
        fp8 = sorted(n for n, (dtype, _) in meta.items() if dtype == "F8_E4M3")
        if qc is None:
            if fp8:
                raise ValueError(
                    f"checkpoint tensor {fp8[0]} is FP8 but config.json has no quantization_config"
                )
            return None
        config = Fp8Config.from_dict(qc)
        for n in sorted(meta):
            if not n.endswith(SCALE_SUFFIX):
                continue
            weight = n.removesuffix(SCALE_SUFFIX)
            if weight not in meta:
                raise ValueError(f"FP8 scale tensor {n} has no weight {weight} in the checkpoint")
            if meta[weight][0] != "F8_E4M3":
                raise ValueError(f"FP8 scale tensor {n} belongs to {weight}, which is not FP8")
        for n in fp8:
            scale = scale_name(n)
            if scale not in meta:
                raise ValueError(
                    f"checkpoint is missing tensor {scale} (the FP8 block scales of {n})"
                )
            if config.ignores(module_of(n)):
                raise ValueError(
                    f"checkpoint tensor {n} is FP8 but modules_to_not_convert names its module"
                )
            shape = meta[n][1]
            want = scale_shape(shape, config.block) if len(shape) >= 2 else None
            dtype, got = meta[scale]
            if got != want or dtype not in _FLOAT_DTYPES:
                raise ValueError(
                    f"checkpoint tensor {scale}: {dtype} {got}, expected a float tensor of shape "
                    f"{want} for {n} {shape} in {config.block[0]}x{config.block[1]} blocks"
                )
        scales: dict[str, torch.Tensor] = {}
        for file in sorted({where[scale_name(n)] for n in fp8}):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for n in fp8:
                    if where[scale_name(n)] == file:
                        scales[n] = f.get_tensor(scale_name(n)).float()
        return cls(config, scales, {n: meta[n][1] for n in fp8})
