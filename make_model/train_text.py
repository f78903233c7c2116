"""Training a written preset on text (`make-model --train-text FILE --train-minutes N`).

A preset's random weights make every prediction a near-tie: greedy tokens flip on a rounding,
speculative drafts are accepted only by construction, and a lossy mode's top-1 agreement says
nothing about a trained model. A few CPU minutes of next-token training on real text (the GSM8K
train set in ../shared/data, say) give the model margins that mean something, so fidelity and
speculative figures measured on it can be compared with a real model's.

The training runs transformers' own model class for the checkpoint (the judge the project's
models are tested against), in fp32 with AdamW, on random windows of the tokenized text, for a
wall-clock budget. The trained values are written back into the checkpoint's own files and
names: tensors transformers holds under the same name are replaced; per-expert matrices
(`experts.<e>.{gate,up,down}_proj.weight`) are cut from transformers' fused stacks
(`gate_up_proj[e] = [gate_e; up_e]`, `down_proj[e] = down_e`); tensors it does not hold (the MTP
head `mtp.*`) stay as they were. The write is checked by loading the checkpoint again and
comparing every tensor transformers holds.

Text files: `.jsonl` lines with `question` and `answer` (GSM8K) become "Question: ...\\nAnswer:
...\\n\\n"; any other file is read as plain text.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

logger = logging.getLogger(__name__)

EXPERT = re.compile(r"(.*)\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


@dataclass(frozen=True)
class TrainResult:
    steps: int
    tokens: int
    loss_first: float  # mean loss of the first 10 steps
    loss_last: float  # mean loss of the last 10 steps
    seconds: float


def read_text(path: str | Path) -> str:
    path = Path(path)
    if path.suffix != ".jsonl":
        return path.read_text()
    parts = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            parts.append(f"Question: {row['question']}\nAnswer: {row['answer']}\n\n")
    return "".join(parts)


def train_checkpoint(
    path: str | Path,
    text_file: str | Path,
    minutes: float,
    seq_len: int = 256,
    batch_size: int = 8,
    lr: float = 2e-3,
    seed: int = 0,
) -> TrainResult:
    """Train the checkpoint at `path` on `text_file` for `minutes` of wall time (at least one
    step) and write the trained weights back (module docstring)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor(tokenizer(read_text(text_file))["input_ids"], dtype=torch.long)
    if ids.numel() <= seq_len + 1:
        raise ValueError(f"{text_file}: {ids.numel()} tokens, fewer than a window of {seq_len}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    budget, start, losses = minutes * 60.0, time.perf_counter(), []
    bar = tqdm(desc="training", unit="step", leave=False)
    while not losses or time.perf_counter() - start < budget:
        frac = min(1.0, (time.perf_counter() - start) / budget)
        warm = min(1.0, (len(losses) + 1) / 10)  # a short warm-up, then cosine decay
        for group in opt.param_groups:
            group["lr"] = lr * warm * 0.5 * (1 + math.cos(math.pi * frac))
        at = torch.randint(0, ids.numel() - seq_len - 1, (batch_size,), generator=gen)
        window = torch.stack([ids[a : a + seq_len + 1] for a in at.tolist()])
        loss = model(input_ids=window[:, :-1], labels=window[:, :-1]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    stored = write_back(path, {k: v.detach() for k, v in model.state_dict().items()})
    check_written(path, model, stored)
    return TrainResult(
        steps=len(losses),
        tokens=len(losses) * batch_size * seq_len,
        loss_first=sum(losses[:10]) / len(losses[:10]),
        loss_last=sum(losses[-10:]) / len(losses[-10:]),
        seconds=time.perf_counter() - start,
    )


def source_of(name: str, state: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor] | None:
    """(transformers' name, the trained tensor) for checkpoint tensor `name`; None where
    transformers does not hold it."""
    if name in state:
        return name, state[name]
    m = EXPERT.fullmatch(name)
    if m is None:
        return None
    prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
    fused_name = f"{prefix}.experts.{'down_proj' if kind == 'down' else 'gate_up_proj'}"
    fused = state.get(fused_name)
    if fused is None:
        return None
    if kind == "down":
        return fused_name, fused[e]
    half = fused.shape[1] // 2
    return fused_name, fused[e, :half] if kind == "gate" else fused[e, half:]


def write_back(path: Path, state: dict[str, torch.Tensor]) -> dict[str, torch.dtype]:
    """Every safetensors file of the checkpoint rewritten with the trained values, each tensor
    in its stored dtype and shape; -> the stored dtype of each of transformers' tensors."""
    stored: dict[str, torch.dtype] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors = {}
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata()
            for name in f.keys():  # noqa: SIM118
                old = f.get_tensor(name)
                found = source_of(name, state)
                if found is None:
                    tensors[name] = old
                    continue
                source, new = found
                if new.shape != old.shape:
                    raise ValueError(
                        f"{name}: trained {tuple(new.shape)}, stored {tuple(old.shape)}"
                    )
                tensors[name] = new.to(old.dtype).contiguous()
                stored[source] = old.dtype
        save_file(tensors, str(file), metadata=meta)
    return stored


def check_written(path: Path, model: torch.nn.Module, stored: dict[str, torch.dtype]) -> None:
    """The checkpoint, loaded again by transformers, holds the trained values rounded to the
    dtypes they are stored in."""
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    for name, value in model.state_dict().items():
        want = value.to(stored.get(name, value.dtype)).float()
        if not torch.equal(again[name], want):
            raise RuntimeError(f"{name}: the written checkpoint does not hold the trained values")
