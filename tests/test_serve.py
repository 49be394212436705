"""The OpenAI-compatible server (`python -m dspark_jax.serve`) over HTTP on 127.0.0.1, driven by the official
`openai` client and httpx, on a small random target with the real tokenizer and vocabulary and a random drafter
(the serving plumbing is under test; losslessness makes greedy answers those of plain decoding)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import time
import types

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

KEY = "test-key"
MODEL = "small"
SLOTS = 4


@pytest.fixture(scope="module")
def served(gguf_path, tmp_path_factory):
    from dspark_jax.build import build_engine, load_drafter_for
    from dspark_jax.serve import BackgroundServer, EngineWorker, create_app
    from dspark_jax.tokenizer import Tokenizer
    from tests.helpers import save_random_drafter, small_real_vocab_target

    tok = Tokenizer.from_gguf(gguf_path)  # the tokenizer only: no weights of the real model are read
    small = small_real_vocab_target(types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=tok.vocab_size),
                                                          tokenizer=tok))
    path = save_random_drafter(small.cfg, tmp_path_factory.mktemp("serve") / "drafter", block=4)
    engine = build_engine(small, "fixed:3", draft=load_drafter_for(small, path), num_slots=SLOTS,
                          max_prompt_tokens=96, max_new_tokens=24)
    worker = EngineWorker(engine, max_queued=64)
    app = create_app(worker, tok, MODEL, api_key=KEY, default_max_tokens=8)
    with BackgroundServer(app) as url:
        yield types.SimpleNamespace(url=url, worker=worker, tok=tok, small=small, drafter=path,
                                    client=openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0))
    assert not worker.alive  # drained and stopped with the server


def plain(served, prompt_ids, n):
    from dspark_jax.decoding import plain_generate

    out, _ = plain_generate(served.small, [prompt_ids], n, 0.0, num_slots=1, capacity=128)
    return served.tok.decode(out[0].output_ids)


def metric(served, name, labels=""):
    text = httpx.get(f"{served.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    m = re.search(rf"^{name}{{[^}}]*{re.escape(labels)}[^}}]*}} (\S+)$", text, re.M)
    return float(m.group(1))


def test_greedy_completion_equals_generate(served, tmp_path):
    from dspark_jax import generate

    question = "Name three colours."
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(generate, "load_target", lambda model=None, dtype=None, mesh=None: served.small)
        report = generate.main(["--prompt", question, "--max-new-tokens", "8", "--policy", "none", "--quiet"])
    want = report["results"][0]["text"]
    templated = served.tok.apply_chat_template([question])
    c = served.client.completions.create(model=MODEL, prompt=templated, max_tokens=8, temperature=0)
    assert c.choices[0].text == want
    n_out = len(report["results"][0]["output_ids"])
    assert c.usage.prompt_tokens == len(served.tok.encode(templated)) and c.usage.completion_tokens == n_out
    chat = served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                                 max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == want and chat.choices[0].finish_reason in ("stop", "length")
    models = served.client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_32_concurrent_streams_with_mixed_temperatures(served):
    """32 streaming chat requests at once over 4 slots (the rest queue): greedy, sampled with and without top-p
    and seeded ones; every one completes, the greedy ones token for token plain decoding's answer, and a seeded
    request repeats its answer."""
    questions = [f"Question {i}: what is {i} plus {i}?" for i in range(8)]
    settings = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=1.2, top_p=0.9),
                dict(temperature=0.7, seed=1234)]

    def ask(i):
        kw = settings[i % 4]
        stream = served.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": questions[i // 4]}], max_tokens=8, stream=True,
            stream_options={"include_usage": True}, **kw)
        text, reason, usage = [], None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                text.append(ch.delta.content or "")
                reason = ch.finish_reason or reason
        return i, "".join(text), reason, usage

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(ask, range(32)))
    assert len(results) == 32
    for i, text, reason, usage in results:
        assert reason in ("stop", "length") and 1 <= usage.completion_tokens <= 8, (i, reason, usage)
        if settings[i % 4]["temperature"] == 0:
            assert text == plain(served, served.tok.encode_chat([questions[i // 4]]), 8), i
    again = served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": questions[1]}],
                                                  max_tokens=8, **settings[3])
    assert again.choices[0].message.content == results[7][1]


def test_disconnect_mid_stream_frees_the_slot(served):
    cancelled = metric(served, "dspark_requests_finished_total", 'reason="cancelled"')
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 24,
            "stream": True, "temperature": 0.0}
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line and '"content": ""' not in line:
                break  # the first token arrived: hang up
    deadline = time.monotonic() + 30
    while metric(served, "dspark_requests_finished_total", 'reason="cancelled"') < cancelled + 1:
        assert time.monotonic() < deadline, "the disconnected request was never cancelled"
        time.sleep(0.1)
    deadline = time.monotonic() + 30
    while metric(served, "dspark_requests_running") > 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_bad_requests_get_4xx_and_the_server_keeps_serving(served):
    url, auth = f"{served.url}/v1", {"Authorization": f"Bearer {KEY}"}
    msgs = [{"role": "user", "content": "Hi"}]
    long_prompt = " ".join(["word"] * 400)
    bad = [
        (404, "chat/completions", {"model": "nope", "messages": msgs}),
        (400, "chat/completions", "{not json"),
        (400, "completions", {"model": MODEL, "prompt": "Hi", "max_tokens": -5}),
        (400, "completions", {"model": MODEL, "prompt": long_prompt}),
        (400, "chat/completions", {"model": MODEL, "messages": msgs, "temperature": 3.5}),
        (400, "chat/completions", {"model": MODEL, "messages": msgs, "top_p": 0}),
        (400, "chat/completions", {"model": MODEL, "messages": msgs, "n": 2}),
        (400, "chat/completions", {"model": MODEL}),
        (400, "completions", {"model": MODEL, "prompt": [10**9]}),
        (400, "completions", {"model": MODEL, "prompt": "Hi", "stream_options": {"include_usage": True}}),
        (400, "completions", {"model": MODEL, "prompt": "Hi", "stop": 5}),
    ]
    received = metric(served, "dspark_requests_received_total")

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            async def one(status, path, body):
                data = body if isinstance(body, str) else json.dumps(body)
                r = await client.post(f"{url}/{path}", content=data,
                                      headers={**auth, "Content-Type": "application/json"})
                return status, r
            return await asyncio.gather(*(one(*b) for b in bad * 3))

    for status, r in asyncio.run(burst()):
        assert r.status_code == status, (status, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"]
    r = httpx.post(f"{url}/chat/completions", json={"model": MODEL, "messages": msgs})  # no key
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{served.url}/metrics").status_code == 401
    assert httpx.get(f"{served.url}/health").status_code == 200  # the health probe needs no key
    good = served.client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert good.usage.completion_tokens >= 1
    assert metric(served, "dspark_requests_received_total") == received + 1  # bad ones never reached the engine


def test_fields_other_clients_send(served, monkeypatch):
    """What benchmark and agent clients send beside the basics: vLLM's ignore_eos reaches the engine; a
    developer turn is a system turn; an assistant turn may have null content; a Hugging Face id ending in the
    served name, null n and stream, 64-bit seeds and a lower-case bearer scheme are accepted; what the server
    cannot do (chat echo, vLLM's prompt_logprobs, tool_choice 'auto' with a template that renders no tools, an
    output constraint that does not compile) is refused by name, not ignored, and so are misplaced logprobs
    fields (tests/test_logprobs.py: what logprobs give); a
    conversation the chat template refuses is a 400 in OpenAI's shape; every chunk of a stream has one
    `created`."""
    from dspark_jax.chat_template import ChatTemplateError

    url, auth = f"{served.url}/v1", {"Authorization": f"Bearer {KEY}"}
    msgs = [{"role": "user", "content": "Hi"}]

    def post(path, body, headers=auth):
        return httpx.post(f"{url}/{path}", json={"model": MODEL, "max_tokens": 4, "temperature": 0, **body},
                          headers=headers, timeout=60)

    seen = []
    submit = served.worker.submit
    monkeypatch.setattr(served.worker, "submit", lambda req: seen.append(req.sampling) or submit(req))
    assert post("completions", {"prompt": "Hi", "ignore_eos": True}).status_code == 200
    assert seen[-1].ignore_eos
    assert post("completions", {"prompt": "Hi"}).status_code == 200 and not seen[-1].ignore_eos

    def answer(body, path="chat/completions", **kw):
        r = post(path, body, **kw)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message" if path.startswith("chat") else "text"]

    system = answer({"messages": [{"role": "system", "content": "Be brief."}, *msgs]})
    assert answer({"messages": [{"role": "developer", "content": "Be brief."}, *msgs]}) == system
    answer({"messages": [*msgs, {"role": "assistant", "content": None}, *msgs]})
    answer({"messages": msgs, "model": f"HuggingFaceTB/{MODEL}", "n": None, "stream": None, "logprobs": False,
            "tools": [], "response_format": {"type": "text"}, "presence_penalty": 0, "frequency_penalty": 0.0,
            "logit_bias": {}, "top_k": -1, "min_p": 0, "best_of": 1, "user": "u1"})
    r = httpx.post(f"{url}/chat/completions", json={"messages": msgs, "max_tokens": 4, "temperature": 0},
                   headers=auth, timeout=60)  # no model: the served one
    assert r.status_code == 200 and r.json()["model"] == MODEL, r.text
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    assert answer({"messages": [{"role": "user", "content": parts}]}) == answer(
        {"messages": [{"role": "user", "content": "Hi\nthere"}]})  # text parts joined as vLLM joins them
    r = post("completions", {"prompt": "Hi", "stop": 5})
    assert r.json()["error"]["param"] == "stop", r.text  # not pydantic's "stop.str"
    answer({"messages": msgs}, headers={"Authorization": f"bearer {KEY}"})
    big = 2**40 + 12345
    hot = {"prompt": "Once", "temperature": 1.0, "max_tokens": 6}
    assert answer({**hot, "seed": big}, "completions") == answer({**hot, "seed": big % 2**31}, "completions")
    assert answer({**hot, "seed": -1}, "completions") == answer({**hot, "seed": 2**31 - 1}, "completions")
    for body, param in (({"logprobs": "maybe"}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
                        ({"echo": True}, "echo"),
                        # SmolLM2's template renders no tools: 'auto' (the default with tools) is refused
                        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
                        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
                            "type": "function", "function": {"name": "g"}}}, "tool_choice"),
                        ({"tools": [{"type": "function", "function": {"name": "f f"}}], "tool_choice": "required"},
                         "tools.0.function.name"),
                        # output constraints that do not compile: refused before any work, naming the field
                        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                            "type": "nosuch"}}}}, "response_format.json_schema.schema"),
                        ({"response_format": {"type": "xml"}}, "response_format.type"),
                        ({"guided_regex": "[a-"}, "guided_regex"), ({"structured_outputs": {"regex": "("}},
                                                                    "structured_outputs.regex"),
                        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
                        ({"structured_outputs": {"grammar": "start: nosuch"}}, "structured_outputs.grammar"),
                        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
                        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex")):
        r = post("chat/completions", {"messages": msgs, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # fields that would change the answer are refused by name unless neutral, never silently dropped
    for body in ({"presence_penalty": 0.5}, {"frequency_penalty": -1}, {"repetition_penalty": 1.2},
                 {"logit_bias": {"10": 5}}, {"top_k": 5}, {"min_p": 0.1}, {"min_tokens": 3}, {"best_of": 2},
                 {"continue_final_message": True}):
        r = post("chat/completions", {"messages": msgs, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(body)), r.text
    for path, body in (("completions", {"prompt": "Hi", "prompt_logprobs": 0}), ("completions", {"prompt": "Hi",
                                                                                          "suffix": "x"}),
                       ("chat/completions", {"messages": msgs, "logprobs": 2}),
                       ("chat/completions", {"messages": msgs, "chat_template_kwargs": {"tools": [{"a": 1}]}})):
        r, param = post(path, body), next(iter(body.keys() - {"prompt", "messages"}))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = post("chat/completions", {"messages": [*msgs, {"role": "robot", "content": "42"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.1.role"
    answer({"messages": [*msgs, {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "42"}]})
    r = post("chat/completions", {"messages": [{"role": "user", "content": None}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"

    def refuse(*a, **k):
        raise ChatTemplateError("Conversation roles must alternate user/assistant")

    given = []
    render = served.tok.apply_chat_template
    monkeypatch.setattr(served.tok, "apply_chat_template", lambda turns, *a, **k: given.append((turns, a, k)) or
                        render(turns, *a, **k))
    answer({"messages": [{"role": "user", "content": "Hi", "name": "ann"}],
            "chat_template_kwargs": {"enable_thinking": False}})
    assert given[-1] == ([{"role": "user", "content": "Hi", "name": "ann"}], (True,), {"enable_thinking": False})
    monkeypatch.setattr(served.tok, "apply_chat_template", refuse)
    r = post("chat/completions", {"messages": msgs})
    assert r.status_code == 400 and "alternate" in r.json()["error"]["message"]
    monkeypatch.undo()
    stream = served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                                   stream=True, stream_options={"include_usage": True})
    assert len({chunk.created for chunk in stream}) == 1


def test_engine_failure_and_unknown_paths_answer_in_openai_shape(served, monkeypatch):
    """An engine that fails mid-answer gives a 500 error body (not a 200 with a truncated answer), and a stream
    ends with an error event then [DONE]; `models.retrieve` finds the served model; unknown paths and methods
    answer with OpenAI's error body."""
    import asyncio as aio

    from dspark_jax.serve.worker import Event

    ids = served.tok.encode("Hello there")

    def failing(req):
        q = aio.Queue()
        q.put_nowait(Event("tokens", tokens=tuple(ids)))
        q.put_nowait(Event("error", status=500, message="the engine failed: boom"))
        return q

    monkeypatch.setattr(served.worker, "submit", failing)
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    r = httpx.post(f"{served.url}/v1/chat/completions", json=body, headers=auth, timeout=60)
    assert r.status_code == 500 and "boom" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{served.url}/v1/chat/completions", json={**body, "stream": True}, headers=auth, timeout=60)
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "boom" in json.loads(events[-2])["error"]["message"]
    assert "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-2]) == "Hello there"
    monkeypatch.undo()
    assert served.client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        served.client.models.retrieve("other")
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
        r = httpx.request(method, f"{served.url}{path}", headers=auth)
        assert r.status_code == status and r.json()["error"]["message"], r.text


def test_overfilled_queue_refuses_the_excess_and_completes_the_rest(served):
    worker = served.worker
    received = metric(served, "dspark_requests_received_total")
    worker.max_queued = 3
    try:
        async def flood():
            async with httpx.AsyncClient(timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as client:
                body = {"model": MODEL, "prompt": "Count to ten:", "max_tokens": 16, "temperature": 0.0}
                return await asyncio.gather(*(client.post(f"{served.url}/v1/completions", json=body)
                                              for _ in range(40)))

        responses = asyncio.run(flood())
    finally:
        worker.max_queued = 64
    codes = [r.status_code for r in responses]
    # at least the queue's 3 are accepted (more when the engine admits some to slots during the flood)
    assert set(codes) <= {200, 429} and codes.count(429) >= 1 and codes.count(200) >= 3
    assert metric(served, "dspark_requests_received_total") == received + codes.count(200)
    texts = {r.json()["choices"][0]["text"] for r in responses if r.status_code == 200}
    assert len(texts) == 1  # every accepted one completed, with the same greedy answer
    assert all(r.json()["error"]["code"] == "queue_full" for r in responses if r.status_code == 429)


def test_stop_strings_cut_the_text(served):
    full = served.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    text = full.choices[0].text
    assert len(text) > 4
    stop = text[2:4]
    stopped = metric(served, "dspark_requests_finished_total", 'reason="stop"')
    cut = served.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0,
                                           stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    deadline = time.monotonic() + 30  # the engine thread counts it when it frees the slot
    while metric(served, "dspark_requests_finished_total", 'reason="stop"') < stopped + 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_worker_drains_on_stop_and_times_out_waiting_requests():
    """Without HTTP: stopping the worker finishes every accepted request and refuses new ones; a request that
    waits past the queue timeout is told so."""
    from dspark_jax.engine import Engine, EngineConfig, SamplingParams
    from dspark_jax.serve.worker import EngineWorker, GenerationRequest, ShuttingDown
    from tests.test_engine import make_model

    model = make_model()

    async def scenario(timeout):
        worker = EngineWorker(Engine(model, None, "none", EngineConfig(num_slots=2, capacity=64), stop_ids=[]),
                              queue_timeout=timeout)
        worker.start()
        reqs = [GenerationRequest([1, 2, 3 + i], 6, SamplingParams()) for i in range(6)]
        queues = [worker.submit(r) for r in reqs]
        stopper = asyncio.get_running_loop().run_in_executor(None, worker.stop)
        ends = []
        for q in queues:
            while True:
                ev = await asyncio.wait_for(q.get(), 120)
                if ev.kind != "tokens":
                    ends.append(ev)
                    break
        await stopper
        with pytest.raises(ShuttingDown):
            worker.submit(GenerationRequest([1], 1))
        return ends, worker.metrics()

    ends, m = asyncio.run(scenario(None))
    assert [e.kind for e in ends] == ["done"] * 6 and m.requests_finished["length"] == 6
    ends, m = asyncio.run(scenario(1e-6))  # only what is admitted at once escapes the timeout
    kinds = [e.kind for e in ends]
    assert kinds.count("done") >= 1 and kinds.count("error") >= 1
    assert all(e.status == 503 and "queue timeout" in e.message for e in ends if e.kind == "error")
    assert m.requests_finished["timeout"] == kinds.count("error")


def test_bench_http_rows(served, tmp_path):
    """The HTTP benchmark end to end (plumbing; timings here mean nothing): each (policy, N) row has the
    in-process and HTTP throughputs of its paired windows, their pooled ratio inside its bootstrap interval, and
    TTFT / ITL percentiles; the JSON names the machine."""
    from dspark_jax.build import load_drafter_for
    from profiling import bench_http

    out = tmp_path / "http.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench_http, "load_target", lambda model=None, dtype=None, mesh=None: served.small)
        mp.setattr(bench_http, "load_drafter_for", lambda target, draft=None: load_drafter_for(target, served.drafter))
        # fixed:3 on 4 slots with a 128-token cache: the served engine's shapes, so its compiled programs serve
        rows = bench_http.main(["--policies", "fixed:3", "--concurrency", "1", str(SLOTS), "--max-new-tokens", "8",
                                "--max-prompt-tokens", "96", "--warmup-tokens", "8", "--measure-tokens", "48",
                                "--repeats", "2", "--json", str(out)])
    assert [(r["policy"], r["N"]) for r in rows] == [("fixed:3", 1), ("fixed:3", SLOTS)]
    for r in rows:
        assert r["pairs"] == 2 and len(r["http_windows"]) == len(r["inproc_windows"]) == 2
        assert r["http_tokens"] >= 2 * 48 and r["http_errors"] == 0
        assert 0 < r["ratio_lo"] <= r["ratio_http"] <= r["ratio_hi"] and r["ratio_median"] > 0
        assert r["ttft_p50_ms"] > 0 and r["itl_p50_ms"] >= 0 and r["inproc_tokens_per_s"] > 0
    report = json.loads(out.read_text())
    assert report["complete"] and report["device"]["backend"] and report["date"]


def test_serve_doctests():
    import doctest

    from dspark_jax import tokenizer
    from dspark_jax.serve import app, load, logprobs

    for module in (app, load, logprobs, tokenizer):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0


def test_cors_preflight_passes_the_key_check_and_names_allowed_origins(served):
    """A browser's preflight carries no credentials: it must not get 401. With --allowed-origins the answer
    allows that origin; without it the server adds no CORS headers (same-origin only). The app is driven
    without its lifespan, so the shared engine is not stopped."""
    from fastapi.testclient import TestClient

    from dspark_jax.serve import create_app

    pre = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    for origins in (["http://localhost:3000"], ["*"]):
        client = TestClient(create_app(served.worker, served.tok, MODEL, api_key=KEY, allowed_origins=origins))
        r = client.options("/v1/chat/completions", headers=pre)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] in ("http://localhost:3000", "*")
        assert client.get("/v1/models", headers={"Origin": "http://localhost:3000"}).status_code == 401
        r = client.get("/v1/models", headers={"Origin": "http://localhost:3000", "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and "access-control-allow-origin" in r.headers
    client = TestClient(create_app(served.worker, served.tok, MODEL, api_key=KEY))
    r = client.options("/v1/chat/completions", headers=pre)
    assert r.status_code != 401 and "access-control-allow-origin" not in r.headers


def test_a_repeated_prompt_is_served_from_the_prefix_cache(served):
    """The second of two equal prompts takes its full pages from the prefix cache (the counters on /metrics say
    so) and answers exactly as the first."""
    prompt = "Tell me about the sea. " * 12  # several full pages of 16 tokens
    hits, queries = metric(served, "dspark_prefix_cache_hits_total"), metric(served, "dspark_prefix_cache_queries_total")
    a, b = (served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text
    n = (metric(served, "dspark_prefix_cache_queries_total") - queries) / 2  # the prompt's tokens, twice
    assert n >= 48
    assert metric(served, "dspark_prefix_cache_hits_total") - hits == (n - 1) // 16 * 16
    assert 0 < metric(served, "dspark_prefix_cache_hit_rate") <= 1
