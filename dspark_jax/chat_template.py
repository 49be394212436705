"""Chat templates: a model's own Jinja template rendered the way Hugging Face transformers renders it.

A checkpoint's template (``tokenizer_config.json``'s ``chat_template``, a ``chat_template.jinja`` file, or a
GGUF's ``tokenizer.chat_template``) is untrusted code from the internet, so it runs in jinja2's immutable
sandbox. The environment matches transformers' (``utils/chat_template_utils.py``): ``trim_blocks`` and
``lstrip_blocks``, the loop-control extension, a ``tojson`` filter that does not escape HTML and keeps
non-ASCII text, and the globals ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``. The template
sees ``messages``, ``add_generation_prompt``, ``tools``, ``documents``, the special tokens
(``bos_token``, ``eos_token``, ...) and any extra keyword (``enable_thinking`` for Qwen3).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, Mapping, Sequence

__all__ = ["ChatTemplateError", "compile_chat_template", "render_chat_template", "as_messages"]


class ChatTemplateError(ValueError):
    """A template that does not compile, or that refused a conversation (its ``raise_exception``)."""


def _raise_exception(message: str):
    import jinja2  # noqa: PLC0415

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML, which a prompt must not have.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` inside a template, without exposing the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str):
    """Compile a chat template in the sandboxed environment (cached by its text).

    Raises:
      ChatTemplateError: the template has a syntax error (the message gives jinja's line and reason).
    """
    import jinja2  # noqa: PLC0415
    import jinja2.ext  # noqa: PLC0415
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

    class Namespace(jinja2.utils.Namespace):
        """``namespace(...)`` that refuses underscore names (no reach into Python internals)."""

        def __init__(*args, **kwargs):  # same signature trick as jinja's Namespace: namespace(self=...) works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text in some templates): rendered as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=Namespace)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not compile: line {e.lineno}: {e.message}") from e


def as_messages(turns: Sequence[Mapping[str, Any]] | Sequence[str]) -> list[dict[str, Any]]:
    """Messages from {"role", "content"} dicts, or plain strings taken as alternating user/assistant turns; keys
    whose value is None are dropped (as transformers does: templates handle a missing key, not a None).

    >>> as_messages(["hi", "hello"])
    [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'hello'}]
    """
    out = []
    for i, t in enumerate(turns):
        if isinstance(t, str):
            out.append({"role": ("user", "assistant")[i % 2], "content": t})
        elif isinstance(t, Mapping):
            out.append({k: v for k, v in t.items() if v is not None})
        else:
            raise TypeError(f"turn {i}: expected a dict with 'role' and 'content' or a string; got {type(t).__name__}")
    return out


def render_chat_template(template: str, turns: Sequence[Mapping[str, Any]] | Sequence[str], *,
                         add_generation_prompt: bool = True, special_tokens: Mapping[str, str] | None = None,
                         tools: Sequence[Mapping[str, Any]] | None = None,
                         documents: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
    """Render a conversation with a Jinja chat template, as transformers' ``apply_chat_template(tokenize=False)``.

    Args:
      template: the template text.
      turns: messages (see `as_messages`).
      add_generation_prompt: end with the header of an assistant turn.
      special_tokens: ``bos_token``, ``eos_token``, ... as strings (templates print them).
      tools, documents: JSON schemas / documents for templates that take them.
      **kwargs: further template variables (e.g. ``enable_thinking=False``); they override special tokens.
    Returns:
      The prompt text.
    Raises:
      ChatTemplateError: the template does not compile or raised an exception for this conversation.

    >>> render_chat_template("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    ...                      "{% if add_generation_prompt %}<assistant>{% endif %}", ["hi"])
    '<user>hi<assistant>'
    """
    import jinja2  # noqa: PLC0415

    if not turns:
        raise ValueError("a conversation needs at least one message")
    variables = {**(special_tokens or {}), **kwargs}
    try:
        return compile_chat_template(template).render(messages=as_messages(turns), tools=tools, documents=documents,
                                                      add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the chat template refused the conversation: {e}") from e
