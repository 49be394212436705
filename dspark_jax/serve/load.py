"""Closed-loop HTTP load: N concurrent streaming clients against an OpenAI-compatible server (as vLLM's serving
benchmark drives a server), with time to first token, inter-token latency and throughput.

Each client sends its next prompt (token ids to ``/v1/completions``, so the workload is exactly the in-process
closed loop's, `dspark_jax.serving.ClosedLoop`) as soon as its previous answer has ended. Tokens are counted as
their chunks arrive (the server sends one chunk per token with text; the rest of a request's ``usage`` count,
such as a stop token, at its end). The measurement window opens once ``warmup_tokens`` tokens have arrived and
closes after ``measure_tokens`` more; then the clients hang up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import time
from typing import Sequence

import numpy as np

__all__ = ["HTTPLoadResult", "http_closed_loop", "http_closed_loop_process", "percentiles"]


@dataclasses.dataclass
class HTTPLoadResult:
    tokens_per_s: float  # tokens that arrived in the window / its seconds
    tokens: int
    seconds: float
    requests: int  # requests that ended inside the window
    errors: int  # non-200 answers
    ttft: list[float]  # seconds from send to the first token, for first tokens that arrived inside the window
    itl: list[float]  # seconds between consecutive token chunks of a request, for chunks inside the window


def percentiles(values: Sequence[float], qs=(50, 90, 99)) -> dict[str, float]:
    """``{"p50": ..., ...}`` in milliseconds (nan when empty).

    >>> percentiles([0.001, 0.002, 0.003], qs=(50,))
    {'p50': 2.0}
    """
    if not len(values):
        return {f"p{q}": float("nan") for q in qs}
    arr = np.asarray(values, np.float64) * 1e3
    return {f"p{q}": float(np.percentile(arr, q)) for q in qs}


async def http_closed_loop(url: str, model: str, prompts: Sequence[Sequence[int]], concurrency: int, max_tokens: int,
                           *, warmup_tokens: int, measure_tokens: int, temperature: float = 0.0,
                           api_key: str | None = None, timeout: float = 600.0) -> HTTPLoadResult:
    """Run ``concurrency`` streaming clients against ``url`` (``http://host:port``) until the window closes.

    Args:
      url: the server's base address; model: the id it serves.
      prompts: token ids of the prompts, sent in order (cycling) as clients become free.
      concurrency: clients (>= 1); max_tokens: each request's budget.
      warmup_tokens: tokens that arrive before the window opens; measure_tokens: tokens in the window (>= 1).
      temperature: each request's temperature.
    Returns:
      An `HTTPLoadResult`.
    """
    import httpx  # noqa: PLC0415

    if concurrency < 1 or measure_tokens < 1 or warmup_tokens < 0 or not prompts:
        raise ValueError(f"http_closed_loop: expected concurrency >= 1, measure_tokens >= 1, warmup_tokens >= 0 "
                         f"and prompts; got {concurrency}, {measure_tokens}, {warmup_tokens}, {len(prompts)} prompts")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    state = {"total": 0, "t0": None, "n0": 0, "t1": None, "n1": 0, "next": 0, "requests": 0, "errors": 0}
    done = asyncio.Event()
    ttft, itl = [], []

    def arrived(n: int, now: float) -> None:
        state["total"] += n
        if state["t0"] is None and state["total"] >= warmup_tokens:
            state["t0"], state["n0"] = now, state["total"]
        elif state["t0"] is not None and state["t1"] is None and state["total"] - state["n0"] >= measure_tokens:
            state["t1"], state["n1"] = now, state["total"]
            done.set()

    def in_window(t: float) -> bool:
        return state["t0"] is not None and t >= state["t0"] and state["t1"] is None

    async def user(client):
        while not done.is_set():
            prompt = list(prompts[state["next"] % len(prompts)])
            state["next"] += 1
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                    "stream": True, "stream_options": {"include_usage": True}}
            sent = time.perf_counter()
            last, chunks, usage = None, 0, None
            async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
                if r.status_code != 200:
                    state["last_error"] = f"{r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                    state["errors"] += 1
                    if state["errors"] >= 20:
                        done.set()
                    await asyncio.sleep(0.05)
                    continue
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if obj.get("usage"):
                        usage = obj["usage"]["completion_tokens"]
                    if any(ch.get("text") for ch in obj.get("choices", ())):
                        now = time.perf_counter()
                        if last is None and in_window(now):
                            ttft.append(now - sent)
                        elif last is not None and in_window(now):
                            itl.append(now - last)
                        last = now
                        chunks += 1
                        arrived(1, now)
                    if done.is_set():
                        return  # hang up: the server cancels the request
            if usage is not None and usage > chunks:
                arrived(usage - chunks, time.perf_counter())
            if in_window(time.perf_counter()):
                state["requests"] += 1

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        tasks = [asyncio.create_task(user(client)) for _ in range(concurrency)]
        await done.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if state["t1"] is None:
        raise RuntimeError(f"http_closed_loop: the server at {url} refused {state['errors']} requests, the last "
                           f"with {state.get('last_error')}")
    seconds = state["t1"] - state["t0"]
    tokens = state["n1"] - state["n0"]
    return HTTPLoadResult(tokens / seconds if seconds > 0 else float("nan"), tokens, seconds, state["requests"],
                          state["errors"], ttft, itl)


def http_closed_loop_process(url: str, model: str, prompts: Sequence[Sequence[int]], concurrency: int,
                             max_tokens: int, **kwargs) -> HTTPLoadResult:
    """`http_closed_loop` run in a separate Python process, as a load generator runs beside a server: clients
    in the server's own process would share its interpreter lock with the engine thread and the event loop,
    and charge their parsing to the server. Same arguments; blocks until the window closes.

    Raises:
      RuntimeError: the load process failed (its last error output is in the message).
    """
    job = {"url": url, "model": model, "prompts": [list(map(int, p)) for p in prompts],
           "concurrency": int(concurrency), "max_tokens": int(max_tokens), **kwargs}
    proc = subprocess.run([sys.executable, "-m", "dspark_jax.serve.load"], input=json.dumps(job),
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"http_closed_loop_process: the load process failed: {proc.stderr[-2000:]}")
    return HTTPLoadResult(**json.loads(proc.stdout))


def _main() -> None:
    """``python -m dspark_jax.serve.load`` < job.json: one `http_closed_loop`, its result as JSON on stdout."""
    job = json.loads(sys.stdin.read())
    args = [job.pop(k) for k in ("url", "model", "prompts", "concurrency", "max_tokens")]
    result = asyncio.run(http_closed_loop(*args, **job))
    print(json.dumps(dataclasses.asdict(result)))


if __name__ == "__main__":
    _main()
