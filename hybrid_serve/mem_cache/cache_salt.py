"""`cache_salt`: requests with different salts never share cached prefixes.

The radix tree (both tiers) and the storage tier are keyed by token ids, so a salt is folded into
the key itself: a salted key's first element is a negative number made of a 39-bit digest of the
salt and the first token id (24 bits), and every later element is the token id as before. Token
ids are never negative (the API refuses them), so a salted key can equal neither an unsalted key
nor one under another salt (up to a 2**-39 digest collision between two salts): their paths part
at the root, matches stop there, `cached_tokens` counts only what the request's own salt could
hit, and the storage tier's hash chain (which starts from the first block's ids) differs too.
Everything else in the cache (splits, eviction, locks, host copies) is oblivious to salts: a
salted path is an ordinary path whose first key element no prompt can produce.

No salt (None or "") leaves the key unchanged, so unsalted requests share prefixes as before.
"""

from __future__ import annotations

import hashlib

SALT_BITS = 39
TOKEN_BITS = 24  # first-token ids up to 16M (vocabularies are far smaller)


def salt_digest(salt: str) -> int:
    return int.from_bytes(hashlib.sha256(salt.encode()).digest()[:8], "big") >> (64 - SALT_BITS)


def salted_key(ids: list[int], salt: str | None) -> list[int]:
    """The tree key of ``ids`` under ``salt``; int64-safe (it stays >= -2**63)."""
    if not salt or not ids:
        return ids
    first = ids[0]
    if not 0 <= first < 1 << TOKEN_BITS:
        raise ValueError(f"token id {first} is outside [0, 2**{TOKEN_BITS})")
    return [-1 - ((salt_digest(salt) << TOKEN_BITS) | first), *ids[1:]]
