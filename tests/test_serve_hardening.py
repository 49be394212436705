"""The server against hostile or careless clients (issue 56's hardening), through one real server on 127.0.0.1: a
small random target with the real tokenizer, the ``none`` policy, 4 slots, a queue of one, prompts of at most 48
tokens, and 1-second header and body timeouts."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
import types

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

MODEL = "small"
SLOTS = 4
MAX_PROMPT = 48
TIMEOUT = 1.0  # header and body timeouts of the test server (seconds)
MAX_CONNECTIONS = 16


@pytest.fixture(scope="module")
def server(gguf_path):
    from dspark_jax.build import build_engine
    from dspark_jax.serve import BackgroundServer, EngineWorker, create_app
    from dspark_jax.tokenizer import Tokenizer
    from tests.helpers import small_real_vocab_target

    tok = Tokenizer.from_gguf(gguf_path)
    small = small_real_vocab_target(types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=tok.vocab_size),
                                                          tokenizer=tok))
    engine = build_engine(small, "none", num_slots=SLOTS, max_prompt_tokens=96, max_new_tokens=24)
    worker = EngineWorker(engine, max_queued=1)
    app = create_app(worker, tok, MODEL, default_max_tokens=4, max_prompt_tokens=MAX_PROMPT,
                     request_body_timeout=TIMEOUT)
    with BackgroundServer(app, header_timeout=TIMEOUT, max_connections=MAX_CONNECTIONS) as url:
        host, port = url.removeprefix("http://").split(":")
        yield types.SimpleNamespace(url=url, addr=(host, int(port)), worker=worker, engine=engine, tok=tok)
    assert not worker.alive


def post(server, path, body, **kw):
    """POST ``body`` as JSON text with ASCII escapes (httpx's ``json=`` cannot encode a lone surrogate)."""
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{server.url}/v1/{path}", content=data, headers={"Content-Type": "application/json"},
                      timeout=60, **kw)


def error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def wait_idle(server, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        m = server.worker.metrics()
        if m.running == 0 and m.waiting == 0:
            return
        assert time.monotonic() < deadline, "the engine never went idle"
        time.sleep(0.02)


def raw_http(server, head: bytes, timeout=10.0) -> socket.socket:
    s = socket.create_connection(server.addr, timeout=timeout)
    s.sendall(head)
    return s


def read_all(s: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def test_lone_surrogates_are_a_400_naming_the_field(server):
    """A lone surrogate (a JSON ``\\ud800`` escape that pairs with nothing) is not text: the tokenizer cannot
    take it. Wherever it is, the answer is a 400 in OpenAI's shape naming the field, not a plain-text 500; a
    proper surrogate pair (an emoji) is text and passes."""
    bad = "\ud800 hi"
    user = {"role": "user", "content": "Hi"}
    cases = [
        ("chat/completions", {"messages": [{"role": "user", "content": bad}]}, "messages.0.content"),
        ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                                         {"type": "text", "text": "\udfff"}]}]},
         "messages.0.content.1.text"),
        ("chat/completions", {"messages": [{"role": "user", "content": "Hi", "name": bad}]}, "messages.0.name"),
        ("chat/completions", {"messages": [user], "stop": bad}, "stop"),
        ("chat/completions", {"messages": [user], "chat_template_kwargs": {"x": bad}}, "chat_template_kwargs.x"),
        ("completions", {"prompt": bad}, "prompt"),
        ("completions", {"prompt": [bad]}, "prompt.0"),
        ("completions", {"prompt": "Hi", "stop": ["\n", bad]}, "stop.1"),
        ("completions", {"prompt": "Hi", "model": bad}, "model"),
    ]
    for path, body, param in cases:
        err = error(post(server, path, {"max_tokens": 2, **body}), 400)
        assert err["param"] == param and "surrogate" in err["message"], (param, err)
    r = post(server, "chat/completions", {"messages": [{"role": "user", "content": "\ud83d\ude00 hi"}],
                                          "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_burst_as_large_as_the_slots_is_admitted_with_a_queue_of_one(server, monkeypatch):
    """--max-queued-requests counts the requests that wait for a slot, not those handed to the engine that join at
    its next round: with 4 free slots and a queue of one, 4 (and 5) concurrent requests are all admitted, every
    time; a burst that leaves more than one waiting still gets 429s. Each round is slowed to 50 ms, so requests
    handed to the engine stay unadmitted while the burst arrives."""
    step = server.engine.step

    def slow_step():
        time.sleep(0.05)
        return step()

    monkeypatch.setattr(server.engine, "step", slow_step)

    async def burst(n):
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"prompt": "Count to ten:", "max_tokens": 4, "ignore_eos": True, "temperature": 0}
            return [r.status_code for r in await asyncio.gather(
                *(client.post(f"{server.url}/v1/completions", json=body) for _ in range(n)))]

    for n in (SLOTS, SLOTS, SLOTS, SLOTS + 1):
        wait_idle(server)
        assert asyncio.run(burst(n)) == [200] * n, n
    wait_idle(server)
    codes = asyncio.run(burst(3 * SLOTS))
    assert codes.count(200) >= SLOTS + 1 and 429 in codes, codes


_PROBE = """
import http.client, json, select, sys, time
conn = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]), timeout=60)
times = []
while not select.select([sys.stdin], [], [], 0)[0]:
    t0 = time.perf_counter()
    conn.request("GET", "/health")
    answer = conn.getresponse()
    answer.read()
    assert answer.status == 200, answer.status
    times.append(time.perf_counter() - t0)
    if len(times) == 1:
        print("ready", flush=True)
    time.sleep(0.01)
print(json.dumps(times), flush=True)
"""


class HealthProbe:
    """Polls ``/health`` from a process of its own (a thread of the server's process would stop with it whenever
    something there holds the interpreter lock, and miss the stall) and records how long each answer took."""

    def __init__(self, server):
        self.addr, self.times = server.addr, []

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", _PROBE, self.addr[0], str(self.addr[1])],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"
        return self

    def __exit__(self, *exc):
        out, _ = self.proc.communicate("stop\n", timeout=60)
        assert self.proc.returncode == 0
        self.times = json.loads(out.strip().splitlines()[-1])


def health_stays_quick(server, work, min_answers=1, attempts=3) -> bool:
    """Whether /health answers within 100 ms throughout ``work()`` (and at least ``min_answers`` times). Up to
    ``attempts`` tries: on a CPU shared with other jobs any single answer can be late, while a stall the server
    causes (the event loop, or the interpreter lock, held by the work) comes back on every try."""
    worst = []
    for _ in range(attempts):
        with HealthProbe(server) as probe:
            work()
        assert len(probe.times) >= min_answers, probe.times
        worst.append(max(probe.times))
        if worst[-1] < 0.1:
            return True
    print(f"/health answered in up to {worst} s")
    return False


def test_bodies_are_bounded_and_parsed_off_the_event_loop(server):
    """A body past --max-request-body-bytes (16 MiB by default) is refused with 413 in OpenAI's shape: at once
    when its Content-Length says so (before any of it is sent), and as soon as it has grown past the limit when
    it comes in chunks. /health keeps answering within 100 ms meanwhile, and while a 2 MB prompt is tokenized
    (then refused as too long: the templates and the tokenizer run on a thread pool, and the tokenizer releases
    the interpreter lock)."""
    from dspark_jax.serve.app import DEFAULT_MAX_REQUEST_BODY_BYTES
    from dspark_jax.tokenizer import TooManyTokens

    limit = DEFAULT_MAX_REQUEST_BODY_BYTES
    text = "<|im_start|>user\nThe colour of the sky is blue. Numbers 12 345, é, 漢字 🙂<|im_end|>\n" * 3
    # the lock-free batch encoding gives the ids the tokenizer's own encode gives, and stops at max_tokens
    assert server.tok.encode(text) == server.tok.backend.encode(text, add_special_tokens=False).ids
    with pytest.raises(TooManyTokens, match="more than 10"):
        server.tok.encode(text, max_tokens=10)
    big = "The colour of the sky is blue. " * 66000  # 2 MB of text: about half a million tokens

    def refuse_maximal_bodies():
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {limit + 1}\r\n\r\n").encode()
        with raw_http(server, head) as s:  # nothing of the body is sent: the answer comes from the headers
            answer = read_all(s)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_too_large"
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
        with raw_http(server, head) as s:
            piece = b"x" * 2**20
            for _ in range(limit // len(piece)):
                s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            s.sendall(b"1\r\nx\r\n")  # one byte past the limit, and the body is not over
            answer = read_all(s)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]

    def tokenize_large_prompts():
        err = error(post(server, "completions", {"prompt": big, "max_tokens": 4}), 400)
        assert err["param"] == "prompt" and err["code"] == "context_length_exceeded", err
        err = error(post(server, "chat/completions", {"messages": [{"role": "user", "content": big}]}), 400)
        assert err["param"] == "messages", err

    assert health_stays_quick(server, refuse_maximal_bodies)
    assert health_stays_quick(server, tokenize_large_prompts, min_answers=10)
    r = post(server, "completions", {"prompt": "Hi", "max_tokens": 2})  # and the server still serves
    assert r.status_code == 200, r.text


def test_clients_that_never_finish_their_request_are_cut_off(server):
    """A connection that sends nothing, or half of its headers, is closed after the header timeout; one whose
    body stops short gets a 408 in OpenAI's shape after the body timeout; past --max-connections open
    connections a request is answered 503, and once the silent ones are closed the server answers again."""
    t0 = time.monotonic()
    silent = raw_http(server, b"")
    half_head = raw_http(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    half_body = raw_http(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    with silent, half_head, half_body:
        assert read_all(silent) == b"" and read_all(half_head) == b""
        answer = read_all(half_body)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert time.monotonic() - t0 < TIMEOUT + 5
    idle = [raw_http(server, b"") for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.1)
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503
        for s in idle:
            assert read_all(s) == b""  # closed by the header timeout
    finally:
        for s in idle:
            s.close()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_errors_name_what_is_wrong(server):
    """A body that is not JSON says so (no field); NaN or infinite sampling values are "not a finite number"; a
    prompt too long by itself names the prompt (or the messages) and the limit, --max-prompt-tokens included;
    only a prompt that fits with too large a budget names max_tokens (or max_completion_tokens)."""
    from fastapi.testclient import TestClient

    from dspark_jax.serve import create_app

    user = [{"role": "user", "content": "Hi"}]
    err = error(post(server, "chat/completions", "{not json"), 400)
    assert "not valid JSON" in err["message"] and err["param"] is None, err
    err = error(post(server, "completions", "[1, 2]"), 400)
    assert "JSON object" in err["message"] and err["param"] is None, err
    for field, value in (("temperature", "NaN"), ("top_p", "NaN"), ("temperature", "Infinity")):
        err = error(post(server, "chat/completions", f'{{"messages": {json.dumps(user)}, "{field}": {value}}}'), 400)
        assert err["param"] == field and "not a finite number" in err["message"], err
    ids = server.tok.encode("Once upon a time there was a ")
    long_ids = (ids * 20)[:MAX_PROMPT + 12]  # fits the context with a small budget, but not --max-prompt-tokens
    err = error(post(server, "completions", {"prompt": long_ids, "max_tokens": 2}), 400)
    assert err["param"] == "prompt" and f"{MAX_PROMPT + 12} tokens" in err["message"], err
    assert f"{MAX_PROMPT}" in err["message"] and "--max-prompt-tokens" in err["message"], err
    err = error(post(server, "chat/completions", {"messages": [{"role": "user", "content": "word " * 60}]}), 400)
    assert err["param"] == "messages" and "--max-prompt-tokens" in err["message"], err
    err = error(post(server, "completions", {"prompt": ids, "max_tokens": 500}), 400)
    assert err["param"] == "max_tokens" and "500" in err["message"], err
    err = error(post(server, "chat/completions", {"messages": user, "max_completion_tokens": 500}), 400)
    assert err["param"] == "max_completion_tokens", err
    # without --max-prompt-tokens the context is the limit (the same engine, an app without the lifespan)
    client = TestClient(create_app(server.worker, server.tok, MODEL))
    capacity = server.engine.cfg.capacity - server.engine.G - 1
    r = client.post("/v1/completions", json={"prompt": (ids * 40)[:capacity + 5], "max_tokens": 1})
    err = error(r, 400)
    assert err["param"] == "prompt" and f"holds {capacity} tokens" in err["message"], err
