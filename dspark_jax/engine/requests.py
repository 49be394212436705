"""The host's records: a request's `Completion`, its `TokenLogprobs`, one round's `RoundStats`, a request being
prefilled (`Prefilling`)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from dspark_jax.engine.config import SamplingParams

__all__ = ["TokenLogprobs", "RoundStats", "Completion", "Prefilling", "token_logprobs"]


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
