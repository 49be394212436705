"""Tool calls for the OpenAI API: the request's ``tools`` into the prompt, ``tool_choice`` forced by a grammar, and
the answer parsed into OpenAI ``tool_calls``.

- ``tool_choice: "required"``: the answer is a JSON array of calls (one call when ``parallel_tool_calls`` is
  false), each ``{"name": <a tool's name>, "arguments": <valid for that tool's parameters>}``, forced by a JSON
  schema grammar (`grammar.Grammar.json_schema`), so it always parses and its arguments always validate.
- a named function (``{"type": "function", "function": {"name": ...}}``): the answer is that function's arguments,
  a JSON value valid for its parameters.
- ``"none"``: no call; the tools are still shown to the model, as OpenAI does.
- ``"auto"`` (the default with tools): only where the chat template renders ``tools`` and writes calls in a syntax
  parsed here (`SYNTAXES`): Hermes' ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (Qwen2.5, Qwen3,
  Hermes), or Llama 3.1-3.3's JSON calls, an answer that is ``{"name": ..., "parameters": ...}`` (several
  separated by ``;``, after an optional ``<|python_tag|>``), as vLLM's ``llama3_json`` parser reads them; refused
  by name (400) elsewhere.

Where the template does not render ``tools`` (SmolLM2's), the tools go into a default system message
(`TOOL_SYSTEM`), appended to the conversation's own system message when it has one. Earlier turns: an assistant
turn's ``tool_calls`` and a ``tool`` turn's result are passed to a template that renders tools as they are, and
written as text (the calls as the JSON this module asks for) for one that does not.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Sequence

__all__ = ["TOOL_SYSTEM", "SYNTAXES", "ToolPlan", "plan_tools", "parse_calls", "renders_tools", "call_syntax",
           "calls_as_text", "template_turn_calls"]

TOOL_SYSTEM = ("You can call the following functions. Their arguments follow these JSON schemas:\n{tools}\n"
               "To call functions, answer with JSON only: a list of calls, each "
               '{{"name": <function name>, "arguments": <an object of its arguments>}}.')
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_PYTHON_TAG = "<|python_tag|>"
# The syntaxes ``auto`` parses, each recognised by what its chat template writes.
SYNTAXES = ("hermes", "llama3_json")


class ToolError(ValueError):
    """A malformed ``tools`` / ``tool_choice``, or one this model cannot serve: ``param`` names the field."""

    def __init__(self, param: str, message: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def renders_tools(template: str | None) -> bool:
    """Whether a chat template renders the ``tools`` variable."""
    return template is not None and re.search(r"\btools\b", template) is not None


def call_syntax(template: str | None) -> str | None:
    """The tool-call syntax a chat template teaches its model (one of `SYNTAXES`), None for none parsed here:
    ``hermes`` where it writes ``<tool_call>``; ``llama3_json`` where it asks for Llama 3.1's JSON calls (its
    ``<|python_tag|>`` or its ``"parameters": dictionary of argument name`` instruction).

    >>> call_syntax("{{ tools }}<tool_call>"), call_syntax('{"name": function name, "parameters": dictionary of '
    ...     'argument name and its value}'), call_syntax("{{ messages }}")
    ('hermes', 'llama3_json', None)
    """
    if template is None:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if _PYTHON_TAG in template or '"parameters": dictionary of argument name' in template:
        return "llama3_json"
    return None


class ToolPlan:
    """What a request's tools do: ``mode`` (``none``, ``auto``, ``required``, ``named``), the tools, the JSON schema
    that forces the answer (None for ``none`` and ``auto``), whether the template renders the tools and, for
    ``auto``, the call syntax parsed from the answer (`SYNTAXES`)."""

    def __init__(self, mode: str, tools: list[dict], schema: dict | None, in_template: bool, name: str | None = None,
                 syntax: str | None = None):
        self.mode, self.tools, self.schema, self.in_template, self.name = mode, tools, schema, in_template, name
        self.syntax = syntax

    def messages(self, turns: list[dict]) -> tuple[list[dict], dict]:
        """The conversation and the template's keyword arguments: ``tools`` for a template that renders them, else
        the default system message with their schemas."""
        if self.in_template:
            return turns, {"tools": self.tools}
        listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in self.tools)
        text = TOOL_SYSTEM.format(tools=listing)
        if turns and turns[0]["role"] == "system":
            return [{**turns[0], "content": f"{turns[0]['content']}\n\n{text}"}, *turns[1:]], {}
        return [{"role": "system", "content": text}, *turns], {}


def plan_tools(tools: Any, tool_choice: Any, parallel: bool | None, template: str | None) -> ToolPlan | None:
    """Check ``tools`` and ``tool_choice`` and plan the request (None: no tools).

    Raises:
      ToolError: naming the field.
    """
    if tool_choice is not None and not tools:
        if tool_choice == "none":
            return None
        raise ToolError("tool_choice", "tool_choice: only with tools")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise ToolError("tools", "tools: expected a list of {\"type\": \"function\", \"function\": {...}}")
    checked, names = [], set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict):
            raise ToolError(f"tools.{i}", f"tools.{i}: expected {{\"type\": \"function\", \"function\": {{...}}}}")
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"tools.{i}.function.name", f"tools.{i}.function.name: expected 1-64 letters, digits, "
                                                        f"'_', '.' or '-', got {name!r}")
        if name in names:
            raise ToolError(f"tools.{i}.function.name", f"tools.{i}.function.name: {name!r} appears twice")
        names.add(name)
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"tools.{i}.function.parameters", f"tools.{i}.function.parameters: expected a JSON schema "
                                                              f"object")
        checked.append({"type": "function", "function": {**f, "parameters": params}})
    in_template = renders_tools(template)
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise ToolError("tool_choice", f"tool_choice: expected {{\"type\": \"function\", \"function\": {{\"name\": "
                                           f"<one of {sorted(names)}>}}}}, got {choice!r}")
        params = next(t["function"]["parameters"] for t in checked if t["function"]["name"] == name)
        return ToolPlan("named", checked, params, in_template, name)
    if choice == "none":
        return ToolPlan("none", checked, None, in_template)
    if choice == "required":
        one = {"anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                           "arguments": t["function"]["parameters"]},
                          "required": ["name", "arguments"], "additionalProperties": False} for t in checked]}
        schema = one if parallel is False else {"type": "array", "items": one, "minItems": 1}
        return ToolPlan("required", checked, schema, in_template)
    if choice == "auto":
        syntax = call_syntax(template) if in_template else None
        if syntax is None:
            raise ToolError("tool_choice", "tool_choice: 'auto' needs a chat template that renders tools and teaches "
                                           "a call syntax parsed here (Hermes' <tool_call>...</tool_call> or Llama "
                                           "3.1's JSON calls); this model's does not (use 'required', a named "
                                           "function or 'none')", code="unsupported_parameter")
        return ToolPlan("auto", checked, None, in_template, syntax=syntax)
    raise ToolError("tool_choice", f"tool_choice: expected 'none', 'auto', 'required' or a named function, got "
                                   f"{choice!r}")


def _call(name: str, arguments: Any) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _json_call(text: str) -> dict | None:
    """An OpenAI call from one JSON call (``name`` and ``arguments`` or Llama's ``parameters``), None if it is not."""
    try:
        c = json.loads(text)
        return _call(c["name"], c.get("arguments", c.get("parameters", {})))
    except (json.JSONDecodeError, KeyError, TypeError):
        return None


def _llama3_json_calls(text: str) -> list[dict]:
    """Llama 3.1's calls: the whole answer (after an optional ``<|python_tag|>``) is JSON calls separated by ``;``;
    anything else is no call (the answer stays text)."""
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].lstrip()
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return []
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return []
        call = _json_call(json.dumps(value))
        if call is None:
            return []
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\n;":
            at += 1
    return calls


def parse_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """The answer's (content, tool_calls) under ``plan``: the forced modes parse the whole text (the grammar made
    it valid; an answer cut by its budget gives no call); ``auto`` takes Hermes' ``<tool_call>`` blocks out of the
    text (blocks that are not a JSON call stay text), or reads a Llama 3.1 answer that is JSON calls (else text)."""
    if plan.mode in ("required", "named"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        if plan.mode == "named":
            return None, [_call(plan.name, value)]
        calls = value if isinstance(value, list) else [value]
        return None, [_call(c["name"], c["arguments"]) for c in calls]
    if plan.mode == "auto" and plan.syntax == "llama3_json":
        calls = _llama3_json_calls(text)
        return (None, calls) if calls else (text, [])
    if plan.mode == "auto":
        calls, rest, at = [], [], 0
        for m in _HERMES.finditer(text):
            call = _json_call(m.group(1))
            if call is None:
                continue
            rest.append(text[at: m.start()])
            at = m.end()
            calls.append(call)
        rest.append(text[at:])
        content = "".join(rest).strip()
        return (content or None) if calls else text, calls
    return text, []


def calls_as_text(tool_calls: Sequence[dict]) -> str:
    """An earlier assistant turn's calls written as this module's JSON (for a template that does not render them)."""
    out = []
    for c in tool_calls:
        f = c.get("function", {})
        args = f.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass
        out.append({"name": f.get("name"), "arguments": args})
    return json.dumps(out, ensure_ascii=False)


def template_turn_calls(tool_calls: Sequence[dict]) -> list[dict]:
    """An earlier assistant turn's calls for a template that renders them: each call's ``arguments`` string parsed to
    the object it holds (as vLLM gives templates; Llama 3.1's writes them with ``tojson``, which would quote a
    string again), a string that is not a JSON object kept as it is."""
    out = []
    for c in tool_calls:
        f = c.get("function")
        args = f.get("arguments") if isinstance(f, dict) else None
        if isinstance(args, str):
            try:
                value = json.loads(args)
            except json.JSONDecodeError:
                value = None
            if isinstance(value, dict):
                c = {**c, "function": {**f, "arguments": value}}
        out.append(c)
    return out
