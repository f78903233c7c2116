"""Gated DeltaNet (Yang et al., 2024), the linear-attention token mixer of Qwen3-Next.

Per value head the layer keeps a recurrent state S [dk, dv] and a short causal-conv window:

    q, k, v = silu(conv1d([q|k|v] projections));  q, k l2-normalised, q scaled by dk^-0.5
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,   o_t = S_t^T q_t
    g_t = -exp(A_log) * softplus(a_t + dt_bias),   beta_t = sigmoid(b_t)  (x2 in OLMo-Hybrid,
                                                     whose eigenvalues may be negative)
    y = out_proj(RMSNormGated(o, z))

Both states live in the Mamba pool and are addressed by `ForwardBatch.mamba_slots`; prefill
continues from whatever the slot holds (zeros for a fresh request), decode steps it by one token.
A prefill batch may also ask for snapshots at tracked offsets (`mamba_track_slots`), positions
on the sequence's 64-token grid: the conv window there is the Kc-1 raw inputs before the offset,
the recurrent state a chunk-boundary state of the chunked kernel (whose chunks, in a round that
starts off the grid, are laid out so that the offset is one).

`DeltaRuleMixer` is what every delta-rule mixer shares (this one, and Kimi Delta Attention in
`models.kda_mixer`, whose forget gate is one value per key channel): reading the batch and the
pool in prefill, decode and verify. A mixer supplies its projections, its gates' parameters, its
gated output norm and its output projection.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from hybrid_serve.kernels import KernelSet, gdn_step
from hybrid_serve.kernels.gdn_step import gates
from hybrid_serve.mem_cache.state_shape import MambaStateShape
from hybrid_serve.models.base_config import HybridConfig
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.layers import REFERENCE, Linear, RMSNormGated
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.parallel_layers import row_linear
from hybrid_serve.models.shard_loader import Shard
from hybrid_serve.models.tp_shards import cols, rows, span


class DeltaRuleMixer(nn.Module):
    """The conv + gated delta rule + gated norm of one layer on the Mamba pool, whatever the
    layout of its projections. A subclass holds `conv1d` (depthwise over the [q | k | v]
    channels), `A_log` and `dt_bias` (`gdn_step.gates`' contract: per value head, or per key
    channel), sets the sizes annotated below and `state_shape`, and supplies:

        in_projections(x)      (qkvz [T, conv_dim + value_dim], ba [T, HV + a's width]), the
                               [q | k | v | z] and [b | a] rows `gdn_step.gdn_decode` reads
        extend_projections(x)  (mixed_qkv, z, b, a): the same four parts, for prefill
        out_norm               the gated output norm (called (o, z); has weight and eps)
        out_projection         the output projection (summing the ranks' heads)
        decode_op()            the decode op (`gdn_step.gdn_decode`'s contract)
        verify_op()            the verify op (`gdn_step.gdn_verify`'s contract)
    """

    ops: KernelSet
    linear_layer_id: int  # index among the recurrent layers: the Mamba-pool layer
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    key_dim: int
    value_dim: int
    conv_dim: int
    beta_scale: float
    state_shape: MambaStateShape
    gate_lower_bound: float | None = None  # KDA's bounded forget gate (`gdn_step.gates`)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if batch.is_decode:
            return self.out_projection(self._decode(x, batch))
        if batch.is_verify:
            return self.out_projection(self._verify(x, batch))
        return self.out_projection(self._extend(x, batch))

    def _decode(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """One token per request: the projections, then everything up to the output projection
        one op (`decode_op`, reference `kernels.gdn_step`) on the pool's states, in place."""
        pool, norm = batch.mamba_pool, self.out_norm
        qkvz, ba = self.in_projections(x)
        return self.decode_op()(
            qkvz, ba, pool.conv_state, pool.ssm_state,
            self.linear_layer_id, self.conv1d.weight.squeeze(1), self.A_log, self.dt_bias,
            norm.weight, batch.mamba_slots, self.num_k_heads, norm.eps,
        )  # fmt: skip

    def _verify(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Speculative verify: each request's few new tokens as consecutive decode steps on
        its running state, the state after each but the last kept in its step slots
        (`gdn_verify`), so the state after any accepted prefix is the one decoding those tokens
        leaves."""
        pool, norm = batch.mamba_pool, self.out_norm
        qkvz, ba = self.in_projections(x)
        return self.verify_op()(
            qkvz, ba, pool.conv_state, pool.ssm_state,
            self.linear_layer_id, self.conv1d.weight.squeeze(1), self.A_log, self.dt_bias,
            norm.weight, batch.mamba_slots, batch.extend_lens_cpu,
            batch.mamba_step_slots_cpu, self.num_k_heads, norm.eps,
        )  # fmt: skip

    def _extend(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T = x.shape[0]
        pool = batch.mamba_pool
        conv_state = pool.conv_state[self.linear_layer_id]  # [slots, conv_dim, Kc-1]
        ssm_state = pool.ssm_state[self.linear_layer_id]  # [slots, HV, dk, dv]
        weight = self.conv1d.weight.squeeze(1)  # [conv_dim, Kc]

        mixed_qkv, z, b, a = self.extend_projections(x)  # b [T, HV]

        if batch.tracks_states:
            track_conv_states(mixed_qkv, conv_state, batch)
        mixed_qkv = self.ops.causal_conv1d_fn(
            mixed_qkv.t(),
            weight,
            None,
            conv_state,
            batch.query_start_loc,
            batch.mamba_slots,
            batch.has_initial_state,
            "silu",
        ).t()  # [T, conv_dim]

        q, k, v = mixed_qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(1, T, self.num_k_heads, self.head_k_dim)  # [1, T, H, dk]
        k = k.reshape(1, T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(1, T, self.num_v_heads, self.head_v_dim)  # [1, T, HV, dv]
        g, beta = gates(
            b, a, self.A_log, self.dt_bias, self.beta_scale, self.gate_lower_bound
        )  # g [T, HV (, dk)]
        g, beta = g.unsqueeze(0), beta.unsqueeze(0)  # [1, T, HV (, dk)]

        track = {}
        if batch.tracks_states:
            track = dict(
                track_offsets=torch.tensor(batch.mamba_track_offsets_cpu, device=x.device),
                track_indices=batch.mamba_track_slots,
            )
        core, _ = self.ops.chunk_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            initial_state=ssm_state,
            initial_state_indices=batch.mamba_slots,
            cu_seqlens=batch.query_start_loc,
            use_qk_l2norm_in_kernel=True,
            **track,
        )  # [1, T, HV, dv]

        core = self.out_norm(
            core.reshape(T * self.num_v_heads, self.head_v_dim),
            z.reshape(T * self.num_v_heads, self.head_v_dim),
        )
        return core.reshape(T, self.value_dim)


class GatedDeltaNet(DeltaRuleMixer):
    """`config` (Qwen3-Next's or OLMo-Hybrid's: one with the `linear_*` fields) carries this
    rank's key/value heads (`ParallelContext.local_shapes`), and so do the conv channels and the
    pool's states; out_proj sums the ranks' heads. The config's `linear_norm_eps` is the output
    norm's epsilon and `linear_beta_scale` beta's factor (Qwen's 1, OLMo-Hybrid's 2)."""

    def __init__(
        self,
        config: HybridConfig,
        linear_layer_id: int,
        tp: ParallelContext | None = None,
        ops: KernelSet = REFERENCE,
    ) -> None:
        super().__init__()
        c, self.ops, self.tp = config, ops, tp or ParallelContext()
        self.grouped = getattr(c, "gdn_projections", None) == "grouped"  # Qwen3-Next's tensors
        self.linear_layer_id = linear_layer_id  # index among the linear-attention layers
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = (
            c.linear_key_dim,
            c.linear_value_dim,
            c.conv_dim,
        )
        # Rows are kept in contiguous [q | k | v | z] and [b | a] order (the loader regroups
        # Qwen3-Next's per-key-head rows and stacks Qwen3.5's split ones: `models.weight_map`).
        qkvz_rows = 2 * self.key_dim + 2 * self.value_dim
        self.in_proj_qkvz = Linear(c.hidden_size, qkvz_rows, bias=False, ops=ops)
        self.in_proj_ba = Linear(c.hidden_size, 2 * self.num_v_heads, bias=False, ops=ops)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, c.linear_conv_kernel_dim, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.beta_scale = c.linear_beta_scale
        self.norm = RMSNormGated(self.head_v_dim, c.linear_norm_eps, ops)
        self.out_proj = row_linear(
            self.value_dim, c.hidden_size, False, tp or ParallelContext(), ops
        )
        # conv window [conv_dim, Kc-1]; delta-rule state [HV, dk, dv] (K-major, as in fla)
        self.state_shape = MambaStateShape(
            self.conv_dim,
            c.linear_conv_kernel_dim - 1,
            (self.num_v_heads, self.head_k_dim, self.head_v_dim),
        )

    def tp_shards(self, config) -> dict[str, Shard | None]:
        """This rank's key heads and their value heads (its heads are an equal share): their
        rows of the [Q|K|V|Z] and [B|A] projections (Qwen3-Next's checkpoint groups these rows
        per key head: one block of groups) and of the [Q|K|V] conv channels, dt_bias / A_log of
        its value heads, out_proj columns; the per-head output norm whole."""
        H, HV = self.num_k_heads * self.tp.size, self.num_v_heads * self.tp.size
        dk, dv, kn, vn = self.head_k_dim, self.head_v_dim, self.num_k_heads, self.num_v_heads
        k0, v0, kd, vd = self.tp.rank * kn, self.tp.rank * vn, H * dk, HV * dv
        keys, values, heads = span(k0, kn, dk), span(v0, vn, dv), span(v0, vn)
        qkv = (keys, span(k0, kn, dk, kd), span(v0, vn, dv, 2 * kd))
        out: dict[str, Shard | None] = {"conv1d.weight": rows(*qkv, segments=(kd, kd, vd))}
        if self.grouped:
            ratio = HV // H
            out["in_proj_qkvz.weight"] = rows(span(k0, kn, 2 * dk + 2 * ratio * dv))
            out["in_proj_ba.weight"] = rows(span(k0, kn, 2 * ratio))
        else:
            z = span(v0, vn, dv, 2 * kd + vd)
            out["in_proj_qkvz.weight"] = rows(*qkv, z, segments=(kd, kd, vd, vd))
            out["in_proj_ba.weight"] = rows(heads, span(v0, vn, offset=HV), segments=(HV, HV))
        out |= {"dt_bias": rows(heads), "A_log": rows(heads), "norm.weight": None}
        return out | {"out_proj.weight": cols(values)}

    @property
    def out_norm(self) -> nn.Module:
        return self.norm

    @property
    def out_projection(self) -> nn.Module:
        return self.out_proj

    def in_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[qkvz | ba] of a few rows in one call (`linear_multi`)."""
        qkvz, ba = (self.in_proj_qkvz, self.in_proj_ba)
        return self.ops.linear_multi(x, [qkvz.weight, ba.weight], [qkvz.bias, ba.bias])

    def extend_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mixed_qkv, z = self.in_proj_qkvz(x).split([self.conv_dim, self.value_dim], dim=-1)
        b, a = self.in_proj_ba(x).split([self.num_v_heads, self.num_v_heads], dim=-1)
        return mixed_qkv, z, b, a

    def decode_op(self) -> Callable:
        """The kernel set's fused decode op; with a beta scale, which the fused ops do not take,
        the reference composition of the set's unfused ops."""
        if self.beta_scale == 1.0:
            return self.ops.gdn_decode
        return partial(
            gdn_step.gdn_decode,
            conv_update=self.ops.causal_conv1d_update,
            recurrent=self.ops.fused_recurrent_gated_delta_rule,
            norm_gated=self.ops.rms_norm_gated,
            beta_scale=self.beta_scale,
        )

    def verify_op(self) -> Callable:
        """The kernel set's fused verify op, or (beta scale) the reference over `decode_op`."""
        if self.beta_scale == 1.0:
            return self.ops.gdn_verify
        return partial(gdn_step.gdn_verify, decode=self.decode_op())


def track_conv_states(raw: torch.Tensor, conv_state: torch.Tensor, batch: ForwardBatch) -> None:
    """conv_state[track slot] = the Kc-1 raw (pre-conv) inputs just before each tracked offset
    of a prefill batch (`ForwardBatch.mamba_track_offsets_cpu`); raw is [T, conv_dim]. An
    offset shorter than the window (a round that starts just before a 64-token grid point)
    takes the window's older columns from the request's slot, which still holds the window
    before the round. Call it before the conv updates the slots. Every recurrent layer with a
    short conv snapshots its window this way."""
    width = conv_state.shape[-1]  # Kc-1
    rows = [i for i, off in enumerate(batch.mamba_track_offsets_cpu) if off]
    starts = batch.query_start_loc.tolist()
    offsets = torch.tensor([batch.mamba_track_offsets_cpu[i] for i in rows])
    rel = offsets.unsqueeze(1) - width + torch.arange(width).unsqueeze(0)  # [n, Kc-1]
    pos = torch.tensor([starts[i] for i in rows]).unsqueeze(1) + rel.clamp(min=0)
    picked = torch.tensor(rows, device=raw.device)
    new = raw[pos.to(raw.device)].to(conv_state.dtype)  # [n, Kc-1, conv_dim]
    old = conv_state[batch.mamba_slots[picked]].transpose(1, 2)  # the window before the round
    col = (rel + width).clamp(max=width - 1).to(raw.device)  # rel < 0: its column in `old`
    old = old.gather(1, col.unsqueeze(-1).expand(-1, -1, old.shape[-1]))
    window = torch.where((rel < 0).to(raw.device).unsqueeze(-1), old, new).transpose(1, 2)
    conv_state.index_copy_(0, batch.mamba_track_slots[picked], window)
