"""Tool calls and reasoning over HTTP on the Mamba2 families' tiny presets, each served with the
default flags, so the parsers are `auto`'s pick from the checkpoint's own chat template:
Nemotron-3-Nano's (`qwen3` reasoning switched by `enable_thinking`, `qwen3_coder` XML calls) on
`tiny-nemotron-h`, Granite 4.0's (`qwen25` JSON calls, no reasoning) on `tiny-granite-4.0-h`.

A forced tool_choice returns one parsed call with valid JSON arguments, streamed and not (the
grammar writes the call in the template's format, so random weights still make one). The
thinking switch changes Nemotron's prompt (an open `<think>` or an empty closed one), and so
whether the output is split at `</think>`; Granite never splits. The outputs with `</think>`
are forced with `ebnf` (random weights rarely write it). One server per family, one at a time;
the request helpers are those of the Qwen3.5 reasoning tests.
"""

from __future__ import annotations

import httpx
import pytest

from hybrid_serve.make_model.catalog import family_of_config
from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from tests.server.conftest import running, serve_command, wait_idle_and_clean
from tests.server.test_reasoning_server import (
    OFF,
    WEATHER,
    chat,
    check_weather,
    collect,
    forced,
    joined,
)

# whether the template has a reasoning format: the family table's row for the preset says
THINKS = {
    preset: family_of_config(preset_config(preset)).reasoning_format is not None
    for preset in ("tiny-nemotron-h", "tiny-granite-4.0-h")
}


@pytest.fixture(scope="module", params=list(THINKS))
def family(request, tmp_path_factory) -> tuple[str, httpx.Client]:
    preset = request.param
    path = write_checkpoint(tmp_path_factory.mktemp(preset), preset_config(preset), seed=5)
    log = tmp_path_factory.mktemp(f"{preset}-log") / "server.log"
    with running(serve_command(path, "--context-length", "2048"), log) as srv:
        with httpx.Client(base_url=srv.url, timeout=300) as c:
            yield preset, c


def test_forced_tool_choice_gives_a_parsed_call(family):
    _, http = family
    named = {"type": "function", "function": {"name": "get_weather"}}
    # thinking off (Nemotron; Granite's template ignores the switch): the call comes first
    body = chat(tools=[WEATHER], tool_choice=named, chat_template_kwargs=OFF, max_tokens=200)
    c = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert c["finish_reason"] == "tool_calls", c
    message = c["message"]
    assert message["content"] is None and message["reasoning_content"] is None
    assert len(message["tool_calls"]) == 1
    check_weather(message["tool_calls"][0])
    deltas, finish = collect(http, body)
    calls = [e for d in deltas for e in d.get("tool_calls", [])]
    assert finish == "tool_calls" and len(calls) >= 2  # the name, then the arguments
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    streamed = "".join(e["function"]["arguments"] for e in calls)
    assert streamed == message["tool_calls"][0]["function"]["arguments"]


def test_thinking_switch_splits_the_reasoning(family):
    preset, http = family
    text = "The user wants weather.</think>It is sunny."
    body = chat(ebnf=forced(text))
    default = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    off = chat(ebnf=forced(text), chat_template_kwargs=OFF)
    switched = http.post("/v1/chat/completions", json=off).json()["choices"][0]["message"]
    plain = {"role": "assistant", "content": text, "reasoning_content": None}
    assert switched == plain  # Nemotron's prompt closed the think block; Granite has none
    if not THINKS[preset]:
        assert default == plain
        return
    # Nemotron thinks by default: its prompt leaves <think> open
    assert default["reasoning_content"] == "The user wants weather."
    assert default["content"] == "It is sunny."
    deltas, finish = collect(http, body)
    assert finish == "stop" and joined(deltas, "content") == "It is sunny."
    assert joined(deltas, "reasoning_content") == "The user wants weather."
    assert wait_idle_and_clean(http)["problems"] == []
