"""Structured output: a token bitmask from a grammar, applied to the logits before sampling.

SGLang's constraint kinds, compiled by xgrammar (the library SGLang uses by default; it runs
on CPU): `json_schema` (a JSON schema string), `json` (any JSON object, OpenAI's
`response_format: json_object`), `regex` and `ebnf`. Each distinct (kind, spec) is compiled once
(`GrammarBackend.compile`, an LRU of compiled grammars); each request gets its own matcher,
which follows its sampled tokens. Per step, `mask_logits` fills one bitmask row per constrained
request and sets every token the grammar forbids to -inf, batched; after sampling, `advance`
feeds each token to its matcher and reports the requests whose grammar has ended (they finish
with "stop"). The tokenizer is loaded on the first constrained request only.

JSON kinds also forbid every token holding a control character (U+0000-U+001F): xgrammar's JSON
strings admit them raw, which strict JSON parsers (Python's `json.loads`) refuse; JSON never
needs them (strings escape them, and the schema grammar uses single-line separators).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

KINDS = ("json_schema", "json", "regex", "ebnf")


@dataclass
class Constraint:
    """One request's grammar state."""

    matcher: Any  # xgrammar.GrammarMatcher, advanced by every sampled token
    ban_control: bool  # JSON: tokens with control characters are never allowed


class GrammarBackend:
    def __init__(self, model_path: str, vocab_size: int, cache_size: int = 256) -> None:
        self.model_path, self.vocab_size, self.cache_size = model_path, vocab_size, cache_size
        self._compiler: Any = None
        self._control_ids: torch.Tensor | None = None  # tokens holding a control character
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.compiles = 0  # grammars compiled so far (cache misses)

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.model_path)
            info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            control = [i for i, b in enumerate(info.decoded_vocab) if any(c < 0x20 for c in b)]
            self._control_ids = torch.tensor(control, dtype=torch.int64)
        return self._compiler

    def compile(self, kind: str, spec: str) -> Any:
        """The compiled grammar of (kind, spec), from the cache when seen before; ValueError
        naming the kind when the spec is not a valid grammar."""
        key = (kind, spec)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        compiler = self._get_compiler()
        try:
            if kind == "json_schema":
                json.loads(spec)
                grammar = compiler.compile_json_schema(spec, any_whitespace=False)
            elif kind == "json":
                grammar = compiler.compile_builtin_json_grammar()
            elif kind == "regex":
                grammar = compiler.compile_regex(spec)
            elif kind == "ebnf":
                grammar = compiler.compile_grammar(spec)
            else:
                raise ValueError(f"unknown grammar kind {kind!r}; one of {KINDS}")
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"invalid {kind}: {e}") from e
        self.compiles += 1
        self._cache[key] = grammar
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return grammar

    def constraint(self, kind: str, spec: str) -> Constraint:
        import xgrammar as xgr

        grammar = self.compile(kind, spec)
        return Constraint(xgr.GrammarMatcher(grammar), kind in ("json", "json_schema"))

    def mask_logits(self, logits: torch.Tensor, constraints: list[Constraint | None]) -> None:
        """In place: forbid, in each constrained row, the tokens its grammar does not allow
        next (rows without a constraint are left alone)."""
        import xgrammar as xgr

        rows = [i for i, c in enumerate(constraints) if c is not None]
        if not rows:
            return
        bitmask = xgr.allocate_token_bitmask(len(constraints), self.vocab_size)
        for i in rows:
            constraints[i].matcher.fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device), vocab_size=self.vocab_size, indices=rows
        )
        banned = self._control_ids
        json_rows = [i for i in rows if constraints[i].ban_control]
        if json_rows and banned is not None and banned.numel():
            ids = banned.to(logits.device)
            logits[torch.tensor(json_rows, device=logits.device).unsqueeze(1), ids] = float("-inf")

    @staticmethod
    def advance(constraints: list[Constraint | None], tokens: list[int]) -> list[int]:
        """Feed each sampled token to its matcher; the rows whose grammar has now ended (or
        rejected the token, which the mask rules out) are returned."""
        ended = []
        for i, (c, t) in enumerate(zip(constraints, tokens, strict=True)):
            if c is None:
                continue
            if not c.matcher.accept_token(t) or c.matcher.is_terminated():
                ended.append(i)
        return ended
