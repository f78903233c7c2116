"""The KV pool and its tiers with MLA's latent rows (`KVShape.latent_row`): one row of
kv_lora_rank + qk_rope_head_dim per token and layer, no V columns, copied device -> host ->
storage file -> (a restart) -> host -> device unchanged; and the bytes per token of both layouts.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.mem_cache.host_pool import HostTier, host_pool_sizes
from hybrid_serve.mem_cache.kv_pool import KVPool
from hybrid_serve.mem_cache.kv_shape import KVShape, common_kv_shape, kv_bytes_per_token
from hybrid_serve.mem_cache.mamba_pool import MambaPool
from hybrid_serve.mem_cache.state_shape import MambaStateShape
from hybrid_serve.mem_cache.storage_file import FileStorage
from hybrid_serve.mem_cache.storage_prefetch import PrefetchOp
from hybrid_serve.mem_cache.storage_tier import StorageTier

# Kimi-Linear-48B-A3B's MLA: 32 heads, r 512, rope 64, nope 128, v 128
KIMI = KVShape.latent_row(512, 64, num_heads=32, k_head_dim=192, v_head_dim=128)
TINY = KVShape.latent_row(6, 2, num_heads=4, k_head_dim=5, v_head_dim=3)
PAGE = 4


def pools(pages: int = 12) -> tuple[KVPool, MambaPool]:
    kv = KVPool(pages, PAGE, [TINY] * 3, torch.float32)
    return kv, MambaPool(4, [MambaStateShape(2, 1, (2,))], torch.float32)


def test_latent_pool_holds_one_row_per_token_and_layer():
    kv, _ = pools()
    rows = (12 + 1) * PAGE
    assert kv.k_all.shape == (3, rows, 1, 8) and kv.v_all.numel() == 0
    assert kv.get_kv(2)[0].shape == (rows, 1, 8) and kv.get_kv(2)[1].shape == (rows, 1, 0)
    assert kv.bytes_per_token == 3 * 8 * 4 == kv_bytes_per_token([TINY] * 3, torch.float32)


def test_bytes_per_token_mla_is_about_a_tenth_of_gqa():
    """Kimi-Linear's latent row (576 values) against GQA K and V of the same 32 heads of 128
    (8192), and the expanded K (192) and V (128) of each head (10240)."""
    gqa = KVShape.mha(32, 128)
    assert KIMI.nbytes(torch.bfloat16) == 576 * 2 and gqa.nbytes(torch.bfloat16) == 8192 * 2
    assert 0.05 < KIMI.nbytes(torch.bfloat16) / gqa.nbytes(torch.bfloat16) < 0.1
    assert KIMI.expanded == 10240 and "576" in KIMI.describe() and "17.8x" in KIMI.describe()
    assert "8 KV heads x (128 K + 128 V)" in KVShape.mha(8, 128).describe()


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="one head"):
        KVShape(2, 8, 0)
    with pytest.raises(ValueError, match="one KV shape"):
        common_kv_shape([TINY, KVShape.mha(1, 8)])
    with pytest.raises(ValueError, match="one KV shape"):
        KVPool(4, PAGE, [TINY, KVShape.mha(1, 8)], torch.float32)


def test_device_host_storage_round_trip_across_a_restart(tmp_path):
    kv, mamba = pools()
    locs = kv.alloc_locs(3 * PAGE)  # 12 tokens: three storage blocks of 4
    rows = torch.randn(3, len(locs), 1, 8)
    kv.k_all[:, locs] = rows
    host = HostTier(kv, mamba, num_pages=8, num_slots=2)
    host_locs = host.kv_pool.alloc_locs(len(locs))
    host.kv_pool.save(host_locs, kv, locs)
    assert torch.equal(host.kv_pool.k_all[:, host_locs], rows)
    slot = int(host.mamba_pool.alloc(1)[0])
    tokens = list(range(100, 112))
    storage = StorageTier(FileStorage(tmp_path, "m", block_size=PAGE), host)
    assert storage.write(tokens, host_locs, slot) == 12

    # A restart: new pools, a new host tier, the same folder.
    kv2, mamba2 = pools()
    host2 = HostTier(kv2, mamba2, num_pages=8, num_slots=2)
    storage2 = StorageTier(FileStorage(tmp_path, "m", block_size=PAGE), host2)
    keys, states = storage2.plan(tokens, 0)
    assert states == [2]
    op = PrefetchOp(
        tokens, 0, None, 0, keys, frozenset(states), host2.kv_pool.alloc_locs(12),
        int(host2.mamba_pool.alloc(1)[0]), timeout=10.0,
    )  # fmt: skip
    storage2.submit(op)
    assert op.done.wait(30), "the prefetch did not finish"
    assert storage2.stop(op) == [2] and not op.failed
    assert torch.equal(host2.kv_pool.k_all[:, op.host_locs], rows)
    device_locs = kv2.alloc_locs(12)
    host2.kv_pool.load(op.host_locs, kv2, device_locs)
    assert torch.equal(kv2.k_all[:, device_locs], rows)


def test_host_pool_sizes_read_the_latent_row():
    kv, mamba = pools(pages=10)
    per_gb = host_pool_sizes(kv, mamba, 1.0, 1.0)  # 1 GB split as the device pools split
    device_kv = 10 * PAGE * kv.bytes_per_token
    share = device_kv / (device_kv + 4 * mamba.bytes_per_slot)
    assert per_gb[0] * PAGE * kv.bytes_per_token == pytest.approx(share * 2**30, rel=1e-3)
