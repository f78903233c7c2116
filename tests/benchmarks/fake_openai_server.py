"""A small fake OpenAI-compatible server for the benchmark scripts' end-to-end tests.

`FakeOpenAIServer` runs FastAPI under uvicorn in a daemon thread on 127.0.0.1 (a free port) and
serves `/v1/models`, `/v1/completions` and `/v1/chat/completions`, streamed (SSE, `[DONE]`,
`stream_options.include_usage`) or not. A "token" is a whitespace-led word of the text (or one id
of a token-id prompt). The answer to a prompt is looked up by the last "Question: ..." in it
(`answers`; None there means HTTP 500), else it is a canned sentence; `ignore_eos` answers exactly
`max_tokens` tokens. `stop` strings truncate the answer (finish_reason "stop"). Usage reports
`cached_tokens` = the longest token prefix shared with any earlier prompt, like a prefix cache.
Requests whose arrival index (0-based, all endpoints together) is in `fail_requests` get HTTP 500.
Every request body is kept in `bodies`; `/v1/models` lists "fake-model" with `root=model_root`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

CANNED = " I think the answer is 42."
_QUESTION = re.compile(r"Question: (.*?)\nAnswer:", re.S)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class FakeOpenAIServer:
    def __init__(
        self,
        answers: dict[str, str | None] | None = None,
        fail_requests: set[int] | None = None,
        model_root: str | None = None,
    ) -> None:
        self.answers = answers or {}
        self.model_root = model_root
        self.fail_requests = fail_requests or set()
        self.bodies: list[dict] = []
        self._seen: list[list[str]] = []
        self._count = itertools.count()
        self.port = free_port()
        self.app = self._build_app()
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeOpenAIServer:
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def _answer_tokens(self, prompt_text: str, body: dict) -> tuple[list[str] | None, str]:
        """(tokens of the answer or None for a 500, finish_reason)."""
        max_tokens = int(body.get("max_tokens") or 16)
        if body.get("ignore_eos"):
            return [" tok"] * max_tokens, "length"
        found = _QUESTION.findall(prompt_text)
        answer = self.answers.get(found[-1], CANNED) if found else CANNED
        if answer is None:
            return None, ""
        tokens = re.findall(r"\s*\S+", answer)
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        text, out = "", []
        for tok in tokens[:max_tokens]:
            hits = [(text + tok).find(s) for s in stops if s in text + tok]
            if hits:
                cut = min(hits) - len(text)
                if cut > 0:
                    out.append(tok[:cut])
                return out, "stop"
            text += tok
            out.append(tok)
        return out, "length" if len(tokens) > max_tokens else "stop"

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict:
            card = {"id": "fake-model", "object": "model", "root": self.model_root}
            return {"object": "list", "data": [card]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._handle(await request.json(), chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self._handle(await request.json(), chat=True)

        return app

    async def _handle(self, body: dict, chat: bool):
        self.bodies.append(body)
        index = next(self._count)
        if chat:
            prompt = body["messages"][-1]["content"]
        else:
            prompt = body["prompt"]
        tokens = [str(t) for t in prompt] if isinstance(prompt, list) else prompt.split()
        text = prompt if isinstance(prompt, str) else ""
        cached = max((_common_prefix(tokens, s) for s in self._seen), default=0)
        self._seen.append(tokens)
        answer, finish = self._answer_tokens(text, body)
        if index in self.fail_requests or answer is None:
            error = {
                "object": "error",
                "message": "injected failure",
                "type": "Internal",
                "code": 500,
            }
            return JSONResponse(error, status_code=500)
        usage = {
            "prompt_tokens": len(tokens),
            "completion_tokens": len(answer),
            "total_tokens": len(tokens) + len(answer),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        head = {"id": f"cmpl-{index}", "created": int(time.time()), "model": body.get("model")}
        if not body.get("stream"):
            joined = "".join(answer)
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": joined}}
                if chat
                else {"index": 0, "text": joined}
            )
            obj = "chat.completion" if chat else "text_completion"
            choice["finish_reason"] = finish
            return {**head, "object": obj, "choices": [choice], "usage": usage}
        include_usage = (body.get("stream_options") or {}).get("include_usage")
        return StreamingResponse(
            self._stream(head, answer, finish, usage, chat, include_usage),
            media_type="text/event-stream",
        )

    async def _stream(self, head, answer, finish, usage, chat, include_usage):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list, extra: dict | None = None) -> str:
            data = {**head, "object": obj, "choices": choices, **(extra or {})}
            return f"data: {json.dumps(data)}\n\n"

        if chat:
            yield event(
                [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
            )
        for i, tok in enumerate(answer):
            await asyncio.sleep(0.001)
            last = finish if i == len(answer) - 1 else None
            part = {"delta": {"content": tok}} if chat else {"text": tok}
            yield event([{"index": 0, **part, "finish_reason": last}])
        if include_usage:
            yield event([], {"usage": usage})
        yield "data: [DONE]\n\n"
