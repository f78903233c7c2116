"""Token ids in, text out: incremental, UTF-8 safe, with stop strings caught across tokens.

`IncrementalDetokenizer.push(ids)` returns only text made of complete characters: while the
decoded tail ends in U+FFFD (a multi-byte character split across tokens) it waits for more
tokens. It is `tokenizers`' `DecodeStream` on the tokenizer's Rust backend, which decodes a short
window (the previously emitted chunk plus the new tokens), never the whole output again; `flush`
adds what `DecodeStream` lacks, the held incomplete tail as U+FFFD. Concatenating every `push` and
the final `flush` gives `decode(all ids)`.

`TextStream` adds stop strings on top: text that could still become the start of a stop string is
held back; once a stop string appears the text is cut right before it (right after it with
`no_stop_trim`, as SGLang), `matched` names it, and nothing more is emitted. Stop strings are
found by `StopMatcher` (Aho-Corasick), so each push costs time linear in its new text, however
many and however long the stop strings are; the first stop string to be completed wins (the
longest one when several complete at the same character).
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

from hybrid_serve.server.stop_matcher import StopMatcher


class IncrementalDetokenizer:
    """`tokenizer` is a fast (Rust-backed) transformers tokenizer."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.backend = tokenizer.backend_tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.chunk: list[int] = []  # ids of the last chunk turned into text: DecodeStream's window
        self.pending: list[int] = []  # ids pushed since, not yet text

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return the new complete text (possibly empty)."""
        if not new_ids:
            return ""
        one = new_ids[0] if len(new_ids) == 1 else list(new_ids)  # an int steps faster
        text = self.stream.step(self.backend, one)
        if text is None:  # a character is still incomplete
            self.pending += new_ids
            return ""
        self.chunk, self.pending = self.pending + new_ids, []
        return text

    def flush(self) -> str:
        """The rest, incomplete characters shown as U+FFFD (call once, at the end)."""
        if not self.pending:
            return ""
        skip = self.skip_special_tokens
        text = self.backend.decode(self.chunk + self.pending, skip_special_tokens=skip)
        text = text[len(self.backend.decode(self.chunk, skip_special_tokens=skip)) :]
        self.stream, self.chunk, self.pending = DecodeStream(skip_special_tokens=skip), [], []
        return text


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
        self.matcher = StopMatcher(self.stops) if self.stops else None
        self.no_stop_trim = no_stop_trim
        self.text = ""  # all decoded text, cut before the stop string once one matched
        self.emitted = 0  # characters of `text` handed out
        self.matched: str | None = None

    def push(self, new_ids: list[int]) -> str:
        if self.matched is not None:
            return ""
        return self._advance(self.detok.push(new_ids), final=False)

    def finish(self) -> str:
        if self.matched is not None:
            return ""
        return self._advance(self.detok.flush(), final=True)

    def _advance(self, new: str, final: bool) -> str:
        start = self.emitted
        self.text += new
        held = 0
        if self.matcher is not None:
            hit = self.matcher.feed(new)
            if hit is not None:
                end = self.matcher.fed  # the matcher stops feeding at the stop string's end
                self.matched = self.text[hit:end]
                cut = max(end if self.no_stop_trim else hit, start)
                self.text = self.text[:cut]
                self.emitted = cut
                return self.text[start:cut]
            held = self.matcher.held
        safe = len(self.text) if final else len(self.text) - held
        if safe <= start:
            return ""
        self.emitted = safe
        return self.text[start:safe]
