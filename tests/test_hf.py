"""Hugging Face checkpoint folders as targets, against transformers on the same folders.

Tiny random Llama (with Llama 3's RoPE scaling), Qwen3 and Qwen2 models are saved with `save_pretrained`;
our loader must give the same logits (float32) and the same greedy continuation, and our tokenizer the same
ids and chat-template text. The real SmolLM2 GGUF, exported to a folder with `save_hf`, must decode exactly as
the GGUF path does. Bad folders must fail early with a message naming the file and the field.
"""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402,E501

from dspark_jax.build import build_engine, load_target  # noqa: E402
from dspark_jax.chat_template import ChatTemplateError, render_chat_template  # noqa: E402
from dspark_jax.models.hf import HFCheckpointError, load_hf_model, read_hf_config, save_hf  # noqa: E402
from dspark_jax.models.llama import RopeScaling, rope_frequencies  # noqa: E402
from dspark_jax.tokenizer import HFTokenizer  # noqa: E402

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CORPUS = ["The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x * 2\n",
          "Natalia sold 48 clips in April and half as many in May.", "héllo naïve café 東京 🙂",
          "<think>\nreasoning here\n</think>\n\nanswer"]

# A Llama 3.1-style template (date, system header, tools as JSON, bos_token variable, raise_exception).
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role not in ['user', 'assistant'] %}
        {{- raise_exception('Only user and assistant roles are supported after the system message') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Qwen3's template in its essentials: a namespace scanned backwards, reasoning_content split off, enable_thinking.
QWEN3_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning_content %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "What's 2+2? 🙂"},
     {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4."}, {"role": "user", "content": "And 3×3?"}],
]


def _tokenizer_json(vocab_size: int = 300) -> Tokenizer:
    """A small byte-level BPE with Llama 3's and Qwen's special tokens (trained on a few lines, in ms)."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(CORPUS, trainer)
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tk


def _save_folder(tmp, model, template: str, *, eos: str, bos: str | None, stops: list[int] | int | None = None):
    model.save_pretrained(tmp)
    tk = _tokenizer_json()
    tk.save(str(tmp / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "chat_template": template}
    if bos is not None:
        cfg["bos_token"] = bos
    (tmp / "tokenizer_config.json").write_text(json.dumps(cfg))
    if stops is not None:
        (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    return tk


COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024)


def _random_init(model, std: float = 0.3):
    """Weights large enough that logits are far from uniform (the argmax then means something)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    return model.eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (folder, the transformers model): Llama 3.1-style, Qwen3 and Qwen2 tiny random checkpoints."""
    torch.set_num_threads(2)
    out = {}
    llama = _random_init(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **COMMON, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})))
    path = tmp_path_factory.mktemp("llama")
    tk = _save_folder(path, llama, LLAMA3_TEMPLATE, eos="<|eot_id|>", bos="<|begin_of_text|>",
                      stops=[0, 1])  # placeholders, rewritten by the generation test
    out["llama"] = (path, llama, tk)
    qwen3 = _random_init(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **COMMON, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False)))
    path = tmp_path_factory.mktemp("qwen3")
    tk = _save_folder(path, qwen3, QWEN3_TEMPLATE, eos="<|im_end|>", bos=None,
                      stops=[tk.token_to_id("<|im_end|>"), tk.token_to_id("<|endoftext|>")])
    out["qwen3"] = (path, qwen3, tk)
    qwen2 = _random_init(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)))
    path = tmp_path_factory.mktemp("qwen2")
    tk = _save_folder(path, qwen2, QWEN3_TEMPLATE, eos="<|im_end|>", bos=None)
    out["qwen2"] = (path, qwen2, tk)
    return out


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen2"])
def test_logits_match_transformers(folders, name):
    path, ref, _ = folders[name]
    model = load_hf_model(path)
    cfg = model.cfg
    assert (cfg.qk_norm, cfg.attn_bias, cfg.rope_scaling is not None) == {
        "llama": (False, False, True), "qwen3": (True, False, False), "qwen2": (False, True, False)}[name]
    assert cfg.tie_embeddings == (name == "qwen2") and (model.weights.lm_head is None) == cfg.tie_embeddings
    ids = list(np.random.default_rng(1).integers(0, COMMON["vocab_size"], 80))  # past the 64 positions of llama3
    ours = np.asarray(model.score(ids))  # [n, V]
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-5 * np.abs(theirs).max())


def test_llama3_scaling_changes_frequencies():
    """The Llama test above is meaningful: its scaling moves the low frequencies and keeps the high ones."""
    plain = np.asarray(rope_frequencies(16, 500000.0))
    scaled = np.asarray(rope_frequencies(16, 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 64)))
    assert scaled[0] == plain[0] and np.all(scaled[-3:] < plain[-3:] * 0.99)
    np.testing.assert_allclose(np.asarray(rope_frequencies(16, 1e4, RopeScaling("linear", 4.0))),
                               np.asarray(rope_frequencies(16, 1e4)) / 4.0)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_greedy_generation_matches_transformers(folders, tmp_path, name):
    """Our engine (policy none) and transformers' generate(do_sample=False), token for token; a stop id that only
    generation_config.json names ends both at the same place."""
    path, ref, _ = folders[name]
    prompt = [5, 17, 42, 99, 7, 260, 33, 12, 8, 150, 77, 3, 201, 64, 9, 11, 250, 45]
    with torch.no_grad():
        free = ref.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(prompt):].tolist()
    stop = free[12]  # make the 13th generated token's id a stop id
    stop_at = free.index(stop)
    assert stop_at >= 6 and len(set(free[:stop_at])) >= 3  # a real continuation, not one token repeated
    folder = tmp_path / name
    shutil.copytree(path, folder)
    tok_eos = HFTokenizer.from_folder(path).eos_id
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok_eos, stop]}))
    model = load_target(folder, dtype="float32")
    assert model.tokenizer.stop_ids == (tok_eos, stop)
    engine = build_engine(model, "none", num_slots=2, max_prompt_tokens=len(prompt), max_new_tokens=20)
    ours = engine.run([prompt], 20)[0].output_ids
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                              eos_token_id=[tok_eos, stop], pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs == free[:stop_at + 1]


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(folders, name, conversation, add_generation_prompt):
    path, _, _ = folders[name]
    ref = transformers.AutoTokenizer.from_pretrained(str(path))
    ours = HFTokenizer.from_folder(path)
    text = ours.apply_chat_template(conversation, add_generation_prompt)
    assert text == ref.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = ref.apply_chat_template(conversation, tokenize=True, add_generation_prompt=add_generation_prompt)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ours.encode_chat(conversation, add_generation_prompt) == list(ids)
    if name == "qwen3":  # a template variable passed through
        kw = dict(tokenize=False, add_generation_prompt=True, enable_thinking=False)
        assert ours.apply_chat_template(conversation, True, enable_thinking=False) == \
            ref.apply_chat_template(conversation, **kw)
        assert ours.apply_chat_template(conversation, True, enable_thinking=False).endswith("</think>\n\n")


def test_tokenizer_matches_transformers(folders):
    path, _, _ = folders["llama"]
    ref = transformers.AutoTokenizer.from_pretrained(str(path))
    ours = HFTokenizer.from_folder(path)
    assert ours.bos_id == ref.bos_token_id and ours.eos_id == ref.eos_token_id
    assert ours.vocab_size == len(ref)
    for text in CORPUS + ["unseen wörds 12345 <|eot_id|> tail", ""]:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special=False) == ref.decode(ids, skip_special_tokens=False)
    stream = ours.stream()
    text = "héllo 東京 🙂"
    assert "".join(stream.push(i) for i in ours.encode(text)) + stream.flush() == text


LLAMA2_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + "
                   "' [/INST]' }}{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}")


@pytest.mark.parametrize("flags", [{"legacy": False}, {}, {"legacy": True}, {"add_prefix_space": False}])
def test_sentencepiece_style_tokenizer_matches_transformers(tmp_path, flags):
    """A Llama 2 / Mistral-style folder (tokenizer_class LlamaTokenizer, byte-fallback BPE whose stored
    normalizer prepends "▁" to every piece): transformers rebuilds its pipeline from the class, so no "▁"
    follows a special token unless ``legacy`` is true; ours must give the same ids, chat prompts and text."""
    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    lines = [c.replace(" ", "\u2581") for c in CORPUS] + ["[INST] hi there [/INST] fine"] * 5
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tk.train_from_iterator(lines, trainer)
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tk.save(str(tmp_path / "tokenizer.json"))
    cfg = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>", "chat_template": LLAMA2_TEMPLATE, **flags}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2, "bos_token_id": 1}))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = HFTokenizer.from_folder(tmp_path)
    for text in ["hi there", " two  spaces", "héllo 東京 🙂 x", "a</s>b<s> c"]:
        want = ref.encode(text)
        assert ours.encode(text, add_special=True) == want, text
        assert ours.decode(want) == ref.decode(want, skip_special_tokens=True)
    conversation = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "fine"},
                    {"role": "user", "content": "héllo"}]
    want = ref.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert ours.encode_chat(conversation) == list(want)
    # a completion streamed after its prompt keeps the space its first word carries ("hi" + " there")
    both = ours.encode("hi there fine", add_special=True)
    cut = max(i for i, p in enumerate(ref.convert_ids_to_tokens(both)) if p.startswith("\u2581"))  # "▁fine"'s start
    prompt, answer = both[:cut], both[cut:]
    assert ref.decode(both, skip_special_tokens=True).endswith(" fine")  # alone, most variants strip its space
    dec = ours.stream(context=prompt)
    assert "".join([dec.push(t) for t in answer] + [dec.flush()]) == " fine"
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))  # null: the EOS alone
    assert HFTokenizer.from_folder(tmp_path).stop_ids == (2,)


def test_template_errors_and_sandbox():
    with pytest.raises(ChatTemplateError, match="Only user and assistant"):
        render_chat_template(LLAMA3_TEMPLATE, [{"role": "tool", "content": "x"}], special_tokens={"bos_token": "B"})
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for m in messages %}", ["hi"])
    with pytest.raises(ChatTemplateError):  # the sandbox refuses Python internals
        render_chat_template("{{ messages.__class__.__mro__ }}", ["hi"])
    assert render_chat_template("{{ messages[0] | tojson }}", ["<é>"]) == '{"role": "user", "content": "<é>"}'


def test_gguf_tokenizer_renders_any_stored_template():
    """A GGUF whose stored template is not ChatML (a Llama 3 GGUF) renders it with the same jinja path."""
    from dspark_jax.tokenizer import Tokenizer as GGUFTokenizer

    tokens = [*SPECIALS, "h", "i"]
    tok = GGUFTokenizer(tokens, [], [3] * len(SPECIALS) + [1, 1], bos_id=0, eos_id=4, chat_template=LLAMA3_TEMPLATE)
    text = tok.apply_chat_template(["hi"])
    assert text == render_chat_template(LLAMA3_TEMPLATE, ["hi"], special_tokens={"bos_token": "<|begin_of_text|>",
                                                                                 "eos_token": "<|eot_id|>"})
    assert text.startswith("<|begin_of_text|><|start_header_id|>system") and tok.default_system is None
    assert tok.encode_chat(["hi"])[:2] == [0, 2]  # the special tokens the template wrote


def test_chat_template_doctests():
    import doctest

    from dspark_jax import chat_template

    result = doctest.testmod(chat_template)
    assert result.failed == 0 and result.attempted > 0


def test_stop_ids_from_config_without_generation_config(bad):
    (bad / "generation_config.json").unlink()
    _edit_config(bad, eos_token_id=[7, 9])
    tok = HFTokenizer.from_folder(bad)
    assert tok.stop_ids == (tok.eos_id, 7, 9)
    _edit_config(bad, eos_token_id="</s>")
    with pytest.raises(ValueError, match=r"config.json: field 'eos_token_id' must be an int or a list of ints"):
        HFTokenizer.from_folder(bad)


def test_dtype_option(folders):
    path, _, _ = folders["qwen3"]
    model = load_target(path, dtype="bfloat16")
    assert model.dtype == jnp.bfloat16 and model.weights.layers[0].q_norm.dtype == jnp.bfloat16
    assert model.weights.stacked("wq").shape == (2, 64, 4 * 32)  # [L, D, H*E]


# ----------------------------------------------------------------------------------------------------
# Bad input


@pytest.fixture
def bad(folders, tmp_path):
    """A fresh copy of the tiny Qwen3 folder to break."""
    folder = tmp_path / "bad"
    shutil.copytree(folders["qwen3"][0], folder)
    return folder


def _edit_config(folder, **changes):
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))


def test_unsupported_architecture(bad):
    _edit_config(bad, architectures=["GPT2LMHeadModel"])
    with pytest.raises(HFCheckpointError, match=r"config.json: field 'architectures' is \['GPT2LMHeadModel'\]"):
        load_target(bad)


@pytest.mark.parametrize("changes, message", [
    (dict(use_sliding_window=True), "sliding-window"),
    (dict(hidden_act="gelu"), "'hidden_act' is 'gelu'"),
    (dict(attention_bias=True), "'attention_bias' is true"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}), "rope_type 'yarn'"),
    (dict(rope_parameters=None, rope_scaling={"rope_type": "llama3", "factor": 8.0}), "lacks 'low_freq_factor'"),
    (dict(num_hidden_layers=None), "'num_hidden_layers' is missing"),
])
def test_unsupported_config_fields(bad, changes, message):
    _edit_config(bad, **changes)
    with pytest.raises(HFCheckpointError, match=message):
        read_hf_config(bad)


def _drop_config(folder, *names):
    raw = json.loads((folder / "config.json").read_text())
    for name in names:
        raw.pop(name, None)
    (folder / "config.json").write_text(json.dumps(raw))


def test_config_defaults_read_as_transformers_reads_them(bad):
    """Fields a config may leave out or give twice mean what transformers makes of them: Qwen3's head_dim
    defaults to 128; llama3 RoPE without original_max_position_embeddings uses max_position_embeddings; a
    non-empty rope_scaling wins over rope_parameters; without architectures the model_type decides; a
    Mistral config without sliding_window has a 4096-token window (refused: not supported)."""
    auto = transformers.AutoConfig.from_pretrained
    _drop_config(bad, "head_dim")
    assert read_hf_config(bad).head_dim == auto(bad).head_dim == 128
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    _edit_config(bad, head_dim=32, rope_parameters=None, rope_scaling=llama3, max_position_embeddings=2048)
    assert read_hf_config(bad).rope_scaling.original_max_positions == 2048
    assert auto(bad).rope_parameters["original_max_position_embeddings"] == 2048
    _edit_config(bad, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                 rope_scaling={"rope_type": "linear", "factor": 2.0})
    cfg = read_hf_config(bad)
    assert (cfg.rope_scaling.kind, cfg.rope_scaling.factor) == ("linear", 2.0)
    assert auto(bad).rope_parameters["rope_type"] == "linear"
    _drop_config(bad, "architectures")
    assert read_hf_config(bad).qk_norm  # qwen3, from model_type
    _edit_config(bad, architectures=["MistralForCausalLM"], model_type="mistral", rope_scaling=None)
    _drop_config(bad, "sliding_window")
    assert auto(bad).sliding_window == 4096
    with pytest.raises(HFCheckpointError, match="'sliding_window' is 4096 .missing"):
        read_hf_config(bad)
    _edit_config(bad, sliding_window=None)
    assert read_hf_config(bad).head_dim == 32


def test_missing_tensor_names_tensor_and_file(bad):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(HFCheckpointError, match=r"bad: tensor 'model.layers.1.self_attn.k_norm.weight' is missing"):
        load_target(bad)


def test_shape_mismatch_names_tensor_and_shapes(bad):
    _edit_config(bad, intermediate_size=96)
    with pytest.raises(HFCheckpointError,
                       match=r"model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has shape \[128, 64\], "
                             r"expected \[96, 64\]"):
        load_target(bad)


def test_missing_files(bad):
    (bad / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="tokenizer.json: missing"):
        load_target(bad)
    (bad / "model.safetensors").unlink()
    with pytest.raises(HFCheckpointError, match="no model.safetensors"):
        load_target(bad)
    (bad / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json is missing"):
        load_target(bad)


def test_sharded_index_with_missing_shard(bad):
    (bad / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(HFCheckpointError, match=r"names shard\(s\) \['model-00001-of-00002.safetensors'\]"):
        load_target(bad)


def test_sharded_checkpoint_loads(folders, tmp_path):
    """A checkpoint saved in several shards (transformers' max_shard_size) loads to the same weights."""
    path, ref, _ = folders["llama"]
    sharded = tmp_path / "sharded"
    shutil.copytree(path, sharded)
    (sharded / "model.safetensors").unlink()
    ref.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    a, b = load_hf_model(path), load_hf_model(sharded)
    np.testing.assert_array_equal(a.weights.stacked("w_down"), b.weights.stacked("w_down"))
    np.testing.assert_array_equal(np.asarray(a.weights.lm_head), np.asarray(b.weights.lm_head))


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_save_hf_round_trip_and_transformers_reads_it(folders, tmp_path, name, monkeypatch):
    """Random weights written by the exporter (through its command line) load back bit for bit, and transformers
    reads the folder as the same model (the fixtures' configs: Llama 3 RoPE scaling, Qwen3's q/k norms)."""
    import jax

    from dspark_jax.models import hf
    from dspark_jax.models.llama import LlamaModel

    base = load_hf_model(folders[name][0])
    rng = np.random.default_rng(3)  # other weights of the same shapes (numpy: nothing to compile)
    weights = jax.tree.map(lambda x: jnp.asarray(rng.normal(0.0, 0.3, x.shape).astype(np.float32)), base.weights)
    cfg = base.cfg
    model = LlamaModel(cfg, weights, HFTokenizer.from_folder(folders["qwen3"][0]))
    monkeypatch.setattr(hf.LlamaModel, "from_gguf", lambda path, dtype: model)
    hf.main(["--from-gguf", "unused.gguf", "--out", str(tmp_path / "out")])
    back = load_hf_model(tmp_path / "out")
    assert back.cfg == cfg
    for a, b in zip(jax.tree.leaves(model.weights), jax.tree.leaves(back.weights)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert back.tokenizer.stop_ids == model.tokenizer.stop_ids
    assert back.tokenizer.chat_template == model.tokenizer.chat_template
    ref = type(folders[name][1]).from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    ids = list(np.random.default_rng(1).integers(0, COMMON["vocab_size"], 80))  # the logits test's shapes
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(back.score(ids)), theirs, rtol=0, atol=2e-5 * np.abs(theirs).max())


# ----------------------------------------------------------------------------------------------------
# The real SmolLM2, GGUF -> Hugging Face folder


@pytest.mark.slow
def test_smollm2_exported_folder_decodes_as_the_gguf(target, tmp_path):
    folder = save_hf(target, tmp_path / "smollm2")
    model = load_target(folder, dtype="float32")
    assert model.cfg == target.cfg
    np.testing.assert_array_equal(model.weights.stacked("wq"), target.weights.stacked("wq"))
    tok, ref_tok = model.tokenizer, target.tokenizer
    assert (tok.eos_id, tok.bos_id, tok.stop_ids, tok.vocab_size) == (ref_tok.eos_id, ref_tok.bos_id,
                                                                       ref_tok.stop_ids, ref_tok.vocab_size)
    for text in CORPUS + ["3.14159 and   42 spaces", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(text) == ref_tok.encode(text)
    turns = [{"role": "user", "content": "Explain in two sentences why the sky is blue, for a ten year old."}]
    ids = tok.encode_chat(turns)
    assert ids == ref_tok.encode_chat(turns) and len(ids) > 16
    assert tok.decode(ids, skip_special=False) == ref_tok.decode(ids, skip_special=False)
    out = [build_engine(m, "none", num_slots=1, max_prompt_tokens=len(ids), max_new_tokens=12).run([ids], 12)[0]
           for m in (target, model)]
    assert out[0].output_ids == out[1].output_ids and len(out[0].output_ids) > 0


def test_gguf_rope_scaling_is_read_or_refused():
    """GGUF metadata: linear scaling is read; Llama 3.1's rope_freqs tensor and YaRN are refused, not ignored."""
    from types import SimpleNamespace

    from dspark_jax.models.gguf import GGUFError, read_rope_scaling

    def reader(**fields):
        return SimpleNamespace(fields={k: SimpleNamespace(contents=lambda v=v: v) for k, v in fields.items()})

    assert read_rope_scaling(reader(), {}) is None
    assert read_rope_scaling(reader(**{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}),
                             {}) == RopeScaling("linear", 4.0)
    with pytest.raises(GGUFError, match="rope_freqs.weight"):
        read_rope_scaling(reader(), {"rope_freqs.weight": [32]})
    with pytest.raises(GGUFError, match="scaling.type='yarn'"):
        read_rope_scaling(reader(**{"llama.rope.scaling.type": "yarn"}), {})


def test_gguf_end_of_turn_ids_stop_generation():
    from dspark_jax.tokenizer import Tokenizer as GGUFTokenizer

    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "<|end_of_text|>", "<|eot_id|>"],
            "tokenizer.ggml.merges": [], "tokenizer.ggml.eos_token_id": 1}
    assert GGUFTokenizer.from_metadata(meta).stop_ids == (1,)
    assert GGUFTokenizer.from_metadata({**meta, "tokenizer.ggml.eot_token_id": 2}).stop_ids == (1, 2)


def test_generate_with_a_qwen3_folder_and_a_deepspec_drafter_equals_plain(folders, tmp_path):
    """The README's one command at toy size: a Qwen3 checkpoint folder as --model and a DeepSpec DSpark folder as
    --draft; `generate --policy dspark` (and fixed:3, which verifies drafts every round) at temperature 0 gives
    `--policy none`'s tokens."""
    from flax import nnx

    from dspark_jax import generate
    from dspark_jax.models import drafter as dr
    from dspark_jax.models.deepspec import save_deepspec_drafter

    path, _, _ = folders["qwen3"]
    cfg = dr.DrafterConfig(vocab_size=COMMON["vocab_size"], dim=COMMON["hidden_size"], n_taps=1, n_layers=1,
                           n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=64, block=7, head="markov", rank=8,
                           confidence=True, rope_base=1e6, norm_eps=1e-6, qk_norm=True,
                           mask_token=COMMON["vocab_size"] - 1, own_embeddings=True, tap_layers=(0,))
    drafter = dr.Drafter(cfg, rngs=nnx.Rngs(0))
    save_deepspec_drafter(drafter, tmp_path / "dspark", num_target_layers=COMMON["num_hidden_layers"])
    common = ["--model", str(path), "--prompt", "hello there", "--max-new-tokens", "12", "--quiet"]
    with pytest.warns(UserWarning):  # the packaged SPS table was measured for another model: said, not hidden
        spec = generate.main(common + ["--policy", "dspark", "--draft", str(tmp_path / "dspark")])
    fixed = generate.main(common + ["--policy", "fixed:3", "--draft", str(tmp_path / "dspark")])
    plain = generate.main(common + ["--policy", "none"])
    for run in (spec, fixed):
        assert [r["output_ids"] for r in run["results"]] == [r["output_ids"] for r in plain["results"]]
    assert fixed["summary"]["drafts_per_request"] > 0 and len(plain["results"][0]["output_ids"]) >= 4
