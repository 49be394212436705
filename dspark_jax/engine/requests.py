"""The host's records: a request's `Completion`, its `TokenLogprobs`, one round's `RoundStats`, what one step gave
(`StepOutput`), a request being prefilled (`Prefilling`), and the engine's bounded `History` of rounds and finished
requests."""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from typing import Any, Generic, Iterator, NamedTuple, TypeVar

import numpy as np

from dspark_jax.engine.config import SamplingParams

__all__ = ["TokenLogprobs", "RoundStats", "Completion", "StepOutput", "History", "Prefilling", "token_logprobs"]

T = TypeVar("T")


class TokenLogprobs(NamedTuple):
    """One token's raw log-probability under the target (``log_softmax(logits)``, temperature 1, no top-p) and
    the most likely tokens at its position, ``top``: (token id, log-probability) pairs, most likely first, as many
    as the request asked for.

    >>> TokenLogprobs(7, -0.1, ((7, -0.1), (3, -2.5))).top[1]
    (3, -2.5)
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass
class RoundStats:
    """Counters of one round (host side)."""

    active: int  # requests in the round
    scheduled: np.ndarray  # drafts scheduled per request
    accepted: np.ndarray  # drafts accepted per request
    emitted: int  # tokens emitted by the round
    batch_tokens: int  # verification batch B (anchors + scheduled drafts)
    padded_tokens: int  # T, the bucket B was padded to
    seconds: float  # wall time of the round: admissions (prefill) and both programs
    compiled: bool  # something compiled during the round (its time is not steady state)
    confidences: np.ndarray | None = None  # [active, G] calibrated confidences (with record_confidences)
    confidence_logits: np.ndarray | None = None  # [active, G] raw confidence logits (with record_confidences)
    finished: int = 0  # requests that finished in the round (admission included)
    prefilled: int = 0  # prompt tokens prefilled in the step before the round
    drafted: bool = False  # the drafter ran this round
    context: int = 0  # committed tokens of the round's longest request (the cost model's L)
    requests: np.ndarray | None = None  # [active] the request id of each row
    # With Engine.record_tokens, per row: the drafted tokens [active, G] (None when the drafter did not run) and
    # the tokens each request emitted this round.
    draft_tokens: np.ndarray | None = None
    emitted_tokens: list[list[int]] | None = None
    constrained: int = 0  # requests of the round with a grammar
    mask_seconds: float = 0.0  # host time spent computing their masks (the first ones while the drafter runs)
    forbidden_drafts: int = 0  # scheduled drafts the grammar forbade (cut from the target's pass)

    def trace_rows(self, index: int) -> list[dict[str, Any]]:
        """One JSON-ready record per request of the round (the engine's ``record_tokens`` and
        ``record_confidences`` must have been on): round ``index``, request id, drafted tokens with their
        calibrated confidences and raw confidence logits (None when the drafter did not run), scheduled length,
        accepted drafts, emitted tokens."""
        if self.emitted_tokens is None:
            raise ValueError("trace_rows: the round was run without Engine.record_tokens")
        rows = []
        for i, rid in enumerate(self.requests):
            ran = self.drafted and self.draft_tokens is not None and self.confidences is not None
            rows.append({
                "round": int(index), "request": int(rid),
                "drafted": self.draft_tokens[i].tolist() if ran else None,
                "confidences": [round(float(c), 6) for c in self.confidences[i]] if ran else None,
                "confidence_logits": [round(float(c), 6) for c in self.confidence_logits[i]] if ran else None,
                "scheduled": int(self.scheduled[i]), "accepted": int(self.accepted[i]),
                "emitted": list(self.emitted_tokens[i]),
            })
        return rows


@dataclasses.dataclass
class Completion:
    request_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    finished_by_stop: bool
    cancelled: bool = False  # ended by `Engine.cancel` (its output is what it had emitted by then)
    # With SamplingParams.logprobs: one entry per output token, in step with output_ids (else None).
    logprobs: list[TokenLogprobs] | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token, the first None (nothing predicts it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclasses.dataclass
class Prefilling:
    """A request whose prompt is being prefilled into its slot: ``done`` prompt tokens so far."""

    rid: int
    prompt: list[int]
    max_new: int
    sampling: SamplingParams
    context: bool  # it gets the drafter's context
    done: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # filled chunk by chunk when asked for


def token_logprobs(token, chosen, top_ids, top, n: int) -> TokenLogprobs:
    """A token's `TokenLogprobs` from one position's host arrays, keeping the ``n`` most likely alternatives."""
    return TokenLogprobs(int(token), float(chosen), tuple((int(i), float(v)) for i, v in zip(top_ids[:n], top[:n])))


@dataclasses.dataclass
class StepOutput:
    """What one `Engine.step` gave (the server and the benchmarks read this, not the engine's attributes).

    Attributes:
      tokens: request id -> the tokens it emitted this step, in order (the first token of a request that joined
        this step included); requests that emitted nothing are absent.
      logprobs: request id -> one `TokenLogprobs` per token of ``tokens``, for the requests that asked for them.
      prompt_logprobs: request id -> its prompt's `TokenLogprobs` (the first None), for the requests that asked and
        joined this step.
      finished: request id -> finish reason (``"stop"``: a stop token, a stop id or the grammar's end;
        ``"length"``: its budget) of the requests that finished this step, in the order they finished
        (cancellations are not steps' doing: `Engine.cancel` reports those).
      admitted: the request ids that took a slot this step (their prompts prefilled now or over the next steps).
      running: requests holding a slot after the step (decoding or still prefilling).
      waiting: requests queued for a slot after the step.
      stats: the round's `RoundStats`, or None when no round ran (nothing was decoding).

    >>> out = StepOutput(tokens={3: [7, 8]}, finished={3: "length"})
    >>> out.tokens[3], out.finished, out.stats is None
    ([7, 8], {3: 'length'}, True)
    """

    tokens: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    logprobs: dict[int, list[TokenLogprobs]] = dataclasses.field(default_factory=dict)
    prompt_logprobs: dict[int, list[TokenLogprobs | None]] = dataclasses.field(default_factory=dict)
    finished: dict[int, str] = dataclasses.field(default_factory=dict)
    admitted: list[int] = dataclasses.field(default_factory=list)
    running: int = 0
    waiting: int = 0
    stats: RoundStats | None = None


class History(Generic[T]):
    """The last ``maxlen`` entries of a record that grows for as long as the engine runs (a server's rounds and
    finished requests), indexed as if nothing had been dropped: ``len`` counts every entry ever appended, ``h[i]``
    is the i-th one (IndexError once dropped), ``h[a:b]`` a list of the entries of that range still held, and
    iteration, ``in`` and ``list(h)`` see the entries held. So ``h[n:]`` with ``n = len(h)`` taken earlier gives
    what was appended since, as with a list, as long as that is at most ``maxlen`` entries. ``clear`` starts
    afresh from index 0.

    >>> h = History(maxlen=3)
    >>> for x in "abcde":
    ...     h.append(x)
    >>> len(h), list(h), h[4], h[3:], h.dropped
    (5, ['c', 'd', 'e'], 'e', ['d', 'e'], 2)
    """

    def __init__(self, maxlen: int):
        if not (isinstance(maxlen, (int, np.integer)) and maxlen >= 1):
            raise ValueError(f"maxlen: expected an integer >= 1, got {maxlen!r}")
        self.maxlen = int(maxlen)
        self._items: deque[T] = deque(maxlen=self.maxlen)
        self.dropped = 0  # entries appended and since dropped (the index of the first held)

    def append(self, item: T) -> None:
        if len(self._items) == self.maxlen:
            self.dropped += 1
        self._items.append(item)

    def clear(self) -> None:
        self._items.clear()
        self.dropped = 0

    def __len__(self) -> int:
        return self.dropped + len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)

    def __contains__(self, item) -> bool:
        return item in self._items

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step) if i >= self.dropped]
            lo, hi = max(start - self.dropped, 0), max(stop - self.dropped, 0)
            if hi <= lo:
                return []
            n = len(self._items)
            if n - lo < lo:  # a recent range (h[n:]): walk from the newest end
                tail = list(itertools.islice(reversed(self._items), n - lo))[::-1]
                return tail[: hi - lo]
            return list(itertools.islice(self._items, lo, hi))
        i = int(index) + (len(self) if index < 0 else 0)
        if not self.dropped <= i < len(self):
            raise IndexError(f"history index {index} out of range (held: {self.dropped} to {len(self) - 1})")
        return self._items[i - self.dropped]

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, (History, list)) else NotImplemented

    def __repr__(self) -> str:
        return f"History(maxlen={self.maxlen}, dropped={self.dropped}, held={list(self._items)!r})"
