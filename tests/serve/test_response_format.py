"""Structured output through the OpenAI API on the live tiny model (draft-target speculation):
response_format on both endpoints, vLLM's guided_* fields, streamed and whole answers alike;
bad constraints are refused before a response opens (tests/serve/test_app.py)."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from live_server import MODEL_NAME

from specjax.bench.structured import CHOICES, REGEXES, SCHEMAS

openai = pytest.importorskip("openai")

SCHEMA = SCHEMAS[0]
CHAT = [{"role": "user", "content": "Give me a person as JSON."}]


@pytest.fixture
def client(server):
    return openai.OpenAI(api_key=server.headers["Authorization"].split()[1],
                         base_url=f"{server.url}/v1", max_retries=0, timeout=60)


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                   "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_json_schema_validates_streamed_or_not(server, client, temperature):
    kwargs = dict(model=MODEL_NAME, messages=CHAT, max_tokens=80, temperature=temperature,
                  seed=7, response_format=json_schema_format(SCHEMA))
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "stop"
    jsonschema.validate(json.loads(whole.message.content), SCHEMA)
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(**kwargs, stream=True) if c.choices)
    assert streamed == whole.message.content


def test_completions_take_response_format_and_guided_fields(server, client):
    out = client.completions.create(model=MODEL_NAME, prompt="config = ", max_tokens=80,
                                    temperature=0, n=2,
                                    extra_body={"response_format": json_schema_format(
                                        SCHEMAS[2])})
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), SCHEMAS[2])
    out = client.completions.create(model=MODEL_NAME, prompt="x = ", max_tokens=30,
                                    temperature=0.8, seed=1,
                                    extra_body={"guided_regex": REGEXES[0]})
    assert re.fullmatch(REGEXES[0], out.choices[0].text), out.choices[0].text
    out = client.completions.create(model=MODEL_NAME, prompt=["a", "b"], max_tokens=10,
                                    extra_body={"guided_choice": CHOICES[1]})
    assert all(c.text in CHOICES[1] for c in out.choices)


def test_json_object_is_a_json_object_or_cut_by_length(server, client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=100,
                                         temperature=0,
                                         response_format={"type": "json_object"}).choices[0]
    text = out.message.content
    assert text.startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:   # an unbounded object may outrun max_tokens, as with any engine
        assert out.finish_reason == "length"
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)
