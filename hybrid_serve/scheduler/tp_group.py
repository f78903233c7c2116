"""Starting and stopping the ranks of a tensor-parallel group.

`--tp-size N` over `--nnodes M` hosts: each host runs N/M consecutive ranks, host `--node-rank k`
ranks [k*N/M, (k+1)*N/M). On host 0 the process that serves (the scheduler process, or the
caller of `Engine`) is rank 0 and spawns the host's other ranks (`TPGroup.start`); the other
hosts run `run_followers` with the same command and their node rank. Every rank joins the
default process group at `--dist-init-addr` (host:port of rank 0; on one host a free loopback
port when not given), builds its shard of the model and its own pools (sized per rank), and
runs the same loop on rank 0's inputs (`hybrid_serve.scheduler.lockstep`).

A rank that dies closes its sockets, so the next collective of every other rank raises at once
(gloo: "Connection closed by peer"): rank 0 then stops the group with a message naming the dead
rank and its exit code (`TPGroup.failure`), and a follower whose rank 0 is gone exits. A rank
that hangs without dying is caught by the collectives' timeout.
"""

from __future__ import annotations

import logging
import pickle
import signal
import subprocess
import sys
from dataclasses import replace

import torch.distributed as dist

from hybrid_serve.models.parallel import ParallelContext, free_port, init_process_group
from hybrid_serve.scheduler.config import RunnerConfig, SchedulerConfig
from hybrid_serve.scheduler.cpu_env import configure_threads, default_num_threads, die_with_parent

logger = logging.getLogger(__name__)

JOIN_S = 10.0


def local_ranks(cfg: RunnerConfig) -> range:
    per_node = cfg.tp_size // cfg.nnodes
    return range(cfg.node_rank * per_node, (cfg.node_rank + 1) * per_node)


def rank_device(cfg: RunnerConfig, rank: int) -> str:
    """Rank `rank`'s device: on CUDA this host's ranks take consecutive GPUs from `--device`
    (rank 0 of host k on its first one); on CPU they share the CPU."""
    if not cfg.device.startswith("cuda"):
        return cfg.device
    base = int(cfg.device.partition(":")[2] or 0)
    return f"cuda:{base + rank - local_ranks(cfg).start}"


def rank_threads(cfg: RunnerConfig) -> int:
    """Torch threads of each rank: --num-threads, or this host's default shared by its ranks."""
    return cfg.num_threads or max(1, default_num_threads() // len(local_ranks(cfg)))


# the follower's command: its arguments arrive pickled on stdin (with rank 0's sys.path)
FOLLOWER_CMD = (
    "import pickle, sys; a = pickle.load(sys.stdin.buffer); sys.path[:0] = a.pop('path'); "
    "from hybrid_serve.scheduler.tp_group import follower_main; follower_main(**a)"
)


def follower_main(
    rank: int,
    model_path: str,
    runner_cfg: RunnerConfig,
    sched_cfg: SchedulerConfig,
    log_level: str,
) -> None:
    """Entry point of a spawned follower rank."""
    from hybrid_serve.scheduler.build import build_scheduler
    from hybrid_serve.scheduler.lockstep import NullIO, follow
    from hybrid_serve.scheduler.loop import SchedulerLoop

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level.upper(), format=f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s"
    )
    configure_threads(rank_threads(runner_cfg), pick_default=False)
    runner_cfg = replace(runner_cfg, device=rank_device(runner_cfg, rank))
    tp = init_process_group(rank, runner_cfg.tp_size, runner_cfg.dist_init_addr, runner_cfg.device)
    try:
        follow(SchedulerLoop(build_scheduler(model_path, runner_cfg, sched_cfg, tp), NullIO()), tp)
    except Exception as e:
        logger.error("tensor-parallel rank %d stops: %s: %s", rank, type(e).__name__, e)
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()


def _spawn(rank: int, **args) -> subprocess.Popen:
    """A fresh interpreter running `follower_main` (a plain child process: the scheduler
    process is a daemonic multiprocessing child, which may not have multiprocessing children)."""
    proc = subprocess.Popen([sys.executable, "-c", FOLLOWER_CMD], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps({"path": sys.path, "rank": rank, **args}))
    proc.stdin.close()
    return proc


class TPGroup:
    """This host's follower processes, and rank 0's place in the group when on host 0."""

    def __init__(self, procs: dict[int, subprocess.Popen], tp: ParallelContext | None) -> None:
        self.procs, self.tp = procs, tp

    @classmethod
    def start(
        cls,
        model_path: str,
        runner_cfg: RunnerConfig,
        sched_cfg: SchedulerConfig,
        log_level: str = "info",
    ) -> tuple[TPGroup, RunnerConfig]:
        """Spawn this host's followers; on host 0 also join as rank 0. Returns the group and
        the config with the rendezvous address filled in."""
        if not runner_cfg.dist_init_addr:
            runner_cfg = replace(runner_cfg, dist_init_addr=f"127.0.0.1:{free_port()}")
        args = dict(model_path=model_path, runner_cfg=runner_cfg, sched_cfg=sched_cfg)
        ranks, size, addr = local_ranks(runner_cfg), runner_cfg.tp_size, runner_cfg.dist_init_addr
        group = cls({r: _spawn(r, **args, log_level=log_level) for r in ranks if r != 0}, None)
        if runner_cfg.node_rank == 0:
            try:
                group.tp = init_process_group(0, size, addr, runner_cfg.device)
            except Exception:
                group.stop()
                raise
        logger.info("tensor parallel: %d ranks (%s), this host runs %s", size, addr, list(ranks))
        return group, runner_cfg

    def failure(self) -> str | None:
        """A message naming a follower that has exited, or None while all run."""
        for rank, proc in self.procs.items():
            if proc.poll() is not None:
                return f"tensor-parallel rank {rank} exited (code {proc.returncode})"
        return None

    def wait(self) -> int:
        """Block until this host's followers exit (hosts other than 0); 1 if any failed."""
        codes = [proc.wait() for proc in self.procs.values()]
        return 1 if any(codes) else 0

    def stop(self) -> None:
        """Join the followers (they leave their loops on rank 0's stop), killing any that
        hang, and leave the process group."""
        for rank, proc in self.procs.items():
            try:
                proc.wait(JOIN_S)
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel rank %d did not exit; killing it", rank)
                proc.kill()
                proc.wait(JOIN_S)
        if self.tp is not None and dist.is_initialized():
            dist.destroy_process_group()
            self.tp = None


def run_followers(
    model_path: str, runner_cfg: RunnerConfig, sched_cfg: SchedulerConfig, log_level: str
) -> int:
    """A host other than 0: run its ranks until they exit; the exit status."""
    if not runner_cfg.dist_init_addr:
        raise ValueError("--node-rank > 0 needs --dist-init-addr (host:port of rank 0)")
    group, _ = TPGroup.start(model_path, runner_cfg, sched_cfg, log_level)
    return group.wait()
