"""Strict safetensors loading of a checkpoint directory of any family `models.registry` knows
(Qwen3-Next, Qwen3.5, NemotronH, Granite-4.0-H, Bamba, Falcon-H1, OLMo-Hybrid).

Reads `model.safetensors` or the shards named by `model.safetensors.index.json`. Every tensor
the model needs must be present exactly once and every tensor present must be used (the MTP head
and a multimodal wrapper's vision tower excepted, named in one info line); otherwise a
`ValueError` names the first offender. Names map to parameters through `models.weight_map`,
in the release's spelling or in transformers' own, tensor by tensor (its `NAME_RULES`).
A block-FP8 checkpoint (`quantization_config`) is checked by `models.fp8`. On CUDA with the
Triton kernels (`fp8_resident=None`: a device of compute capability 8.9 or more, whose Triton
has e4m3) its matrices stay FP8, one byte per weight plus the block scales, wherever the
checkpoint's blocks land whole on the parameter (`models.fp8_resident`); elsewhere, and on the
CPU always, the weights are dequantized at load (`hybrid_serve.models.fp8`).

`mtp=True` builds the model with its multi-token-prediction head (`models.qwen3_next_mtp`,
`models.nemotron_h_mtp`, `models.bailing_hybrid_mtp`; the checkpoint's config must describe one:
`mtp_num_hidden_layers`, NemotronH's and Ling-3's `num_nextn_predict_layers`) and makes the
head's tensors (`mtp.*`; Ling-3's layer after the main ones, `skipped_prefixes` otherwise) part
of the strict key set: from then on they load like any other tensor (FP8, tensor-parallel shards,
dtype and quantization rules, dummy weights), and a missing one is an error. Without it they are
skipped.

`load_format="dummy"` (SGLang's and vLLM's `--load-format dummy`) reads config.json alone: the
model is allocated exactly as for a checkpoint and filled with random weights in place
(`hybrid_serve.models.dummy_weights`); no weight file is opened, and there need be none.

bf16 on CPU means bf16 *weights*: the matrices (every linear layer, the experts, the LM head)
are stored in bf16 and read by the C++ kernels with fp32 accumulation, while embeddings, norms,
convolution and decay parameters, activations and every pool (KV, conv and recurrent states)
stay fp32. Elsewhere a dtype applies to the whole model.

`quantization="int8"` or `"int4"` (CPU only) is weight-only quantization at load, from whatever
the checkpoint holds (float or block-FP8): the model is loaded as for its dtype (matrices in it,
the rest fp32), then every matrix but the MoE routers' gates (the router and the shared-expert
gate) is replaced, one at a time, by its quantized format (`kernels.quant`: int8 per output row,
int4 per group of 32 with int8 for a matrix whose K does not divide into groups). Embeddings,
norms and states are unchanged; the products of the quantized matrices take their fp32
activations rounded to int8 per block of 32 (`kernels.quant.round_activations`, llama.cpp's Q8_0
activations).
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from hybrid_serve.kernels import KernelSet
from hybrid_serve.kernels import choose as choose_kernels
from hybrid_serve.kernels.bf16_pack import in_panels, pack_bf16_
from hybrid_serve.kernels.quant import quantize, row_peaks
from hybrid_serve.kernels.weight_formats import check_quantization
from hybrid_serve.models.base_config import HybridConfig, read_json
from hybrid_serve.models.dummy_weights import fill_dummy
from hybrid_serve.models.fp8 import Fp8Checkpoint, Fp8Config
from hybrid_serve.models.fp8_resident import (
    BlockTarget,
    attach_scales,
    dummy_plan,
    make_resident,
    read_resident,
)
from hybrid_serve.models.fp8_resident import plan as resident_plan
from hybrid_serve.models.hybrid_lm import HybridForCausalLM
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.registry import config_family, model_class, read_config
from hybrid_serve.models.shard_loader import read_shard
from hybrid_serve.models.weight_map import Target, checkpoint_map, is_skipped

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOAD_FORMATS = ("auto", "safetensors", "dummy")  # auto: the checkpoint's safetensors


def resolve_dtype(dtype: str, config: HybridConfig) -> torch.dtype:
    """`auto` keeps the checkpoint's dtype; otherwise one of DTYPES."""
    name = config.torch_dtype if dtype == "auto" else dtype
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r} (choose auto, {', '.join(DTYPES)})")
    return DTYPES[name]


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no *.safetensors weights in {path} (--load-format dummy: random weights)"
        )
    return files


def checkpoint_names(files: list[Path]) -> dict[str, Path]:
    """Every tensor name -> its file (headers only, no data read); a repeated name raises."""
    where: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name in where:
                    raise ValueError(f"checkpoint tensor {name} appears twice")
                where[name] = file
    return where


def load_model(
    model_path: str | Path,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    tp: ParallelContext | None = None,
    load_format: str = "auto",
    ops: KernelSet | None = None,
    quantization: str | None = None,
    mtp: bool = False,
    draft_quantization: str | None = None,
    fp8_resident: bool | None = None,
    mamba_ssm_dtype: str | None = None,
) -> HybridForCausalLM:
    """Build the model in `dtype` on `device` and fill it tensor by tensor from the checkpoint.
    With a tensor-parallel context, build rank `tp.rank`'s shard and read only its part of each
    sharded tensor (the model's `checkpoint_shard`: `models.tp_shards`, `models.shard_loader`).
    `load_format="dummy"`: random weights, no file read.

    The key set is checked against `checkpoint_map` before any data is read (a missing or extra
    tensor is a `ValueError` naming it). Parameters are allocated once, in the target dtype, and
    each checkpoint tensor is converted while copied, so peak memory is the model plus the
    largest single tensor (never a full-size copy in another dtype; an FP8 tensor is widened
    to fp32 one at a time).

    The layers run `ops`, by default the kernel set `kernels.choose` picks for the device and
    the activations' dtype (logged as a table). `quantization`: None, "int8" or "int4" (module
    docstring). `mtp`: build and load the MTP head too (module docstring; a `ValueError` when
    the config has none). `draft_quantization` ("int8"/"int4", CPU): the head, which only drafts,
    gets its own matrices in that format and a copy of the LM head in it for its predictions
    (SGLang's --speculative-draft-model-quantization); with `quantization` it must be the same.
    `fp8_resident`: keep a block-FP8 checkpoint's matrices in FP8 (`models.fp8_resident`; with
    dummy weights, those of the config's `quantization_config`); None decides by the device and
    the kernels (module docstring), True forces it on any device (the references widen the
    matrices per product: tests).
    """
    _check_load_args(load_format, device, quantization, draft_quantization)
    on_cpu = torch.device(device).type == "cpu"
    path = Path(model_path)
    config = read_config(path)
    torch_dtype = resolve_dtype(dtype, config)
    weights_only = on_cpu and (torch_dtype == torch.bfloat16 or quantization is not None)
    tp = tp or ParallelContext()
    if ops is None:
        activations = torch.float32 if weights_only else torch_dtype
        ops = _default_kernels(device, activations, mamba_ssm_dtype or config.mamba_ssm_dtype)
    if fp8_resident is None:
        fp8_resident = fp8_device(device, ops)
    elif fp8_resident and quantization is not None:
        raise ValueError("FP8-resident matrices and --quantization exclude each other")
    with torch.device("meta"):
        model = model_class(config)(config, tp, ops, mtp=mtp)
    # dtypes are set on meta (free), so each parameter is allocated once, in its final dtype
    model = model.to(torch.float32 if weights_only else torch_dtype)
    if weights_only:
        cast_matrices(model, torch_dtype)
    source = None if load_format == "dummy" else index_checkpoint(model, path, config)
    resident, block = plan_fp8(model, path, source) if fp8_resident else (set(), None)
    make_resident(model, resident)
    model = _allocate(model, device, config)
    if resident:
        attach_scales(model, resident, block)
    _fill(model, source, tp, config)
    if weights_only and config.tie_word_embeddings:  # the LM head: its own copy of the embedding
        model.lm_head.weight = torch.nn.Parameter(model.embed_tokens.weight.to(torch_dtype))
    _quantize(model, tp, quantization, draft_quantization)
    pack_matrices(model)  # under the bf16 route only (its rule: `in_panels`)
    logger.info(
        "loaded %s (%s%s%s, %s%s%s)",
        path,
        torch_dtype,
        " weights, fp32 activations" * weights_only,
        f", {quantization} matrices" * (quantization is not None),
        device,
        ", dummy weights" * (source is None),
        ", with its MTP head" * mtp
        + f" ({draft_quantization} draft matrices)" * (draft_quantization is not None),
    )
    return model.eval()


def _default_kernels(device, activations: torch.dtype, state_dtype: str) -> KernelSet:
    """The kernel set `kernels.choose` picks for `device`, the activations' dtype and the
    recurrent states' (a name of a torch dtype), logged as a table."""
    ops = choose_kernels(device, activations, state_dtype=getattr(torch, state_dtype))
    logger.info("%s", ops.table())
    return ops


def _fill(
    model: HybridForCausalLM, source: CheckpointIndex | None, tp: ParallelContext, config
) -> None:
    """The allocated `model`'s weights: read from the checkpoint `source`, or drawn at random
    where it is None (`--load-format dummy`); with tensor parallelism the vocabulary shards'
    padding rows zeroed (after the draw, before the read)."""
    if source is None:
        fill_dummy(model, config_family(config))
    if tp.enabled:  # the vocab shards' padding rows
        _, rows, _ = tp.vocab_range(config.vocab_size)
        model.embed_tokens.weight.data[rows:].zero_()
        model.lm_head.weight.data[rows:].zero_()
    if source is not None:
        read_checkpoint(model, source)


def _check_load_args(
    load_format: str, device, quantization: str | None, draft_quantization: str | None
) -> None:
    """`load_model`'s argument checks, before anything is read: `ValueError`s naming the bad
    value."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load format {load_format!r} (choose {', '.join(LOAD_FORMATS)})")
    check_quantization(quantization, str(device), "quantization")
    check_quantization(draft_quantization, str(device), "draft_quantization")
    if draft_quantization is not None and quantization not in (None, draft_quantization):
        raise ValueError("the draft head's quantization must be the model's (--quantization)")


def _allocate(model: HybridForCausalLM, device, config) -> HybridForCausalLM:
    """The meta `model`'s tensors allocated (uninitialised) on `device` in their dtypes, and
    the tied LM head tied again."""
    # what to_empty() does, with torch.empty: empty_like on meta tensors would import sympy
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    if config.tie_word_embeddings:  # to_empty() unties: tie again
        model.lm_head.weight = model.embed_tokens.weight
    return model


def _quantize(
    model: HybridForCausalLM,
    tp: ParallelContext,
    quantization: str | None,
    draft_quantization: str | None,
) -> None:
    """The loaded model's matrices in `quantization`, or only its MTP head's (with its own copy
    of the LM head) in `draft_quantization`."""
    if quantization is not None:
        quantize_matrices(model, quantization, tp)
    elif draft_quantization is not None and model.mtp is not None:
        model.mtp.lm_head = copy.deepcopy(model.lm_head)  # the head's own, for its drafts
        quantize_matrices(model.mtp, draft_quantization, tp)


@dataclass
class CheckpointIndex:
    """A checkpoint checked against the model from its headers: where each tensor is, its
    target parameter, the FP8 layout if any, and the FP8 tensors whose parameters stay FP8."""

    where: dict[str, Path]
    table: dict[str, Target]
    fp8: Fp8Checkpoint | None
    resident: dict[str, BlockTarget] = field(default_factory=dict)


def index_checkpoint(model: HybridForCausalLM, path: Path, config: HybridConfig) -> CheckpointIndex:
    """The strict key set of the checkpoint at `path` against `model` (meta is enough), from the
    headers: a missing or extra tensor, or a bad FP8 layout, is a `ValueError` naming it. The
    `mtp.*` tensors are the model's when it holds its MTP head, else skipped, as are those
    under the config's `skipped_prefixes` where it has them (Ling-3's MTP layer)."""
    mtp = model.mtp is not None
    where = checkpoint_names(checkpoint_files(path))
    fp8 = Fp8Checkpoint.open(path, where, mtp)  # None unless block-FP8; a bad layout raises
    # e.g. MTP layers stored after the stack, the model's own when it holds its head
    unused = () if mtp else getattr(config, "skipped_prefixes", ())
    skipped = sorted(n for n in where if is_skipped(n, mtp) or n.startswith(unused))
    if config.tie_word_embeddings and "lm_head.weight" in where:
        skipped.append("lm_head.weight")  # some tied checkpoints still carry a copy
    names = set(where) - set(skipped) - (fp8.scale_names if fp8 else set())
    table = checkpoint_map(model, names)
    extra = sorted(names - table.keys())
    if extra:
        raise ValueError(f"unexpected checkpoint tensor {extra[0]} ({len(extra)} unexpected)")
    missing = sorted(table.keys() - names)
    if missing:
        raise ValueError(f"checkpoint is missing tensor {missing[0]} ({len(missing)} missing)")
    if skipped:
        groups = sorted(
            {n.split(".")[0] if n.startswith("mtp.") else n.rsplit(".", 2)[0] for n in skipped}
        )
        logger.info(
            "skipped %d checkpoint tensors not used here (%s)", len(skipped), ", ".join(groups[:4])
        )
    return CheckpointIndex(where, table, fp8)


def fp8_device(device: str | torch.device, ops: KernelSet) -> bool:
    """Whether block-FP8 matrices stay FP8 by default: a CUDA device whose Triton has e4m3
    (compute capability 8.9 or more) under the Triton kernels."""
    device = torch.device(device)
    if device.type != "cuda" or ops.backend != "triton":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def plan_fp8(
    model: HybridForCausalLM, path: Path, source: CheckpointIndex | None
) -> tuple[set[str], tuple[int, int] | None]:
    """(the parameters that stay FP8, the block) for the checkpoint `source`, or for dummy
    weights (`source` None) the config's `quantization_config`; records the checkpoint's
    resident tensors in `source.resident`. Matrices kept float under weight-only quantization
    (`Linear.keep_float`) are dequantized at load here too."""
    from hybrid_serve.models.layers import Linear

    params = dict(model.named_parameters())
    embedding = model.embed_tokens.weight
    # a matrix its module reads as plain numbers stays float, as under weight-only quantization
    # (`Linear.keep_float`: MLA's kv_b_proj, whose per-head blocks the absorbed decode multiplies)
    floats = {id(m.weight) for m in model.modules() if isinstance(m, Linear) and m.keep_float}
    ids = {id(p) for p in matrices(model) if p is not embedding and id(p) not in floats}
    mats = {n for n, p in params.items() if id(p) in ids}
    if source is None:
        qc = read_json(path / "config.json").get("quantization_config")
        if qc is None:
            return set(), None
        fp8 = Fp8Config.from_dict(qc)
        table = checkpoint_map(model)
        names = dummy_plan(params, mats, table, fp8)
    else:
        if source.fp8 is None:
            return set(), None
        source.resident = resident_plan(
            params, mats, source.table, source.fp8,
            lambda n: model.checkpoint_shard(n, source.table[n]),
        )  # fmt: skip
        names = {source.table[n].param for n in source.resident}
        fp8 = source.fp8.config
        left = len(source.fp8.scales) - len(source.resident)
        if left:
            logger.info("%d FP8 tensors do not land on whole blocks: dequantized at load", left)
    if names:
        gb = sum(params[p].numel() for p in names) / 1e9
        logger.info("%d matrices stay block-FP8 (%.2f GB, one byte per weight)", len(names), gb)
    return names, fp8.block


def read_checkpoint(model: HybridForCausalLM, source: CheckpointIndex) -> None:
    """Fill `model` from the checkpoint `source` (see `load_model`): FP8 tensors of resident
    parameters copied as they are with their scales, the others converted while copied."""
    table, fp8 = source.table, source.fp8
    params = dict(model.named_parameters())
    with torch.no_grad():
        for file in sorted(set(source.where.values())):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118
                    target = table.get(name)
                    if target is None:
                        continue
                    shard = model.checkpoint_shard(name, target)
                    bt = source.resident.get(name)
                    if bt is not None:
                        values, scales = read_resident(f, name, shard, target, bt, fp8)
                        param = params[target.param]
                        _copy(name, param.scale_inv[bt.index], scales)
                        _copy(name, param.data[target.index], values)
                        continue
                    w = fp8.read(f, name, shard) if fp8 else read_shard(f, name, shard)
                    if target.transform is not None:
                        w = target.transform(w)
                    dst = params[target.param].data[target.index]
                    if shard is not None and shard.rows is not None:
                        dst = dst[: shard.rows]
                    _copy(name, dst, w)


def _copy(name: str, dst: torch.Tensor, w: torch.Tensor) -> None:
    if dst.shape != w.shape:
        raise ValueError(
            f"checkpoint tensor {name}: shape {tuple(w.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(w)


def matrices(model: HybridForCausalLM) -> list[torch.nn.Parameter]:
    """Every linear layer's and expert's weight matrix: what `--dtype bfloat16` stores in bf16
    on CPU (a tied LM head is the embedding itself)."""
    from hybrid_serve.models.layers import Experts, Linear

    out = []
    for module in model.modules():
        if isinstance(module, Linear):
            out.append(module.weight)
        elif isinstance(module, Experts):
            out += [module.gate_up_proj, module.down_proj]
    return out


def quantize_matrices(model: HybridForCausalLM, method: str, tp: ParallelContext) -> None:
    """Replace every linear layer's and expert stack's matrix, except those the model keeps in
    float (`Linear.keep_float`: the MoE routers' gates, whose top-k picks must not move), by
    its `method` format (`kernels.quant.quantize`), one matrix at a time. A shard whose columns
    are split over tensor-parallel ranks takes its int8 row scales from the whole rows (their
    peaks reduced over the ranks), and int4's groups are whole where the split falls on a group
    boundary (else int8): every rank count serves the same numbers."""
    from hybrid_serve.models.layers import Experts, Linear
    from hybrid_serve.models.tp_shards import k_split_params

    split = k_split_params(model, model.config) if tp.enabled else set()
    for module in list(model.modules()):
        if isinstance(module, Linear) and not module.keep_float:
            names = ["weight"]
        elif isinstance(module, Experts):
            names = ["gate_up_proj", "down_proj"]
        else:
            continue
        for name in names:
            w = getattr(module, name).detach()
            peak = tp.all_reduce_max(row_peaks(w)) if id(getattr(module, name)) in split else None
            q = quantize(w, method, peak)
            setattr(module, name, torch.nn.Parameter(q, requires_grad=False))


def pack_matrices(model: HybridForCausalLM) -> int:
    """Under the bf16 route (`KernelSet.bf16_products`) every bf16 matrix on the CPU
    (`matrices`: the linear layers', the LM head's own copy, the expert stacks', each expert
    packed alone, the MTP head's) in K-pair panels (`kernels.bf16_pack`), in place of its rows:
    same shape, dtype and bytes, rewritten in its own storage a chunk at a time (`pack_bf16_`:
    the load's peak memory stays one copy of the weights); every product of the route reads that
    layout, and readers that take rows unpack (`Linear.rows`). Returns how many were packed."""
    seen: set[int] = set()
    for param in matrices(model):
        if id(param) in seen or not in_panels(param.data, model.ops.bf16_products):
            continue
        seen.add(id(param))
        pack_bf16_(param.data)
    if seen:
        logger.info("%d bf16 matrices packed in K-pair panels for the bf16 route", len(seen))
    return len(seen)


def cast_matrices(model: HybridForCausalLM, dtype: torch.dtype) -> None:
    """Store every matrix (`matrices`) in `dtype`, nothing else (on the meta model: free). A
    tied LM head is left tied here (the embedding stays fp32); the loader gives it its own copy
    once the embedding is loaded."""
    embedding = model.embed_tokens.weight
    for param in matrices(model):
        if param is not embedding:
            param.data = param.data.to(dtype)
