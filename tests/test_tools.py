"""Tool calls' plumbing (`dspark_jax.serve.tools`): plans by tool_choice, the forcing schemas, parsing."""

import json

import pytest

from dspark_jax.serve.tools import ToolError, parse_calls, plan_tools

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}, "required": ["x"]}}}, {"type": "function", "function": {"name": "g"}}]
HERMES = "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}<tool_call>{% endif %}"


def test_plans_by_tool_choice():
    assert plan_tools(None, None, None, None) is None and plan_tools([], "none", None, None) is None
    required = plan_tools(TOOLS, "required", None, None)
    assert required.schema["type"] == "array" and len(required.schema["items"]["anyOf"]) == 2
    assert "anyOf" in plan_tools(TOOLS, "required", False, None).schema
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "f"}}, None, None)
    assert named.mode == "named" and named.schema == TOOLS[0]["function"]["parameters"]
    assert plan_tools(TOOLS, "none", None, None).schema is None
    assert plan_tools(TOOLS, None, None, HERMES).mode == "auto"
    # the default system message for a template without tools, added to the conversation's own
    turns, kw = required.messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert kw == {} and turns[0]["content"].startswith("Be brief.") and '"name": "f"' in turns[0]["content"]
    assert plan_tools(TOOLS, "auto", None, HERMES).messages([{"role": "user", "content": "hi"}])[1]["tools"]


@pytest.mark.parametrize("tools,choice,param", [
    (TOOLS, None, "tool_choice"), (TOOLS, "auto", "tool_choice"), (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "h"}}, "tool_choice"), (None, "required", "tool_choice"),
    ([{"type": "function", "function": {"name": "a b"}}], "required", "tools.0.function.name"),
    ([TOOLS[0], TOOLS[0]], "required", "tools.1.function.name"), ([{"type": "code"}], "required", "tools.0"),
])
def test_refusals_name_the_field(tools, choice, param):
    with pytest.raises(ToolError) as e:
        plan_tools(tools, choice, None, None)
    assert e.value.param == param


def test_parse_calls():
    required = plan_tools(TOOLS, "required", None, None)
    content, calls = parse_calls(required, '[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]')
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("f", {"x": 1}), ("g", {})]
    assert parse_calls(required, '[{"name": "f", "argu')[1] == []  # cut by its budget: no call
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "f"}}, None, None)
    assert json.loads(parse_calls(named, '{"x": 2}')[1][0]["function"]["arguments"]) == {"x": 2}
    auto = plan_tools(TOOLS, "auto", None, HERMES)
    content, calls = parse_calls(auto, 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 3}}\n</tool_call>')
    assert content == "Sure." and calls[0]["function"]["name"] == "f"
    assert parse_calls(auto, "no call") == ("no call", [])
