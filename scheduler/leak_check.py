"""Idle conservation laws of every pool (invariant I3), with the leaked ids named.

When no request runs: every request row is free; every KV page is free or held by the radix
tree; every Mamba slot is free or held by the tree. (Session-held resources join these sums when
sessions land.) Slot 0 is never handed out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler


def leak_report(scheduler: Scheduler) -> list[str]:
    """Problems found (empty when clean). Call only when the scheduler is idle."""
    runner, tree = scheduler.runner, scheduler.tree
    problems: list[str] = []
    if scheduler.has_work():
        return ["scheduler is not idle"]
    rows = runner.req_pool.allocated_slots()
    if rows:
        problems.append(f"request rows leaked: {sorted(rows)[:16]}")
    ps = runner.kv_pool.page_size
    tree_pages = {loc // ps for loc in tree.held_kv_locs()}
    kv_leaked = runner.kv_pool.allocated_slots() - tree_pages
    if kv_leaked:
        problems.append(f"KV pages leaked ({len(kv_leaked)}): {sorted(kv_leaked)[:16]}")
    mamba_leaked = runner.mamba_pool.allocated_slots() - tree.held_mamba_slots()
    if mamba_leaked:
        problems.append(f"Mamba slots leaked: {sorted(mamba_leaked)[:16]}")
    for name, held in (("KV page", tree_pages), ("Mamba slot", tree.held_mamba_slots())):
        if 0 in held:
            problems.append(f"{name} 0 (reserved) is held by the radix tree")
    if tree.protected_size() or tree.mamba_protected_size():
        problems.append(
            f"radix tree still locked: {tree.protected_size()} tokens, "
            f"{tree.mamba_protected_size()} states"
        )
    return problems


def assert_no_leaks(scheduler: Scheduler) -> None:
    problems = leak_report(scheduler)
    assert not problems, "; ".join(problems)
