"""GrammarBackend: each (kind, spec) compiled once, the mask allows exactly the grammar's next
tokens (and never a control character in JSON), a matcher ends with its grammar."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.scheduler.grammar import GrammarBackend


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("tiny"), preset_config("tiny"), seed=3)
    vocab = preset_config("tiny")["vocab_size"]
    return GrammarBackend(str(path), vocab), AutoTokenizer.from_pretrained(path), vocab


def test_compiles_are_cached_and_bad_grammars_refused(backend):
    grammars, _, _ = backend
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "boolean"}}})
    first = grammars.compile("json_schema", schema)
    assert grammars.compile("json_schema", schema) is first and grammars.compiles == 1
    grammars.compile("regex", "[ab]+")
    assert grammars.compiles == 2
    with pytest.raises(ValueError, match="invalid regex"):
        grammars.compile("regex", "(")
    with pytest.raises(ValueError, match="invalid json_schema"):
        grammars.compile("json_schema", "{")


def test_mask_follows_the_grammar_to_its_end(backend):
    grammars, tok, vocab = backend
    c = grammars.constraint("json_schema", json.dumps({"enum": ["yes", "no"]}))
    free = grammars.constraint("regex", "x")  # another row, and one with no constraint
    gen = torch.Generator().manual_seed(0)
    out: list[int] = []
    for _ in range(20):
        logits = torch.randn(3, vocab, generator=gen)
        grammars.mask_logits(logits, [None, c, free])
        assert torch.isfinite(logits[0]).all()
        allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
        assert allowed and all(all(ord(ch) >= 0x20 for ch in tok.decode([t])) for t in allowed)
        t = int(torch.softmax(logits[1], -1).multinomial(1, generator=gen))
        out.append(t)
        if GrammarBackend.advance([None, c, None], [0, t, 0]) == [1]:
            break
    text = tok.decode(out, skip_special_tokens=True)
    assert json.loads(text) in ("yes", "no")
