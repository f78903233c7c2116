"""Incremental detokenization (never a broken character, same text as one decode) and stop
strings across token boundaries, token by token on the tiny preset's byte-level tokenizer."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from hybrid_serve.server.detokenizer import IncrementalDetokenizer, TextStream

REPLACEMENT = "\ufffd"  # what decoding part of a character's bytes gives


@pytest.fixture(scope="module")
def tok(tiny_path):
    return AutoTokenizer.from_pretrained(tiny_path)


def feed(stream, ids: list[int]) -> list[str]:
    return [stream.push([t]) for t in ids]


def test_multibyte_characters_split_across_tokens(tok):
    text = "naïve café — 你好世界 🙂👍 ok"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(REPLACEMENT in tok.decode([t]) for t in ids)  # some tokens are partial characters
    d = IncrementalDetokenizer(tok)
    deltas = feed(d, ids)
    assert not any(REPLACEMENT in x for x in deltas)
    assert "".join(deltas) + d.flush() == text


def test_random_ids_join_to_one_decode(tok):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        d = IncrementalDetokenizer(tok)
        pieces = []
        i = 0
        while i < len(ids):
            n = rng.randrange(1, 4)
            pieces.append(d.push(ids[i : i + n]))
            i += n
        pieces.append(d.flush())
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)


def test_stop_string_spanning_tokens_is_trimmed(tok):
    text = "The answer is 42. Question: what next? Question again"
    ids = tok.encode(text, add_special_tokens=False)
    s = TextStream(tok, stop=["Question", "zzz"])
    out = "".join(feed(s, ids)) + s.finish()
    assert out == "The answer is 42. "
    assert s.matched == "Question"
    # the partial "Quest" was held back, never emitted before the match
    s2 = TextStream(tok, stop=["Question"])
    emitted = ""
    for t in ids:
        emitted += s2.push([t])
        assert "Q" not in emitted
        if s2.matched:
            break


def test_no_stop_match_flushes_the_held_tail(tok):
    text = "ends with Quest"
    ids = tok.encode(text, add_special_tokens=False)
    s = TextStream(tok, stop=["Question"])
    streamed = "".join(feed(s, ids))
    assert not streamed.endswith("Quest")  # held: it may still become the stop string
    assert streamed + s.finish() == text
    assert s.matched is None


def test_special_tokens_skipped(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("hello", add_special_tokens=False) + [eos]
    d = IncrementalDetokenizer(tok)
    assert "".join(feed(d, ids)) + d.flush() == "hello"


def test_no_stop_trim_keeps_the_stop_string(tok):
    ids = tok.encode("abc Question def", add_special_tokens=False)
    s = TextStream(tok, stop=["Question"], no_stop_trim=True)
    assert "".join(feed(s, ids)) + s.finish() == "abc Question"
    assert s.matched == "Question"


def test_many_long_stop_strings_cost_time_linear_in_the_text(tok):
    """1,000 stop strings of 1,000 characters that all share the streamed prefix (the worst case
    for a scan of every held tail; the issue-13 stall took 113 s) cost O(1) steps per character:
    each character is fed to the matcher once and follows at most one failure link, amortised
    (counted, not timed, so the check holds on any CPU)."""
    from tests.server.test_stop_matcher import CountingList

    text = "a" * 300 + "b"
    stops = ["a" * 999 + chr(0x4E00 + i) for i in range(1000)]
    ids = tok.encode(text, add_special_tokens=False)
    s = TextStream(tok, stop=stops)
    s.matcher.fail = CountingList(s.matcher.fail)
    streamed = "".join(feed(s, ids))
    assert streamed + s.finish() == text and s.matched is None
    assert s.matcher.fed == len(text) and s.matcher.fail.reads <= len(text)
