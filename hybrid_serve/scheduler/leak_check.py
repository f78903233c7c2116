"""Conservation laws of every pool (invariant I3), with the leaked ids named.

When no request runs: every request row is free or held by a session; every KV page is free,
held by the radix tree or by a session; every Mamba slot is free, the tree's or a session's; the
only tree locks left are the sessions' (one per session on its first turn's node). Slot 0 is never
handed out. With the host tier, every host KV page and host Mamba slot is free or the tree's.
Between steps (`pool_report`) the live requests' holdings count as well: their rows,
the KV of positions [cache_protected_len, kv_reserved_len), their Mamba and track slots and one
lock on `last_node` each; that audit runs after a request fault (`scheduler/faults.py`).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from hybrid_serve.mem_cache.radix_cache import MambaRadixCache
    from hybrid_serve.scheduler.model_runner import ModelRunner
    from hybrid_serve.scheduler.request import Req
    from hybrid_serve.scheduler.session import SessionManager


class Audited(Protocol):
    """What the audit reads of a `Scheduler`."""

    runner: ModelRunner
    tree: MambaRadixCache
    sessions: SessionManager

    def has_work(self) -> bool: ...

    def live_requests(self) -> list[Req]: ...


def leak_report(scheduler: Audited) -> list[str]:
    """Problems found (empty when clean). Call only when the scheduler is idle."""
    if scheduler.has_work():
        return ["scheduler is not idle"]
    return pool_report(scheduler)


def pool_report(scheduler: Audited) -> list[str]:
    """Problems found with live requests counted as holders (call between steps; O(pool size))."""
    runner, tree = scheduler.runner, scheduler.tree
    problems: list[str] = []
    h_rows, h_kv, h_mamba, h_nodes = scheduler.sessions.held()
    live = [r for r in scheduler.live_requests() if r.req_slot is not None]
    h_rows = h_rows | {r.req_slot for r in live}
    row_of = runner.req_pool.req_to_token
    for r in live:
        end = max(r.kv_len, r.kv_reserved_len)
        h_kv = h_kv | set(row_of[r.req_slot, r.cache_protected_len : end].tolist())
        h_mamba = h_mamba | {r.mamba_slot, *r.track_slots}
        h_nodes = [*h_nodes, r.last_node]
    rows = runner.req_pool.allocated_slots()
    if rows != h_rows:
        problems.append(f"request rows leaked: {sorted(rows - h_rows)[:16]}")
    ps = runner.kv_pool.page_size
    tree_pages = {loc // ps for loc in tree.held_kv_locs()}
    held_pages = {loc // ps for loc in h_kv}
    kv_leaked = runner.kv_pool.allocated_slots() - tree_pages - held_pages
    if kv_leaked:
        problems.append(f"KV pages leaked ({len(kv_leaked)}): {sorted(kv_leaked)[:16]}")
    if tree_pages & held_pages:
        problems.append(
            "KV pages held by a request or session and the tree: "
            f"{sorted(tree_pages & held_pages)[:16]}"
        )
    tree_slots = tree.held_mamba_slots()
    if tree.total_size() != len(tree.held_kv_locs()):
        problems.append(f"tree KV counter {tree.total_size()} != {len(tree.held_kv_locs())} held")
    if tree.mamba_evictable_size() + tree.mamba_protected_size() != len(tree_slots):
        problems.append(f"tree Mamba counters do not add up to its {len(tree_slots)} states")
    mamba_leaked = runner.mamba_pool.allocated_slots() - tree_slots - h_mamba
    if mamba_leaked:
        problems.append(f"Mamba slots leaked: {sorted(mamba_leaked)[:16]}")
    for name, held in (
        ("KV page", tree_pages | held_pages),
        ("Mamba slot", tree_slots | h_mamba),
        ("request row", rows),
    ):
        if 0 in held:
            problems.append(f"{name} 0 (reserved) is handed out")
    for name, pool, held_ids in tree.host_pools():
        leaked = pool.allocated_slots() - held_ids
        if leaked:
            problems.append(f"host {name} leaked ({len(leaked)}): {sorted(leaked)[:16]}")
    pins = Counter(id(n) for n in h_nodes if n is not tree.root)
    locked = [n for n in tree.iter_nodes() if n.mamba_lock_ref != pins[id(n)]]
    if locked:
        problems.append(f"radix tree locks left by requests: {locked[:8]}")
    return problems
