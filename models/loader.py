"""Strict safetensors loading of a Qwen3-Next checkpoint directory.

Reads `model.safetensors` or the shards named by `model.safetensors.index.json`. Every tensor
the model needs must be present exactly once and every tensor present must be used (`mtp.*`
excepted); otherwise a `ValueError` names the first offender.

bf16 on CPU means bf16 *weights*: the matrices (every linear layer, the experts, the LM head)
are stored in bf16 and read by the C++ kernels with fp32 accumulation, while embeddings, norms,
convolution and decay parameters, activations and every pool (KV, conv and recurrent states)
stay fp32. Elsewhere a dtype applies to the whole model.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from models.config import ModelConfig
from models.qwen3_next import Qwen3NextForCausalLM

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, config: ModelConfig) -> torch.dtype:
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
        raise ValueError(f"no *.safetensors weights in {path}")
    return files


def iter_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[str] = set()
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name in seen:
                    raise ValueError(f"checkpoint tensor {name} appears twice")
                seen.add(name)
                yield name, f.get_tensor(name)


def load_model(
    model_path: str | Path, dtype: str = "auto", device: str | torch.device = "cpu"
) -> Qwen3NextForCausalLM:
    path = Path(model_path)
    config = ModelConfig.from_hf(path)
    torch_dtype = resolve_dtype(dtype, config)
    weights_only = torch_dtype == torch.bfloat16 and torch.device(device).type == "cpu"
    with torch.device("meta"):
        model = Qwen3NextForCausalLM(config)
    model = model.to_empty(device=device).to(torch.float32 if weights_only else torch_dtype)
    if config.tie_word_embeddings:  # to_empty() unties: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    try:
        filled = model.load_weights(iter_checkpoint(path))
    except KeyError as e:
        raise ValueError(str(e.args[0])) from None
    layout = (
        "fused" if any(n.endswith("mlp.experts.gate_up_proj") for n in filled) else "per_expert"
    )
    missing = sorted(model.expected_checkpoint_names(layout) - filled)
    if missing:
        raise ValueError(f"checkpoint is missing tensor {missing[0]} ({len(missing)} missing)")
    if weights_only:
        cast_matrices(model, torch_dtype)
    logger.info(
        "loaded %s (%s%s, %s)",
        path,
        torch_dtype,
        " weights, fp32 activations" * weights_only,
        device,
    )
    return model.eval()


def cast_matrices(model: Qwen3NextForCausalLM, dtype: torch.dtype) -> None:
    """Store every linear layer's and expert's weight matrix in `dtype`, nothing else. A tied LM
    head gets its own copy (the embedding stays fp32)."""
    from models.layers import Experts, Linear

    if model.lm_head.weight is model.model.embed_tokens.weight:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    for module in model.modules():
        if isinstance(module, Linear):
            names = ["weight"]
        elif isinstance(module, Experts):
            names = ["gate_up_proj", "down_proj"]
        else:
            continue
        for name in names:
            param = getattr(module, name)
            param.data = param.data.to(dtype)
