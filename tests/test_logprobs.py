"""Logprobs (issue 56): the engine's per-request logprobs on a tiny model (tokens unchanged with them on, values
against a plain log-softmax, no program compiled after warm-up), and the OpenAI server over the real SmolLM2 under
``none`` and ``dspark`` with the official ``openai`` client: greedy chat logprobs equal between the policies and
equal transformers' log-softmax of the same model (the repo's own float32 forward without transformers), streamed
as not, completions' shape and echo, bad values refused."""

from __future__ import annotations

import types

import numpy as np
import pytest

from dspark_jax import engine as eng
from dspark_jax.sampling import MAX_LOGPROBS
from tests.helpers import count_compilations
from tests.test_engine import SPS, make_drafter, make_model, prompts


def log_softmax(logits) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


# ------------------------------------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def tiny():
    m = make_model()
    return m, make_drafter(m)


def run_twice(model, drafter, policy, ps, first, second, n=9):
    """One engine runs the requests with ``first`` sampling, then with ``second``: (completions of each, programs
    compiled by the second run)."""
    e = eng.Engine(model, drafter, policy, eng.EngineConfig(num_slots=2, capacity=64), sps=SPS, stop_ids=[5])
    out = []
    for sampling in (first, second):
        with count_compilations() as compiled:
            ids = [e.submit(p, n, s) for p, s in zip(ps, sampling)]
            while not e.idle():
                e.step()
        out.append([e.requests[i] for i in ids])
    return out[0], out[1], compiled()


def test_engine_logprobs_leave_the_tokens_alone_and_equal_log_softmax(tiny):
    """Greedy and seeded sampled requests, with and without logprobs, under ``none`` and ``fixed:3``: the same
    tokens; each output token's logprob and its top alternatives (and the prompt's, with prompt_logprobs) are the
    raw log-softmax of the model's logits at that position (temperature and top-p do not enter); the policies
    agree on the greedy requests; the rounds with logprobs run the programs of the rounds without (nothing
    compiles)."""
    model, drafter = tiny
    ps = prompts(4, seed=1)
    plain = [eng.SamplingParams(temperature=t, top_p=p, seed=s)
             for t, p, s in ((0.0, 1.0, None), (0.9, 0.8, 7), (0.0, 1.0, None), (1.3, 1.0, 3))]
    asked = [eng.SamplingParams(temperature=s.temperature, top_p=s.top_p, seed=s.seed, logprobs=n, prompt_logprobs=n)
             for s, n in zip(plain, (5, 0, MAX_LOGPROBS, 2))]
    results = {}
    for policy in ("none", "fixed:3"):
        off, on, compiled = run_twice(model, drafter, policy, ps, plain, asked)
        assert [c.output_ids for c in on] == [c.output_ids for c in off], policy
        assert all(c.logprobs is None and c.prompt_logprobs is None for c in off)
        assert compiled == 0, policy
        results[policy] = on
    for c, s in [*zip(results["none"], asked), *zip(results["fixed:3"], asked)]:
        assert [e.token for e in c.logprobs] == c.output_ids
        full = c.prompt_ids + c.output_ids
        ref = log_softmax(model.score(full))  # [n, V]: row i predicts token i + 1
        n = len(c.prompt_ids)
        np.testing.assert_allclose([e.logprob for e in c.logprobs], ref[np.arange(n - 1, len(full) - 1),
                                                                         c.output_ids], atol=1e-4)
        assert c.prompt_logprobs[0] is None and len(c.prompt_logprobs) == n
        np.testing.assert_allclose([e.logprob for e in c.prompt_logprobs[1:]], ref[np.arange(n - 1), full[1:n]],
                                   atol=1e-4)
        for pos, e in zip(range(n - 1, len(full) - 1), c.logprobs):
            assert len(e.top) == s.logprobs
            top_ids = [t for t, _ in e.top]
            np.testing.assert_array_equal(top_ids, np.argsort(-ref[pos], kind="stable")[: s.logprobs])
            np.testing.assert_allclose([v for _, v in e.top], ref[pos, top_ids], atol=1e-4)
    for a, b in [(a, b) for a, b, s in zip(results["fixed:3"], results["none"], asked) if s.temperature == 0]:
        assert [e.token for e in a.logprobs] == [e.token for e in b.logprobs]
        np.testing.assert_allclose([e.logprob for e in a.logprobs], [e.logprob for e in b.logprobs], atol=1e-4)


def test_sampling_params_refuse_bad_logprobs():
    for name in ("logprobs", "prompt_logprobs"):
        for bad in (-1, MAX_LOGPROBS + 1, 1.5, True):
            with pytest.raises(ValueError, match=name):
                eng.SamplingParams(**{name: bad})


# ------------------------------------------------------------------------------------------------ the server

openai = None
MODEL = "smollm2"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def servers(target):
    """Two real servers over SmolLM2: plain decoding (``none``) and the packaged DSpark drafter (``dspark``)."""
    global openai
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    import contextlib

    from dspark_jax.build import build_engine
    from dspark_jax.serve import BackgroundServer, EngineWorker, create_app

    with contextlib.ExitStack() as stack:
        out = {}
        for policy in ("none", "dspark"):
            engine = build_engine(target, policy, num_slots=2, max_prompt_tokens=64, max_new_tokens=16)
            app = create_app(EngineWorker(engine), target.tokenizer, MODEL, default_max_tokens=8)
            url = stack.enter_context(BackgroundServer(app))
            out[policy] = types.SimpleNamespace(
                url=url, engine=engine, client=openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0))
        yield out


_BY_BYTES: dict[bytes, int] = {}


def token_ids(target, pieces):
    """Token ids of the answer's tokens, from their bytes (byte-level BPE pieces are unique)."""
    if not _BY_BYTES:
        _BY_BYTES.update({target.tokenizer.token_bytes(i): i for i in range(target.cfg.vocab_size)})
    return [_BY_BYTES[bytes(p)] for p in pieces]


def reference_log_softmax(target, ids, request):
    """Log-softmax of the model's logits for ``ids`` [n, V]: transformers' (float32) where installed, else the
    repo's own float32 forward."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return log_softmax(target.score(ids))
    import torch

    with torch.no_grad():
        logits = request.getfixturevalue("hf_model")(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), -1).numpy()


def test_greedy_chat_logprobs_equal_between_policies_and_transformers(servers, target, request):
    """Greedy chat, ``logprobs: true, top_logprobs: 5``: the same tokens and logprobs (within 1e-4) under
    ``dspark`` as under ``none``; top_logprobs sorted, the emitted token first among them; the values equal the
    reference log-softmax at those positions within 1e-3."""
    answers = {}
    for policy, s in servers.items():
        r = s.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                             logprobs=True, top_logprobs=5)
        answers[policy] = r.choices[0]
    none, dspark = answers["none"], answers["dspark"]
    assert none.message.content == dspark.message.content
    a, b = none.logprobs.content, dspark.logprobs.content
    assert len(a) == len(b) >= 1
    assert [t.token for t in a] == [t.token for t in b] and [t.bytes for t in a] == [t.bytes for t in b]
    np.testing.assert_allclose([t.logprob for t in a], [t.logprob for t in b], atol=1e-4)
    for t, u in zip(a, b):
        assert [x.token for x in t.top_logprobs] == [x.token for x in u.top_logprobs]
        np.testing.assert_allclose([x.logprob for x in t.top_logprobs], [x.logprob for x in u.top_logprobs],
                                   atol=1e-4)
        values = [x.logprob for x in t.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob  # greedy: the argmax
    assert "".join(t.token for t in a).startswith(none.message.content)
    prompt = target.tokenizer.encode_chat([m["content"] for m in MESSAGES])
    out = token_ids(target, [t.bytes for t in a])
    ref = reference_log_softmax(target, prompt + out, request)
    rows = np.arange(len(prompt) - 1, len(prompt) + len(out) - 1)
    np.testing.assert_allclose([t.logprob for t in a], ref[rows, out], atol=1e-3)
    for row, t in zip(rows, a):
        top = token_ids(target, [x.bytes for x in t.top_logprobs])
        np.testing.assert_allclose([x.logprob for x in t.top_logprobs], ref[row, top], atol=1e-3)
    assert any(r.drafted for r in servers["dspark"].engine.rounds)  # the drafter did run


def collect_stream(stream, chat):
    text, entries = [], []
    for chunk in stream:
        for ch in chunk.choices:
            text.append((ch.delta.content if chat else ch.text) or "")
            if ch.logprobs is not None:
                entries.append(ch.logprobs)
    return "".join(text), entries


def test_streaming_gives_the_logprobs_of_the_answer(servers):
    """Chat and completions, streamed and not (greedy): the same text and the same per-token logprobs; each
    streamed chunk carries the logprobs of its own tokens only."""
    client = servers["dspark"].client
    kw = dict(model=MODEL, max_tokens=8, temperature=0)
    whole = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=3, **kw)
    text, parts = collect_stream(client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=3,
                                                                stream=True, **kw), chat=True)
    streamed = [t for p in parts for t in p.content]
    assert text == whole.choices[0].message.content
    # the second request takes the first one's prompt pages from the prefix cache and prefills the rest in
    # another chunk shape: the same tokens, values equal to float32 rounding over a 49152-token log-softmax
    # (1e-4, the tolerance between policies)
    same = [t.model_dump() for t in whole.choices[0].logprobs.content]
    got = [t.model_dump() for t in streamed]
    assert [t["token"] for t in got] == [t["token"] for t in same]
    np.testing.assert_allclose([t["logprob"] for t in got], [t["logprob"] for t in same], atol=1e-4)
    assert [[a["token"] for a in t["top_logprobs"]] for t in got] == [[a["token"] for a in t["top_logprobs"]]
                                                                      for t in same]
    prompt = "The capital of France is"
    whole = client.completions.create(prompt=prompt, logprobs=2, **kw).choices[0]
    text, parts = collect_stream(client.completions.create(prompt=prompt, logprobs=2, stream=True, **kw), chat=False)
    assert text == whole.text
    for field in ("tokens", "text_offset"):
        assert [x for p in parts for x in getattr(p, field)] == getattr(whole.logprobs, field), field
    np.testing.assert_allclose([x for p in parts for x in p.token_logprobs], whole.logprobs.token_logprobs, atol=1e-4)
    assert [sorted(x) for p in parts for x in p.top_logprobs] == [sorted(x) for x in whole.logprobs.top_logprobs]


def test_completions_logprobs_shape_and_echo(servers, target):
    """Completions ``logprobs: 2``: one entry per output token, two alternatives each, offsets into the text;
    ``echo`` puts the prompt first, with its tokens' logprobs (the first one null) equal to the plain forward's;
    echo without logprobs echoes the text only."""
    client = servers["none"].client
    prompt = "The capital of France is"
    c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2).choices[0]
    lp = c.logprobs
    n = len(lp.tokens)
    assert n == 6 or c.finish_reason == "stop"
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert all(len(d) <= 2 and d[tok] == v for d, tok, v in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens).startswith(c.text)

    e = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2,
                                  echo=True).choices[0]
    ids = target.tokenizer.encode(prompt, add_special=True)
    assert e.text == prompt + c.text
    assert e.logprobs.tokens == [target.tokenizer.decode([i]) for i in ids] + lp.tokens
    assert e.logprobs.token_logprobs[0] is None and e.logprobs.top_logprobs[0] is None
    assert e.logprobs.text_offset[len(ids):] == [o + len(prompt) for o in lp.text_offset]
    np.testing.assert_allclose(e.logprobs.token_logprobs[len(ids):], lp.token_logprobs, atol=1e-4)
    ref = log_softmax(target.score(ids))
    np.testing.assert_allclose(e.logprobs.token_logprobs[1:len(ids)], ref[np.arange(len(ids) - 1), ids[1:]],
                               atol=1e-3)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True).choices[0]
    assert plain.text == prompt + c.text and plain.logprobs is None


def test_bad_logprobs_values_are_refused_by_name(servers):
    """Out of range or misplaced values: 400 in OpenAI's error shape naming the field."""
    client = servers["none"].client
    cases = [("chat", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
             ("chat", dict(logprobs=True, top_logprobs=-1), "top_logprobs"),
             ("chat", dict(top_logprobs=3), "top_logprobs"),
             ("chat", dict(extra_body={"echo": True}), "echo"),
             ("completions", dict(logprobs=21), "logprobs"),
             ("completions", dict(logprobs=-1), "logprobs"),
             ("completions", dict(extra_body={"prompt_logprobs": 1}), "prompt_logprobs")]
    for endpoint, kw, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            if endpoint == "chat":
                client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **kw)
            else:
                client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, **kw)
        assert err.value.status_code == 400 and err.value.body["param"] == param, (kw, err.value.body)
