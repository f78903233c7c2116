"""File backend of the storage tier: KV blocks and Mamba states on disk, keyed by token hashes.

Keys. A sequence is cut into blocks of ``block_size`` tokens; block ``i`` has the key
``h_i = sha256(h_{i-1} || tokens of block i)`` with ``h_{-1} = identity``, so a key names the
whole prefix up to the end of its block, and ``identity`` (see `model_identity`: the model's
config and a sample of its weights, the dtypes and the block size) makes another checkpoint's
keys disjoint. The Mamba state after a block is stored under that block's key (kind ``state``).

Files. ``<root>/<key[:2]>/<key>.<kind>``: one header line (JSON: magic, version, identity, key,
kind, payload length, payload sha256) and the payload (safetensors bytes). A write goes to a
temporary file in the same folder, is flushed and fsynced, then renamed over the final name, so a
reader sees a whole file or none. A read checks every header field and the checksum: a missing,
torn, corrupted or foreign file is a miss (`get` returns None), never wrong data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

logger = logging.getLogger(__name__)

MAGIC = "hybrid-serve-kv"
VERSION = 1
KINDS = ("kv", "state")
WEIGHT_SAMPLE = 256  # elements of each parameter (first and last) hashed into the identity


def model_identity(model: torch.nn.Module, extra: str = "") -> str:
    """Hex digest naming the model that produced cached tensors: its config, every parameter's
    name, shape, dtype and first / last `WEIGHT_SAMPLE` elements, and ``extra`` (pool dtypes,
    block size). Two checkpoints that differ in any sampled weight get different identities."""
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    h.update(repr(sorted(vars(config).items()) if config is not None else "").encode())
    h.update(extra.encode())
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        sample = torch.cat([flat[:WEIGHT_SAMPLE], flat[-WEIGHT_SAMPLE:]]).float().cpu()
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()


class FileStorage:
    """Content store under ``root`` for one model ``identity``; see the module docstring."""

    def __init__(self, root: str | Path, identity: str, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.identity = identity
        self.block_size = block_size
        self.stats: Counter[str] = Counter()  # reads, misses, corrupt, writes

    def block_keys(self, tokens: list[int]) -> list[str]:
        """Keys of the whole blocks of ``tokens`` (a trailing partial block has none)."""
        keys, prev = [], self.identity
        bs = self.block_size
        for start in range(0, len(tokens) - bs + 1, bs):
            h = hashlib.sha256(prev.encode())
            h.update(torch.tensor(tokens[start : start + bs], dtype=torch.int64).numpy().tobytes())
            prev = h.hexdigest()
            keys.append(prev)
        return keys

    def _header(self, key: str, kind: str, payload: bytes) -> dict[str, object]:
        return {
            "magic": MAGIC, "version": VERSION, "identity": self.identity, "key": key,
            "kind": kind, "length": len(payload), "sha256": hashlib.sha256(payload).hexdigest(),
        }  # fmt: skip

    def path(self, key: str, kind: str) -> Path:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}")
        return self.root / key[:2] / f"{key}.{kind}"

    def exists(self, key: str, kind: str) -> bool:
        return self.path(key, kind).is_file()

    def put(self, key: str, kind: str, tensors: dict[str, torch.Tensor]) -> bool:
        """Write ``tensors`` under (key, kind) atomically; False (logged) on an OS error."""
        payload = st_save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
        header = self._header(key, kind, payload)
        final = self.path(key, kind)
        tmp = None
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{key[:16]}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps(header).encode() + b"\n")
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except OSError:
            logger.exception("storage: writing %s failed", final)
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            return False
        self.stats["writes"] += 1
        return True

    def get(self, key: str, kind: str) -> dict[str, torch.Tensor] | None:
        """The tensors stored under (key, kind), or None if missing, torn, corrupt or foreign."""
        self.stats["reads"] += 1
        try:
            data = self.path(key, kind).read_bytes()
        except OSError:
            self.stats["misses"] += 1
            return None
        line, _, payload = data.partition(b"\n")
        try:
            ok = json.loads(line) == self._header(key, kind, payload)
            tensors = st_load(payload) if ok else None
        except (ValueError, KeyError, TypeError, RuntimeError):
            tensors = None
        if tensors is None:
            self.stats["corrupt"] += 1
            logger.warning("storage: %s.%s is torn, corrupt or foreign: ignored", key[:16], kind)
        return tensors
