"""CPU tests for the request, KV and Mamba pools (invariants I1-I3 at the pool level)."""

from __future__ import annotations

import random

import pytest
import torch

from hybrid_serve.kernels.attention import store_kv
from hybrid_serve.mem_cache.kv_pool import KVPool
from hybrid_serve.mem_cache.kv_shape import KVShape
from hybrid_serve.mem_cache.mamba_pool import MambaPool
from hybrid_serve.mem_cache.req_pool import ReqToTokenPool, SlotAllocator
from hybrid_serve.mem_cache.state_shape import MambaStateShape


def make_req_pool(size: int = 6) -> ReqToTokenPool:
    return ReqToTokenPool(size, max_context_len=16)


def make_kv_pool(num_pages: int = 6, page_size: int = 4) -> KVPool:
    return KVPool(num_pages, page_size, [KVShape.mha(2, 3)] * 2, torch.float32)


SHAPE = MambaStateShape(5, 3, (2, 3, 2))  # conv 5 x 3, temporal 2 x 3 x 2


def make_mamba_pool(size: int = 6) -> MambaPool:
    return MambaPool(size, [SHAPE] * 3, conv_dtype=torch.bfloat16)


def ids(x: list[int] | torch.Tensor) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


# Each pool behind one tiny interface, so the shared contract is tested once for all three.
POOLS = {
    "req": make_req_pool,
    "kv": make_kv_pool,
    "mamba": make_mamba_pool,
}


@pytest.fixture(params=sorted(POOLS))
def pool(request: pytest.FixtureRequest) -> ReqToTokenPool | KVPool | MambaPool:
    return POOLS[request.param]()


# ---------------------------------------------------------------------------- shared contract


def test_slot_zero_never_handed_out_and_exhaustion(pool) -> None:
    assert pool.size == 6 and pool.available() == 6
    got = ids(pool.alloc(4)) + ids(pool.alloc(2))
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert pool.available() == 0
    assert pool.allocated_slots() == set(range(1, 7))
    assert pool.alloc(1) is None
    assert pool.available() == 0 and pool.allocated_slots() == set(range(1, 7))
    pool.check_integrity()


def test_alloc_short_returns_none_and_leaves_pool_unchanged(pool) -> None:
    held = ids(pool.alloc(4))
    assert pool.alloc(3) is None
    assert pool.available() == 2
    assert pool.allocated_slots() == set(held)
    assert sorted(ids(pool.alloc(2))) == sorted(set(range(1, 7)) - set(held))
    pool.check_integrity()


def test_counts_return_to_totals_after_free(pool) -> None:
    a = pool.alloc(3)
    b = pool.alloc(2)
    pool.free(a)
    assert pool.available() == 4
    pool.free(ids(b)[0])
    pool.free(ids(b)[1:])
    assert pool.available() == 6 and pool.allocated_slots() == set()
    pool.check_integrity()
    assert len(ids(pool.alloc(6))) == 6  # everything is reusable


def test_alloc_zero_is_empty(pool) -> None:
    assert ids(pool.alloc(0)) == []
    assert pool.available() == 6


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ([0], "slot 0"),
        ([7], "unknown"),
        ([-1], "unknown"),
        ([1, 1], "more than once"),
    ],
)
def test_bad_free_raises_and_frees_nothing(pool, bad: list[int], needle: str) -> None:
    pool.alloc(6)
    with pytest.raises(ValueError, match=needle) as err:
        pool.free(bad)
    assert str(bad[0]) in str(err.value)
    assert pool.available() == 0
    pool.check_integrity()


def test_double_free_raises_naming_slot(pool) -> None:
    a = ids(pool.alloc(3))
    pool.free(a[1])
    with pytest.raises(ValueError, match=rf"double free.*\[{a[1]}\]"):
        pool.free(a[1])
    # A mixed call is rejected as a whole: the good slot is not freed either.
    with pytest.raises(ValueError):
        pool.free([a[0], a[1]])
    assert pool.allocated_slots() == {a[0], a[2]}
    pool.check_integrity()


def test_free_accepts_tensors_and_lists(pool) -> None:
    a = pool.alloc(3)
    pool.free(torch.tensor(ids(a)[:2]))
    pool.free([ids(a)[2]])
    assert pool.available() == 6
    with pytest.raises(TypeError):
        pool.free(torch.tensor([1.0]))


def test_clear_resets_bookkeeping(pool) -> None:
    pool.alloc(5)
    pool.clear()
    assert pool.available() == 6 and pool.allocated_slots() == set()
    pool.check_integrity()


def test_constructor_rejects_empty_pool() -> None:
    with pytest.raises(ValueError):
        ReqToTokenPool(0, 4)
    with pytest.raises(ValueError):
        KVPool(4, 0, [KVShape.mha(1, 1)], torch.float32)


# ------------------------------------------------------------------------------ ReqToTokenPool


def test_req_pool_table_shape_and_padding_row() -> None:
    pool = make_req_pool()
    assert pool.req_to_token.shape == (7, 16) and pool.req_to_token.dtype == torch.int32
    for slot in pool.alloc(6):
        pool.req_to_token[slot] = slot
    assert torch.count_nonzero(pool.req_to_token[0]) == 0
    assert pool.alloc() is None


def test_req_pool_alloc_default_is_one_row_fifo() -> None:
    pool = make_req_pool(3)
    assert pool.alloc() == [1]
    assert pool.alloc(2) == [2, 3]
    pool.free(2)
    pool.free(1)
    assert pool.alloc(2) == [2, 1]  # oldest freed first


# -------------------------------------------------------------------------------------- KVPool


def test_kv_pool_buffers_and_token_counts() -> None:
    pool = make_kv_pool(num_pages=5, page_size=4)
    assert len(pool.k_buffer) == len(pool.v_buffer) == 2
    assert pool.k_buffer[0].shape == (24, 2, 3)
    assert pool.available_tokens() == 20 and pool.size * pool.page_size == 20
    pages = pool.alloc(2)
    assert pages.dtype == torch.int64
    assert pool.available() == 3 and pool.available_tokens() == 12
    k, v = pool.get_kv(1)
    assert k is pool.k_buffer[1] and v is pool.v_buffer[1]


def test_kv_pool_page_location_arithmetic() -> None:
    pool = make_kv_pool(num_pages=5, page_size=4)
    pages = pool.alloc(3)
    assert 0 not in pages.tolist()
    locs = pool.page_locs(pages)
    expected = [p * 4 + j for p in pages.tolist() for j in range(4)]
    assert locs.tolist() == expected
    # The reserved page 0 covers token locations 0..3 and none of them is ever in a handed-out page.
    all_pages = torch.cat([pages, pool.alloc(2)])
    assert min(pool.page_locs(all_pages).tolist()) >= 4


def test_kv_pool_store_kv_writes_only_where_asked() -> None:
    """The model's write path (`store_kv` on a layer's buffers) lands in that layer's slice of
    the pool's storage at the given token locations, cast to the pool's dtype, and nowhere else."""
    pool = make_kv_pool(num_pages=5, page_size=4)
    pages = pool.alloc(2)  # pages 1, 2: locations 4..11
    p = int(pages[1])
    loc = torch.tensor([p * 4 + 1, p * 4 + 3])
    k = torch.randn(2, 2, 3, dtype=torch.float64)
    v = torch.randn(2, 2, 3, dtype=torch.float64)
    store_kv(*pool.get_kv(1), loc, k, v)
    kb, vb = pool.k_all[1], pool.v_all[1]
    assert kb.dtype == torch.float32
    torch.testing.assert_close(kb[loc], k.float())
    torch.testing.assert_close(vb[loc], v.float())
    mask = torch.ones(kb.shape[0], dtype=torch.bool)
    mask[loc] = False
    assert torch.count_nonzero(kb[mask]) == 0 and torch.count_nonzero(vb[mask]) == 0
    # Other layers are untouched.
    assert torch.count_nonzero(pool.k_buffer[0]) == 0 and torch.count_nonzero(pool.v_buffer[0]) == 0


def test_kv_pool_page_size_one() -> None:
    pool = KVPool(3, 1, [KVShape.mha(1, 2)], torch.float16)
    assert pool.k_buffer[0].shape == (4, 1, 2)
    pages = pool.alloc(3)
    assert sorted(pages.tolist()) == [1, 2, 3]
    assert pool.page_locs(pages).tolist() == pages.tolist()
    assert pool.available_tokens() == 0


def test_kv_bytes_per_token() -> None:
    pool = KVPool(1, 1, [KVShape.mha(2, 128)] * 4, torch.bfloat16)
    assert pool.bytes_per_token == 2 * 4 * 2 * 128 * 2


# ----------------------------------------------------------------------------------- MambaPool


def test_mamba_pool_shapes_and_sizing() -> None:
    pool = make_mamba_pool()
    assert pool.conv_state.shape == (3, 7, 5, 3) and pool.conv_state.dtype == torch.bfloat16
    assert pool.ssm_state.shape == (3, 7, 2, 3, 2) and pool.ssm_state.dtype == torch.float32
    conv, ssm = pool.get_state(2)
    assert conv.shape == (7, 5, 3) and ssm.shape == (7, 2, 3, 2)
    assert conv.data_ptr() == pool.conv_state[2].data_ptr()  # a view, not a copy
    per_slot = 3 * (5 * 3 * 2 + 2 * 3 * 2 * 4)
    assert pool.bytes_per_slot == per_slot
    assert MambaPool.state_bytes_per_slot([SHAPE] * 3, torch.bfloat16) == per_slot
    # Qwen3-Next default: 36 linear layers, about 74 MiB per request (reference section 2.1).
    gdn = MambaStateShape(8192, 3, (32, 128, 128))
    qwen = MambaPool.state_bytes_per_slot([gdn] * 36, torch.bfloat16)
    assert 73 * 2**20 < qwen < 75 * 2**20
    # Nemotron-3-Nano-30B-A3B: 23 Mamba2 layers, conv 6144 x 3, SSM 64 x 64 x 128 (47 MiB)
    mamba2 = MambaStateShape(6144, 3, (64, 64, 128))
    nano = MambaPool.state_bytes_per_slot([mamba2] * 23, torch.bfloat16)
    assert 46 * 2**20 < nano < 47 * 2**20


def test_mamba_pool_takes_any_temporal_rank_but_one_shape() -> None:
    pool = MambaPool(2, [MambaStateShape(4, 2, (3, 5))] * 2, conv_dtype=torch.float32)
    assert pool.conv_state.shape == (2, 3, 4, 2) and pool.ssm_state.shape == (2, 3, 3, 5)
    empty = MambaPool(2, [], conv_dtype=torch.float32)
    assert empty.num_layers == 0 and empty.bytes_per_slot == 0
    with pytest.raises(ValueError, match="one state shape"):
        MambaPool(2, [SHAPE, MambaStateShape(5, 3, (2, 3, 3))], conv_dtype=torch.float32)
    with pytest.raises(ValueError, match="bad conv state shape"):
        MambaStateShape(0, 3, (1,))
    with pytest.raises(ValueError, match="bad temporal"):
        MambaStateShape(1, 3, ())
    with pytest.raises(ValueError, match="bad temporal"):
        MambaStateShape(1, 3, (2, -1))


def test_a_conv_window_alone_takes_no_temporal_bytes() -> None:
    """A mixer whose state is its conv window alone (LFM2's short conv: temporal (0,)): the
    pool holds and counts the window only, and copies it between slots as any state."""
    window = MambaStateShape(6, 2, (0,))
    assert window.nbytes(torch.float32, torch.float32) == 6 * 2 * 4
    pool = MambaPool(3, [window] * 2, conv_dtype=torch.float32)
    assert pool.ssm_state.shape == (2, 4, 0) and pool.bytes_per_slot == 2 * 6 * 2 * 4
    src, dst = pool.alloc(2).tolist()
    pool.conv_state[:, src] = 5.0
    pool.copy([src], [dst])
    assert (pool.conv_state[:, dst] == 5.0).all()


def dirty(pool: MambaPool, slots: list[int], value: float = 7.0) -> None:
    for s in slots:
        pool.conv_state[:, s] = value
        pool.ssm_state[:, s] = value


def test_mamba_alloc_zeroes_previous_owners_state() -> None:
    pool = make_mamba_pool(3)
    slots = pool.alloc(3).tolist()
    dirty(pool, slots)
    pool.conv_state[:, 0] = 9.0  # padding rows scribble on slot 0; nobody cares
    pool.free(slots[:2])
    again = pool.alloc(2).tolist()
    assert sorted(again) == sorted(slots[:2])
    assert torch.count_nonzero(pool.conv_state[:, again]) == 0
    assert torch.count_nonzero(pool.ssm_state[:, again]) == 0
    # The slot that stayed allocated keeps its state.
    assert bool((pool.ssm_state[:, slots[2]] == 7.0).all())
    # zero=False hands out the slot as is (for copy-on-write destinations).
    dirty(pool, [again[0]])
    pool.free(again[0])
    raw = int(pool.alloc(1, zero=False))
    assert raw == again[0]
    assert bool((pool.conv_state[:, raw] == 7.0).all())
    pool.free(raw)
    assert int(pool.alloc(1)) == raw  # zero=True: zeroed again
    assert torch.count_nonzero(pool.conv_state[:, raw]) == 0


def test_mamba_copy_all_layers_only_target_slots() -> None:
    pool = make_mamba_pool(5)
    a, b, c, d, e = pool.alloc(5).tolist()
    torch.manual_seed(0)
    pool.conv_state.copy_(torch.randn_like(pool.conv_state, dtype=torch.float32))
    pool.ssm_state.copy_(torch.randn_like(pool.ssm_state))
    conv_before = pool.conv_state.clone()
    ssm_before = pool.ssm_state.clone()
    pool.copy(torch.tensor([a, b]), torch.tensor([c, d]))
    pool.copy(e, a)  # plain ints work too; a, already read by the first copy, is overwritten
    for src, dst in ((a, c), (b, d)):
        assert torch.equal(pool.conv_state[:, dst], conv_before[:, src])
        assert torch.equal(pool.ssm_state[:, dst], ssm_before[:, src])
    assert torch.equal(pool.ssm_state[:, a], ssm_before[:, e])
    for untouched in (0, b, e):
        assert torch.equal(pool.conv_state[:, untouched], conv_before[:, untouched])
        assert torch.equal(pool.ssm_state[:, untouched], ssm_before[:, untouched])


def test_mamba_copy_overlapping_reads_before_writes() -> None:
    pool = make_mamba_pool(3)
    a, b, c = pool.alloc(3).tolist()
    for s, val in ((a, 1.0), (b, 2.0), (c, 3.0)):
        dirty(pool, [s], val)
    pool.copy([a, b], [b, c])  # shift: b <- old a, c <- old b
    assert float(pool.ssm_state[0, b, 0, 0, 0]) == 1.0
    assert float(pool.ssm_state[0, c, 0, 0, 0]) == 2.0


def test_mamba_copy_rejects_bad_slots() -> None:
    pool = make_mamba_pool(4)
    a, b = pool.alloc(2).tolist()
    with pytest.raises(ValueError, match="copy from.*0"):
        pool.copy(0, a)
    with pytest.raises(ValueError, match="copy into"):
        pool.copy(a, 3)  # slot 3 is free
    with pytest.raises(ValueError, match="more than once"):
        pool.copy([a, b], [b, b])
    with pytest.raises(ValueError, match="sources"):
        pool.copy([a, b], [b])


def test_mamba_group_basic_and_end_returns_rest() -> None:
    pool = make_mamba_pool(6)
    held = pool.alloc(1).tolist()
    assert pool.alloc_group_begin(3) == 3
    assert pool.group_open and pool.group_remaining() == 3
    assert pool.available() == 5  # free list + undrawn group slots
    got = [int(pool.alloc(1)) for _ in range(2)]
    assert got == [2, 3]  # drawn from the group, in order
    assert pool.available() == 3 and pool.group_remaining() == 1
    assert pool.allocated_slots() == set(held + got)  # the undrawn group slot is not allocated
    pool.check_integrity()
    assert pool.alloc_group_end() == 1
    assert not pool.group_open and pool.available() == 3
    pool.check_integrity()
    # The unused slot went back to the front of the free list.
    assert pool.alloc(1).tolist() == [4]


def test_mamba_group_slots_are_zeroed_when_handed_out() -> None:
    pool = make_mamba_pool(2)
    s = pool.alloc(2).tolist()
    dirty(pool, s)
    pool.free(s)
    pool.alloc_group_begin(2)
    assert bool((pool.ssm_state[:, s] == 7.0).all())  # the bulk draw itself touches nothing
    slot = int(pool.alloc(1))
    assert torch.count_nonzero(pool.ssm_state[:, slot]) == 0
    assert torch.count_nonzero(pool.conv_state[:, slot]) == 0
    pool.alloc_group_end()


def test_mamba_group_larger_than_available() -> None:
    pool = make_mamba_pool(4)
    pool.alloc(3)
    assert pool.alloc_group_begin(10) == 1
    assert pool.available() == 1
    assert pool.alloc(1) is not None
    assert pool.alloc(1) is None
    assert pool.alloc_group_end() == 0
    assert pool.available() == 0
    pool.check_integrity()


def test_mamba_group_falls_through_to_free_list() -> None:
    pool = make_mamba_pool(6)
    assert pool.alloc_group_begin(2) == 2
    assert pool.alloc(1).tolist() == [1]
    # Asking for more than the group holds: the group's last slot, then the free list.
    assert pool.alloc(3).tolist() == [2, 3, 4]
    assert pool.group_remaining() == 0
    assert pool.alloc(1).tolist() == [5]
    assert pool.alloc(2) is None  # short: group empty, 1 free
    assert pool.available() == 1
    assert pool.alloc_group_end() == 0
    assert pool.available() == 1
    pool.check_integrity()


def test_mamba_group_nesting_and_end_without_begin() -> None:
    pool = make_mamba_pool(4)
    assert pool.alloc_group_end() == 0  # harmless no-op
    pool.alloc_group_begin(2)
    with pytest.raises(RuntimeError, match="already open"):
        pool.alloc_group_begin(1)
    assert pool.group_remaining() == 2  # the failed begin changed nothing
    pool.alloc_group_end()
    assert pool.available() == 4
    pool.check_integrity()


def test_mamba_group_slot_cannot_be_freed_before_handed_out() -> None:
    pool = make_mamba_pool(4)
    pool.alloc_group_begin(2)
    with pytest.raises(ValueError, match=r"allocation group.*\[1\]"):
        pool.free(1)
    with pytest.raises(ValueError, match="not currently handed out"):
        pool.copy(1, 1)
    pool.alloc_group_end()
    pool.check_integrity()


def test_mamba_group_context_manager_ends_on_error() -> None:
    pool = make_mamba_pool(4)
    with pytest.raises(KeyError):
        with pool.alloc_group(3) as got:
            assert got == 3
            pool.alloc(1)
            raise KeyError("boom")
    assert not pool.group_open and pool.available() == 3
    pool.check_integrity()


def test_mamba_group_begin_without_alloc_is_identity() -> None:
    pool = make_mamba_pool(5)
    a = pool.alloc(3).tolist()
    pool.free([a[2], a[0]])
    before = list(pool.allocator._free)
    pool.alloc_group_begin(3)
    pool.alloc_group_end()
    assert list(pool.allocator._free) == before


# ----------------------------------------------------------------------------- randomized model


@pytest.mark.parametrize("seed", range(8))
def test_allocator_random_ops_against_model(seed: int) -> None:
    """Random alloc/free/group ops against a plain-set model of the pool."""
    rng = random.Random(seed)
    size = rng.randint(1, 12)
    pool = MambaPool(size, [MambaStateShape(2, 1, (1, 1, 1))], conv_dtype=torch.float32)
    free: set[int] = set(range(1, size + 1))
    group: set[int] | None = None
    held: set[int] = set()
    ever_handed: dict[int, int] = {}  # slot -> how many times handed out while held (must be <= 1)

    for _ in range(300):
        op = rng.choice(["alloc", "alloc", "free", "free", "bad_free", "begin", "end"])
        avail = len(free) + (len(group) if group is not None else 0)
        if op == "alloc":
            n = rng.randint(0, 4)
            got = pool.alloc(n)
            if n > avail:
                assert got is None
            else:
                assert got is not None
                got_ids = got.tolist()
                assert len(got_ids) == n == len(set(got_ids))
                assert 0 not in got_ids and not (set(got_ids) & held)
                pool_side = free | (group if group is not None else set())
                assert set(got_ids) <= pool_side
                if group is not None:
                    # The group is drained first, the free list only covers the rest.
                    assert len(set(got_ids) & group) == min(n, len(group))
                    group -= set(got_ids)
                free -= set(got_ids)
                held |= set(got_ids)
                for s in got_ids:
                    ever_handed[s] = ever_handed.get(s, 0) + 1
                    assert float(pool.ssm_state[0, s].abs().sum()) == 0.0
                    pool.ssm_state[0, s] = 1.0  # dirty it for the next owner
        elif op == "free" and held:
            some = rng.sample(sorted(held), rng.randint(1, len(held)))
            pool.free(torch.tensor(some) if rng.random() < 0.5 else some)
            held -= set(some)
            free |= set(some)
            for s in some:
                ever_handed[s] -= 1
        elif op == "bad_free":
            candidates = [0, size + 1] + sorted(free) + sorted(group or ())
            bad = rng.choice(candidates)
            mix = [bad] + (rng.sample(sorted(held), 1) if held else [])
            with pytest.raises(ValueError, match=str(bad)):
                pool.free(mix)
        elif op == "begin":
            n = rng.randint(0, 6)
            if group is not None:
                with pytest.raises(RuntimeError):
                    pool.alloc_group_begin(n)
            else:
                got_n = pool.alloc_group_begin(n)
                assert got_n == min(n, len(free))
                group = set(pool.allocator._group or ())
                assert len(group) == got_n and group <= free
                free -= group
        elif op == "end":
            back = pool.alloc_group_end()
            assert back == (len(group) if group is not None else 0)
            if group is not None:
                free |= group
            group = None

        assert pool.available() == len(free) + (len(group) if group is not None else 0)
        assert pool.allocated_slots() == held
        assert pool.group_open == (group is not None)
        assert all(count <= 1 for count in ever_handed.values())
        pool.check_integrity()

    pool.alloc_group_end()
    pool.free(sorted(held))
    assert pool.available() == size
    pool.check_integrity()


def test_check_integrity_detects_corruption() -> None:
    alloc = SlotAllocator(4, name="t")
    alloc.alloc(2)
    alloc._free.append(1)  # an allocated slot sneaks into the free list
    with pytest.raises(RuntimeError, match="slot 1"):
        alloc.check_integrity()
