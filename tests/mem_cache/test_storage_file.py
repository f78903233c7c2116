"""File storage backend: hash-chain keys, atomic checksummed files, bad files are misses."""

from __future__ import annotations

import torch

from hybrid_serve.mem_cache.storage_file import FileStorage, model_identity


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"k": torch.randn(2, 4, 3, generator=g), "v": torch.randn(2, 4, 3, generator=g)}


def test_block_keys_chain_prefixes_and_depend_on_identity(tmp_path):
    s = FileStorage(tmp_path, "model-a", block_size=4)
    keys = s.block_keys(list(range(10)))
    assert len(keys) == 2  # the partial third block has no key
    assert s.block_keys(list(range(8)) + [99]) == keys  # same prefix, same keys
    assert s.block_keys([0, 1, 2, 3, 9, 9, 9, 9])[0] == keys[0]
    assert s.block_keys([0, 1, 2, 3, 9, 9, 9, 9])[1] != keys[1]
    assert s.block_keys([4, 5, 6, 7])[0] != keys[1]  # a key names the whole prefix
    assert FileStorage(tmp_path, "model-b", block_size=4).block_keys(list(range(8)))[0] != keys[0]


def test_round_trip_and_restart(tmp_path):
    s = FileStorage(tmp_path, "m", block_size=4)
    key = s.block_keys([1, 2, 3, 4])[0]
    assert s.get(key, "kv") is None and not s.exists(key, "kv")
    t = tensors()
    assert s.put(key, "kv", t)
    again = FileStorage(tmp_path, "m", block_size=4)  # a new process on the same folder
    got = again.get(key, "kv")
    assert got is not None and all(torch.equal(got[n], t[n]) for n in t)
    assert not [p for p in tmp_path.rglob("*.tmp")], "temporary files left behind"


def test_corrupt_torn_and_foreign_files_are_misses(tmp_path):
    s = FileStorage(tmp_path, "m", block_size=4)
    key = s.block_keys([1, 2, 3, 4])[0]
    s.put(key, "state", tensors())
    path = s.path(key, "state")
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one flipped payload byte
    path.write_bytes(bytes(data))
    assert s.get(key, "state") is None
    s.put(key, "state", tensors())
    path.write_bytes(path.read_bytes()[:-10])  # torn
    assert s.get(key, "state") is None
    path.write_bytes(b"not a header\n")
    assert s.get(key, "state") is None
    FileStorage(tmp_path, "other-model", block_size=4).put(key, "state", tensors())
    assert s.get(key, "state") is None  # another model's file under the same name
    assert s.stats["corrupt"] == 4


def test_model_identity_tells_checkpoints_apart():
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    assert model_identity(a) == model_identity(a)
    assert model_identity(a) != model_identity(b)
    assert model_identity(a, "bf16") != model_identity(a, "fp32")
