"""`ForwardBatch`: everything the model may read for one forward pass, and nothing else.

A flat ragged batch: the new tokens of N requests are packed one after another. Request i
already has `prefix_lens[i]` tokens in the caches (its KV is reachable through `req_to_token`
and its Gated DeltaNet state sits in `mamba_pool` at `mamba_slots[i]`), and computes
`extend_lens[i]` new tokens now. Decode is the case extend_len == 1 for every request.

Padding rows (decode batches padded to a captured size) use request row 0, KV location 0 and
Mamba slot 0: every pool reserves those, so padding can write there but never touches a live
request.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from hybrid_serve.mem_cache.kv_pool import KVPool
    from hybrid_serve.mem_cache.mamba_pool import MambaPool

Phase = Literal["prefill", "decode"]


@dataclass
class ForwardBatch:
    phase: Phase
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    out_loc: torch.Tensor  # [T] int64, KV location each new token's K/V is written to
    req_slots: torch.Tensor  # [N] int64, rows of req_to_token
    mamba_slots: torch.Tensor  # [N] int64, Mamba pool slots (0 = padding)
    seq_lens: torch.Tensor  # [N] int64, prefix + extend
    prefix_lens_cpu: list[int]  # [N] tokens already cached (KV and recurrent state)
    extend_lens_cpu: list[int]  # [N] tokens computed now; sum == T
    req_to_token: torch.Tensor  # [rows, max_context] int32
    kv_pool: KVPool
    mamba_pool: MambaPool
    max_seq_len: int = 0  # decode: longest seq_len in the batch (host side, avoids a sync)
    return_all_logits: bool = False  # prefill: logits for every new token, not only the last
    # prefill: logits for exactly these packed token indices instead (prompt logprobs)
    logit_indices: torch.Tensor | None = None  # [K] int64
    # prefill state tracking (prefix cache): request i also leaves the conv and recurrent state
    # after `mamba_track_offsets_cpu[i]` of its new tokens (0 = none; any offset up to its
    # extend_len, in practice one ending on the sequence's 64-token grid: prefix_len + offset is
    # a multiple of 64) in Mamba slot `mamba_track_slots[i]`
    mamba_track_slots: torch.Tensor | None = None  # [N] int64
    mamba_track_offsets_cpu: list[int] | None = None  # [N]
    # verify (speculative decoding): the Gated DeltaNet layers step each request's new tokens
    # one at a time, and the conv and recurrent state after its new token j (every one but its
    # last) also go to Mamba slot `mamba_step_slots_cpu[i][j]`, to roll back to
    mamba_step_slots_cpu: list[list[int]] | None = None  # [N][extend_len - 1]

    @property
    def num_reqs(self) -> int:
        return len(self.extend_lens_cpu)

    @property
    def is_decode(self) -> bool:
        return self.phase == "decode"

    @cached_property
    def query_start_loc(self) -> torch.Tensor:
        """[N+1] int64 offsets of each request's tokens in the packed batch (built once)."""
        lens = torch.tensor([0, *self.extend_lens_cpu], dtype=torch.int64)
        return lens.cumsum(0).to(self.input_ids.device)

    @cached_property
    def has_initial_state(self) -> torch.Tensor:
        """[N] bool: the request continues from a cached state (prefix_len > 0)."""
        return torch.tensor([p > 0 for p in self.prefix_lens_cpu], device=self.input_ids.device)

    @property
    def tracks_states(self) -> bool:
        return self.mamba_track_offsets_cpu is not None and any(self.mamba_track_offsets_cpu)

    @property
    def is_verify(self) -> bool:
        return self.mamba_step_slots_cpu is not None

    def last_token_indices(self) -> torch.Tensor:
        """[N] index of each request's last new token in the packed batch."""
        return self.query_start_loc[1:] - 1
