"""The dequantized twin of an FP8 checkpoint, the judge of the FP8 parity tests: the checkpoint
that holds exactly the numbers an FP8 checkpoint stands for, in bf16 (`write_dequantized`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from hybrid_serve.make_model.weights_file import save_weights
from hybrid_serve.models.base_config import encode_special_floats, read_json
from hybrid_serve.models.fp8 import E4M3, SCALE_SUFFIX, Fp8Config, dequantize, scale_name


def _weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    return files


def write_dequantized(
    src: str | Path, dst: str | Path, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write FP8 checkpoint `src` to `dst` with every FP8 tensor dequantized (`models.fp8`'s
    rule, in fp32) and cast to `dtype`, the scales dropped and `quantization_config` removed;
    every other tensor and file is copied unchanged (shard names and index kept). An FP8 tensor
    without its scale is a `ValueError` naming the scale."""
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError("write_dequantized needs a destination other than its source")
    dst.mkdir(parents=True, exist_ok=True)
    config = read_json(src / "config.json")
    block = Fp8Config.from_dict(config.get("quantization_config") or {}).block
    files = _weight_files(src)
    where: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), file))

    kept: dict[str, str] = {}  # tensor -> file name, for the index
    for file in files:
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in where:
                    continue
                t = f.get_tensor(name)
                if t.dtype == E4M3:
                    scale = scale_name(name)
                    if scale not in where:
                        raise ValueError(f"checkpoint is missing tensor {scale} (scales of {name})")
                    with safe_open(str(where[scale]), framework="pt", device="cpu") as g:
                        t = dequantize(t, g.get_tensor(scale), block).to(dtype)
                out[name] = t
                kept[name] = file.name
        save_weights(out, dst / file.name, {"format": "pt"})

    for item in src.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name != "config.json":
            shutil.copyfile(item, dst / item.name)
    config.pop("quantization_config")
    # NaN and infinities written back tagged, as transformers writes them (and as they came)
    text = json.dumps(encode_special_floats(config), indent=2, sort_keys=True)
    (dst / "config.json").write_text(text + "\n")
    index = dst / "model.safetensors.index.json"
    if index.is_file():
        body = json.loads(index.read_text())
        body["weight_map"] = {n: f for n, f in body["weight_map"].items() if n in kept}
        body.pop("metadata", None)
        index.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    return dst
