"""The GGUF tokenizer and chat template against transformers' reading of the same file."""

from __future__ import annotations

import re

import pytest
from tokenizers import pre_tokenizers

from dspark_jax.tokenizer import Tokenizer

VARIED = [
    "Hello world", "", " ", "    ", "\n\n\n", "héllo naïve café Ωmega — “quotes” «guillemets»",
    "日本語のテキストと中文", "emoji 🙂👍🏽🇫🇷 family 👨‍👩‍👧", "Привет, как дела?", "مرحبا بالعالم",
    "def f(x):\n    return x**2  # square\n", "for i in range(10):\n\tprint(i, end='')\r\n",
    "int main() { return printf(\"%d\\n\", 42); }", "I'm you'll DON'T they've",
    "3.14159 1,000,000 -42 1e-9 0x1F 2024-11-29T12:00:00Z", "π≈3.14, √2≈1.414, ∑_{i=1}^n i = n(n+1)/2",
    "trailing spaces   ", "   leading spaces", "tab\tsep\tvalues\n", "<|im_start|>user\nhi<|im_end|>\n",
    "text<|endoftext|>more<repo_name>x", "mixed\u00a0nbsp and zero\u200bwidth", "A" * 50, "ab" * 40,
    # prompts in the style of the project's prompt sets (math with LaTeX, code with a spec, Markdown)
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
    "clips did Natalia sell altogether in April and May?\nPlease reason step by step, and put your final answer "
    "within \\boxed{}.",
    "### Question:\nYou are given a length-N sequence A=(A_1,A_2,\\ldots,A_N).\n\n### Format: Read the inputs "
    "from stdin\n```python\n# YOUR CODE HERE\n```\n\n### Answer: (use the provided format with backticks)\n",
    "| col | value |\n| --- | ---: |\n| **bold** | `code` |\n\n> quote\n- item 1\n- item 2\n",
]
# transformers builds the GGUF tokenizer with GPT-2's pre-tokenizer and drops the digit split of SmolLM's
# ("smollm" in llama.cpp, Digits(individual_digits) in the original tokenizer.json). Every digit is a token of
# its own either way, so the two differ only where a whitespace run precedes a digit.
DIGIT_AFTER_SPACES = ["a  1", "x   12 y", "values:\n  1, 2,  3", "    42", "\t\t7"]


@pytest.fixture(scope="module")
def tok(target):
    return target.tokenizer


@pytest.fixture(scope="module")
def hf_digits(hf_tokenizer):
    """transformers' tokenizer with SmolLM's digit split restored (the reference for whitespace-digit text)."""
    import copy

    backend = copy.deepcopy(hf_tokenizer.backend_tokenizer)
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return backend


def test_special_ids(tok):
    assert tok.vocab_size == 49152
    assert tok.eos_id == 2 and tok.tokens[tok.eos_id] == "<|im_end|>"
    assert tok.bos_id == 1 and tok.tokens[tok.bos_id] == "<|im_start|>"
    assert tok.stop_ids == (2,)
    assert tok.encode("<|im_end|>") == [2]
    assert tok.default_system == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def test_vocab_has_no_multi_digit_tokens(tok):
    """Evidence for the digit split: no token mixes a digit with anything else."""
    assert not [t for t in tok.tokens if re.search(r"\d", t) and not re.fullmatch(r"\d", t)]


def test_ids_match_transformers(tok, hf_tokenizer, hf_digits):
    for text in VARIED:
        ours = tok.encode(text)
        assert ours == hf_digits.encode(text, add_special_tokens=False).ids, text
        if not re.search(r"\s{2,}\d", text):
            assert ours == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert tok.decode(ours) == hf_tokenizer.decode(ours, skip_special_tokens=True)
        assert tok.decode(ours, skip_special=False) == text  # byte-level BPE is lossless


def test_whitespace_before_digits_follows_the_digit_split(tok, hf_tokenizer, hf_digits):
    for text in DIGIT_AFTER_SPACES:
        assert tok.encode(text) == hf_digits.encode(text, add_special_tokens=False).ids
    assert tok.encode("a  1") == [81, 256, 33]  # "a", "ĠĠ", "1"
    assert hf_tokenizer.encode("a  1", add_special_tokens=False) == [81, 216, 216, 33]  # transformers' split


CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "user", "content": "What's 2+2?"}, {"role": "assistant", "content": "4."},
     {"role": "user", "content": "And 3 × 3? 🙂\n\nThanks"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "def f(): pass  # ok?"}],
    [{"role": "user", "content": ""}],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_stored_template(tok, hf_tokenizer, conversation, add_generation_prompt):
    ours = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    ref = hf_tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == ref
    ref_ids = hf_tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=add_generation_prompt)
    ref_ids = ref_ids["input_ids"] if hasattr(ref_ids, "keys") else ref_ids
    assert tok.encode_chat(conversation, add_generation_prompt) == list(ref_ids)


def test_plain_string_turns_alternate_user_assistant(tok):
    as_strings = tok.apply_chat_template(["Q1", "A1", "Q2"])
    as_dicts = tok.apply_chat_template([{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                                        {"role": "user", "content": "Q2"}])
    assert as_strings == as_dicts
    assert as_strings.startswith("<|im_start|>system\nYou are a helpful AI assistant")
    assert as_strings.endswith("<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n")


def test_stream_decoding_never_breaks_characters(tok):
    text = "Zürich → 東京 🙂👍🏽 naïve\nend"
    ids = tok.encode(text)
    stream = tok.stream()
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p == "") > 0  # some tokens end inside a character and were held back


def test_non_bpe_tokenizer_is_rejected():
    with pytest.raises(ValueError, match="only byte-level BPE tokenizers"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "llama"})
