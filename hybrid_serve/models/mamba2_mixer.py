"""The Mamba2 mixer (Dao and Gu, 2024), the recurrent token mixer of NemotronH, Granite-4.0-H,
Bamba and Falcon-H1.

    z | xBC | dt = in_proj(x * m_in) * m_zxbcdt        widths I, I + 2GN, H   (I = H * P); the
                                                       muP multipliers are Falcon-H1's (else 1)
    x | B | C = silu(conv1d(xBC) + conv_bias)          x [H, P]; B, C [G, N]; head h reads group
                                                       h // (H/G)
    dt = clamp(softplus(dt + dt_bias), *time_step_limit);   A = -exp(A_log)
    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T,        y_t = S_t C_t + D x_t      (per head)
    out = out_proj(rms_norm_gate_first(y, z))          RMS over groups of I/G, gate first

Under tensor parallelism a rank holds H/N heads and their groups (all groups when G = 1,
replicated, as SGLang and vLLM do; a share when N divides G), its columns of out_proj (summed
over the ranks) and its channels of the norm, whose RMS spans every rank when G = 1
(`models.parallel_layers.ParallelRMSNormGateFirst`); its pool holds only its heads' states.

Both states live in the Mamba pool, addressed by `ForwardBatch.mamba_slots`: the conv window
[conv_dim, K-1] and S [H, P, N] (`state_shape`). Prefill runs the chunked SSD scan from whatever
the slot holds (zeros for a fresh request) and may leave snapshots at any tracked offset
(`mamba_track_slots`: the conv window is the K-1 raw inputs before the offset); decode steps the
state by one token; verify steps each request's tokens one at a time, keeping the states between.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_serve.kernels import KernelSet
from hybrid_serve.mem_cache.state_shape import MambaStateShape
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.gated_delta_net import track_conv_states
from hybrid_serve.models.layers import REFERENCE, Linear
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.parallel_layers import ParallelRMSNormGateFirst, row_linear
from hybrid_serve.models.shard_loader import Shard
from hybrid_serve.models.tp_shards import cols, rows, span


@dataclass(frozen=True)
class Mamba2Config:
    """One Mamba2 mixer's shapes and options, read from each family's config.json."""

    hidden_size: int
    num_heads: int  # H
    head_dim: int  # P
    n_groups: int  # G
    state_size: int  # N
    conv_kernel: int  # K
    chunk_size: int  # the SSD scan's chunk
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    conv_bias: bool = True
    proj_bias: bool = False  # in_proj and out_proj
    norm_eps: float = 1e-5
    gated_norm: bool = True  # False: y * silu(z), no norm (Falcon-H1's mamba_rms_norm=false)
    # Falcon-H1's muP: the input scaled by `in_multiplier`, the projection's z, x, B, C and dt
    # segments by `zxbcdt_multipliers` (its `ssm_in_multiplier`, `ssm_multipliers`)
    in_multiplier: float = 1.0
    zxbcdt_multipliers: tuple[float, float, float, float, float] = (1.0,) * 5

    def __post_init__(self) -> None:
        if self.num_heads % self.n_groups:
            raise ValueError(
                f"config.json: {self.num_heads} Mamba heads do not divide into "
                f"{self.n_groups} groups"
            )

    @property
    def inner_size(self) -> int:  # I = H * P
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:  # channels of the conv: [x | B | C]
        return self.inner_size + 2 * self.n_groups * self.state_size

    def local(self, tp: ParallelContext) -> Mamba2Config:
        """This rank's heads and groups: H/N heads; G/N groups, or all of them when G = 1."""
        heads = tp.split(self.num_heads, "Mamba heads")[1]
        if self.n_groups == 1 or not tp.enabled:
            return replace(self, num_heads=heads)
        return replace(self, num_heads=heads, n_groups=tp.split(self.n_groups, "Mamba groups")[1])

    def zxbcdt_scale(self) -> torch.Tensor | None:
        """The per-channel multiplier of in_proj's output [I + conv_dim + H] (fp32, on the
        CPU), or None when every segment's is 1."""
        if all(m == 1.0 for m in self.zxbcdt_multipliers):
            return None
        gn = self.n_groups * self.state_size
        widths = (self.inner_size, self.inner_size, gn, gn, self.num_heads)
        return torch.cat(
            [
                torch.full((w,), m, device="cpu")
                for w, m in zip(widths, self.zxbcdt_multipliers, strict=True)
            ]
        )


class RMSNormGateFirst(nn.Module):
    """The Mamba2 output norm: g = y * silu(z), then w * g / rms(g) over groups of
    `group_size` channels (mamba_ssm's `norm_before_gate=False`)."""

    def __init__(self, dim: int, group_size: int, eps: float, ops: KernelSet = REFERENCE):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps, self.ops = group_size, eps, ops

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm_gate_first(y, z, self.weight, self.eps, self.group_size)


class Mamba2Mixer(nn.Module):
    """Module names are the checkpoints' (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`,
    `norm`, `out_proj`). `mamba_layer_id` is the layer's index among the model's recurrent
    layers (its pool layer). `config` is the checkpoint's; `self.config` this rank's."""

    def __init__(
        self,
        config: Mamba2Config,
        mamba_layer_id: int,
        ops: KernelSet = REFERENCE,
        tp: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.tp, self.whole = tp or ParallelContext(), config
        c = self.config = config.local(self.tp)
        self.ops, self.mamba_layer_id = ops, mamba_layer_id
        H, inner, conv_dim = c.num_heads, c.inner_size, c.conv_dim
        self.in_proj = Linear(c.hidden_size, inner + conv_dim + H, bias=c.proj_bias, ops=ops)
        self.conv1d = nn.Conv1d(
            conv_dim, conv_dim, c.conv_kernel, groups=conv_dim, bias=c.conv_bias
        )
        self.dt_bias = nn.Parameter(torch.ones(H))
        self.A_log = nn.Parameter(torch.zeros(H))
        self.D = nn.Parameter(torch.ones(H))
        self.norm: nn.Module | None = None
        if c.gated_norm and self.tp.enabled and config.n_groups == 1:  # one group on all ranks
            self.norm = ParallelRMSNormGateFirst(inner, c.norm_eps, self.tp)
        elif c.gated_norm:
            self.norm = RMSNormGateFirst(inner, inner // c.n_groups, c.norm_eps, ops)
        # whether the decode ops apply the norm (else they return y * silu(z), normed after)
        self.norm_in_op = isinstance(self.norm, RMSNormGateFirst)
        self.out_proj = row_linear(inner, c.hidden_size, c.proj_bias, self.tp, ops)
        # A plain attribute built on the CPU (a model constructed on the meta device keeps it),
        # moved to the activations' device and dtype where used
        self.zxbcdt_scale = c.zxbcdt_scale()
        # conv window [conv_dim, K-1]; SSM state [H, P, N]
        self.state_shape = MambaStateShape(
            conv_dim, c.conv_kernel - 1, (H, c.head_dim, c.state_size)
        )

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.config.in_multiplier != 1.0:
            x = x * self.config.in_multiplier
        zxbcdt = self.in_proj(x)  # [T, I + conv_dim + H]
        if self.zxbcdt_scale is not None:
            self.zxbcdt_scale = self.zxbcdt_scale.to(zxbcdt)  # a no-op once moved
            zxbcdt = zxbcdt * self.zxbcdt_scale
        if batch.is_decode or batch.is_verify:
            step = self._decode if batch.is_decode else self._verify
            y = step(zxbcdt, batch)  # [T, I], normed unless the norm spans the ranks
            if self.norm is not None and not self.norm_in_op:
                y = self.norm.scale(y)
            return self.out_proj(y)
        return self.out_proj(self._extend(zxbcdt, batch))

    def tp_shards(self, config) -> dict[str, Shard | None]:
        """This rank's part of each parameter (`models.tp_shards`): its heads' rows of z, x and
        dt, its groups' (all when G = 1) of B and C."""
        w, hn, gn = self.whole, self.config.num_heads, self.config.n_groups
        h0 = self.tp.rank * hn
        g0 = 0 if w.n_groups == 1 else self.tp.rank * gn
        I, GN, P, N = w.inner_size, w.n_groups * w.state_size, w.head_dim, w.state_size
        # in_proj rows [z | x | B | C | dt]; conv channels [x | B | C]
        x, b, c = span(h0, hn, P), span(g0, gn, N, offset=I), span(g0, gn, N, offset=I + GN)
        shifted = tuple((start + I, end + I) for start, end in (x, b, c))
        proj = rows(span(h0, hn, P), *shifted, span(h0, hn, offset=2 * I + 2 * GN))
        heads, conv = rows(span(h0, hn)), rows(x, b, c)
        out = {"in_proj.weight": proj, "conv1d.weight": conv, "out_proj.weight": cols(x)}
        out |= {"dt_bias": heads, "A_log": heads, "D": heads}
        if self.norm is not None:
            out["norm.weight"] = rows(x)
        if w.proj_bias:  # out_proj's is added after the sum over the ranks: whole
            out |= {"in_proj.bias": proj, "out_proj.bias": None}
        if w.conv_bias:
            out["conv1d.bias"] = conv
        return out

    def _step_args(self, batch: ForwardBatch) -> tuple:
        """The decode and verify ops' leading arguments after the projection."""
        pool = batch.mamba_pool
        norm = self.norm.weight if self.norm_in_op else None
        return (
            pool.conv_state, pool.ssm_state, self.mamba_layer_id, self.conv1d.weight.squeeze(1),
            self.conv1d.bias, self.A_log, self.dt_bias, self.D, norm,
        )  # fmt: skip

    def _decode(self, zxbcdt: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """One token per request: conv update, state update and norm in one op
        (`mamba2_decode`, reference `kernels.mamba2_step`), on the pool's states in place."""
        c = self.config
        return self.ops.mamba2_decode(
            zxbcdt, *self._step_args(batch), batch.mamba_slots, c.n_groups, c.norm_eps,
            c.time_step_limit,
        )  # fmt: skip

    def _verify(self, zxbcdt: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Speculative verify: each request's new tokens as consecutive decode steps, the state
        after each but the last kept in its step slots (`mamba2_verify`)."""
        c = self.config
        return self.ops.mamba2_verify(
            zxbcdt, *self._step_args(batch), batch.mamba_slots, batch.extend_lens_cpu,
            batch.mamba_step_slots_cpu, c.n_groups, c.norm_eps, c.time_step_limit,
        )  # fmt: skip

    def _extend(self, zxbcdt: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        c = self.config
        T, H, P, G, N = zxbcdt.shape[0], c.num_heads, c.head_dim, c.n_groups, c.state_size
        pool = batch.mamba_pool
        conv_state = pool.conv_state[self.mamba_layer_id]  # [slots, conv_dim, K-1]
        ssm_state = pool.ssm_state[self.mamba_layer_id]  # [slots, H, P, N]
        z, xbc, dt = zxbcdt.split([c.inner_size, c.conv_dim, H], dim=-1)

        if batch.tracks_states:
            track_conv_states(xbc, conv_state, batch)
        xbc = self.ops.causal_conv1d_fn(
            xbc.t(),
            self.conv1d.weight.squeeze(1),
            self.conv1d.bias,
            conv_state,
            batch.query_start_loc,
            batch.mamba_slots,
            batch.has_initial_state,
            "silu",
        ).t()  # [T, conv_dim]
        x, B, C = xbc.split([c.inner_size, G * N, G * N], dim=-1)

        track = {}
        if batch.tracks_states:
            track = dict(
                track_offsets=batch.mamba_track_offsets_cpu, track_indices=batch.mamba_track_slots
            )
        y = self.ops.mamba_chunk_scan_combined(
            x.reshape(T, H, P),
            dt,
            -self.A_log.float().exp(),
            B.reshape(T, G, N),
            C.reshape(T, G, N),
            c.chunk_size,
            self.D,
            self.dt_bias,
            True,
            c.time_step_limit,
            cu_seqlens=batch.query_start_loc,
            ssm_states=ssm_state,
            state_indices=batch.mamba_slots,
            has_initial_state=batch.has_initial_state,
            **track,
        ).reshape(T, c.inner_size)  # fp32
        if self.norm is None:
            return (y * F.silu(z.float())).to(zxbcdt.dtype)
        return self.norm(y, z).to(zxbcdt.dtype)
