"""Structured output and forced tool calls through the real server and the official `openai` client, on the real
SmolLM2 model with the shipped DSpark drafter: every JSON-schema answer parses and validates, greedy answers under
``dspark`` are those of plain decoding (``none``), byte for byte, and ``tool_choice: required`` always calls a tool
with valid arguments, streamed or not."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                     "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4}},
        "required": ["colors"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "stars": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["sentiment", "stars"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 100}, "b": {"type": "integer", "minimum": 0, "maximum": 100},
        "sum": {"type": "integer", "minimum": 0, "maximum": 200},
        "ok": {"type": "boolean"}},
        "required": ["a", "b", "sum", "ok"], "additionalProperties": False},
}
QUESTIONS = {
    "nested": "Invent a person living in Paris. Answer in JSON with name and address (city, zip).",
    "array": "List three colours of the rainbow in JSON.",
    "enum": "Review: 'The film was wonderful.' Give the sentiment and a star rating in JSON.",
    "numbers": "Add 12 and 30. Answer in JSON with a, b, sum and whether the sum is even (ok).",
}


@pytest.fixture(scope="module")
def servers(target):
    from dspark_jax.build import build_engine
    from dspark_jax.serve import BackgroundServer, EngineWorker, create_app

    urls = {}
    with contextlib.ExitStack() as stack:
        for policy in ("dspark", "none"):
            engine = build_engine(target, policy, num_slots=4, max_prompt_tokens=160, max_new_tokens=96)
            app = create_app(EngineWorker(engine), target.tokenizer, "smol", default_max_tokens=80)
            urls[policy] = stack.enter_context(BackgroundServer(app))
        yield {p: openai.OpenAI(base_url=f"{u}/v1", api_key="x", max_retries=0) for p, u in urls.items()}


def ask(client, name, **kw):
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": QUESTIONS[name]}],
                                       response_format=fmt, max_tokens=80, **kw)
    return r.choices[0]


def test_json_schema_answers_validate_and_dspark_equals_plain_decoding(servers):
    """Four schemas (nested objects, arrays, enums, integers and booleans), asked concurrently on each server:
    every greedy answer ends by its grammar, parses and validates; the dspark server's text equals the none
    server's. Sampled answers (temperature 0.8) validate too."""
    names = list(SCHEMAS)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        greedy = {p: list(pool.map(lambda n, c=c: ask(c, n, temperature=0), names)) for p, c in servers.items()}
        sampled = list(pool.map(lambda n: ask(servers["dspark"], n, temperature=0.8, seed=7), names * 2))
    for name, a, b in zip(names, greedy["dspark"], greedy["none"]):
        assert a.message.content == b.message.content, name
        assert a.finish_reason == "stop", (name, a.message.content)
        jsonschema.validate(json.loads(a.message.content), SCHEMAS[name])
    for name, c in zip(names * 2, sampled):
        if c.finish_reason == "stop":  # a sampled answer may run out of budget inside a string
            jsonschema.validate(json.loads(c.message.content), SCHEMAS[name])
    assert sum(c.finish_reason == "stop" for c in sampled) >= 6


def test_json_object_regex_and_choice(servers):
    client = servers["dspark"]
    msgs = [{"role": "user", "content": "Describe a cat in JSON."}]
    r = client.chat.completions.create(model="smol", messages=msgs, response_format={"type": "json_object"},
                                       max_tokens=60, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Is water wet?"}],
                                       max_tokens=10, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="smol", prompt="The year the Eiffel tower was finished:", max_tokens=10,
                                  temperature=0, extra_body={"guided_regex": r"1[89][0-9]{2}"})
    assert len(r.choices[0].text) == 4 and r.choices[0].text[:2] in ("18", "19")
    stream = client.chat.completions.create(model="smol", messages=msgs, max_tokens=60, temperature=0,
                                            response_format={"type": "json_object"}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        client.chat.completions.create(model="smol", messages=msgs, max_tokens=60, temperature=0,
                                       response_format={"type": "json_object"}).choices[0].message.content


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                         "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
        "required": ["a", "b"], "additionalProperties": False}}},
]


def test_required_tool_calls_validate_and_stream_as_they_answer(servers):
    """tool_choice 'required' with two tools (SmolLM2's template renders none: the default system message lists
    them): every answer calls a tool, its arguments validate against that tool's schema; the streamed calls equal
    the unstreamed ones (names and arguments); a named function gets that function's arguments; a tool turn is
    taken back."""
    client = servers["dspark"]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    questions = ["What is the weather in Oslo?", "What is 17 plus 25?", "Is it raining in Lima, in fahrenheit?",
                 "Add 3 and 4."]

    def call(q, stream, **kw):
        args = dict(model="smol", messages=[{"role": "user", "content": q}], tools=TOOLS, max_tokens=80,
                    temperature=0, **kw)
        if not stream:
            c = client.chat.completions.create(**args).choices[0]
            assert c.finish_reason == "tool_calls", c
            return [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
        calls, reasons = [], []
        for chunk in client.chat.completions.create(stream=True, **args):
            for ch in chunk.choices:
                calls += [(t.function.name, t.function.arguments) for t in ch.delta.tool_calls or []]
                reasons.append(ch.finish_reason)
        assert reasons[-1] == "tool_calls"
        return calls

    for q in questions:
        got = call(q, False, tool_choice="required")
        assert got and got == call(q, True, tool_choice="required")
        for name, arguments in got:
            jsonschema.validate(json.loads(arguments), schemas[name])
    named = call("Weather in Rome?", False, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [n for n, _ in named] == ["get_weather"]
    jsonschema.validate(json.loads(named[0][1]), schemas["get_weather"])
    single = call("Add 1 and 2.", False, tool_choice="required", parallel_tool_calls=False)
    assert len(single) == 1
    r = client.chat.completions.create(model="smol", max_tokens=20, temperature=0, tools=TOOLS, tool_choice="none",
                                       messages=[{"role": "user", "content": "Add 1 and 2."},
                                                 {"role": "assistant", "content": None, "tool_calls": [
                                                     {"id": "c1", "type": "function", "function": {
                                                         "name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
                                                 {"role": "tool", "tool_call_id": "c1", "content": "3"}])
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
