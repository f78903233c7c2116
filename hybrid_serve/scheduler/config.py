"""How the scheduler and the model runner run: frozen dataclasses with SGLang's option names,
each field with its `--help` text (`opt`; `server/args.py` makes the command line from them).

Torch-free, so that the API process can parse and validate them before it spawns the scheduler
process (the only one that imports torch).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from hybrid_serve.kernels.weight_formats import QUANTIZATION_METHODS, check_quantization

STRATEGIES = ("no_buffer", "extra_buffer", "extra_buffer_lazy")
# Mamba slots per running request (running + track slots + a share for tree states), as SGLang's
# ratios without the overlap scheduler; sizes the pool when --mamba-cache-size is not given.
MAMBA_SLOTS_PER_REQUEST = {"no_buffer": 3, "extra_buffer": 5, "extra_buffer_lazy": 4}
POLICIES = ("fcfs", "lpm")
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
# hybrid_serve.models.loader.DTYPES's names, spelled out so that this module imports no torch
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# hybrid_serve.models.loader.LOAD_FORMATS, likewise (dummy: random weights from config.json alone)
LOAD_FORMATS = ("auto", "safetensors", "dummy")
SPECULATIVE_ALGORITHMS = ("NEXTN",)  # drafts from the checkpoint's own MTP head (`mtp_hidden`)


DEFAULT_SPEC_STEPS = 3


def opt(default: Any, help: str) -> Any:
    """A dataclass field with its command-line help (`server/args.py` makes the flags)."""
    return field(default=default, metadata={"help": help})


def _one_of(cfg: object, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        flag = "--" + name.replace("_", "-")
        raise ValueError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_prefill_tokens: int = opt(16384, "new tokens in one prefill batch")
    chunked_prefill_size: int = opt(
        2048, "max new tokens of one request per prefill round (<= 0: no chunking)"
    )
    schedule_policy: str = opt("fcfs", "waiting queue order: fcfs or lpm (longest prefix match)")
    schedule_conservativeness: float = opt(
        1.0,
        "scales the decode room reserved for running requests when admitting new ones (larger: "
        "fewer retractions, smaller batches)",
    )
    disable_radix_cache: bool = opt(False, "turn prefix caching off")
    mamba_scheduler_strategy: str = opt(
        "no_buffer", "when Mamba states are snapshotted for the radix cache"
    )
    mamba_track_interval: int = opt(
        256, "decode tokens between Mamba state snapshots (extra_buffer*)"
    )
    cuda_graph_bs: tuple[int, ...] = opt(
        (1, 2, 4, 8, 16, 24, 32, 48, 64), "decode batch sizes (batches are padded up to one)"
    )
    cuda_graph_max_bs: int = opt(
        64, "largest padded decode size (CUDA graphs captured up to it; also added to the list)"
    )
    disable_cuda_graph: bool = opt(
        False, "run decode batches at their own size (on CPU: no decode plan)"
    )
    enable_hierarchical_cache: bool = opt(
        False,
        "keep radix-cache KV and Mamba states in host memory too (evicted device nodes are "
        "demoted there and loaded back on a hit)",
    )
    hicache_ratio: float = opt(2.0, "host pools as a multiple of the device KV and Mamba pools")
    hicache_size: float = opt(0.0, "host pools in GB (> 0 overrides --hicache-ratio)")
    hicache_write_policy: str = opt(
        "write_through",
        "when nodes are copied to host: write_through (on insert), write_through_selective (on "
        "the second hit) or write_back (on device eviction)",
    )
    hicache_storage_backend: str = opt("", "storage tier under the host tier: file (default: none)")
    hicache_storage_dir: str = opt("", "folder of the file storage tier (kept across restarts)")
    hicache_prefetch_threshold: int = opt(
        256, "storage hits shorter than this many tokens are not prefetched"
    )
    # SGLang defaults to best_effort; a request arriving at an idle server then reads nothing.
    hicache_storage_prefetch_policy: str = opt(
        "timeout",
        "how long an arriving request waits for its storage prefetch: best_effort (admitted "
        "with what has arrived), wait_complete (until every block is read), timeout (until "
        "read or base + per_ki_token * tokens / 1024 seconds have passed)",
    )
    hicache_prefetch_timeout_base: float = opt(
        1.0, "timeout policy: seconds waited for any prefetch"
    )
    hicache_prefetch_timeout_per_ki_token: float = opt(
        0.25, "timeout policy: extra seconds per 1024 tokens"
    )
    max_sessions: int = opt(
        4096, "most sessions open at once (0: no cap); /open_session beyond it is a 429"
    )
    session_timeout: float = opt(
        3600.0,
        "seconds a session may go without a new turn before it is closed and its state freed "
        "(0: never; /open_session's timeout overrides it)",
    )

    def __post_init__(self) -> None:
        _one_of(self, "schedule_policy", POLICIES)
        _one_of(self, "mamba_scheduler_strategy", STRATEGIES)
        _one_of(self, "hicache_storage_prefetch_policy", PREFETCH_POLICIES)
        _one_of(self, "hicache_write_policy", HICACHE_WRITE_POLICIES)
        if self.mamba_scheduler_strategy != "no_buffer" and self.disable_radix_cache:
            raise ValueError(
                f"--mamba-scheduler-strategy {self.mamba_scheduler_strategy} needs the radix "
                "cache (drop --disable-radix-cache)"
            )
        if self.mamba_track_interval < 1:
            raise ValueError("--mamba-track-interval must be >= 1")
        if self.cuda_graph_max_bs < 1 or any(bs < 1 for bs in self.cuda_graph_bs):
            raise ValueError("--cuda-graph-bs sizes and --cuda-graph-max-bs must be >= 1")
        if not self.schedule_conservativeness > 0:
            raise ValueError("--schedule-conservativeness must be > 0")
        if self.max_sessions < 0 or self.session_timeout < 0:
            raise ValueError("--max-sessions and --session-timeout must be >= 0")
        if self.max_prefill_tokens < 1:
            raise ValueError("--max-prefill-tokens must be >= 1")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ValueError("--enable-hierarchical-cache needs the radix cache")
        if self.hicache_ratio <= 0 or self.hicache_size < 0:
            raise ValueError("--hicache-ratio must be > 0 and --hicache-size >= 0")
        if self.hicache_storage_backend not in ("", "file"):
            raise ValueError("--hicache-storage-backend must be 'file' (or empty: none)")
        if self.hicache_storage_backend and not (
            self.enable_hierarchical_cache and self.hicache_storage_dir
        ):
            raise ValueError(
                "--hicache-storage-backend needs --enable-hierarchical-cache and "
                "--hicache-storage-dir"
            )
        if self.hicache_prefetch_threshold < 0:
            raise ValueError("--hicache-prefetch-threshold must be >= 0")
        if self.hicache_prefetch_timeout_base < 0 or self.hicache_prefetch_timeout_per_ki_token < 0:
            raise ValueError("--hicache-prefetch-timeout-base / -per-ki-token must be >= 0")

    def mamba_slots_for(self, max_running_requests: int) -> int:
        """Default Mamba pool size for this strategy."""
        if self.disable_radix_cache:
            return max_running_requests
        return MAMBA_SLOTS_PER_REQUEST[self.mamba_scheduler_strategy] * max_running_requests

    def mamba_slots_held(self) -> int:
        """Mamba slots an admitted request holds until it finishes: its running slot and its
        track slots (two for extra_buffer, one for extra_buffer_lazy, none for no_buffer or
        without the radix cache); admission waits until all of them are free."""
        if self.disable_radix_cache or self.mamba_scheduler_strategy == "no_buffer":
            return 1
        return 2 if self.mamba_scheduler_strategy == "extra_buffer_lazy" else 3

    def decode_graph_sizes(self, max_running_requests: int) -> list[int]:
        """Padded decode sizes: cuda_graph_bs up to min(cuda_graph_max_bs, max running), plus
        that bound itself; none with --disable-cuda-graph."""
        if self.disable_cuda_graph:
            return []
        max_bs = min(self.cuda_graph_max_bs, max_running_requests)
        return sorted({bs for bs in self.cuda_graph_bs if bs <= max_bs} | {max_bs})


@dataclass(frozen=True)
class RunnerConfig:
    max_running_requests: int = opt(64, "requests decoded together (rows of req_to_token)")
    max_total_tokens: int = opt(65536, "KV cache capacity in tokens")
    max_context_len: int = opt(4096, "longest sequence (prompt + output) in tokens")
    page_size: int = opt(1, "tokens per KV page")
    mamba_cache_size: int = opt(
        0, "Mamba state slots (0: sized from the strategy and max running requests)"
    )
    dtype: str = opt("auto", "weights and activations dtype (auto: the checkpoint's)")
    device: str = opt("cpu", "cpu or cuda")
    load_format: str = opt(
        "auto",
        "auto (the checkpoint's safetensors) or dummy: random weights from config.json alone, "
        "no weight file read (for real-size measurements; hybrid_serve/models/dummy_weights.py)",
    )
    mamba_ssm_dtype: str | None = opt(
        None,
        "dtype of the Mamba pool's temporal (SSM / recurrent) states: float32, bfloat16 or "
        "float16 (default: the checkpoint's mamba_ssm_dtype, else float32); the conv windows "
        "keep the model's dtype and every update is computed in fp32",
    )
    quantization: str | None = opt(
        None,
        "weight-only matrices quantized at load from any float or FP8 checkpoint (CPU; "
        f"kernels/quant.py): {' or '.join(QUANTIZATION_METHODS)} (int8: one scale per output "
        "row; int4: a bf16 scale per 32)",
    )
    # speculative decoding: SGLang's flags (hybrid_serve/scheduler/spec/)
    speculative_algorithm: str | None = opt(
        None,
        "NEXTN: speculative decoding with the checkpoint's MTP head (greedy requests draft; "
        "the others decode as usual)",
    )
    speculative_num_steps: int = opt(0, f"draft tokens per step (0: {DEFAULT_SPEC_STEPS})")
    speculative_eagle_topk: int = opt(0, "drafts per step; only 1 (a chain)")
    speculative_num_draft_tokens: int = opt(
        0, "tokens verified per step: --speculative-num-steps + 1"
    )
    speculative_draft_model_quantization: str | None = opt(
        None,
        f"{' or '.join(QUANTIZATION_METHODS)} (CPU): the MTP head's matrices and its own copy of "
        "the LM head in that "
        "format (drafts only: outputs are unchanged)",
    )
    speculative_disable_by_batch_size: int = opt(
        2,
        "decode steps with more running requests than this decode plainly (vLLM's "
        "disable_by_batch_size; 0: no limit; 2: where it stops paying on CPU)",
    )
    # memory budgets that size the KV pool instead of max_total_tokens (scheduler/pool_sizing.py)
    mem_fraction_static: float = opt(
        0.0,
        "CUDA: fraction of GPU memory for weights + KV/Mamba pools; sizes the KV pool (0: "
        "--max-total-tokens decides)",
    )
    pool_memory_gb: float = opt(
        0.0,
        "GB for the KV and Mamba pools on any device; sizes the KV pool (0: --max-total-tokens "
        "decides)",
    )
    num_threads: int = opt(
        0,
        "torch CPU threads (0: OMP_NUM_THREADS if set, else the CPUs this process may use; the "
        "Engine keeps torch's setting)",
    )
    # tensor parallelism: SGLang's flags (hybrid_serve/scheduler/tp_group.py)
    tp_size: int = opt(1, "tensor parallel ranks")
    nnodes: int = opt(1, "hosts the ranks run on")
    node_rank: int = opt(0, "this host's index")
    dist_init_addr: str = opt(
        "", "rank 0's host:port for the rendezvous (default on one host: a free loopback port)"
    )

    def __post_init__(self) -> None:
        if self.num_threads < 0:
            raise ValueError(f"--num-threads must be >= 0, got {self.num_threads}")
        if not 0.0 <= self.mem_fraction_static < 1.0:
            raise ValueError(
                f"--mem-fraction-static must be in [0, 1), got {self.mem_fraction_static}"
            )
        if self.pool_memory_gb < 0:
            raise ValueError(f"--pool-memory-gb must be >= 0, got {self.pool_memory_gb}")
        for name in ("max_running_requests", "max_total_tokens", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if self.max_context_len < 2:
            raise ValueError(f"--context-length must be >= 2, got {self.max_context_len}")
        if self.mamba_cache_size < 0:
            raise ValueError(f"--mamba-cache-size must be >= 0, got {self.mamba_cache_size}")
        _one_of(self, "dtype", ("auto", *DTYPE_NAMES))
        if self.mamba_ssm_dtype is not None:
            _one_of(self, "mamba_ssm_dtype", DTYPE_NAMES)
        _one_of(self, "load_format", LOAD_FORMATS)
        if self.tp_size < 1 or self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValueError(
                f"--tp-size ({self.tp_size}) must be a positive multiple of --nnodes "
                f"({self.nnodes})"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr (host:port of rank 0)")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"--device must be cpu, cuda or cuda:N, got {self.device!r}")
        self._check_speculative()
        check_quantization(self.quantization, self.device)

    def _check_speculative(self) -> None:
        if self.speculative_disable_by_batch_size < 0:
            raise ValueError("--speculative-disable-by-batch-size must be >= 0")
        if self.speculative_algorithm is None:
            if (
                self.speculative_num_steps
                or self.speculative_num_draft_tokens
                or self.speculative_draft_model_quantization
            ):
                raise ValueError("--speculative-num-steps needs --speculative-algorithm NEXTN")
            return
        _one_of(self, "speculative_algorithm", SPECULATIVE_ALGORITHMS)
        steps = self.speculative_num_steps
        if steps < 0 or self.speculative_num_draft_tokens < 0:
            raise ValueError("--speculative-num-steps / -num-draft-tokens must be >= 1")
        if self.speculative_eagle_topk not in (0, 1):
            raise ValueError("--speculative-eagle-topk: only 1 (chain drafts) is supported")
        if self.speculative_num_draft_tokens not in (0, (steps or DEFAULT_SPEC_STEPS) + 1):
            raise ValueError(
                "--speculative-num-draft-tokens must be --speculative-num-steps + 1 (chain "
                f"drafts), got {self.speculative_num_draft_tokens}"
            )
        if self.page_size != 1:
            raise ValueError("--speculative-algorithm needs --page-size 1")
        draft = self.speculative_draft_model_quantization
        if draft is not None:
            check_quantization(draft, self.device, "--speculative-draft-model-quantization")
            if self.quantization not in (None, draft):
                raise ValueError(
                    "--speculative-draft-model-quantization with --quantization must be the "
                    "same format"
                )

    @property
    def spec_steps(self) -> int:
        """Draft tokens per request and step (0: no speculative decoding)."""
        if self.speculative_algorithm is None:
            return 0
        return self.speculative_num_steps or DEFAULT_SPEC_STEPS

    @property
    def mamba_slots(self) -> int:
        return self.mamba_cache_size or 3 * self.max_running_requests
