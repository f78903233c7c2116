"""`SpecState`: what speculative decoding keeps on one request (`Req.spec`), and its
draft-length state (`DraftState`, `hybrid_serve/scheduler/spec/policy.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FIRST_WAIT = 8  # decode steps a request that stopped drafting waits before probing again


@dataclass
class DraftState:
    """A request's drafting state (`DraftPolicy`)."""

    keep: list[float]  # a_j: P(draft j kept | drafts 1 .. j-1 kept)
    wait: int = 0  # > 0: idle (no drafts, no head passes) for this many more decode steps
    next_wait: int = FIRST_WAIT  # the wait after its next failed probe
    probe: bool = False  # its next drafting round is a probe (one draft)
    head: bool = False  # the head runs over its landed rows after the round in flight


@dataclass
class SpecState:
    """The MTP head's output at the request's newest verified row and its predicted token (the
    next round's first draft); the round's drafts."""

    hidden: torch.Tensor | None = None  # the head's y at the newest verified row
    token: tuple[int, torch.Tensor | None] = (0, None)  # d1 and q, the draw's distribution
    drafts: list[int] = field(default_factory=list)
    q: list[torch.Tensor | None] = field(default_factory=list)  # sampled drafts' q
    n: int = 0  # drafts it asks for next round (0: --speculative-num-steps)
    policy: DraftState | None = None  # its draft-length state, made on first use
    verify_ct: int = 0  # speculative rounds it could draft in (SGLang's spec_verify_ct)
