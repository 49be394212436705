"""The engine's own thread, bridged to asyncio: requests join and leave between rounds.

`EngineWorker` owns an `Engine` and runs its rounds on one thread. The event loop (the HTTP server) submits
`GenerationRequest`s and cancels them through a locked inbox; the thread applies them between rounds and
sends each request's tokens, as the round commits them, to the request's `asyncio.Queue` on its loop. The thread
reads what each step gave from its `StepOutput` (tokens, logprobs, finished requests with their reasons,
admissions and the engine's queue), not from the engine's attributes.

Bounded queue: at most ``max_queued`` accepted requests wait for a slot (`EngineWorker.waiting`: those of the
inbox and the engine's queue that the free slots will not take at the next admission); past that `submit`
raises `QueueFull` (the server answers 429), and after `stop` it raises `ShuttingDown` (503). A request that
waited longer than ``queue_timeout`` seconds for a slot leaves the queue and is told so (`Event` kind
``"error"`` with status 503). Nothing accepted is dropped: `stop` drains the queue and the
active requests before the thread ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import deque
from typing import Any, Sequence

import numpy as np

from dspark_jax.engine import Engine, SamplingParams, StepOutput, TokenLogprobs

__all__ = ["GenerationRequest", "Event", "EngineWorker", "QueueFull", "ShuttingDown", "Metrics",
           "ROUND_SECONDS_BUCKETS", "prometheus_text"]

ROUND_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class QueueFull(Exception):
    """The bounded queue holds ``max_queued`` requests already."""


class ShuttingDown(Exception):
    """The worker is draining and takes no new requests."""


@dataclasses.dataclass(frozen=True)
class Event:
    """What the engine thread tells a request: ``tokens`` (new token ids, with their `TokenLogprobs` when the
    request asked for them, and with the first tokens, the prompt's when it asked for those), ``done``
    (``finish_reason`` ``"stop"`` or ``"length"``) or ``error`` (``status`` and ``message``)."""

    kind: str
    tokens: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs, ...] | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    finish_reason: str | None = None
    status: int = 0
    message: str = ""


@dataclasses.dataclass(eq=False)
class GenerationRequest:
    """One request for the engine thread.

    Attributes:
      prompt_ids: the prompt's token ids (chat template already applied).
      max_tokens: output token budget (>= 1).
      sampling: the request's sampling settings.
      events: filled by `EngineWorker.submit`: the queue its `Event`s arrive on (on the submitting loop).
    """

    prompt_ids: Sequence[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    events: asyncio.Queue | None = None
    loop: asyncio.AbstractEventLoop | None = None
    request_id: int | None = None  # the engine's id, once the thread has submitted it
    submitted_at: float = 0.0
    admitted: bool = False  # it took a slot (the engine's `StepOutput.admitted`)


@dataclasses.dataclass
class Metrics:
    """Counters since the worker started (read under the worker's lock with `EngineWorker.metrics`)."""

    requests_received: int = 0
    requests_finished: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"stop": 0, "length": 0, "cancelled": 0, "timeout": 0, "error": 0})
    requests_rejected: int = 0  # refused at submit (queue full, shutting down)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    rounds: int = 0
    round_seconds_sum: float = 0.0
    round_seconds_buckets: list[int] = dataclasses.field(default_factory=lambda: [0] * len(ROUND_SECONDS_BUCKETS))
    request_rounds: int = 0  # sum over rounds of the requests in them
    accepted_length_sum: float = 0.0  # sum over request-rounds of accepted drafts + 1
    drafts_sum: float = 0.0  # sum over request-rounds of scheduled drafts
    compiled_rounds: int = 0  # rounds that compiled a program (a shape seen for the first time)
    compiled_seconds: float = 0.0  # their wall time
    running: int = 0
    waiting: int = 0
    # the prefix cache (`Engine.prefix_cache_stats`): prompt tokens admitted and of those taken from the cache,
    # pages held by requests and kept for later ones, pages evicted
    prefix_prompt_tokens: int = 0
    prefix_cached_tokens: int = 0
    kv_pages_in_use: int = 0
    prefix_cached_pages: int = 0
    prefix_evictions: int = 0


class EngineWorker:
    """Runs ``engine`` on its own thread; see the module docstring.

    Args:
      engine: an idle engine (built with `dspark_jax.build.build_engine`).
      max_queued: most accepted requests waiting for a slot (>= 1; see `waiting`).
      queue_timeout: seconds a request may wait for a slot (None: no limit).
      idle_wait: seconds the idle thread sleeps between looks at its inbox (it is also woken at once).
    """

    def __init__(self, engine: Engine, *, max_queued: int = 256, queue_timeout: float | None = None,
                 idle_wait: float = 0.05):
        if not (isinstance(max_queued, int) and max_queued >= 1):
            raise ValueError(f"max_queued: expected an integer >= 1, got {max_queued!r}")
        if queue_timeout is not None and not queue_timeout > 0:
            raise ValueError(f"queue_timeout: expected None or seconds > 0, got {queue_timeout!r}")
        if not engine.idle():
            raise ValueError("EngineWorker: the engine must be idle")
        self.engine, self.max_queued, self.queue_timeout, self.idle_wait = engine, max_queued, queue_timeout, idle_wait
        self._lock = threading.Condition()
        self._inbox: deque[GenerationRequest] = deque()
        self._cancels: deque[tuple[GenerationRequest, str]] = deque()
        self._by_id: dict[int, GenerationRequest] = {}
        self._engine_pending = 0  # the engine's queue length, as of the thread's last look
        self._stopping = False
        self._metrics = Metrics()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what ended the thread, if it failed

    # ------------------------------------------------------------------------------------------ event loop side
    def start(self) -> None:
        """Start the engine thread."""
        if self._thread is not None:
            raise ValueError("EngineWorker.start: already started")
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Take no new requests, finish every accepted one, then end the thread (waits up to ``timeout``)."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, req: GenerationRequest) -> asyncio.Queue:
        """Accept ``req`` (call from the event loop that reads its events). Returns the queue of its `Event`s.

        Raises:
          QueueFull: ``max_queued`` requests already wait for a slot.
          ShuttingDown: the worker is draining, or its thread has ended.
        """
        req.loop = asyncio.get_running_loop()
        req.events = asyncio.Queue()
        with self._lock:
            if self._stopping or not self.alive:
                self._metrics.requests_rejected += 1
                raise ShuttingDown(f"the engine failed: {self.error!r}" if self.error is not None else
                                   "the server is shutting down" if self._stopping else "the engine has stopped")
            if self._waiting() >= self.max_queued:
                self._metrics.requests_rejected += 1
                raise QueueFull(f"{self.max_queued} requests are already waiting (--max-queued-requests)")
            req.submitted_at = time.monotonic()
            self._inbox.append(req)
            self._metrics.requests_received += 1
            self._lock.notify_all()
        return req.events

    def cancel(self, req: GenerationRequest, reason: str = "cancelled") -> None:
        """Stop ``req`` (its client left: ``cancelled``; a stop string ended it: ``stop``, the reason the metrics
        count); its slot is freed before the next round."""
        with self._lock:
            self._cancels.append((req, reason))
            self._lock.notify_all()

    def waiting(self) -> int:
        """Accepted requests that wait for a slot: those not yet admitted (in the inbox or the engine's queue)
        beyond the slots free as of the engine thread's last look. A request handed to the engine while a slot is
        free is not waiting, though it joins only at the next round."""
        with self._lock:
            return self._waiting()

    def _waiting(self) -> int:  # under the lock
        free = self.engine.cfg.num_slots - self._metrics.running
        return max(0, len(self._inbox) + self._engine_pending - free)

    def metrics(self) -> Metrics:
        """A copy of the counters."""
        with self._lock:
            m = dataclasses.replace(self._metrics, requests_finished=dict(self._metrics.requests_finished),
                                    round_seconds_buckets=list(self._metrics.round_seconds_buckets))
            m.waiting = self._waiting()
            return m

    # ------------------------------------------------------------------------------------------ engine thread
    def _send(self, req: GenerationRequest, event: Event) -> None:
        req.loop.call_soon_threadsafe(req.events.put_nowait, event)

    def _take_inbox(self) -> tuple[list[GenerationRequest], list[tuple[GenerationRequest, str]]]:
        with self._lock:
            while not self._inbox and not self._cancels and self.engine.idle() and not self._stopping:
                self._lock.wait(self.idle_wait)
            new, cancels = list(self._inbox), list(self._cancels)
            self._inbox.clear()
            self._cancels.clear()
            self._engine_pending += len(new)  # still counted until the thread reads the engine's queue again
            return new, cancels

    def _finish(self, req: GenerationRequest, reason: str) -> None:
        self._by_id.pop(req.request_id, None)
        self._metrics.requests_finished[reason] = self._metrics.requests_finished.get(reason, 0) + 1

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a failed round: tell every request, refuse new ones
            self.error = e
            with self._lock:
                self._stopping = True
                waiting = list(self._inbox)
                self._inbox.clear()
            for req in waiting + list(self._by_id.values()):
                self._send(req, Event("error", status=500, message=f"the engine failed: {e!r}"))
            raise

    def _loop(self) -> None:
        eng = self.engine
        while True:
            new, cancels = self._take_inbox()
            for req in new:
                try:
                    req.request_id = eng.submit(req.prompt_ids, req.max_tokens, req.sampling)
                except ValueError as e:
                    with self._lock:
                        self._metrics.requests_finished["error"] += 1
                        self._engine_pending -= 1  # counted when taken from the inbox
                    self._send(req, Event("error", status=400, message=str(e)))
                    continue
                self._by_id[req.request_id] = req
                with self._lock:
                    self._metrics.prompt_tokens += len(req.prompt_ids)
            for req, reason in cancels:
                if req.request_id is not None and req.request_id in self._by_id and eng.cancel(req.request_id):
                    with self._lock:
                        self._left_engine(req)
                        self._finish(req, reason)
            with self._lock:
                if eng.idle() and self._stopping and not self._inbox:
                    return
            if eng.idle():
                continue
            self._deliver(eng.step())  # admits what fits, then one round
            self._expire(time.monotonic())

    def _left_engine(self, req: GenerationRequest) -> None:  # under the lock: a cancelled request's count
        if req.admitted:
            self._metrics.running -= 1
        else:
            self._engine_pending -= 1

    def _expire(self, now: float) -> None:
        """Requests still queued past ``queue_timeout`` leave the queue and are told so."""
        if self.queue_timeout is None:
            return
        for req in [r for r in self._by_id.values() if not r.admitted]:  # queued in the engine
            waited = now - req.submitted_at
            if waited > self.queue_timeout and self.engine.cancel(req.request_id):
                with self._lock:
                    self._left_engine(req)
                    self._finish(req, "timeout")
                self._send(req, Event("error", status=503, message=(
                    f"the request waited {waited:.1f} s for a free slot, longer than the queue timeout of "
                    f"{self.queue_timeout:g} s (--queue-timeout); try again later")))

    def _deliver(self, out: StepOutput) -> None:
        """Send what the step gave to its requests: their tokens (with logprobs, and the prompt's with the first
        tokens), then ``done`` to those that finished; update the counters."""
        eng = self.engine
        for rid in out.admitted:
            req = self._by_id.get(rid)
            if req is not None:
                req.admitted = True
        for rid, tokens in out.tokens.items():
            req = self._by_id.get(rid)
            if req is not None:
                logprobs = out.logprobs.get(rid)
                prompt = out.prompt_logprobs.get(rid)
                self._send(req, Event("tokens", tokens=tuple(tokens),
                                      logprobs=None if logprobs is None else tuple(logprobs),
                                      prompt_logprobs=None if prompt is None else tuple(prompt)))
        stats = out.stats
        with self._lock:
            self._engine_pending, m = out.waiting, self._metrics
            m.running = out.running
            m.generation_tokens += sum(len(t) for t in out.tokens.values())
            if stats is not None:
                m.rounds += 1
                m.round_seconds_sum += stats.seconds
                for i, edge in enumerate(ROUND_SECONDS_BUCKETS):
                    if stats.seconds <= edge:
                        m.round_seconds_buckets[i] += 1
                m.request_rounds += stats.active
                m.accepted_length_sum += float(np.sum(stats.accepted + 1))
                m.drafts_sum += float(np.sum(stats.scheduled))
                if stats.compiled:
                    m.compiled_rounds += 1
                    m.compiled_seconds += stats.seconds
            prefix = eng.prefix_cache_stats()
            m.prefix_prompt_tokens, m.prefix_cached_tokens = prefix["prompt_tokens"], prefix["cached_tokens"]
            m.kv_pages_in_use, m.prefix_cached_pages = prefix["pages_in_use"], prefix["cached_pages"]
            m.prefix_evictions = prefix["evictions"]
            for rid, reason in out.finished.items():
                req = self._by_id.get(rid)
                if req is None:
                    continue
                self._finish(req, reason)
                self._send(req, Event("done", finish_reason=reason))
        for rid in out.finished:  # the engine keeps no finished request's tokens (a server runs indefinitely)
            eng.pop_completion(rid)


def prometheus_text(m: Metrics, model: str, extra: dict[str, Any] | None = None) -> str:
    """The counters in Prometheus' text exposition format (version 0.0.4)."""
    lbl = f'model="{model}"'
    lines = []

    def metric(name, kind, help_, samples):
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for suffix, labels, value in samples:
            lab = ",".join(x for x in (lbl, labels) if x)
            lines.append(f"{name}{suffix}{{{lab}}} {value}")

    metric("dspark_requests_received_total", "counter", "Requests accepted into the queue.",
           [("", "", m.requests_received)])
    metric("dspark_requests_rejected_total", "counter", "Requests refused at the door (queue full, shutting down).",
           [("", "", m.requests_rejected)])
    metric("dspark_requests_finished_total", "counter", "Requests that ended, by reason.",
           [("", f'reason="{k}"', v) for k, v in sorted(m.requests_finished.items())])
    metric("dspark_requests_running", "gauge", "Requests holding a slot.", [("", "", m.running)])
    metric("dspark_requests_waiting", "gauge", "Requests waiting for a slot.", [("", "", m.waiting)])
    metric("dspark_prompt_tokens_total", "counter", "Prompt tokens of submitted requests.",
           [("", "", m.prompt_tokens)])
    metric("dspark_generation_tokens_total", "counter", "Tokens emitted.", [("", "", m.generation_tokens)])
    # cumulative already: a round counts in every bucket at or above its time
    buckets = [("_bucket", f'le="{edge:g}"', n) for edge, n in zip(ROUND_SECONDS_BUCKETS, m.round_seconds_buckets)]
    buckets.append(("_bucket", 'le="+Inf"', m.rounds))
    metric("dspark_round_seconds", "histogram", "Wall time of an engine round (admissions and both programs).",
           buckets + [("_sum", "", f"{m.round_seconds_sum:.6f}"), ("_count", "", m.rounds)])
    metric("dspark_request_rounds_total", "counter", "Sum over rounds of the requests in them.",
           [("", "", m.request_rounds)])
    metric("dspark_accepted_length_sum", "counter", "Sum over request-rounds of accepted drafts + 1 "
           "(divide by dspark_request_rounds_total for the mean accepted length).", [("", "", m.accepted_length_sum)])
    metric("dspark_drafts_sum", "counter", "Sum over request-rounds of scheduled drafts (divide by "
           "dspark_request_rounds_total for the mean drafts per request per round).", [("", "", m.drafts_sum)])
    metric("dspark_compiled_rounds_total", "counter", "Rounds that compiled a program (a shape seen for the first "
           "time; --warm-up compiles them before serving).", [("", "", m.compiled_rounds)])
    metric("dspark_compiled_seconds_total", "counter", "Wall time of the rounds that compiled.",
           [("", "", f"{m.compiled_seconds:.6f}")])
    metric("dspark_prefix_cache_queries_total", "counter", "Prompt tokens admitted to the engine (looked up in the "
           "prefix cache).", [("", "", m.prefix_prompt_tokens)])
    metric("dspark_prefix_cache_hits_total", "counter", "Prompt tokens taken from the prefix cache instead of "
           "prefilled (divide by dspark_prefix_cache_queries_total for the hit rate).", [("", "", m.prefix_cached_tokens)])
    metric("dspark_prefix_cache_hit_rate", "gauge", "Prompt tokens taken from the prefix cache / prompt tokens "
           "admitted, since start.",
           [("", "", f"{m.prefix_cached_tokens / m.prefix_prompt_tokens if m.prefix_prompt_tokens else 0.0:.6f}")])
    metric("dspark_kv_pages_in_use", "gauge", "KV pages held by requests.", [("", "", m.kv_pages_in_use)])
    metric("dspark_prefix_cache_pages", "gauge", "Pages kept in the prefix cache for later requests.",
           [("", "", m.prefix_cached_pages)])
    metric("dspark_prefix_cache_evictions_total", "counter", "Prefix cache pages evicted for space.",
           [("", "", m.prefix_evictions)])
    for name, value in (extra or {}).items():
        metric(name, "gauge", name.replace("_", " "), [("", "", value)])
    return "\n".join(lines) + "\n"
