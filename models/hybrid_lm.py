"""What every hybrid family's causal LM gives the loader and the scheduler, written once.

The contract is `Qwen3NextForCausalLM`'s: `forward`, `final_hidden`, `logits_from_hidden`,
`state_shapes`, `num_kv_layers`, `use_kernels`, `embed_tokens`, `config` / `local_config`,
`tp`, `ops`, `mtp`. A family subclasses `HybridForCausalLM` and supplies its stack:

    hidden_states(batch)   the last layer's output [T, hidden] (before the final norm)
    final_norm(x)          the final norm of some of those rows
    embed_tokens           the token embedding (tied to `lm_head` where the config says so)
    lm_head                the output projection; logits = lm_head(h) * logits_multiplier

The recurrent mixers (Mamba2, Gated DeltaNet) are found in module order, which is their layer
order and so their Mamba-pool order; each describes its own state (`state_shape`). Under tensor
parallelism every sharded module declares its parameters' shards (`tp_shards`, see
`models.tp_shards`), the embedding and LM head are vocab-parallel, and `local_config` carries
this rank's attention heads (what its KV pool holds).
"""

from __future__ import annotations

from dataclasses import replace
from functools import cached_property

import torch
from torch import nn

from kernels import KernelSet
from mem_cache.state_shape import MambaStateShape
from models.forward_batch import ForwardBatch
from models.layers import REFERENCE
from models.parallel import ParallelContext
from models.shard_loader import Shard
from models.tp_shards import stacked
from models.weight_map import Target


class HybridForCausalLM(nn.Module):
    """Base of the Mamba2 / linear-attention hybrids' causal LMs (module docstring). No MTP
    head is served for these families (`mtp` is always None)."""

    logits_multiplier: float = 1.0  # Granite's 1 / logits_scaling, Falcon-H1's lm_head multiplier

    def __init__(
        self, config, tp: ParallelContext | None, ops: KernelSet = REFERENCE, mtp: bool = False
    ) -> None:
        super().__init__()
        if mtp:
            raise ValueError(f"{config.model_type}: no MTP head is served for this family")
        self.tp, self.ops = tp or ParallelContext(), ops
        self.config = config
        self.local_config = config
        if self.tp.enabled:  # this rank's attention heads: what its KV pool holds
            self.local_config = replace(
                config,
                num_attention_heads=self.tp.split(config.num_attention_heads, "heads")[1],
                num_key_value_heads=self.tp.kv_heads(config.num_key_value_heads)[1],
            )
        self.mtp = None

    # ---- what a family supplies ------------------------------------------------------------
    @property
    def embed_tokens(self) -> nn.Module:
        raise NotImplementedError

    def hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        """The last layer's output [T, hidden], before the final norm."""
        raise NotImplementedError

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # ---- the contract ------------------------------------------------------------------------
    def checkpoint_shard(self, name: str, target: Target) -> Shard | None:
        """The part of checkpoint tensor `name` (loading into `target`) this rank reads; None:
        all of it."""
        shard = self._param_shards.get(target.param)
        if shard is None:
            return None
        return stacked(shard, len(target.index)) if target.index else shard

    @cached_property
    def _param_shards(self) -> dict[str, Shard]:
        """Parameter name -> this rank's shard, from every sharded module and the vocab."""
        if not self.tp.enabled:
            return {}
        found = {}
        for prefix, module in self.named_modules():
            if hasattr(module, "tp_shards"):
                found |= {f"{prefix}.{k}": s for k, s in module.tp_shards().items()}
        start, count, _ = self.tp.vocab_range(self.config.vocab_size)
        vocab = Shard(0, ((start, start + count),), rows=count)
        names = {id(p): n for n, p in self.named_parameters()}
        for weight in (self.embed_tokens.weight, self.lm_head.weight):
            found[names[id(weight)]] = vocab
        return found

    @property
    def state_shapes(self) -> tuple[MambaStateShape, ...]:
        """Each recurrent mixer's per-sequence state (this rank's share), in pool order: what
        the Mamba pool is built from."""
        return tuple(m.state_shape for m in self.modules() if hasattr(m, "state_shape"))

    @property
    def num_kv_layers(self) -> int:
        """Layers whose keys and values the KV pool holds."""
        return len(self.config.full_attention_layers)

    def use_kernels(self, ops: KernelSet) -> None:
        """Run every layer on `ops` from now on."""
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [N, vocab] (last new token per request), [T, vocab] with return_all_logits,
        or [K, vocab] at `logit_indices`; fp32."""
        return self.logits_from_hidden(self.final_hidden(batch))

    @torch.inference_mode()
    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [K, vocab] fp32 of final hidden states [K, hidden] (`final_hidden`'s)."""
        logits = self.lm_head(hidden)
        if self.logits_multiplier != 1.0:
            logits = logits * self.logits_multiplier
        return logits.float()

    @torch.inference_mode()
    def final_hidden(self, batch: ForwardBatch, every_row: bool = False) -> torch.Tensor:
        """The final normed hidden states of the rows `forward` returns logits for (with
        `every_row`, of every new token)."""
        x = self.hidden_states(batch)
        if not (every_row or batch.is_decode):
            if batch.logit_indices is not None:
                x = x[batch.logit_indices]
            elif not batch.return_all_logits:
                x = x[batch.last_token_indices()]
        return self.final_norm(x)
