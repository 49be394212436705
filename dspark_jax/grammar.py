"""Grammar constraints on a request's output (structured output), through llguidance, exact under speculation.

A `Grammar` is a compiled constraint: a JSON schema, any JSON object, a regular expression, a list of choices or
a Lark grammar (llguidance's dialect), checked against the tokenizer when it is built (`GrammarError` names what is
wrong). The engine gives each constrained request a `Matcher` (its grammar's state after the request's output so
far) and, each round, asks `fill_first` and `fill_drafts` for the allowed tokens at every position the target
verifies: after the output so far, and after each draft of the block ahead of that position. The masks are packed bits (32 tokens a
word, llguidance's layout: token ``v`` is bit ``v % 32`` of word ``v // 32``), one row [W] per position,
W = ceil(V / 32).

Why the masked target law keeps decoding exact: at position ``j`` of a block the target's law is masked by the
grammar's state after the committed tokens and drafts ``x_1..x_j``; acceptance, the residual and the bonus draw
all use that masked law, so the tokens follow plain constrained decoding's law (and greedy decoding picks its
argmax), whatever the drafter proposed. A draft the grammar forbids has probability 0 under the masked law: it is
rejected with certainty, so the positions after it need no mask and no target pass (`allowed_prefix`).

The end of a request: the engine's stop ids (EOS) are allowed only where the grammar is complete (llguidance's
mask has them exactly when its matcher accepts), and a request ends as soon as its grammar is finished
(`Matcher.advance` reports the token after which no other token may follow).

Axis legend: R rows, P positions of a row (verified block + 1), W mask words (ceil(V / 32)), V vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import weakref
from typing import Any, Sequence

import numpy as np

__all__ = ["Grammar", "GrammarError", "Matcher", "grammar_tokenizer", "mask_words", "fill_first", "fill_drafts", "allowed_prefix",
           "leading_allowed", "device_leading_allowed", "apply_mask",
           "allowed", "JSON_FORMAT"]

# JSON output without free whitespace: `json.dumps`' separators (", " and ": ") and no other whitespace between
# tokens. A grammar that allows any whitespace lets a model spend its budget on blank lines; a schema's own
# "x-guidance" options override these.
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


_NAMES = {"json_schema": "JSON schema", "json_object": "JSON schema", "regex": "regular expression",
          "choice": "choice list", "grammar": "grammar"}


class GrammarError(ValueError):
    """A constraint that does not compile: an invalid schema, regular expression, choice list or grammar."""


def mask_words(vocab_size: int) -> int:
    """Words of 32 bits that hold one bit per token of a vocabulary of ``vocab_size``.

    >>> mask_words(49152), mask_words(33)
    (1536, 2)
    """
    return -(-int(vocab_size) // 32)


_TOKENIZERS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def grammar_tokenizer(tokenizer, vocab_size: int | None = None, stop_ids: Sequence[int] | None = None):
    """llguidance's tokenizer (``LLTokenizer``) for one of ours (`dspark_jax.tokenizer.Tokenizer` or
    `HFTokenizer`: its ``backend`` is a `tokenizers.Tokenizer`), made once per tokenizer and settings (~0.2 s).

    Args:
      tokenizer: our tokenizer.
      vocab_size: the model's vocabulary (its logits' width; default: the tokenizer's).
      stop_ids: the tokens that end a request (default: the tokenizer's ``stop_ids``): a grammar allows them only
        where it is complete.
    """
    import llguidance  # noqa: PLC0415

    vocab = int(vocab_size if vocab_size is not None else tokenizer.vocab_size)
    stops = tuple(int(t) for t in (tokenizer.stop_ids if stop_ids is None else stop_ids))
    with _TOKENIZERS_LOCK:
        made = _TOKENIZERS.setdefault(tokenizer, {})
        key = (vocab, stops)
        if key not in made:
            made[key] = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab,
                                               eos_token=list(stops) or None)
        return made[key]


@dataclasses.dataclass(frozen=True, eq=False)
class Grammar:
    """A constraint compiled for one tokenizer (hashable by identity; build with the class methods).

    Attributes:
      kind: ``json_schema``, ``json_object``, ``regex``, ``choice`` or ``lark``.
      source: what it was built from (the schema, the expression, the choices or the grammar), for messages.
      text: llguidance's grammar (its JSON form).
      tokenizer: llguidance's tokenizer (`grammar_tokenizer`).
    """

    kind: str
    source: Any
    text: str
    tokenizer: Any

    @classmethod
    def _checked(cls, kind: str, source, text: str, tokenizer) -> "Grammar":
        import llguidance  # noqa: PLC0415

        problem = llguidance.LLMatcher.validate_grammar(text, tokenizer)
        if problem and not problem.startswith("WARNING"):
            raise GrammarError(f"invalid {_NAMES.get(kind, kind)}: {problem.strip()}")
        return cls(kind, source, text, tokenizer)

    @classmethod
    def json_schema(cls, schema: dict | str, tokenizer) -> "Grammar":
        """Output a JSON value valid for ``schema`` (a dict or its JSON text), in `JSON_FORMAT`'s layout.

        Raises:
          GrammarError: the schema is not a JSON object, or llguidance cannot compile it.
        """
        import llguidance  # noqa: PLC0415

        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"invalid JSON schema: not JSON ({e})") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"invalid JSON schema: expected a JSON object, got {type(schema).__name__}")
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=dict(JSON_FORMAT))
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
        return cls._checked("json_schema", schema, text, tokenizer)

    @classmethod
    def json_object(cls, tokenizer) -> "Grammar":
        """Output any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls.json_schema({"type": "object"}, tokenizer)

    @classmethod
    def regex(cls, pattern: str, tokenizer) -> "Grammar":
        """Output text matching ``pattern`` whole (Rust ``regex`` syntax, as llguidance reads it)."""
        import llguidance  # noqa: PLC0415

        if not isinstance(pattern, str):
            raise GrammarError(f"invalid regular expression: expected a string, got {type(pattern).__name__}")
        return cls._checked("regex", pattern, llguidance.LLMatcher.grammar_from_regex(pattern), tokenizer)

    @classmethod
    def choice(cls, choices: Sequence[str], tokenizer) -> "Grammar":
        """Output exactly one of ``choices`` (non-empty strings)."""
        import llguidance  # noqa: PLC0415

        choices = list(choices) if isinstance(choices, (list, tuple)) else choices
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
            raise GrammarError(f"invalid choice list: expected a non-empty list of non-empty strings, got {choices!r}")
        # Lark string literals read JSON's escapes
        lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        return cls._checked("choice", choices, llguidance.LLMatcher.grammar_from_lark(lark), tokenizer)

    @classmethod
    def lark(cls, grammar: str, tokenizer) -> "Grammar":
        """Output a sentence of a Lark grammar (llguidance's dialect: ``start`` rule, ``%json`` and regex terminals)."""
        import llguidance  # noqa: PLC0415

        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarError("invalid grammar: expected the text of a Lark grammar")
        return cls._checked("grammar", grammar, llguidance.LLMatcher.grammar_from_lark(grammar), tokenizer)

    def matcher(self) -> "Matcher":
        """A fresh state of this grammar (one per request)."""
        return Matcher(self)


class Matcher:
    """One request's grammar state (llguidance's ``LLMatcher``) after the tokens it has emitted."""

    def __init__(self, grammar: Grammar):
        import llguidance  # noqa: PLC0415

        self.grammar = grammar
        self._m = llguidance.LLMatcher(grammar.tokenizer, grammar.text, log_level=0)
        if self._m.is_error():
            raise GrammarError(f"invalid {_NAMES.get(grammar.kind, grammar.kind)}: {self._m.get_error()}")

    @property
    def finished(self) -> bool:
        """No token may follow (the grammar is complete and cannot be extended, or EOS was taken)."""
        return self._m.is_stopped()

    def fill(self, out: np.ndarray) -> None:
        """Write the mask of the next token into ``out`` (int32 or uint32 [W], C-contiguous)."""
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def advance(self, tokens: Sequence[int]) -> int | None:
        """Take emitted ``tokens``; returns how many of them end the request (up to and including the token after
        which the grammar is finished), or None when it goes on. A token the grammar cannot take (only where no
        token was allowed: a grammar the vocabulary cannot complete) ends the request there too.
        """
        for i, t in enumerate(tokens):
            if not self._m.consume_token(int(t)) or self._m.is_stopped():
                return i + 1
        return None

    def fill_drafts(self, drafts: Sequence[int], out: np.ndarray) -> int:
        """Masks after each draft of one row, ``out[j]`` after the first ``j`` drafts (``out[0]``, the mask after
        the tokens so far, already filled by `fill`), as long as each draft is allowed; the state is left as it was.

        Args:
          drafts: the row's verified drafts (int [l]).
          out: int32 or uint32 [P >= l + 1, W]; rows past the first forbidden draft are left untouched.
        Returns:
          the number of leading drafts taken (0..l).
        """
        taken = 0
        for x in drafts:
            if not allowed(out[taken], int(x)) or not self._m.consume_token(int(x)):
                break
            taken += 1
            self.fill(out[taken])
        if taken:
            self._m.rollback(taken)
        return taken


def allowed(words: np.ndarray, token: int) -> bool:
    """Whether ``token``'s bit is set in a packed mask ``words`` [W].

    >>> allowed(np.array([0b100, 1], np.uint32), 2), allowed(np.array([0b100, 1], np.uint32), 32)
    (True, True)
    """
    return bool((int(words[token >> 5]) >> (token & 31)) & 1)


def fill_first(matchers: Sequence[Matcher | None], out: np.ndarray) -> None:
    """The first masks of a round (host side): ``out[r, 0]`` after the output so far for each constrained row; every
    token allowed at every position of the other rows (unconstrained, padding).

    Args:
      matchers: per row, its request's `Matcher` or None (R of them, or fewer: the rest are padding).
      out: int32 [R, P, W] (P = 1 + the most drafts a row may verify), overwritten.
    """
    out[...] = -1
    for r, m in enumerate(matchers):
        if m is not None:
            out[r] = 0
            m.fill(out[r, 0])


def fill_drafts(matchers: Sequence[Matcher | None], drafts: np.ndarray, lengths: np.ndarray,
                out: np.ndarray) -> np.ndarray:
    """The rest of a round's masks once its drafts are known: ``out[r, j]`` after the first ``j`` drafts of each
    constrained row (``out`` as `fill_first` left it).

    Args:
      matchers: per row, its `Matcher` or None; drafts: int [R, G]; lengths: int [R] drafts verified per row.
      out: int32 [R, P, W] with P > G.
    Returns:
      int64 [R] the leading drafts each row's grammar allows (``lengths`` for an unconstrained row), read from the
      masks' bits as the verification program reads them (`leading_allowed`).
    """
    for r, m in enumerate(matchers):
        if m is not None and lengths[r] > 0:
            m.fill_drafts(drafts[r, : int(lengths[r])], out[r])
    return leading_allowed(out, drafts, lengths)


def allowed_prefix(lengths: np.ndarray, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Verification lengths with masks: (target lengths, acceptance lengths) [R] from the scheduled ``lengths``
    and the leading allowed drafts ``ok``. The target runs on the anchor and the allowed drafts only; the first
    forbidden draft still goes through acceptance (rejected with certainty), so a sampled row draws the residual
    law there, as if it had been verified.

    >>> [a.tolist() for a in allowed_prefix(np.array([3, 3, 0]), np.array([3, 1, 0]))]
    [[3, 1, 0], [3, 2, 0]]
    """
    lengths = np.asarray(lengths)
    return np.minimum(lengths, ok), np.minimum(lengths, ok + 1)


def leading_allowed(masks: np.ndarray, drafts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Host twin of `_device_leading_allowed`: per row, the leading drafts within ``lengths`` whose bit is set in
    the mask of the position before them.

    Args:
      masks: int32 or uint32 [R, P, W]; drafts: int [R, G] (G < P); lengths: int [R].
    Returns:
      int64 [R].
    """
    R, G = drafts.shape
    words = np.take_along_axis(masks[:, :G].view(np.uint32), (drafts.astype(np.int64) >> 5)[..., None], axis=2)[..., 0]
    bits = ((words >> (drafts.astype(np.uint32) & 31)) & 1).astype(bool)  # [R, G]
    within = np.arange(G)[None, :] < np.asarray(lengths)[:, None]
    return np.cumprod(bits & within, axis=1).sum(axis=1)


def device_leading_allowed(masks, drafts, lengths):
    """Per row, the leading drafts within ``lengths`` that the grammar allows: masks uint32 [R, P, W] (P > G),
    drafts int32 [R, G], lengths int32 [R] -> int32 [R] (the engine's verification program; `leading_allowed` is
    its host twin)."""
    import jax.numpy as jnp  # noqa: PLC0415

    G = drafts.shape[1]
    words = jnp.take_along_axis(masks[:, :G], (drafts >> 5)[..., None], axis=2)[..., 0]  # [R, G]
    bits = ((words >> (drafts & 31).astype(jnp.uint32)) & 1).astype(bool)
    within = jnp.arange(G)[None, :] < lengths[:, None]
    return jnp.sum(jnp.cumprod(bits & within, axis=1), axis=1, dtype=jnp.int32)


def apply_mask(logits, words):
    """Logits with the tokens a packed mask forbids set to -inf (probability 0 under any temperature and top-p):
    logits [..., V], words uint32 [..., W] (W * 32 >= V). A mask that allows nothing (a position no row verifies)
    leaves its logits as they are.

    >>> import jax.numpy as jnp
    >>> apply_mask(jnp.zeros(3), jnp.array([0b101], jnp.uint32)).tolist()
    [0.0, -inf, 0.0]
    """
    import jax.numpy as jnp  # noqa: PLC0415

    V = logits.shape[-1]
    bits = (words[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1  # [..., W, 32]
    bits = bits.reshape(*words.shape[:-1], -1)[..., :V].astype(bool)  # [..., V]
    bits = bits | ~jnp.any(bits, axis=-1, keepdims=True)
    return jnp.where(bits, logits, -jnp.inf)
