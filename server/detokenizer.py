"""Token ids in, text out: incremental, UTF-8 safe, with stop strings caught across tokens.

`IncrementalDetokenizer.push(ids)` returns only text made of complete characters: while the
decoded tail ends in U+FFFD (a multi-byte character split across tokens) it waits for more
tokens. It decodes a short window (the previously emitted chunk plus the new tokens), never the
whole output again. Concatenating every `push` and the final `flush` gives `decode(all ids)`.

`TextStream` adds stop strings on top: text that could still become the start of a stop string is
held back; once a stop string appears the text is cut right before it (right after it with
`no_stop_trim`, as SGLang), `matched` names it, and nothing more is emitted.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the window: the last chunk already turned into text
        self.read_offset = 0  # tokens before this are emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return the new complete text (possibly empty)."""
        self.ids.extend(new_ids)
        if len(self.ids) == self.read_offset:
            return ""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if full.endswith(REPLACEMENT) or len(full) < len(prefix):
            return ""  # a character is still incomplete
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """The rest, incomplete characters shown as U+FFFD (call once, at the end)."""
        if len(self.ids) == self.read_offset:
            return ""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]


class TextStream:
    """One request's output text: `push` per delta, `finish` at the end; both return new text."""

    def __init__(
        self,
        tokenizer: Any,
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
        no_stop_trim: bool = False,
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stops = [s for s in (stop or []) if s]
        self.no_stop_trim = no_stop_trim
        self.text = ""  # all decoded text, cut before the stop string once one matched
        self.emitted = 0  # characters of `text` handed out
        self.matched: str | None = None

    def push(self, new_ids: list[int]) -> str:
        if self.matched is not None:
            return ""
        self.text += self.detok.push(new_ids)
        return self._advance(final=False)

    def finish(self) -> str:
        if self.matched is not None:
            return ""
        self.text += self.detok.flush()
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        text, start = self.text, self.emitted
        if self.stops:
            hits = [(i, s) for s in self.stops if (i := text.find(s, start)) >= 0]
            if hits:
                cut, self.matched = min(hits)
                if self.no_stop_trim:
                    cut += len(self.matched)
                self.text = text[:cut]
                self.emitted = cut
                return text[start:cut]
        safe = len(text) if final else len(text) - self._held(text)
        if safe <= start:
            return ""
        self.emitted = safe
        return text[start:safe]

    def _held(self, text: str) -> int:
        """Length of the longest tail of `text` that a stop string starts with."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
