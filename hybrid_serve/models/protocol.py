"""`ServedModel`: what the scheduler may ask of a loaded causal LM, whatever its family.

The scheduler (its runner, pool sizing, graph runner and speculative decoding) types the model
by these protocols and by nothing family-specific: every family's causal LM (a
`HybridForCausalLM`, built through `models.registry`) satisfies them structurally. A member the
scheduler starts to use is added here first.

`ServedConfig` is the part of a model config it reads: the checkpoint's (`config`) or this
tensor-parallel rank's share of the heads (`local_config`, what its pools hold).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
from torch import nn

from hybrid_serve.kernels import KernelSet
from hybrid_serve.mem_cache.kv_shape import KVShape
from hybrid_serve.mem_cache.state_shape import MambaStateShape
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.parallel import ParallelContext


class ServedConfig(Protocol):
    """The config fields the scheduler reads (every family's config class has them)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def num_key_value_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def full_attention_layers(self) -> Sequence[int]:
        """Layer ids whose keys and values the KV pool holds."""
        ...

    @property
    def eos_token_ids(self) -> Sequence[int]: ...

    @property
    def mamba_ssm_dtype(self) -> str:
        """The checkpoint's recurrent-state dtype name (a key of `models.loader.DTYPES`)."""
        ...


class DraftHead(Protocol):
    """A multi-token-prediction head (`models.qwen3_next_mtp`, `models.nemotron_h_mtp`):
    `layer_input(ids, hidden, embed)` is what its first layer reads; `lm_head` its own LM head
    (the loader's quantized copy for `draft_quantization`) or None (the model's)."""

    lm_head: nn.Module | None

    def layer_input(
        self, ids: torch.Tensor, hidden: torch.Tensor, embed: nn.Module
    ) -> torch.Tensor: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


class ServedModel(Protocol):
    """A loaded causal LM (the whole model or one rank's shard) as the scheduler drives it.

    `model(batch)` / `forward(batch)` returns fp32 logits [N, vocab] and equals
    `logits_from_hidden(final_hidden(batch))`; `state_shapes` lists each recurrent layer's
    per-sequence state in Mamba-pool order; `num_kv_layers` counts the KV pool's layers (an MTP
    head's included) and `kv_shapes` describes each one's per-token row in KV-pool order.
    `mtp` is the multi-token-prediction head or None (`DraftingModel`)."""

    config: ServedConfig
    local_config: ServedConfig
    tp: ParallelContext
    ops: KernelSet
    mtp: DraftHead | None

    def __call__(self, batch: ForwardBatch) -> torch.Tensor: ...

    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...

    def final_hidden(self, batch: ForwardBatch, every_row: bool = False) -> torch.Tensor: ...

    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def use_kernels(self, ops: KernelSet) -> None: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    @property
    def embed_tokens(self) -> nn.Module: ...

    @property
    def state_shapes(self) -> tuple[MambaStateShape, ...]: ...

    @property
    def num_kv_layers(self) -> int: ...

    @property
    def kv_shapes(self) -> tuple[KVShape, ...]: ...


class DraftingModel(ServedModel, Protocol):
    """A `ServedModel` loaded with its MTP head (`mtp` not None): what speculative decoding
    (`scheduler.spec`) runs. `mtp_hidden(batch, hidden)` is the head's output y [T, hidden] for
    rows whose previous final hidden is `hidden`; `draft_logits(y)` its fp32 predictions."""

    mtp: DraftHead

    def mtp_hidden(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor: ...

    def draft_logits(self, y: torch.Tensor) -> torch.Tensor: ...
