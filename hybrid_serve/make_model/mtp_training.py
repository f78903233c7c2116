"""Training a checkpoint's MTP head on its own main model's output (`make-model --fit-mtp`).

A preset's head is random, so it drafts almost nothing right. Fitting trains it on what it will
be asked during speculative decoding: rows (h_p, t_{p+1}) of the main model's greedy sequences,
whose target is the main model's greedy token at p+1 (so t_{p+2} inside a greedy continuation):

    loss = CE(lm_head(head(h_p, t_{p+1})), argmax main(t_0 .. t_{p+1}))    over every row p

The sequences (`FitData`) come from the scheduler's runner (`make_model.mtp_fitting`, which runs
the whole `--fit-mtp` pass); here are the trainable twin of the served head, the training loop,
the accept rate and the write-back.
The twin (`TrainableHead`) is a `MultiTokenPredictor` on the torch reference kernels (every op
of its MLP or MoE and its norms runs under autograd) whose attention is plain causal attention
over each sequence instead of the KV pool; embedding and LM head are the main model's, frozen.

What a fit reaches on new prompts is bounded by how predictable the main model is: the presets'
random models are chaotic (any one context token changed changes the next greedy token), so
there the head learns its training sequences and little that carries over.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from hybrid_serve.kernels.attn_step import apply_rope
from hybrid_serve.make_model.fp8_writer import quantize
from hybrid_serve.make_model.weights_file import save_weights
from hybrid_serve.models.base_config import read_json
from hybrid_serve.models.fp8 import E4M3, SCALE_SUFFIX, Fp8Config
from hybrid_serve.models.layers import REFERENCE
from hybrid_serve.models.loader import checkpoint_files, checkpoint_names
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.qwen3_next import Qwen3NextForCausalLM
from hybrid_serve.models.qwen3_next_layers import GatedAttention
from hybrid_serve.models.qwen3_next_mtp import MultiTokenPredictor
from hybrid_serve.models.weight_map import MTP_PREFIX, checkpoint_map

logger = logging.getLogger(__name__)


@dataclass
class FitData:
    """S sequences of L tokens: a random prompt of `prompt_len` tokens, then the main model's
    greedy continuation. Row p of a sequence is the head's input (hidden[p], tokens[p+1]) at
    position p, its target greedy[p+1]; rows p >= prompt_len - 1 are the ones decoding drafts
    (their input token is a generated one)."""

    tokens: torch.Tensor  # [S, L] int64
    hidden: torch.Tensor  # [S, L, hidden] fp32: the main model's final normed hidden states
    greedy: torch.Tensor  # [S, L] int64: the main model's argmax at each position
    prompt_len: int

    def split(self, n: int) -> tuple[FitData, FitData]:
        """The first `n` sequences and the rest."""
        fields = (self.tokens, self.hidden, self.greedy)
        return (
            FitData(*(t[:n] for t in fields), self.prompt_len),
            FitData(*(t[n:] for t in fields), self.prompt_len),
        )


class TrainableHead(nn.Module):
    """An fp32 copy of `model.mtp` with the same parameter names (`head.*` = `mtp.*` of the
    served module) that runs whole sequences under autograd; `forward` equals the served head
    (`Qwen3NextForCausalLM.mtp_hidden` over an extend batch of the same rows)."""

    def __init__(self, model: Qwen3NextForCausalLM) -> None:
        super().__init__()
        assert model.mtp is not None, "load the model with mtp=True"
        self.head = MultiTokenPredictor(model.config, ParallelContext(), REFERENCE)
        self.head.load_state_dict({k: v.float() for k, v in model.mtp.state_dict().items()})
        self.embed = model.model.embed_tokens.weight.detach().float()  # frozen, shared
        self.lm_head = model.lm_head.weight.detach().float()
        self.rotary = model.model.rotary

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] (t_{p+1}), hidden [B, T, hidden] (h_p), row p at position p ->
        the head's output y [B, T, hidden]."""
        B, T = tokens.shape
        m = self.head
        e = m.pre_fc_norm_embedding(F.embedding(tokens.reshape(-1), self.embed))
        h = m.pre_fc_norm_hidden(hidden.reshape(B * T, -1))
        x = m.fc(torch.cat([e, h], dim=-1))  # [B*T, hidden]
        positions = torch.arange(T).repeat(B)
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        residual = None
        # Qwen3NextDecoderLayer.forward with causal attention over each sequence
        for layer in m.layers:
            h, residual = layer.input_layernorm.add_forward(x, residual)
            h = causal_attention(layer.self_attn, h, cos_sin, B)
            h, residual = layer.post_attention_layernorm.add_forward(h, residual)
            x = layer.mlp(h)
        y, _ = m.norm.add_forward(x, residual)
        return y.view(B, T, -1)

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        return y @ self.lm_head.T


def causal_attention(
    attn: GatedAttention, x: torch.Tensor, cos_sin: tuple[torch.Tensor, ...], batch: int
) -> torch.Tensor:
    """`GatedAttention`'s math on `batch` equal-length sequences packed in x [B*T, hidden]:
    each row attends to its own sequence's rows up to itself."""
    BT = x.shape[0]
    nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q, gate = attn.q_proj(x).view(BT, nh, 2 * hd).chunk(2, dim=-1)
    q = apply_rope(attn.q_norm(q), *cos_sin)  # [BT, nH, hd]
    k = apply_rope(attn.k_norm(attn.k_proj(x).view(BT, nkv, hd)), *cos_sin)
    v = attn.v_proj(x).view(BT, nkv, hd)

    def heads(t: torch.Tensor) -> torch.Tensor:  # [BT, n, hd] -> [B, nH, T, hd]
        t = t.view(batch, BT // batch, t.shape[1], hd).transpose(1, 2)
        return t.repeat_interleave(nh // t.shape[1], dim=1)

    o = F.scaled_dot_product_attention(
        heads(q), heads(k), heads(v), is_causal=True, scale=attn.scale
    )
    o = o.transpose(1, 2).reshape(BT, nh * hd)
    return attn.o_proj(o * torch.sigmoid(gate.reshape(BT, -1)))


def _rows(data: FitData, idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(tokens t_{p+1}, hidden h_p, targets) [B, L-1] of sequences `idx`."""
    return data.tokens[idx, 1:], data.hidden[idx, :-1], data.greedy[idx, 1:]


@torch.no_grad()
def accept_rate(head: TrainableHead, data: FitData, batch: int = 16) -> float:
    """Fraction of the rows inside the greedy continuations (p >= prompt_len - 1) where the
    head's argmax equals the main model's greedy token: the first draft's accept rate."""
    hits = total = 0
    for start in range(0, data.tokens.shape[0], batch):
        tokens, hidden, target = _rows(
            data, torch.arange(start, min(start + batch, len(data.tokens)))
        )
        pred = head.logits(head(tokens, hidden)).argmax(-1)[:, data.prompt_len - 1 :]
        hits += (pred == target[:, data.prompt_len - 1 :]).sum().item()
        total += pred.numel()
    return hits / max(total, 1)


@dataclass
class FitResult:
    """Accept rates (`accept_rate`) of the head as written and as fitted: on held-out
    sequences, and on as many training sequences (what it learnt, against what carries over)."""

    before: float
    after: float
    train_before: float
    train_after: float
    steps: int  # optimizer steps taken
    loss: float  # the last step's loss
    seconds: float


def fit_head(
    head: TrainableHead,
    train: FitData,
    steps: int,
    *,
    lr: float = 2e-3,
    batch: int = 8,
    seed: int = 0,
    time_limit: float | None = None,
) -> tuple[int, float]:
    """Adam on the cross-entropy of every row of `batch` sequences a step (drawn with a
    generator seeded by `seed`), the learning rate decaying linearly to a tenth; stops after
    `steps` steps or once `time_limit` seconds have passed. Returns (steps taken, last loss)."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(head.head.parameters(), lr=lr)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - 0.9 * i / max(steps, 1))
    start, loss, done = time.perf_counter(), float("nan"), 0
    with tqdm(total=steps, desc="fitting the MTP head", unit="step", leave=False) as bar:
        while done < steps:
            idx = torch.randint(len(train.tokens), (batch,), generator=gen)
            tokens, hidden, target = _rows(train, idx)
            step_loss = F.cross_entropy(
                head.logits(head(tokens, hidden)).flatten(0, 1), target.flatten()
            )
            opt.zero_grad(set_to_none=True)
            step_loss.backward()
            opt.step()
            decay.step()
            loss, done = step_loss.item(), done + 1
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            bar.update()
            if time_limit is not None and time.perf_counter() - start > time_limit:
                logger.info("MTP fit: time limit of %.0fs reached after %d steps", time_limit, done)
                break
    return done, loss


def fit(
    model: Qwen3NextForCausalLM, train: FitData, test: FitData, steps: int, **options
) -> FitResult:
    """Fit `model.mtp` in place to `train` (`fit_head`'s options) and measure the accept rates
    before and after (`FitResult`)."""
    start = time.perf_counter()
    head = TrainableHead(model)
    seen = train.split(len(test.tokens))[0]
    before, train_before = accept_rate(head, test), accept_rate(head, seen)
    logger.info(
        "MTP fit: %d steps on %d sequences, %d held out; accept rate before %.3f",
        steps, len(train.tokens), len(test.tokens), before,
    )  # fmt: skip
    done, loss = fit_head(head, train, steps, **options)
    after, train_after = accept_rate(head, test), accept_rate(head, seen)
    with torch.no_grad():
        for name, p in model.mtp.named_parameters():
            p.copy_(head.head.get_parameter(name))
    result = FitResult(
        before, after, train_before, train_after, done, loss, time.perf_counter() - start
    )
    logger.info(
        "MTP fit: accept rate %.3f -> %.3f held out (%.3f -> %.3f on training sequences); "
        "%d steps, loss %.3f, %.1fs",
        before, after, train_before, train_after, done, loss, result.seconds,
    )  # fmt: skip
    return result


def write_head(path: str | Path, model: Qwen3NextForCausalLM) -> list[str]:
    """Rewrite every `mtp.*` tensor of the checkpoint at `path` from `model.mtp` (unsharded),
    in the dtype and layout it has there (block-FP8 matrices re-quantized, `models.fp8`); every
    other tensor is written back as read, in the same file (so a shard index stays right), and
    files without head tensors are untouched. Each file is replaced atomically. Returns the
    names rewritten."""
    path = Path(path)
    where = checkpoint_names(checkpoint_files(path))
    table = checkpoint_map(model, (n for n in where if not n.endswith(SCALE_SUFFIX)))
    params = dict(model.named_parameters())
    quant = read_json(path / "config.json").get("quantization_config")
    block = Fp8Config.from_dict(quant).block if quant else None
    done = []
    for file in sorted({where[n] for n in where if n.startswith(MTP_PREFIX)}):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
            meta = f.metadata()
        for name, old in tensors.items():
            if not name.startswith(MTP_PREFIX):
                continue
            target = table[name.removesuffix(SCALE_SUFFIX)]
            new = params[target.param].detach()[target.index].float()
            if name.endswith(SCALE_SUFFIX) or old.dtype == E4M3:
                weight, scale = quantize(new, block)
                new = scale if name.endswith(SCALE_SUFFIX) else weight
            tensors[name] = new.to(old.dtype).contiguous()
            done.append(name)
        tmp = file.with_name(file.name + ".tmp")
        save_weights(tensors, tmp, meta)
        os.replace(tmp, file)
    return done
