"""Writing a checkpoint directory: the config completed for transformers, the weights drawn by
`make_model.tensor_specs` (optionally FP8 or in a multimodal wrapper), sharded or not, and the
tokenizer and side files. See `hybrid_serve.make_model.presets` for the contract.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from hybrid_serve.make_model import fp8_writer
from hybrid_serve.make_model.chat_templates import TEMPLATES, template_name, tokens_for
from hybrid_serve.make_model.tensor_specs import (
    EXPERT_LAYOUTS,
    WRAPPERS,
    checkpoint_shapes,
    random_tensors,
)
from hybrid_serve.make_model.tensor_specs import complete_config as complete_family_config
from hybrid_serve.make_model.tokenizer_builder import (
    ENDOFTEXT,
    IM_END,
    special_token_ids,
    write_tokenizer_files,
)
from hybrid_serve.make_model.weights_file import save_weights

logger = logging.getLogger(__name__)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def complete_config(
    config: dict, *, dtype: torch.dtype = torch.float32, init_range: float = 0.1
) -> dict:
    """``config`` plus everything transformers (4.57 and 5.x) needs, completed by its family's
    preset module (the family table's row); the input is not modified.

    ``vocab_size`` is kept as given (the tokenizer is trained to fill it). Special ids:
    bos = pad = ``<|endoftext|>``, eos = ``<|im_end|>``.
    """
    ids = special_token_ids()
    common = dict(
        dtype=_dtype_name(dtype),
        torch_dtype=_dtype_name(dtype),
        initializer_range=init_range,
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
    )
    return complete_family_config(config, common)


def _clear_weights(out: Path) -> None:
    """Remove weight files a previous write may have left (they would shadow the new ones)."""
    for path in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        if path.is_file():
            path.unlink()


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Greedy in-order packing; a tensor larger than ``max_bytes`` gets a shard of its own."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def write_checkpoint(
    out_dir: str | Path,
    config: dict,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    expert_layout: str = "per_expert",
    init_range: float = 0.1,
    max_shard_bytes: int | None = None,
    multimodal: bool = False,
    fp8_block: tuple[int, int] | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write a complete random-weight checkpoint directory for ``config``; return its path.

    ``multimodal=True`` (Qwen3.5 configs only) writes the layout of the vision-language release:
    the config nested as ``text_config`` of a ``qwen3_5`` / ``qwen3_5_moe`` wrapper, the language
    model's tensors under ``model.language_model.``, plus a token vision tower (``model.visual.*``)
    that a text server must skip, and the MTP head at top level (``mtp.*``, as in the release):
    the complete head when ``config`` has ``mtp_num_hidden_layers``, else a two-tensor stand-in.
    The language model's numbers are the same as those of the text-only checkpoint with the
    same seed.

    ``config["mtp_num_hidden_layers"]`` > 0 adds the complete multi-token-prediction head
    (``make_model.qwen3_next_preset.mtp_head``), drawn after every other tensor: the rest of
    the checkpoint holds the same numbers as without it.

    ``chat_template`` names one of :data:`make_model.chat_templates.TEMPLATES` (default: the model
    family's: Qwen3-Next Instruct, Qwen3.5, Nemotron-3-Nano or Granite 4.0); the tokenizer holds
    its tokens whole and its end of turn is the checkpoint's eos.

    ``fp8_block=(rows, cols)`` writes the official block-FP8 layout (``models.fp8``): the
    matrices ``hybrid_serve.make_model.fp8_writer.quantize_tensors`` picks as e4m3 plus fp32
    ``weight_scale_inv``, everything else in ``dtype``, and ``quantization_config`` in config.json.

    ``out_dir`` is created if missing; existing weight files in it are replaced. With
    ``max_shard_bytes`` the weights are always written as ``model-0000k-of-0000N.safetensors``
    plus ``model.safetensors.index.json`` (even when N is 1). See the module docstring for the
    initialisation and the determinism contract.
    """
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {expert_layout!r}")
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError("max_shard_bytes must be positive")
    start = time.perf_counter()
    cfg = complete_config(config, dtype=dtype, init_range=init_range)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    if multimodal and cfg["model_type"] not in WRAPPERS:
        raise ValueError(f"multimodal layout needs a Qwen3.5 config, not {cfg['model_type']}")
    tensors = random_tensors(cfg, seed, init_range, expert_layout)
    if fp8_block is not None:
        tensors = fp8_writer.quantize_tensors(tensors, fp8_block, cfg["model_type"])
    for key, t in tensors.items():
        keep = key.endswith((".A_log", ".dt_bias", "_scale_inv")) or t.dtype == fp8_writer.E4M3
        tensors[key] = t if keep else t.to(dtype)
    file_cfg = cfg
    if multimodal:
        tensors, file_cfg = _wrap_multimodal(tensors, cfg, dtype)
    if fp8_block is not None:
        file_cfg["quantization_config"] = fp8_writer.quantization_config(
            tensors, fp8_block, cfg["model_type"]
        )

    _write_weights(out, tensors, max_shard_bytes)
    n_tok = _write_side_files(out, cfg, file_cfg, chat_template)
    n_params = sum(t.numel() for t in tensors.values())
    logger.info(
        "wrote %s: %d parameters, %s, %s layout, tokenizer %d/%d, %.2f s",
        out,
        n_params,
        _dtype_name(dtype),
        expert_layout,
        n_tok,
        cfg["vocab_size"],
        time.perf_counter() - start,
    )
    return out


def _write_weights(
    out: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int | None
) -> None:
    """`tensors` written into `out` (its old weight files removed first): one
    model.safetensors, or with `max_shard_bytes` the numbered shards and their index."""
    _clear_weights(out)
    meta = {"format": "pt"}
    if max_shard_bytes is None:
        save_weights(tensors, out / "model.safetensors", meta)
        return
    groups = _shards(tensors, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for k, keys in enumerate(groups, start=1):
        name = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        save_weights({key: tensors[key] for key in keys}, out / name, meta)
        weight_map.update(dict.fromkeys(keys, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(out / "model.safetensors.index.json", index)


def _write_side_files(out: Path, cfg: dict, file_cfg: dict, chat_template: str | None) -> int:
    """The tokenizer files, ``config.json`` (``file_cfg``) and ``generation_config.json``;
    returns the tokenizer's size. The chat template (``chat_template``, else the family's) sets
    the tokens the tokenizer holds whole and the end-of-turn token: ``eos_token_id`` in both
    configs (with ``<|endoftext|>`` in generation_config.json)."""
    name = template_name(cfg["model_type"], chat_template)
    tokens = tokens_for(name)
    n_tok = write_tokenizer_files(
        out,
        cfg["vocab_size"],
        model_max_length=cfg["max_position_embeddings"],
        chat_template=TEMPLATES[name],
        tokens=tokens,
    )
    if n_tok > cfg["vocab_size"]:  # pragma: no cover - BpeTrainer never exceeds vocab_size
        raise RuntimeError(f"tokenizer has {n_tok} tokens > vocab_size {cfg['vocab_size']}")
    ids = special_token_ids(tokens)
    eos = ids[tokens.eos]
    if "eos_token_id" in file_cfg:  # a VL wrapper holds it in text_config (Qwen: ChatML's)
        file_cfg = {**file_cfg, "eos_token_id": eos}
    _write_json(out / "config.json", file_cfg)
    generation = {
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": [eos, ids[ENDOFTEXT]],
        "pad_token_id": ids[ENDOFTEXT],
    }
    _write_json(out / "generation_config.json", generation)
    return n_tok


def write_config_only(
    out_dir: str | Path,
    config: dict,
    *,
    dtype: torch.dtype = torch.bfloat16,
    init_range: float = 0.1,
    chat_template: str | None = None,
    fp8_block: tuple[int, int] | None = None,
) -> Path:
    """A checkpoint directory without weights: ``config.json`` (as :func:`write_checkpoint`
    completes it, ``dtype`` as the checkpoint dtype; with ``fp8_block`` the
    ``quantization_config`` of its block-FP8 form), ``generation_config.json`` and the presets'
    tokenizer files, for ``--load-format dummy``. Weight files a previous write left are removed
    (a dummy load reads none anyway). The tokenizer is the presets' byte-level BPE: for a real
    vocabulary (151936 or 248320 rows) it holds only the few thousand tokens its corpus supplies
    and the other ids decode to nothing, which is all a throughput measurement needs."""
    cfg = complete_config(config, dtype=dtype, init_range=init_range)
    if fp8_block is not None:
        shapes = checkpoint_shapes(config)
        cfg["quantization_config"] = fp8_writer.config_quantization(
            shapes, fp8_block, cfg.get("model_type")
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _clear_weights(out)
    n_tok = _write_side_files(out, cfg, cfg, chat_template)
    logger.info(
        "wrote %s: config only (%s), tokenizer %d/%d",
        out,
        _dtype_name(dtype),
        n_tok,
        cfg["vocab_size"],
    )
    return out


def _wrap_multimodal(
    tensors: dict[str, torch.Tensor], text_cfg: dict, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict]:
    """Language-model tensors moved under ``model.language_model.`` (the MTP head, if any, stays
    at top level), with small stand-ins for the vision tower and, when there is no head, for
    the MTP head; the wrapper config around ``text_cfg``."""
    out = {
        (f"model.language_model.{k.removeprefix('model.')}" if k.startswith("model.") else k): t
        for k, t in tensors.items()
    }
    hid = text_cfg["hidden_size"]
    gen = torch.Generator().manual_seed(0)
    for key, shape in (
        ("model.visual.patch_embed.proj.weight", (hid, 3, 2, 2)),
        ("model.visual.merger.linear_fc1.weight", (hid, hid)),
        ("mtp.fc.weight", (hid, 2 * hid)),
        ("mtp.norm.weight", (hid,)),
    ):
        if key not in out:  # a complete MTP head is not replaced (its stand-ins come last)
            out[key] = torch.randn(shape, generator=gen).to(dtype)
    wrapper = {
        "model_type": WRAPPERS[text_cfg["model_type"]],
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text_cfg,
        "vision_config": {"hidden_size": hid, "depth": 1},
        "tie_word_embeddings": text_cfg["tie_word_embeddings"],
        "dtype": text_cfg["dtype"],
    }
    return out, wrapper


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
