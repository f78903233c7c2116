"""Structured output over HTTP (xgrammar masks, random weights): `response_format` json_schema
output parses and satisfies the schema for 20 seeds, streaming and not; SGLang's native `regex`
and `json_schema`; a bad grammar is a 400; the compile of each grammar is cached."""

from __future__ import annotations

import json
import re

import pytest

from tests.server.conftest import MODEL_NAME, wait_idle_and_clean

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "ok"],
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}


def check_person(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == set(SCHEMA["required"])
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6
    assert type(obj["age"]) is int and 0 <= obj["age"] <= 120
    assert obj["pet"] in ("cat", "dog") and type(obj["ok"]) is bool


def chat_body(**extra) -> dict:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Describe a person as JSON."}],
        "max_tokens": 120,
        "temperature": 1.0,
        "seed": 0,
        "n": 20,
        "response_format": FORMAT,
        **extra,
    }


def test_json_schema_output_always_validates(http):
    r = http.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 20
    for c in choices:
        assert c["finish_reason"] == "stop", c
        check_person(c["message"]["content"])
    assert len({c["message"]["content"] for c in choices}) > 1  # the seeds really differ
    texts = [""] * 20
    with http.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] += c["delta"].get("content") or ""
    assert texts == [c["message"]["content"] for c in choices]  # same seeds, same output
    for t in texts:
        check_person(t)
    assert wait_idle_and_clean(http)["problems"] == []


def test_native_regex_and_json_schema(http):
    sp = {"max_new_tokens": 40, "temperature": 1.0, "sampling_seed": 3}
    for seed in range(4):
        sp["sampling_seed"] = seed
        body = {"text": "Phone:", "sampling_params": {**sp, "regex": r"\(\d{3}\) \d{3}-\d{4}"}}
        out = http.post("/generate", json=body).json()
        assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", out["text"]), out["text"]
        body["sampling_params"] = {**sp, "max_new_tokens": 120, "json_schema": json.dumps(SCHEMA)}
        check_person(http.post("/generate", json=body).json()["text"])
    completion = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 120, "response_format": FORMAT}
    check_person(http.post("/v1/completions", json=completion).json()["choices"][0]["text"])


@pytest.mark.parametrize(
    "sampling",
    [{"regex": "(unclosed"}, {"json_schema": "{not json"}, {"regex": "a", "ebnf": 'root ::= "a"'}],
)
def test_bad_grammar_is_a_400(http, sampling):
    body = {"text": "x", "sampling_params": {"max_new_tokens": 4, **sampling}}
    r = http.post("/generate", json=body)
    assert r.status_code == 400, r.text


def test_bad_response_format_is_a_400(http):
    bad = {**chat_body(n=1), "response_format": {"type": "json_schema", "json_schema": {}}}
    r = http.post("/v1/chat/completions", json=bad)
    assert r.status_code == 400 and r.json()["param"] == "response_format"
