"""Byte-level BPE tokenizer and ChatML chat template, built from a GGUF file's tokenizer metadata.

The vocabulary, merges, token types and special ids come from `tokenizer.ggml.*`; the pre-tokenizer follows
`tokenizer.ggml.pre` (SmolLM splits every digit on its own before the GPT-2 byte-level split, as llama.cpp's
"smollm" pre-tokenizer does). The chat template stored in the file is ChatML with a default system prompt;
it is rendered here directly (no jinja2), and tests/test_tokenizer.py checks it against the stored template.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Iterable, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_CHATML_SYSTEM = re.compile(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", re.S)


def _pre_tokenizer(pre: str | None):
    """The pre-tokenizer for a `tokenizer.ggml.pre` name (GPT-2's byte-level split when unknown)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre not in (None, "default", "gpt2"):
        warnings.warn(f"unknown tokenizer.ggml.pre={pre!r}: using GPT-2's byte-level pre-tokenizer")
    return byte_level


class Tokenizer:
    """Encode, decode and chat-template text for a GGUF model.

    Attributes:
      eos_id: end of a turn (`<|im_end|>` for SmolLM2), where generation stops.
      bos_id, pad_id: from the metadata (None when absent).
      stop_ids: token ids that end generation.
      vocab_size: number of token ids.
    """

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int] | None = None,
                 *, bos_id: int | None = None, eos_id: int, pad_id: int | None = None, pre: str | None = None,
                 chat_template: str | None = None, add_bos: bool = False, add_eos: bool = False):
        vocab = {tok: i for i, tok in enumerate(tokens)}
        pairs = [tuple(m.split(" ")) for m in merges]
        bad = [m for m, p in zip(merges, pairs) if len(p) != 2]
        if bad:
            raise ValueError(f"merges must be 'left right' pairs; got {bad[:3]}")
        self._tk = _HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
        self._tk.pre_tokenizer = _pre_tokenizer(pre)
        self._tk.decoder = decoders.ByteLevel()
        types = list(token_types) if token_types is not None else [1] * len(tokens)
        self._tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                     for t, ty in zip(tokens, types) if ty == _CONTROL])
        self._tk.add_tokens([AddedToken(t, special=False, normalized=False)
                             for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
        self.tokens = list(tokens)
        self.vocab_size = len(tokens)
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.stop_ids = (eos_id,)
        self.add_bos, self.add_eos = add_bos, add_eos
        self.chat_template = chat_template
        self.default_system = self._default_system(chat_template)

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> "Tokenizer":
        """Build from GGUF `tokenizer.*` metadata (as returned by `models.gguf.load_gguf`)."""
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"only byte-level BPE tokenizers (tokenizer.ggml.model='gpt2') are supported; "
                             f"this file has {model!r}")
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id"):
            if key not in meta:
                raise ValueError(f"GGUF tokenizer metadata lacks {key!r}")
        return cls(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"],
                   meta.get("tokenizer.ggml.token_type"),
                   bos_id=meta.get("tokenizer.ggml.bos_token_id"), eos_id=int(meta["tokenizer.ggml.eos_token_id"]),
                   pad_id=meta.get("tokenizer.ggml.padding_token_id"), pre=meta.get("tokenizer.ggml.pre"),
                   chat_template=meta.get("tokenizer.chat_template"),
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                   add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)))

    @classmethod
    def from_gguf(cls, path) -> "Tokenizer":
        """Read only the tokenizer metadata of a GGUF file (no weights)."""
        from dspark_jax.models.gguf import read_tokenizer_metadata, validate_gguf

        return cls.from_metadata(read_tokenizer_metadata(validate_gguf(path)))

    # -- text <-> ids -----------------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text (`<|im_start|>`...) map to their ids.

        add_special: add BOS/EOS where the file asks for them (tokenizer.ggml.add_bos_token/add_eos_token).
        """
        ids = self._tk.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if add_special and self.add_eos:
            ids = ids + [self.eos_id]
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    # -- chat --------------------------------------------------------------------------------------------

    @staticmethod
    def _default_system(template: str | None) -> str | None:
        if template is None:
            return None
        if "<|im_start|>" not in template:
            raise ValueError("the file's chat template is not ChatML; only ChatML templates are supported")
        m = _CHATML_SYSTEM.search(template)
        return m.group(1) if m else None

    def apply_chat_template(self, turns: Sequence[dict[str, str]] | Sequence[str],
                            add_generation_prompt: bool = True) -> str:
        """Render a conversation with the file's ChatML template.

        Args:
          turns: messages {"role", "content"}, or plain strings taken as alternating user/assistant turns.
          add_generation_prompt: end with the header of an assistant turn.
        Returns:
          The prompt text; the default system prompt is added when the first message is not a system one.
        """
        messages = [t if isinstance(t, dict) else {"role": ("user", "assistant")[i % 2], "content": t}
                    for i, t in enumerate(turns)]
        parts = []
        if messages and messages[0]["role"] != "system" and self.default_system is not None:
            parts.append(f"<|im_start|>system\n{self.default_system}<|im_end|>\n")
        parts += [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    def encode_chat(self, turns: Sequence[dict[str, str]] | Sequence[str],
                    add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the chat-templated conversation."""
        return self.encode(self.apply_chat_template(turns, add_generation_prompt))

    def stream(self, skip_special: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, skip_special)


class StreamDecoder:
    """Incremental decoding for streaming: `push(id)` returns the new text, never half a UTF-8 character.

    Byte-level BPE tokens can end inside a multi-byte character; text is held back while the decoded tail
    ends with the replacement character and released once the character completes.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self._tok, self._skip = tokenizer, skip_special
        self._ids: list[int] = []
        self._prefix = 0  # ids before this are settled text already returned
        self._read = 0  # ids[prefix:read] decode to text already returned

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        done = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        full = self._tok.decode(self._ids[self._prefix:], self._skip)
        if full.endswith("\ufffd") or len(full) <= len(done):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(done):]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end decodes as U+FFFD)."""
        done = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        full = self._tok.decode(self._ids[self._prefix:], self._skip)
        self._prefix = self._read = len(self._ids)
        return full[len(done):]
