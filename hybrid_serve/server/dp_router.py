"""Which data-parallel replica runs a request: cache-aware matching balanced by load.

Each replica has its own radix cache, so a prompt is fastest on the replica that already holds
its prefix. The router cannot see those caches; it keeps an approximate copy of each one, a
`PrefixTree` of the token ids it sent there (salted prompts under a key of their own, as the
scheduler keys them), bounded in size by evicting least recently used leaves. This is the scheme of
SGLang's router (`cache_aware`), on token ids instead of text:

1. When the load is imbalanced (the busiest replica has more than `balance_abs_threshold` requests
   in flight over the idlest *and* more than `balance_rel_threshold` times as many), the least
   loaded replica wins, whatever the cache says.
2. Otherwise the replica whose tree holds the longest prefix of the prompt wins when that prefix
   is more than `cache_threshold` of the prompt;
3. else the least loaded replica (ties: the smallest tree, the one with most room).

The chosen replica's tree then records the prompt. `round_robin`, `shortest_queue` (fewest
requests in flight) and `minimum_tokens` (fewest prompt + max new tokens in flight) are SGLang's
plain `--load-balance-method`s; they record nothing. Loads are counted here, in the API process:
a request is in flight from `started` until `finished`.
"""

from __future__ import annotations

import heapq
import itertools
import zlib
from collections.abc import Sequence

LOAD_BALANCE_METHODS = ("cache_aware", "round_robin", "shortest_queue", "minimum_tokens")


class _Node:
    __slots__ = ("children", "key", "last_used", "parent")

    def __init__(self, key: tuple[int, ...], parent: _Node | None, now: int) -> None:
        self.key = key  # the tokens on the edge into this node
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.last_used = now  # the tree's clock: a count of matches and inserts


class PrefixTree:
    """A radix tree of token sequences holding at most `max_tokens` tokens (edge lengths summed);
    inserting past that evicts least recently used leaves down to 90% of it."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.root = _Node((), None, 0)
        self.size = 0
        self._clock = itertools.count(1)

    def match(self, ids: Sequence[int]) -> int:
        """How many leading tokens of `ids` the tree holds (touching the nodes it walks)."""
        node, i, now = self.root, 0, next(self._clock)
        while i < len(ids) and (child := node.children.get(ids[i])) is not None:
            n = _common(child.key, ids, i)
            child.last_used = now
            i += n
            if n < len(child.key):
                break
            node = child
        return i

    def insert(self, ids: Sequence[int]) -> None:
        node, i, now = self.root, 0, next(self._clock)
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                leaf = _Node(tuple(ids[i:]), node, now)
                node.children[ids[i]] = leaf
                self.size += len(leaf.key)
                break
            n = _common(child.key, ids, i)
            if n < len(child.key):  # split the edge: child keeps the tail under a new middle
                mid = _Node(child.key[:n], node, now)
                node.children[ids[i]] = mid
                child.key, child.parent = child.key[n:], mid
                mid.children[child.key[0]] = child
                child = mid
            child.last_used = now
            node, i = child, i + n
        if self.size > self.max_tokens:
            self._evict(int(self.max_tokens * 0.9))

    def _evict(self, target: int) -> None:
        heap = [(n.last_used, id(n), n) for n in self._leaves()]
        heapq.heapify(heap)
        while heap and self.size > target:
            leaf = heapq.heappop(heap)[2]
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self.size -= len(leaf.key)
            if parent is not self.root and not parent.children:  # the parent became a leaf
                heapq.heappush(heap, (parent.last_used, id(parent), parent))

    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out


def _common(key: tuple[int, ...], ids: Sequence[int], start: int) -> int:
    n = min(len(key), len(ids) - start)
    for j in range(n):
        if key[j] != ids[start + j]:
            return j
    return n


def routing_key(prompt_ids: Sequence[int], cache_salt: str | None) -> list[int]:
    """The tree key of a prompt: a salted prompt starts with a negative id of its salt, so it
    matches only prompts with the same salt (the scheduler shares prefixes the same way)."""
    if cache_salt is None:
        return list(prompt_ids)
    return [-1 - zlib.crc32(cache_salt.encode()), *prompt_ids]


class Router:
    """Picks a replica among the live ones and counts each replica's load."""

    def __init__(
        self,
        size: int,
        method: str = "cache_aware",
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_tokens: int = 1 << 20,
    ) -> None:
        if method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"load balance method must be one of {LOAD_BALANCE_METHODS}")
        self.method = method
        self.cache_threshold = cache_threshold
        self.abs_threshold, self.rel_threshold = balance_abs_threshold, balance_rel_threshold
        self.trees = [PrefixTree(max_tree_tokens) for _ in range(size)]
        self.requests = [0] * size  # in flight
        self.tokens = [0] * size  # prompt + max new tokens in flight
        self._turn = itertools.count()

    def pick(self, key: Sequence[int], live: Sequence[int]) -> int:
        """The replica (one of `live`, not empty) for a prompt with tree key `key`."""
        if len(live) == 1:
            choice = live[0]
        elif self.method == "round_robin":
            choice = live[next(self._turn) % len(live)]
        elif self.method == "minimum_tokens":
            choice = min(live, key=lambda r: (self.tokens[r], self.requests[r]))
        elif self.method == "shortest_queue" or self._imbalanced(live):
            choice = self._least_loaded(live)
        else:
            matched = {r: self.trees[r].match(key) for r in live}
            best = max(live, key=lambda r: (matched[r], -self.requests[r]))
            hit = matched[best] / len(key) if key else 0.0
            choice = best if hit > self.cache_threshold else self._least_loaded(live)
        if self.method == "cache_aware":
            self.trees[choice].insert(key)
        return choice

    def _imbalanced(self, live: Sequence[int]) -> bool:
        loads = [self.requests[r] for r in live]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.abs_threshold and hi > lo * self.rel_threshold

    def _least_loaded(self, live: Sequence[int]) -> int:
        return min(live, key=lambda r: (self.requests[r], self.trees[r].size))

    def started(self, replica: int, tokens: int) -> None:
        self.requests[replica] += 1
        self.tokens[replica] += tokens

    def finished(self, replica: int, tokens: int) -> None:
        self.requests[replica] -= 1
        self.tokens[replica] -= tokens

    def forget(self, replica: int) -> None:
        """The replica is gone (or flushed): its cache is empty."""
        self.trees[replica] = PrefixTree(self.trees[replica].max_tokens)
