"""Training a written preset on text (`make-model --train-text FILE --train-minutes N`).

A preset's random weights make every prediction a near-tie: greedy tokens flip on a rounding,
speculative drafts are accepted only by construction, and a lossy mode's top-1 agreement says
nothing about a trained model. A few CPU minutes of next-token training on real text (the GSM8K
train set in ../shared/data, say) give the model margins that mean something, so fidelity and
speculative figures measured on it can be compared with a real model's.

The training runs transformers' own model class for the checkpoint (the judge the project's
models are tested against) with AdamW (torch's fused kernel) on fp32 master weights, on random
windows of the tokenized text (`batch_size` windows of `seq_len` tokens a step), for a
wall-clock budget and/or a number of steps, whichever ends first. The learning rate warms up
over 10 steps, then decays on a cosine to zero over the budget; the loss is logged once a
minute. `precision` picks the forward's arithmetic:
"bfloat16" runs it under CPU autocast (matrix products in bf16 with fp32 sums, everything else
and the optimizer in fp32), "float32" runs it all in fp32, and "auto" (the default) takes
bfloat16 on CPUs with bf16 dot products in hardware (avx512_bf16 or AMX,
`kernels.cpu_levels.multiplies_bf16`) and float32 elsewhere, where bf16 products are emulated.

The trained values are written back into the checkpoint's own files and names: tensors
transformers holds under the same name are replaced; per-expert matrices
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
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from hybrid_serve.kernels import cpu_levels
from hybrid_serve.make_model.weights_file import save_weights

logger = logging.getLogger(__name__)

EXPERT = re.compile(r"(.*)\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
PRECISIONS = ("auto", "bfloat16", "float32")
WARMUP_STEPS = 10


@dataclass(frozen=True)
class TrainResult:
    steps: int
    tokens: int
    loss_first: float  # mean loss of the first 10 steps
    loss_last: float  # mean loss of the last 10 steps
    seconds: float
    precision: str  # the forward's arithmetic: "bfloat16" (autocast) or "float32"
    phases: dict[str, float] = field(default_factory=dict)  # seconds in forward/backward/optimizer


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


def tokenize_text(path: str | Path, text_file: str | Path) -> torch.Tensor:
    """`read_text(text_file)` as 1-D token ids of the checkpoint at `path`'s tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return torch.tensor(tokenizer(read_text(text_file))["input_ids"], dtype=torch.long)


def resolve_precision(name: str, features: set[str] | frozenset[str] | None = None) -> str:
    """The forward's arithmetic for a `PRECISIONS` name: "bfloat16" or "float32"; "auto" is
    bfloat16 where the host (`features`, default this CPU's) has bf16 dot products in
    hardware, else float32."""
    if name not in PRECISIONS:
        raise ValueError(f"training precision {name!r}: choose one of {', '.join(PRECISIONS)}")
    if name != "auto":
        return name
    return "bfloat16" if cpu_levels.multiplies_bf16(features) else "float32"


def sample_windows(
    ids: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator
) -> torch.Tensor:
    """[batch_size, seq_len] windows of the 1-D `ids` at uniform random starts."""
    at = torch.randint(0, ids.numel() - seq_len + 1, (batch_size,), generator=gen)
    return torch.stack([ids[a : a + seq_len] for a in at.tolist()])


def lr_scale(step: int, progress: float) -> float:
    """The peak learning rate's factor at `step` (0-based) with `progress` (0..1) of the
    budget spent: linear warm-up over `WARMUP_STEPS`, then a cosine to zero."""
    warm = min(1.0, (step + 1) / WARMUP_STEPS)
    return warm * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class Trainer:
    """AdamW on every trainable parameter of a causal LM (`fused`: torch's fused kernel, one
    pass over the state per step; else its default per-tensor loop), the forward under
    `precision` (module docstring); `step` runs one update and keeps the seconds spent in each
    phase."""

    def __init__(
        self, model: torch.nn.Module, lr: float, precision: str, fused: bool = True
    ) -> None:
        self.model, self.lr, self.precision = model.train(), lr, precision
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(
            self.params, lr=lr, weight_decay=0.01, betas=(0.9, 0.95), fused=fused or None
        )
        self.phases = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}

    def step(self, window: torch.Tensor, scale: float = 1.0) -> float:
        """One update on `window` [batch, seq_len] (next-token loss over every position) at
        `scale` times the peak learning rate; -> the loss."""
        for group in self.opt.param_groups:
            group["lr"] = self.lr * scale
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.precision == "bfloat16"):
            loss = self.model(input_ids=window, labels=window).loss
        t1 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        t3 = time.perf_counter()
        for phase, seconds in zip(self.phases, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            self.phases[phase] += seconds
        return loss.item()


def train_checkpoint(
    path: str | Path,
    text_file: str | Path,
    minutes: float | None = 5.0,
    seq_len: int = 256,
    batch_size: int = 4,
    lr: float = 2e-3,
    seed: int = 0,
    steps: int | None = None,
    precision: str = "auto",
) -> TrainResult:
    """Train the checkpoint at `path` on `text_file` for `minutes` of wall time and/or `steps`
    steps, whichever ends first (at least one step; one of the two must be given), and write
    the trained weights back (module docstring)."""
    from transformers import AutoModelForCausalLM

    if minutes is None and steps is None:
        raise ValueError("training needs a budget: minutes, steps or both")
    if (minutes is not None and minutes <= 0) or (steps is not None and steps < 1):
        raise ValueError(f"training budget: {minutes} minutes, {steps} steps")
    precision = resolve_precision(precision)
    path = Path(path)
    ids = tokenize_text(path, text_file)
    if ids.numel() <= seq_len:
        raise ValueError(f"{text_file}: {ids.numel()} tokens, fewer than a window of {seq_len}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trainer = Trainer(model, lr, precision)
    gen = torch.Generator().manual_seed(seed)
    budget = math.inf if minutes is None else minutes * 60.0
    start, losses = time.perf_counter(), []

    def progress() -> float:
        by_time = (time.perf_counter() - start) / budget
        return max(by_time, len(losses) / steps) if steps is not None else by_time

    logger.info(
        "training on %s: %d tokens, windows %d x %d, lr %g, %s forward, %d threads",
        text_file, ids.numel(), batch_size, seq_len, lr, precision, torch.get_num_threads(),
    )  # fmt: skip
    bar = tqdm(desc="training", unit="step", leave=False, total=steps)
    logged = start
    while not losses or progress() < 1.0:
        window = sample_windows(ids, batch_size, seq_len, gen)
        losses.append(trainer.step(window, lr_scale(len(losses), progress())))
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if time.perf_counter() - logged >= 60.0:  # the curve, once a minute
            logged = time.perf_counter()
            recent = losses[-10:]
            logger.info(
                "step %d, %.0fs: loss %.3f (mean of the last %d)",
                len(losses), logged - start, sum(recent) / len(recent), len(recent),
            )  # fmt: skip
    bar.close()
    seconds = time.perf_counter() - start
    stored = write_back(path, {k: v.detach() for k, v in model.state_dict().items()})
    check_written(path, model, stored)
    return TrainResult(
        steps=len(losses),
        tokens=len(losses) * batch_size * seq_len,
        loss_first=sum(losses[:10]) / len(losses[:10]),
        loss_last=sum(losses[-10:]) / len(losses[-10:]),
        seconds=seconds,
        precision=precision,
        phases=dict(trainer.phases),
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
        save_weights(tensors, file, meta)
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
