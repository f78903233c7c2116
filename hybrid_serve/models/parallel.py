"""Tensor-parallel context: which rank of how many this process is, and the collectives the
sharded layers need, on `torch.distributed` (gloo on CPU, NCCL on CUDA).

`ParallelContext()` (the default, size 1) is what every model and runner gets without tensor
parallelism: the collectives are identity functions and `local_shapes` returns the config
unchanged, so tp_size=1 builds exactly today's modules. With size N the caller has initialised
the default process group (`init_process_group` below) and passes `ParallelContext(rank, N)`.

Head and width splits (`local_shapes`), for rank r of N:

    attention   H/N query heads; KV heads KV/N, or (KV < N) one replicated KV head, number
                r*KV//N, which serves exactly the query heads of rank r
    GDN         Hk/N key heads and their Hv/N value heads (grouped as in the checkpoint)
    MLP / MoE   intermediate sizes / N (the routed experts and the shared expert alike)
    vocab       ceil(V/N) rows of the embedding and the LM head, the last rank padded
"""

from __future__ import annotations

import datetime
import pickle
import socket
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from hybrid_serve.models.base_config import HybridConfig


@dataclass(frozen=True)
class ParallelContext:
    """Rank `rank` of a tensor-parallel group of `size` (the default process group)."""

    rank: int = 0
    size: int = 1
    # the group host-side objects travel in: gloo, also when the tensors use NCCL
    cpu_group: object = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad tensor-parallel rank {self.rank} of {self.size}")

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    # ---- splits --------------------------------------------------------------------------
    def split(self, n: int, what: str) -> tuple[int, int]:
        """(start, count) of this rank's equal share of `n` items; `n % size` must be 0."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by --tp-size {self.size}")
        count = n // self.size
        return self.rank * count, count

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, count) this rank holds: a share, or one replicated head when there
        are fewer KV heads than ranks."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "num_key_value_heads")
        if self.size % num_kv_heads:
            raise ValueError(
                f"--tp-size {self.size} must be a multiple of num_key_value_heads {num_kv_heads}"
            )
        return self.rank * num_kv_heads // self.size, 1

    def vocab_range(self, vocab_size: int) -> tuple[int, int, int]:
        """(start, rows holding real tokens, rows allocated) of this rank's vocabulary shard."""
        per = -(-vocab_size // self.size)
        start = min(self.rank * per, vocab_size)
        return start, min(per, vocab_size - start), per

    def local_shapes(self, c: HybridConfig) -> HybridConfig:
        """The config with this rank's head counts and widths (vocab unchanged: the vocab-parallel
        layers split it themselves). The identity at size 1. Any config with attention and Gated
        DeltaNet heads will do (OLMo-Hybrid's too, which has no expert widths)."""
        if not self.enabled:
            return c
        self.split(c.num_attention_heads, "num_attention_heads")
        self.split(c.linear_num_key_heads, "linear_num_key_heads")
        shapes = dict(
            num_attention_heads=c.num_attention_heads // self.size,
            num_key_value_heads=self.kv_heads(c.num_key_value_heads)[1],
            linear_num_key_heads=c.linear_num_key_heads // self.size,
            linear_num_value_heads=c.linear_num_value_heads // self.size,
        )
        for name in (
            "intermediate_size",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
        ):
            width = getattr(c, name, None)
            if width is not None:
                shapes[name] = self.split(width, name)[1] if width else 0
        return replace(c, **shapes)

    # ---- collectives ---------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks (in place when x may be written)."""
        if not self.enabled:
            return x
        x = x.contiguous()
        dist.all_reduce(x)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum of `x` over the ranks."""
        if not self.enabled:
            return x
        x = x.contiguous()
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` concatenated along the last dimension, in rank order."""
        if not self.enabled:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's `obj` on every rank (pickled; one size message and one payload)."""
        if not self.enabled:
            return obj
        if self.is_first:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
            dist.broadcast(size, 0, group=self.cpu_group)
            dist.broadcast(data, 0, group=self.cpu_group)
            return obj
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self.cpu_group)
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(data, 0, group=self.cpu_group)
        return pickle.loads(data.numpy().tobytes())

    def all_gather_object(self, obj: object) -> list:
        """Every rank's `obj`, in rank order."""
        if not self.enabled:
            return [obj]
        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (for the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(
    rank: int, size: int, init_addr: str, device: str = "cpu", timeout_s: float = 600.0
) -> ParallelContext:
    """Join the default process group at `init_addr` (host:port): gloo on CPU, NCCL on CUDA.
    A collective that waits longer than `timeout_s` raises instead of hanging."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{init_addr}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else None
    return ParallelContext(rank, size, cpu_group)
