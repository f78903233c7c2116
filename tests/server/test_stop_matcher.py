"""The Aho-Corasick stop matcher against a brute-force scan, fed in random chunks."""

from __future__ import annotations

import random

from hybrid_serve.server.stop_matcher import StopMatcher


class CountingList(list):
    """A list that counts its reads: the matcher's failure links, to count the steps a feed
    takes (the work, not the clock, so the check holds on any CPU)."""

    reads = 0

    def __getitem__(self, i):
        self.reads += 1
        return super().__getitem__(i)


def _naive(stops: list[str], text: str) -> tuple[int | None, int]:
    """(start of the first stop string to complete, longest-first at a tie; held tail)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if s and text[:end].endswith(s)]
        if ending:
            return end - max(map(len, ending)), 0
    held = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return None, held


def test_matches_brute_force_on_random_text():
    rng = random.Random(0)
    for _ in range(400):
        alphabet = "ab" if rng.random() < 0.5 else "abc"
        stops = [
            "".join(rng.choices(alphabet, k=rng.randint(1, 5))) for _ in range(rng.randint(1, 4))
        ]
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 30)))
        m, pos, got = StopMatcher(stops), 0, None
        while pos < len(text) and got is None:
            step = rng.randint(1, 4)
            got = m.feed(text[pos : pos + step])
            pos += step
        want, held = _naive(stops, text)
        assert got == want, (stops, text)
        if want is None:
            assert m.held == held, (stops, text)


def test_many_long_stop_strings_stay_fast():
    rng = random.Random(1)
    stops = ["".join(rng.choices("abcdefgh", k=1000)) for _ in range(100)]
    m = StopMatcher(stops)
    m.fail = CountingList(m.fail)
    text = "".join(rng.choices("abcdefgh", k=20_000))
    for i in range(0, len(text), 4):
        m.feed(text[i : i + 4])
    # the quadratic tail check cost ~len(stop)^2 per stop string per token (~1e8 steps here);
    # Aho-Corasick follows at most one failure link per character fed, amortised
    assert m.fail.reads <= len(text)
