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


# What Llama 3.1's template writes (its tool instruction and an earlier turn's calls with ``tojson``), shortened.
LLAMA31 = ('{%- if tools %}Given the following functions, please respond with a JSON for a function call with its '
           'proper arguments that best answers the given prompt.\nRespond in the format {"name": function name, '
           '"parameters": dictionary of argument name and its value}.{% endif %}'
           '{%- for m in messages %}{%- if m.tool_calls %}{%- for c in m.tool_calls %}<|python_tag|>'
           '{{- \'{"name": "\' + c.function.name + \'", "parameters": \' }}{{- c.function.arguments | tojson }}'
           '{{- "}" }}{%- endfor %}{%- else %}{{ m.content }}{%- endif %}{%- endfor %}')


def test_llama3_json_calls():
    """``auto`` with a Llama 3.1 template: an answer that is JSON calls (after an optional ``<|python_tag|>``,
    several separated by ``;``) becomes tool_calls; anything else stays text; an earlier turn's arguments reach the
    template as an object, so its ``tojson`` writes them once."""
    from dspark_jax.chat_template import render_chat_template
    from dspark_jax.serve.tools import call_syntax, template_turn_calls

    auto = plan_tools(TOOLS, "auto", None, LLAMA31)
    assert auto.mode == "auto" and auto.syntax == "llama3_json" and call_syntax(HERMES) == "hermes"
    content, calls = parse_calls(auto, '{"name": "f", "parameters": {"x": 3}}')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"x": 3}
    content, calls = parse_calls(auto, '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", '
                                       '"parameters": {}}')
    assert content is None and [c["function"]["name"] for c in calls] == ["f", "g"]
    for text in ('The answer is {"x": 1}', '{"x": 1}', '{"name": "f", "parameters": {"x": 1}} and more',
                 '{"name": "f", "param', "Hello."):
        assert parse_calls(auto, text) == (text, []), text
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 3}'}},
        {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]}
    given = template_turn_calls(turn["tool_calls"])
    assert given[0]["function"]["arguments"] == {"x": 3} and given[1]["function"]["arguments"] == "not json"
    assert turn["tool_calls"][0]["function"]["arguments"] == '{"x": 3}'  # the request's own turn is not changed
    text = render_chat_template(LLAMA31, [{**turn, "tool_calls": given[:1]}])
    assert '<|python_tag|>{"name": "f", "parameters": {"x": 3}}' in text
