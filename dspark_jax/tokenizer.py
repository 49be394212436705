"""Tokenizers and chat templates of the two model formats: a GGUF file's metadata (`Tokenizer`) and a Hugging
Face checkpoint folder (`HFTokenizer`). Both present one interface: `encode`, `decode`, `apply_chat_template`,
`encode_chat`, `stream`, `token_bytes`, and `eos_id`, `bos_id`, `stop_ids`, `vocab_size`.

GGUF: the vocabulary, merges, token types and special ids come from `tokenizer.ggml.*`; the pre-tokenizer
follows `tokenizer.ggml.pre` (SmolLM splits every digit on its own before the GPT-2 byte-level split, as
llama.cpp's "smollm" pre-tokenizer does).

Hugging Face: ``tokenizer.json`` (read by the `tokenizers` library), the special tokens of
``tokenizer_config.json``, and the stop ids of ``generation_config.json``.

Either way, the model's own Jinja chat template is rendered as transformers renders it (`dspark_jax.chat_template`).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from dspark_jax.chat_template import as_messages, render_chat_template
from dspark_jax.io import read_json_object

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
# Ids that also end a turn (Llama 3: <|eot_id|>, <|eom_id|>), besides tokenizer.ggml.eos_token_id.
_STOP_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
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
      stop_ids: token ids that end generation: eos_id, and the end-of-turn ids the file names
        (tokenizer.ggml.eot_token_id, eom_token_id).
      vocab_size: number of token ids.
    """

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int] | None = None,
                 *, bos_id: int | None = None, eos_id: int, pad_id: int | None = None, pre: str | None = None,
                 chat_template: str | None = None, add_bos: bool = False, add_eos: bool = False,
                 extra_stop_ids: Sequence[int] = ()):
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
        self.stop_ids = tuple(dict.fromkeys([eos_id, *(int(i) for i in extra_stop_ids)]))
        self.add_bos, self.add_eos = add_bos, add_eos
        self.chat_template = chat_template
        self.default_system = self._default_system(chat_template)
        self.special_tokens = {name: tokens[i] for name, i in (("bos_token", bos_id), ("eos_token", eos_id),
                                                               ("pad_token", pad_id))
                               if i is not None and 0 <= int(i) < len(tokens)}

    @property
    def backend(self) -> _HFTokenizer:
        """The `tokenizers.Tokenizer` that encodes and decodes (its ``to_str()`` is a ``tokenizer.json``)."""
        return self._tk

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
                   add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
                   extra_stop_ids=[meta[k] for k in _STOP_KEYS if meta.get(k) is not None])

    @classmethod
    def from_gguf(cls, path) -> "Tokenizer":
        """Read only the tokenizer metadata of a GGUF file (no weights)."""
        from dspark_jax.models.gguf import read_tokenizer_metadata, validate_gguf

        return cls.from_metadata(read_tokenizer_metadata(validate_gguf(path)))

    # -- text <-> ids -----------------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = False, max_tokens: int | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text (`<|im_start|>`...) map to their ids.

        add_special: add BOS/EOS where the file asks for them (tokenizer.ggml.add_bos_token/add_eos_token).
        max_tokens: raise `TooManyTokens` for a text of more tokens (before its ids are listed).
        """
        ids = encode_ids(self._tk, text, add_special=False, max_tokens=max_tokens)
        if add_special and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if add_special and self.add_eos:
            ids = ids + [self.eos_id]
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (`token_bytes`)."""
        return token_bytes(self._tk, token_id)

    # -- chat --------------------------------------------------------------------------------------------

    @staticmethod
    def _default_system(template: str | None) -> str | None:
        """The system prompt a ChatML template adds when the conversation has none (None otherwise)."""
        m = _CHATML_SYSTEM.search(template) if template is not None else None
        return m.group(1) if m else None

    def apply_chat_template(self, turns: Sequence[dict[str, str]] | Sequence[str],
                            add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """Render a conversation with the file's chat template (ChatML when the file has none).

        Args:
          turns: messages {"role", "content"}, or plain strings taken as alternating user/assistant turns.
          add_generation_prompt: end with the header of an assistant turn.
          **template_kwargs: further template variables.
        Returns:
          The prompt text (SmolLM2's template adds its default system prompt when the first message is not a
          system one).
        """
        if self.chat_template is not None:
            return render_chat_template(self.chat_template, turns, add_generation_prompt=add_generation_prompt,
                                        special_tokens=self.special_tokens, **template_kwargs)
        messages = as_messages(turns)
        parts = []
        if messages and messages[0]["role"] != "system" and self.default_system is not None:
            parts.append(f"<|im_start|>system\n{self.default_system}<|im_end|>\n")
        parts += [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    def encode_chat(self, turns: Sequence[dict[str, str]] | Sequence[str],
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        """Token ids of the chat-templated conversation."""
        return self.encode(self.apply_chat_template(turns, add_generation_prompt, **template_kwargs))

    def stream(self, skip_special: bool = True, context: Sequence[int] = ()) -> "StreamDecoder":
        return StreamDecoder(self, skip_special, context)


class TooManyTokens(ValueError):
    """A text encoded to more tokens than asked for (``count``: how many, ``limit``: the most allowed)."""

    def __init__(self, count: int, limit: int):
        super().__init__(f"the text has {count} tokens, more than {limit}")
        self.count, self.limit = count, limit


def encode_ids(backend: _HFTokenizer, text: str, *, add_special: bool = False,
               max_tokens: int | None = None) -> list[int]:
    """Ids of ``text`` by a `tokenizers.Tokenizer` through ``encode_batch_fast`` (``encode_batch`` before
    tokenizers 0.21): the same ids as ``encode``, but the Rust code releases the interpreter lock while it works
    (``encode`` holds it, so a megabyte of text stalls every other thread, a server's event loop included) and
    computes no character offsets (a long encoding is then cheap to free). More than ``max_tokens`` tokens raise
    `TooManyTokens` before the ids become a Python list."""
    encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
    encoding = encode_batch([text], add_special_tokens=add_special)[0]
    if max_tokens is not None and len(encoding) > max_tokens:
        raise TooManyTokens(len(encoding), max_tokens)
    return encoding.ids


CONTEXT_TOKENS = 6  # prompt tokens a StreamDecoder decodes ahead of the stream (vLLM's detokenizer keeps 5)


class StreamDecoder:
    """Incremental decoding for streaming: `push(id)` returns the new text, never half a UTF-8 character.

    Byte-level BPE tokens can end inside a multi-byte character; text is held back while the decoded tail
    ends with the replacement character and released once the character completes.

    ``context``: the last few tokens before the stream (the prompt's tail), decoded with it but never returned:
    a SentencePiece-style decoder strips the space a word-initial token carries only at the start of a text,
    so without it a completion of "The capital is" would begin "Paris" instead of " Paris".
    """

    def __init__(self, tokenizer: "Tokenizer | HFTokenizer", skip_special: bool = True,
                 context: Sequence[int] = ()):
        self._tok, self._skip = tokenizer, skip_special
        ctx = [int(t) for t in context][-CONTEXT_TOKENS:]
        if ctx and tokenizer.decode(ctx, skip_special).endswith("\ufffd"):
            ctx = []  # a prompt ending inside a character: its tail cannot be a clean prefix
        self._ids: list[int] = ctx
        self._prefix = 0  # ids before this are settled text already returned
        self._read = len(ctx)  # ids[prefix:read] decode to text already returned (or to the context)

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


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character that stands for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_chars()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(backend: _HFTokenizer, token_id: int) -> bytes:
    """The bytes a token stands for, alone (a token may hold part of a UTF-8 character): a byte-level BPE piece
    through GPT-2's byte alphabet, a SentencePiece piece with ``\u2581`` as a space and ``<0xNN>`` as its byte,
    a special token as its text in UTF-8; b"" for an id the vocabulary lacks.

    >>> from tokenizers import Tokenizer as T, decoders, models
    >>> tk = T(models.BPE(vocab={"\u0120hi": 0, "\u00e6": 1}, merges=[]))
    >>> tk.decoder = decoders.ByteLevel()
    >>> token_bytes(tk, 0), token_bytes(tk, 1)
    (b' hi', b'\xe6')
    """
    piece = backend.id_to_token(int(token_id))
    if piece is None:
        return b""
    if isinstance(backend.decoder, decoders.ByteLevel) and all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    byte = _BYTE_PIECE.fullmatch(piece)
    if byte is not None:
        return bytes([int(byte.group(1), 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...} (an AddedToken)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"expected a token string or {{'content': ...}}; got {value!r}")


def _read_json(path: Path, required: bool = False) -> dict[str, Any]:
    return read_json_object(path, required=required, missing="missing (a Hugging Face checkpoint folder needs it)")


def _sentencepiece_pipeline(backend: _HFTokenizer, *, legacy: bool, add_prefix_space: bool) -> None:
    """Give a SentencePiece-style BPE (``tokenizer_class`` LlamaTokenizer: Llama 2, Mistral) the text pipeline
    transformers builds for that class, whatever ``tokenizer.json`` stores: no normalizer, a Metaspace
    pre-tokenizer that marks the start of the text alone (``legacy`` false, the default) or every piece
    between special tokens (``legacy`` true), or nothing (``add_prefix_space`` false). The stored files of
    these models prepend "▁" to every piece, which would put one after each special token of a chat prompt
    ("<s>[INST]" became "<s>", "▁[INST]")."""
    scheme = ("always" if legacy else "first") if add_prefix_space else "never"
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_prefix_space else []))


class HFTokenizer:
    """Encode, decode and chat-template text for a Hugging Face checkpoint folder.

    Attributes:
      eos_id: the tokenizer's end-of-sequence token (tokenizer_config.json ``eos_token``).
      bos_id, pad_id: their ids, or None.
      stop_ids: ids that end generation: eos_id and every ``eos_token_id`` of generation_config.json.
      vocab_size: number of token ids the tokenizer knows (added tokens included).
      chat_template: the model's Jinja chat template, or None.
      special_tokens: {"bos_token": "<s>", ...} as the template sees them.
    """

    def __init__(self, backend: _HFTokenizer, *, eos_token: str | None, bos_token: str | None = None,
                 pad_token: str | None = None, unk_token: str | None = None, chat_template: str | None = None,
                 add_bos: bool = False, add_eos: bool = False, extra_stop_ids: Sequence[int] = (),
                 source: str = "tokenizer"):
        self._tk = backend
        self.special_tokens = {name: tok for name, tok in (("bos_token", bos_token), ("eos_token", eos_token),
                                                           ("unk_token", unk_token), ("pad_token", pad_token))
                               if tok is not None}

        def token_id(name: str, tok: str | None) -> int | None:
            if tok is None:
                return None
            i = backend.token_to_id(tok)
            if i is None:
                raise ValueError(f"{source}: {name} {tok!r} is not a token of tokenizer.json")
            return int(i)

        self.bos_id, self.pad_id = token_id("bos_token", bos_token), token_id("pad_token", pad_token)
        eos_id = token_id("eos_token", eos_token)
        extra = [int(i) for i in extra_stop_ids]
        if eos_id is None:
            if not extra:
                raise ValueError(f"{source}: no eos_token in tokenizer_config.json and no eos_token_id in "
                                 f"generation_config.json: generation would never stop")
            eos_id = extra[0]
        self.eos_id = eos_id
        self.stop_ids = tuple(dict.fromkeys([eos_id, *extra]))
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self.add_bos, self.add_eos = bool(add_bos), bool(add_eos)

    @classmethod
    def from_folder(cls, folder: str | Path) -> "HFTokenizer":
        """Read ``tokenizer.json``, ``tokenizer_config.json`` (special tokens, ``add_bos_token``, the chat template,
        or ``chat_template.jinja`` beside it) and ``generation_config.json`` (stop ids; without that file,
        ``config.json``'s ``eos_token_id``) of a checkpoint folder.

        Raises:
          ValueError: naming the file and field that is missing or wrong.
        """
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{path}: missing (a Hugging Face checkpoint folder needs tokenizer.json; a model with "
                             f"only a SentencePiece tokenizer.model must be converted to tokenizer.json first)")
        try:
            backend = _HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception type for malformed files
            raise ValueError(f"{path}: not a readable tokenizers file: {e}") from e
        cfg_path = folder / "tokenizer_config.json"
        cfg = _read_json(cfg_path)
        if cfg.get("tokenizer_class") in ("LlamaTokenizer", "LlamaTokenizerFast"):
            _sentencepiece_pipeline(backend, legacy=bool(cfg.get("legacy", False)),
                                    add_prefix_space=cfg.get("add_prefix_space", True) is not False)
        special_map = _read_json(folder / "special_tokens_map.json")  # legacy file: fills what the config lacks
        gen_path = folder / "generation_config.json"
        if not gen_path.is_file():  # as transformers does: the generation defaults then come from config.json
            gen_path = folder / "config.json"
        gen = _read_json(gen_path)

        def special(name: str) -> str | None:
            try:
                return _token_text(cfg.get(name, special_map.get(name)))
            except ValueError as e:
                raise ValueError(f"{cfg_path}: field {name!r}: {e}") from None

        template = cfg.get("chat_template")
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():  # transformers >= 4.50 saves the template beside the config
            template = jinja_file.read_text(encoding="utf-8")
        elif isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            if "default" not in named:
                raise ValueError(f"{cfg_path}: field 'chat_template' lists templates {sorted(named)} but no 'default'")
            template = named["default"]
        if template is not None and not isinstance(template, str):
            raise ValueError(f"{cfg_path}: field 'chat_template' must be a string; got {type(template).__name__}")
        stops = gen.get("eos_token_id")
        stops = [] if stops is None else [stops] if isinstance(stops, int) else stops
        if not isinstance(stops, list) or not all(isinstance(i, int) for i in stops):
            raise ValueError(f"{gen_path}: field 'eos_token_id' must be an int or a list of ints; got {stops!r}")
        return cls(backend, eos_token=special("eos_token"), bos_token=special("bos_token"),
                   pad_token=special("pad_token"), unk_token=special("unk_token"), chat_template=template,
                   add_bos=bool(cfg.get("add_bos_token", False)), add_eos=bool(cfg.get("add_eos_token", False)),
                   extra_stop_ids=stops, source=str(folder))

    @property
    def backend(self) -> _HFTokenizer:
        """The `tokenizers.Tokenizer` that encodes and decodes."""
        return self._tk

    def encode(self, text: str, add_special: bool = False, max_tokens: int | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text map to their ids.

        add_special: add what the tokenizer adds around a sequence (tokenizer.json's post-processor; BOS/EOS
        where tokenizer_config.json's add_bos_token/add_eos_token ask for them).
        max_tokens: raise `TooManyTokens` for a text of more tokens (before its ids are listed).
        """
        ids = encode_ids(self._tk, text, add_special=add_special, max_tokens=max_tokens)
        if add_special and self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        if add_special and self.add_eos and ids[-1:] != [self.eos_id]:
            ids = ids + [self.eos_id]
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (`token_bytes`)."""
        return token_bytes(self._tk, token_id)

    def apply_chat_template(self, turns: Sequence[dict[str, str]] | Sequence[str],
                            add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """Render a conversation with the model's chat template, as transformers' ``apply_chat_template``.

        Args:
          turns: messages {"role", "content"}, or plain strings taken as alternating user/assistant turns.
          add_generation_prompt: end with the header of an assistant turn.
          **template_kwargs: further template variables (``enable_thinking=False`` for Qwen3...).
        Raises:
          ValueError: the model has no chat template.
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json 'chat_template' or "
                             "chat_template.jinja); encode the prompt text with encode() instead")
        return render_chat_template(self.chat_template, turns, add_generation_prompt=add_generation_prompt,
                                    special_tokens=self.special_tokens, **template_kwargs)

    def encode_chat(self, turns: Sequence[dict[str, str]] | Sequence[str],
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        """Token ids of the chat-templated conversation (the template writes any BOS itself, so none is added)."""
        return self.encode(self.apply_chat_template(turns, add_generation_prompt, **template_kwargs))

    def stream(self, skip_special: bool = True, context: Sequence[int] = ()) -> "StreamDecoder":
        return StreamDecoder(self, skip_special, context)
