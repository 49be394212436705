"""OpenAI's logprobs shapes from the engine's `TokenLogprobs`: chat's ``choices[].logprobs.content`` and the legacy
completions' ``choices[].logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``).

The values are the target's raw log-probabilities (``log_softmax`` of its logits: temperature 1, no top-p), as
vLLM reports by default (``raw_logprobs``). A token's string is its bytes as UTF-8 text; a token that holds part
of a character (byte-level BPE splits multi-byte characters) is written ``bytes:\\xNN...`` (OpenAI's
convention), and chat's ``bytes`` gives every token's exact bytes. A log-probability below -9999 (an underflow to
-inf, which JSON cannot hold) is reported as -9999, as vLLM does.
"""

from __future__ import annotations

import codecs
from typing import Any, Sequence

from dspark_jax.engine import TokenLogprobs

__all__ = ["LogprobFormat", "text_offsets"]

FLOOR = -9999.0  # vLLM's floor for a log-probability that JSON must carry


def _value(logprob: float) -> float:
    return max(float(logprob), FLOOR)


def text_offsets(pieces: Sequence[bytes], start: int = 0) -> list[int]:
    """The character offset in the decoded text where each of a sequence of tokens' ``pieces`` begins (a piece
    that continues a character takes that character's offset), counting from ``start``.

    >>> text_offsets([b"a", b"\\xc3", b"\\xa9", b"b"], 10)
    [10, 11, 11, 12]
    """
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out, at = [], start
    for piece in pieces:
        out.append(at)
        at += len(dec.decode(piece))
    return out


class LogprobFormat:
    """Token strings and OpenAI's logprobs objects for one tokenizer (each token's string is made once).

    >>> class Chars:  # a stand-in tokenizer: token i is the byte i
    ...     def token_bytes(self, i):
    ...         return bytes([i])
    >>> f = LogprobFormat(Chars())
    >>> e = TokenLogprobs(104, -0.5, ((104, -0.5), (105, -1.0)))
    >>> f.chat([e])[0]["top_logprobs"][1]
    {'token': 'i', 'logprob': -1.0, 'bytes': [105]}
    >>> f.completion([105, 104], [None, e], [0, 1])
    {'tokens': ['i', 'h'], 'token_logprobs': [None, -0.5], 'top_logprobs': [None, {'h': -0.5, 'i': -1.0}], 'text_offset': [0, 1]}
    >>> f.token(0xc3)
    ('bytes:\\\\xc3', [195])
    """

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._strings: dict[int, tuple[str, list[int]]] = {}

    def piece(self, token_id: int) -> bytes:
        """The bytes of one token."""
        return self._tok.token_bytes(int(token_id))

    def token(self, token_id: int) -> tuple[str, list[int]]:
        """(string, bytes as a list of ints) of one token."""
        out = self._strings.get(token_id)
        if out is None:
            raw = self.piece(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:  # part of a character
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            out = self._strings[token_id] = (text, list(raw))
        return out

    def _top(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self.token(token_id)
        return {"token": text, "logprob": _value(logprob), "bytes": raw}

    def chat(self, entries: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
        """Chat's ``logprobs.content``: per token {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}."""
        return [{**self._top(e.token, e.logprob), "top_logprobs": [self._top(t, v) for t, v in e.top]}
                for e in entries]

    def completion(self, token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None],
                   offsets: Sequence[int]) -> dict[str, Any]:
        """The completions ``logprobs`` object of some tokens starting at the text ``offsets`` (an entry None: a
        token nothing predicts, the prompt's first: its logprob and alternatives are null, as OpenAI's and
        vLLM's echo give it)."""
        values = [None if e is None else _value(e.logprob) for e in entries]
        tops = [None if e is None else {self.token(t)[0]: _value(v) for t, v in e.top} for e in entries]
        return {"tokens": [self.token(t)[0] for t in token_ids], "token_logprobs": values, "top_logprobs": tops,
                "text_offset": list(offsets)}
