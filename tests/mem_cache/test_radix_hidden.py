"""The final hidden state a radix node may keep for exact prompt repeats: set by `insert` with
``hidden`` (on a new leaf, a revived tombstone or a node that already had a state) or by
`set_hidden`; found by `exact_node` only at a node ending exactly at the key; dropped whenever
the node's device slot goes or changes; kept by the lower part of a split."""

from __future__ import annotations

import torch

from hybrid_serve.mem_cache.kv_pool import KVPool
from hybrid_serve.mem_cache.kv_shape import KVShape
from hybrid_serve.mem_cache.mamba_pool import MambaPool
from hybrid_serve.mem_cache.radix_cache import MambaRadixCache
from hybrid_serve.mem_cache.state_shape import MambaStateShape

H = 3


def make_cache(slots: int = 8) -> MambaRadixCache:
    kv = KVPool(64, 1, [KVShape.mha(1, 1)], torch.float32)
    mamba = MambaPool(
        slots, [MambaStateShape(1, 1, (1, 1, 1))], conv_dtype=torch.float32, hidden_size=H,
    )  # fmt: skip
    return MambaRadixCache(kv, mamba, chunk_size=4)


def put(cache: MambaRadixCache, key: list[int], hidden: torch.Tensor | None = None):
    kv = cache.kv_pool.page_locs(cache.kv_pool.alloc(len(key)))
    slot = int(cache.mamba_pool.alloc(1)[0])
    prefix, exist = cache.insert(key, kv, slot, hidden=hidden)
    if exist:
        cache.mamba_pool.free([slot])
    cache.sanity_check()
    return prefix, exist


def test_insert_with_hidden_marks_the_node_ending_at_the_key() -> None:
    c = make_cache()
    h = torch.tensor([1.0, 2.0, 3.0])
    put(c, [1, 2, 3, 4])
    put(c, [1, 2, 3, 4, 5, 6], hidden=h)  # a new leaf [5, 6] under [1..4]
    node = c.exact_node([1, 2, 3, 4, 5, 6])
    assert node is not None and torch.equal(c.mamba_pool.hidden[node.mamba_slot], h)
    assert c.exact_node([1, 2, 3, 4]) is None  # a state but no hidden
    assert c.exact_node([1, 2, 3, 4, 5]) is None  # ends inside a node
    assert c.exact_node([1, 2, 3, 4, 5, 6, 7]) is None
    # a node that already has a state takes the hidden of a later insert (exist=True)
    assert put(c, [1, 2, 3, 4], hidden=-h) == (4, True)
    node = c.exact_node([1, 2, 3, 4])
    assert node is not None and torch.equal(c.mamba_pool.hidden[node.mamba_slot], -h)


def test_a_split_keeps_the_lower_nodes_hidden_and_matching_finds_it() -> None:
    c = make_cache()
    put(c, [1, 2, 3, 4, 5, 6], hidden=torch.ones(H))
    c.match_prefix([1, 2, 7])  # splits [1..6] at 2: the upper part is a tombstone
    assert c.exact_node([1, 2]) is None
    node = c.exact_node([1, 2, 3, 4, 5, 6])
    assert node is not None and node.key == [3, 4, 5, 6]
    match = c.match_prefix([1, 2, 3, 4, 5, 6])
    assert match.last_node is node and len(match.kv_indices) == 6
    c.sanity_check()


def test_eviction_and_revival_drop_the_hidden() -> None:
    c = make_cache()
    put(c, [1, 2, 3, 4], hidden=torch.ones(H))
    put(c, [1, 2, 3, 4, 5, 6], hidden=torch.ones(H))
    upper = c.exact_node([1, 2, 3, 4])
    assert c.evict_mamba(1) == 1  # the least recently used state: [1..4] becomes a tombstone
    assert upper.mamba_slot is None and not upper.hidden_valid
    assert c.exact_node([1, 2, 3, 4]) is None
    put(c, [1, 2, 3, 4])  # revived without a hidden: still not an exact node
    assert upper.mamba_slot is not None and c.exact_node([1, 2, 3, 4]) is None
    c.set_hidden(upper, torch.zeros(H))
    assert c.exact_node([1, 2, 3, 4]) is upper
    c.evict(num_tokens=64)
    assert c.exact_node([1, 2, 3, 4]) is None and c.total_size() == 0
    c.sanity_check()
