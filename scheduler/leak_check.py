"""Idle conservation laws of every pool (invariant I3), with the leaked ids named.

When no request runs: every request row is free or held by a session; every KV page is free,
held by the radix tree or by a session; every Mamba slot is free, the tree's or a session's; the
only tree locks left are the sessions' (one per session on its first turn's node). Slot 0 is never
handed out. With the host tier, every host KV page and host Mamba slot is free or the tree's.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler


def leak_report(scheduler: Scheduler) -> list[str]:
    """Problems found (empty when clean). Call only when the scheduler is idle."""
    runner, tree = scheduler.runner, scheduler.tree
    problems: list[str] = []
    if scheduler.has_work():
        return ["scheduler is not idle"]
    s_rows, s_kv, s_mamba, s_nodes = scheduler.sessions.held()
    rows = runner.req_pool.allocated_slots()
    if rows != s_rows:
        problems.append(f"request rows leaked: {sorted(rows - s_rows)[:16]}")
    ps = runner.kv_pool.page_size
    tree_pages = {loc // ps for loc in tree.held_kv_locs()}
    session_pages = {loc // ps for loc in s_kv}
    kv_leaked = runner.kv_pool.allocated_slots() - tree_pages - session_pages
    if kv_leaked:
        problems.append(f"KV pages leaked ({len(kv_leaked)}): {sorted(kv_leaked)[:16]}")
    if tree_pages & session_pages:
        problems.append(
            f"KV pages held by a session and the tree: {sorted(tree_pages & session_pages)[:16]}"
        )
    mamba_leaked = runner.mamba_pool.allocated_slots() - tree.held_mamba_slots() - s_mamba
    if mamba_leaked:
        problems.append(f"Mamba slots leaked: {sorted(mamba_leaked)[:16]}")
    for name, held in (
        ("KV page", tree_pages | session_pages),
        ("Mamba slot", tree.held_mamba_slots() | s_mamba),
        ("request row", rows),
    ):
        if 0 in held:
            problems.append(f"{name} 0 (reserved) is handed out")
    for name, pool, held_ids in tree.host_pools():
        leaked = pool.allocated_slots() - held_ids
        if leaked:
            problems.append(f"host {name} leaked ({len(leaked)}): {sorted(leaked)[:16]}")
    pins = Counter(id(n) for n in s_nodes if n is not tree.root)
    locked = [n for n in tree.iter_nodes() if n.mamba_lock_ref != pins[id(n)]]
    if locked:
        problems.append(f"radix tree locks left by requests: {locked[:8]}")
    return problems


def assert_no_leaks(scheduler: Scheduler) -> None:
    problems = leak_report(scheduler)
    assert not problems, "; ".join(problems)
