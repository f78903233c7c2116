"""What every hybrid family's causal LM gives the loader and the scheduler, written once.

The contract: `forward`, `final_hidden`, `logits_from_hidden`, `state_shapes`, `num_kv_layers`,
`kv_shapes`, `use_kernels`, `embed_tokens`, `config` / `local_config`, `tp`, `ops`, `mtp`, all
held by `HybridForCausalLM`, every family's causal LM. A family subclasses it and builds in
`build()` a `HybridModel` of its decoder layers under the checkpoint's names (`build_stack`, which
adds the LM head), and where it serves one its MTP head in `build_mtp()`; or it supplies these
parts itself:

    hidden_states(batch)   the last layer's output [T, hidden] (before the final norm), or the
                           pair (that output, the residual stream) whose sum is the hidden state
                           where the family defers the residual add into the next norm
                           (Qwen3-Next's `RMSNorm.add_forward`)
    final_norm(x)          the final norm of some of those rows (of both tensors of a pair)
    embed_tokens           the token embedding (tied to `lm_head` where the config says so)
    lm_head                the output projection; logits = lm_head(h) * logits_multiplier

The recurrent mixers (Mamba2, Gated DeltaNet) are found in module order, which is their layer
order and so their Mamba-pool order; each describes its own state (`state_shape`). An attention
layer may describe its KV row (`kv_shape`, with its pool layer `kv_layer`: MLA's latent row);
the others keep K and V of the config's KV heads. Under tensor
parallelism (and only then) the modules are asked for their parameters' shards (`tp_shards`, see
`models.tp_shards`: every parameter is declared, the vocab-parallel embedding and LM head too),
and `local_config` carries this rank's attention heads (what its KV pool holds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import cached_property

import torch
from torch import nn

from hybrid_serve.kernels import KernelSet
from hybrid_serve.mem_cache.kv_shape import KVShape
from hybrid_serve.mem_cache.state_shape import MambaStateShape
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.layers import REFERENCE, RMSNormPlain, RotaryEmbedding
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.parallel_layers import embedding, lm_head
from hybrid_serve.models.shard_loader import Shard
from hybrid_serve.models.tp_shards import param_shards, target_shard
from hybrid_serve.models.weight_map import Target

# a stack's output: the last layer's [T, hidden], or (that output, the residual stream)
Hidden = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class HybridModel(nn.Module):
    """A family's stack: the token embedding, `layers` and the final norm (a `norm` of the
    hidden size: plain-weight by default), registered under the checkpoint's names (`embed_name`,
    `norm_name`), and the RoPE angles where the family has positions (`rotary_dim` > 0; in
    `rotary_dtype`, default the activations'). `layer(config, layer_id, ops, tp)` builds one
    decoder layer, which is called as `layer(x, batch, cos_sin)` (`cos_sin` None without
    positions):

        x_0 = embedding_multiplier * embed(ids);   x_(i+1) = layers[i](x_i, batch, cos_sin)

    A layer may return a pair (its output, the residual stream) for the next layer to add in
    (`HybridForCausalLM.hidden_states`): the stack passes x on as the layers give it.
    """

    def __init__(
        self,
        c,
        layer: Callable[..., nn.Module],
        ops: KernelSet,
        tp: ParallelContext,
        embed_name: str = "embed_tokens",
        norm_name: str = "norm",
        rotary_dim: int = 0,
        embedding_multiplier: float = 1.0,
        rotary_dtype: torch.dtype | None = None,
        norm: Callable[..., nn.Module] = RMSNormPlain,
    ) -> None:
        super().__init__()
        self.embed_name, self.norm_name = embed_name, norm_name
        self.embedding_multiplier = embedding_multiplier
        self.add_module(embed_name, embedding(c.vocab_size, c.hidden_size, tp))
        self.layers = nn.ModuleList(layer(c, i, ops, tp) for i in range(c.num_hidden_layers))
        self.add_module(norm_name, norm(c.hidden_size, c.rms_norm_eps, ops))
        self.rotary = RotaryEmbedding(rotary_dim, c.rope_theta) if rotary_dim else None
        self.rotary_dtype = rotary_dtype

    @property
    def embed(self) -> nn.Module:
        return getattr(self, self.embed_name)

    @property
    def final_norm(self) -> nn.Module:
        return getattr(self, self.norm_name)

    def forward(self, batch: ForwardBatch) -> Hidden:
        """-> the last layer's output [T, hidden] (before the final norm), or its pair."""
        x = self.embed(batch.input_ids)  # [T, hidden]
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        cos_sin = None  # 2 x [T, rotary_dim] with positions
        if self.rotary is not None:
            cos_sin = self.rotary.cos_sin(batch.positions, self.rotary_dtype or x.dtype)
        for layer in self.layers:
            x = layer(x, batch, cos_sin)
        return x


class HybridForCausalLM(nn.Module):
    """Base of every hybrid family's causal LM (module docstring): the whole model, or rank
    `tp.rank`'s shard of it; `ops` is the kernel set every layer calls (`kernels.choose`; the
    torch references by default). With `mtp` the model also holds its multi-token-prediction
    head, `self.mtp` (`build_mtp`: a ValueError for a family that serves none; else None)."""

    logits_multiplier: float = 1.0  # Granite's 1 / logits_scaling, Falcon-H1's lm_head multiplier

    def __init__(
        self,
        config,
        tp: ParallelContext | None = None,
        ops: KernelSet = REFERENCE,
        mtp: bool = False,
    ) -> None:
        super().__init__()
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
        self.stack_name = "model"
        self.build()
        if mtp:
            self.mtp = self.build_mtp()

    # ---- the family's stack ------------------------------------------------------------------
    def build(self) -> None:
        """Build the family's layers (`build_stack`); the last step of `__init__`."""

    def build_mtp(self) -> nn.Module:
        """The family's MTP head (after `build`); this base serves none."""
        raise ValueError(f"{self.config.model_type}: no MTP head is served for this family")

    def build_stack(self, layer: Callable[..., nn.Module], name: str = "model", **stack) -> None:
        """`self.<name>` (the checkpoint's: `model` or `backbone`) = the `HybridModel` of
        `layer`s (`stack`: its other arguments), then the LM head, tied to the stack's
        embedding where the config says so."""
        c = self.config
        self.stack_name = name
        self.add_module(name, HybridModel(c, layer, self.ops, self.tp, **stack))
        self.lm_head = lm_head(c.hidden_size, c.vocab_size, self.tp, self.ops)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def embed_tokens(self) -> nn.Module:
        return getattr(self, self.stack_name).embed

    def hidden_states(self, batch: ForwardBatch) -> Hidden:
        """The last layer's output [T, hidden], before the final norm (or its pair with the
        residual stream: module docstring)."""
        return getattr(self, self.stack_name)(batch)

    def final_norm(self, x: Hidden) -> torch.Tensor:
        """The final normed hidden states [K, hidden] of rows of `hidden_states`' output."""
        return getattr(self, self.stack_name).final_norm(x)

    # ---- the contract ------------------------------------------------------------------------
    @property
    def num_kv_layers(self) -> int:
        """Layers whose keys and values the KV pool holds: the stack's attention layers, then
        its MTP head's (`mtp.num_kv_layers`) where it holds one."""
        extra = self.mtp.num_kv_layers if self.mtp is not None else 0
        return len(self.config.full_attention_layers) + extra

    @torch.inference_mode()
    def draft_logits(self, y: torch.Tensor) -> torch.Tensor:
        """The MTP head's predictions [K, vocab] fp32 from its outputs y (`mtp_hidden`): through
        its own LM head where the loader gave it one (`draft_quantization`), else the model's."""
        head: nn.Module = self.mtp.lm_head if self.mtp.lm_head is not None else self.lm_head
        return head(y).float()

    @torch.inference_mode()
    def final_hidden(self, batch: ForwardBatch, every_row: bool = False) -> torch.Tensor:
        """The final normed hidden states of the rows `forward` returns logits for (with
        `every_row`, of every new token)."""
        x = self.hidden_states(batch)
        rows = None
        if not (every_row or batch.is_decode):
            if batch.logit_indices is not None:
                rows = batch.logit_indices
            elif not batch.return_all_logits:
                rows = batch.last_token_indices()
        if rows is not None:
            x = tuple(t[rows] for t in x) if isinstance(x, tuple) else x[rows]
        return self.final_norm(x)

    # ---- what every family computes alike ------------------------------------------------
    @property
    def state_shapes(self) -> tuple[MambaStateShape, ...]:
        """Each recurrent mixer's per-sequence state (this rank's share), in pool order: what
        the Mamba pool is built from."""
        return tuple(m.state_shape for m in self.modules() if hasattr(m, "state_shape"))

    @property
    def kv_shapes(self) -> tuple[KVShape, ...]:
        """Each KV-pool layer's per-token row (this rank's share), in pool order: what the KV
        pool is built from. A layer that declares its `kv_shape` (at its `kv_layer`) gets that;
        the rest hold K and V of `local_config`'s KV heads."""
        c = self.local_config
        declared = {m.kv_layer: m.kv_shape for m in self.modules() if hasattr(m, "kv_shape")}
        default = KVShape.mha(c.num_key_value_heads, c.head_dim)
        return tuple(declared.get(i, default) for i in range(self.num_kv_layers))

    def use_kernels(self, ops: KernelSet) -> None:
        """Run every layer on `ops` from now on (tests and benchmarks compare kernel sets on
        the same weights)."""
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops

    def checkpoint_shard(self, name: str, target: Target) -> Shard | None:
        """The part of checkpoint tensor `name` (loading into `target`) this rank reads, from
        the shard its parameter's module declares (`models.tp_shards`); None: all of it."""
        shard = self._param_shards.get(target.param)
        return None if shard is None else target_shard(shard, target)

    @cached_property
    def _param_shards(self) -> dict[str, Shard | None]:
        """Parameter name -> this rank's shard (`models.tp_shards.param_shards`; refuses an
        undeclared parameter at TP > 1)."""
        return param_shards(self, self.config) if self.tp.enabled else {}

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [N, vocab] (last new token per request), [T, vocab] with return_all_logits,
        or [K, vocab] at `logit_indices`; fp32."""
        return self.logits_from_hidden(self.final_hidden(batch))

    @torch.inference_mode()
    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [K, vocab] fp32 of final hidden states [K, hidden] (`final_hidden`'s): `forward`
        is `logits_from_hidden(final_hidden(batch))`."""
        logits = self.lm_head(hidden)
        if self.logits_multiplier != 1.0:
            logits = logits * self.logits_multiplier
        return logits.float()
