"""Batched speculative decoding engine: draft, confidence, schedule and verify, with continuous batching.

A fixed number of request slots S share one target KV cache and one drafter context cache. Requests join
free slots (chunked prefill), decode in rounds and leave on EOS or their token limit, so the batch changes
every round. A round runs as two jitted programs with static shapes, each taking a frozen static spec
(`RoundSpec`) and one pytree of the engine's constant inputs (`RoundInputs`):

1. ``draft_and_schedule`` (per row bucket R): the drafter's backbone pass and sequential sampling scan for
   the active rows, calibrated confidences, and the scheduling policy -> verification lengths [R];
2. ``verify_and_commit`` (per row bucket R and token bucket T): pack only the scheduled tokens of every
   active row into one flat batch of T tokens, run the target once, accept with `verify.speculative_accept`
   (or the argmax at temperature 0), commit the accepted prefix to the target cache and the drafter's context
   cache, and emit tokens.

Everything else is an array, so few programs serve a whole run (`Engine.round_shapes`; at 64 slots of 8192
positions, 33 verification programs and 7 draft programs): the attention reads the caches in parts up to the
round's longest context (`llama.over_context`), a round whose requests are all greedy skips the sampling work
under ``lax.cond``, and a round where no request has the drafter's context skips its context write and the gate.
Between the two the host reads one scalar, the batch size B, to pick the token bucket T (the shape of the
second program); everything else stays on the device. With the ``dspark`` policies a small program after the
second decides whether drafting will pay in the next round for the same requests (the drafter gate,
`dspark_jax.gate`: the engine only calls its pure functions and keeps its state); when it will
not and nobody joined, the next round skips the first program and its host read: a plain round of a
drafting engine costs a plain round plus the drafter's context update. Where the gate's estimate stays below
its bar long enough at a load, the drafter is switched off there (``EngineConfig.drafter_off_after``): the
requests drop their context and the rounds are plain decoding's, until a retry. The host only
admits new requests and collects finished ones. Rows are the active slots moved to the front (a stable
argsort of ``~active``) and padded to a power of two, so the drafter's cost follows the load, not the slot
count.

Policies (`parse_policy`): ``none`` (plain decoding, no drafter), ``fixed:K``, ``threshold:C`` (verify up to
the first calibrated per-token confidence below C), ``dspark`` (Algorithm 1, first drop, on the SPS table)
and ``dspark-async`` (capacity K by the greedy-path argmax over the confidences of two rounds earlier, then
the top-K drafts by current survival). All are lossless: whether draft ``x_k`` is verified never depends on
``x_k`` itself. The argmax over fresh confidences is deliberately not offered (spec appendix A).

Sampling is per request (`SamplingParams`, given to `Engine.submit`): each slot holds its request's
temperature, top-p and seed, so greedy and sampled requests share a round and each is verified exactly
against its own target law (``top_p(softmax(logits / T))``; argmax at temperature 0).

Logprobs are per request too (``SamplingParams.logprobs`` and ``prompt_logprobs``): the raw log-softmax of the
target's logits (temperature 1, no top-p, vLLM's default ``raw_logprobs``) at each emitted position, with the
`sampling.MAX_LOGPROBS` most likely tokens, computed inside the verification and prefill programs from the logits
they already hold (no second forward), under a ``lax.cond`` on a flag array that is set only for a round with
such a request, and read by the host only then; the tokens themselves are the same with or without them.

Randomness: every draw uses a key folded from (the request's seed, its key id, position): the key id is the
request id (the engine's seed for requests without one) or, for a request with its own seed, a fixed value,
so the same seeded request draws the same random numbers whatever else is in the batch and whenever it
runs (its tokens repeat where the draft lengths do, policies ``none`` and ``fixed:K``, up to float rounding:
the logits' last bits depend on the round's padded shapes, so a draw at a near-tie can differ between batch
compositions; the law never does). Two requests with the same seed share their random numbers: each follows
the target's law, but their samples are not independent of each other.

Axis legend: S slots, R rows of a round, G block, T packed tokens, V vocabulary, W draft vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import warnings
from collections import deque
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import calibration, gate, grammar, scheduler, verify
from dspark_jax.sampling import MAX_LOGPROBS, categorical, effective_temperature, logprobs_at, safe_log
from dspark_jax.sps import DEFAULT_WINDOW_RULE, SPSTable, default_sps_table, plain_sps_from_cost, sps_from_cost
from dspark_jax.timing import compile_count
from dspark_jax.cache import prefix
from dspark_jax.cache.pages import PagePool, pages_for
from dspark_jax.models import drafter as dr
from dspark_jax.models.llama import (
    BUCKETS,
    LlamaModel,
    PagedKVCache,
    init_paged_cache,
    bucket_for,
    commit,
    first_argmax,
    forward_packed,
    grid_bucket,
    logits_from_hidden,
    PREFILL_CHUNKS,
    prefill,
    prefill_chunks,
)

__all__ = ["Policy", "parse_policy", "POLICY_NAMES", "EngineConfig", "Engine", "RoundStats", "Completion",
           "SamplingParams", "TokenLogprobs", "engine_state_axes", "policy_lengths"]

POLICY_NAMES = ("none", "fixed:K", "threshold:C", "dspark", "dspark-async")


@dataclasses.dataclass(frozen=True)
class Policy:
    """A scheduling policy (hashable: a static argument of the round programs)."""

    kind: str  # none | fixed | threshold | dspark | dspark-async
    k: int = 0
    threshold: float = 0.0

    @property
    def drafts(self) -> bool:
        return self.kind != "none"

    @property
    def value(self) -> float:
        """The policy's number: K of ``fixed:K``, C of ``threshold:C`` (0 for the others)."""
        return float(self.k) if self.kind == "fixed" else self.threshold

    @property
    def needs_confidence(self) -> bool:
        return self.kind in ("threshold", "dspark", "dspark-async")

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.k}"
        if self.kind == "threshold":
            return f"threshold:{self.threshold:g}"
        return self.kind


def parse_policy(text: str) -> Policy:
    """``none``, ``fixed:K`` (K >= 0), ``threshold:C`` (0 <= C <= 1), ``dspark`` or ``dspark-async``."""
    text = str(text).strip()
    if text in ("none", "dspark", "dspark-async"):
        return Policy(text)
    kind, _, arg = text.partition(":")
    try:
        if kind == "fixed":
            k = int(arg)
            if k < 0:
                raise ValueError
            return Policy("fixed", k=k)
        if kind == "threshold":
            c = float(arg)
            if not 0.0 <= c <= 1.0:
                raise ValueError
            return Policy("threshold", threshold=c)
    except ValueError:
        pass
    raise ValueError(f"policy {text!r}: expected one of {', '.join(POLICY_NAMES)} "
                     f"(K an integer >= 0, C a number in [0, 1])")


def _checked_temperature(t) -> float:
    """A sampling temperature as decoded (`sampling.effective_temperature`); ValueError unless finite and >= 0."""
    if not (isinstance(t, (int, float, np.floating)) and np.isfinite(t) and t >= 0):
        raise ValueError(f"temperature: expected a finite number >= 0 (0: greedy), got {t!r}")
    return effective_temperature(t)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static settings of an `Engine`: slots, cache capacity per slot, sampling, and the drafter gate
    (its fields validated here, through `gate.GateConfig`, which `gate_config` returns).

    >>> EngineConfig(num_slots=4, capacity=512, temperature=0.7).num_slots
    4
    """

    num_slots: int = 16
    capacity: int = 1024
    temperature: float = 0.0
    seed: int = 0
    # Starting value of the engine-wide average confidence per position, which a request with no history
    # yet takes as its stale confidences (dspark-async) and average (the gate); the average then follows
    # the drafted rounds.
    prior_confidence: float = 0.7
    # The dspark policies' drafter gate: after skipped rounds, draft once to refresh the estimates it decides
    # on (a decision made from counters and earlier rounds alone: lossless). At least this many rounds apart...
    gate_probe_every: int = 2
    # ... and at least as many as keep the probes' expected loss (a drafting round's time times the share of
    # plain decoding's throughput it is expected to lose, from the cost model and the same estimates) under
    # this share of the time: near break-even a probe costs little and comes often; at high load a probe
    # loses most of a round that costs several plain ones, so it comes rarely.
    gate_probe_budget: float = 0.02
    # ... and drafts only when the schedule's expected throughput beats plain decoding by this share: the
    # cost model's drafting/plain ratio moves by up to ~10% between measurements on a shared 2-core host,
    # and the per-request confidence averages are noisy, so a gate that opens on any expected gain opens
    # on estimates that are too high (docs/design.md, the drafter gate). 0 trusts the estimates as they are.
    gate_margin: float = 0.05
    # Correct the cost model's drafting and plain round times by the engine's own measurements before the
    # gate compares them (`Engine.time_scale`: a host factor and the drafting rounds' excess over it). On by
    # default: a table measured on another host, or on this one while it was busy, can misprice the two kinds
    # of round against each other by half (docs/design.md). The output stays lossless either way; with it,
    # which rounds draft depends on timings, so
    # sampled tokens (not their law) can differ between runs of the same seed: False for reproducible samples.
    # Off under jax.distributed (several processes): every process must take the same decisions.
    calibrate_times: bool = True
    # The dspark policies learn where drafting never pays on this hardware: once the gate's estimate has
    # stayed below its bar (drafting not expected to pay by `1 + gate_margin`; probes aside) for this many consecutive
    # request-rounds at one load (row bucket: 1, 2, 3-4, 5-8, ... active requests), from at least
    # `drafter_off_requests` distinct requests each counting at most its share (`gate.cutoff_update`), the
    # drafter is switched off at that load: the active requests drop their context (the rounds become plain
    # decoding's own programs at once) and requests joining at that load are admitted without one. Evidence is
    # counted in request-rounds, so a busy engine decides within a few rounds (128 at 16 users: 8 rounds), and
    # over distinct requests, so an idle one needs several answers' evidence (8 answers at one user), never one
    # long answer that happens not to draft well. After
    # `drafter_off_retry` rounds with the drafter off at that load, joining requests get the context again
    # and, once the requests without one have finished, the gate looks afresh (the traffic, and so the
    # drafts' acceptance, may have changed; counted in rounds so that the wait for those requests to finish,
    # a few hundred rounds, stays a small share). A gate that opens on its estimate at a load resets that
    # load's count. None: never (the gate alone decides, every request keeps its context).
    drafter_off_after: int | None = 128
    drafter_off_requests: int = 8
    drafter_off_retry: int = 2048
    # The dspark policies: extend each round's schedule with the next-ranked drafts up to the padded batch
    # the verification runs anyway (`scheduler.fill_to_bucket`, lossless), and let the drafter gate price a
    # round at the padded batch it pays for, with the filled schedule's expected tokens.
    fill_buckets: bool = True
    # Attention windows over the caches: "step" = multiples of 128 (reads little beyond the context held),
    # "pow2" = powers of two (fewer shapes to compile). SPS cost models record the rule they were profiled with.
    window_rule: str = DEFAULT_WINDOW_RULE
    # Where the KV caches live. "pages": a page pool per layer (target and drafter, one block table) that requests
    # take pages from as their tokens are written and give back when they end, read by the ragged paged
    # attention kernels (`dspark_jax.kernels`); "slots": one dense run of ``capacity`` positions per slot, read in
    # place (XLA:CPU's gather of pages costs several times the attention's own read); "auto": "pages" on a single
    # GPU or TPU, "slots" on a CPU or a device mesh.
    kv_layout: str = "auto"
    # Tokens per page (vLLM's ``block_size``): the unit of allocation, and of the slot layout's accounting.
    block_size: int = 16
    # Pages in the pool ("pages" layout); None: enough for every slot at full capacity. `cache.plan.plan_memory`
    # sizes it from a device's memory (``gpu_memory_utilization``).
    num_pages: int | None = None
    # Tokens one step may run (vLLM's ``max_num_batched_tokens``): the running requests' tokens come first, and
    # prompts are prefilled, chunk by chunk, in what is left, so a burst of long prompts slows the running
    # streams by at most one budget a step instead of freezing them while it prefills. None: no budget (each
    # prompt prefilled whole at admission).
    max_num_batched_tokens: int | None = 512
    # JAX's persistent compilation cache in a user cache folder (`use_compilation_cache`; the environment variable
    # DSPARK_JAX_COMPILATION_CACHE=0 turns it off too): a restarted engine reads its programs back.
    compilation_cache: bool = True
    # Automatic prefix caching (vLLM's ``enable_prefix_caching``): full pages of committed tokens are kept under
    # a key chained from every token before them, after their request ends, and a request whose prompt starts with
    # kept pages takes them instead of prefilling them, the drafter's context with them (`cache.pages`,
    # `cache.prefix`). None: on wherever it runs (one device, either layout); True: required (a device mesh
    # refuses it); False: off.
    enable_prefix_caching: bool | None = None
    # Pages of the slot layout's prefix store (`cache.prefix`: pages are copied there and back, the slot caches
    # being dense); None: half as many as the slots hold. The "pages" layout keeps prefixes in its pool.
    num_prefix_pages: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "temperature", _checked_temperature(self.temperature))
        if self.kv_layout not in ("auto", "pages", "slots"):
            raise ValueError(f"kv_layout: expected 'auto', 'pages' or 'slots', got {self.kv_layout!r}")
        if not (isinstance(self.block_size, (int, np.integer)) and self.block_size >= 1):
            raise ValueError(f"block_size: expected an integer >= 1, got {self.block_size!r}")
        if self.num_pages is not None and not (isinstance(self.num_pages, (int, np.integer)) and self.num_pages >= 1):
            raise ValueError(f"num_pages: expected None or an integer >= 1, got {self.num_pages!r}")
        if self.num_prefix_pages is not None and not (
                isinstance(self.num_prefix_pages, (int, np.integer)) and self.num_prefix_pages >= 1):
            raise ValueError(f"num_prefix_pages: expected None or an integer >= 1, got {self.num_prefix_pages!r}")
        if self.enable_prefix_caching not in (None, True, False):
            raise ValueError(f"enable_prefix_caching: expected None, True or False, got {self.enable_prefix_caching!r}")
        least = self.num_slots + PREFILL_CHUNKS[0]
        if self.max_num_batched_tokens is not None and not (
                isinstance(self.max_num_batched_tokens, (int, np.integer)) and self.max_num_batched_tokens >= least):
            raise ValueError(f"max_num_batched_tokens: expected None or an integer >= num_slots + "
                             f"{PREFILL_CHUNKS[0]} = {least} (every running request's token and a prefill chunk), "
                             f"got {self.max_num_batched_tokens!r}")
        try:
            self.gate_config()
        except ValueError as err:  # name the field the caller set
            field, _, rest = str(err).partition(":")
            names = {g: e for e, g in _GATE_FIELDS.items()}
            raise ValueError(f"{names.get(field, field)}:{rest}") from None

    @property
    def max_num_seqs(self) -> int:
        """vLLM's name of ``num_slots``: requests decoded together."""
        return self.num_slots

    @property
    def max_model_len(self) -> int:
        """vLLM's name of ``capacity``: the most positions one request holds (prompt, answer and a block)."""
        return self.capacity

    def layout_for(self, device_platform: str, mesh_devices: int) -> str:
        """The KV layout ``kv_layout`` resolves to on a platform ("cpu", "gpu", "tpu") and device count."""
        if self.kv_layout != "auto":
            return self.kv_layout
        return "pages" if device_platform in ("gpu", "tpu", "cuda", "rocm") and mesh_devices <= 1 else "slots"

    def gate_config(self) -> gate.GateConfig:
        """The drafter gate's settings (`gate.GateConfig`) from these fields.

        >>> EngineConfig(gate_margin=0.1).gate_config().margin
        0.1
        """
        return gate.GateConfig(**{g: getattr(self, e) for e, g in _GATE_FIELDS.items()})


_GATE_FIELDS = {  # EngineConfig field -> gate.GateConfig field
    "gate_probe_every": "probe_every", "gate_probe_budget": "probe_budget", "gate_margin": "margin",
    "fill_buckets": "fill", "drafter_off_after": "off_after", "drafter_off_requests": "off_requests",
    "drafter_off_retry": "off_retry",
    "calibrate_times": "calibrate_times",
}


SEEDED_KEY_ID = -1  # the key id of a request with its own seed (request ids are >= 0, so streams never meet)
MAX_SEED = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (`Engine.submit`); None takes the engine's `EngineConfig` value.

    Attributes:
      temperature: >= 0; 0 is greedy (the target's argmax, token for token plain greedy decoding), and so is
        any temperature below `sampling.GREEDY_TEMPERATURE` (1e-5, as vLLM).
      top_p: in (0, 1]: sample from the smallest set of most likely tokens whose probability reaches
        ``top_p`` (renormalised); 1 keeps every token.
      seed: in [0, 2**31 - 1]: the request's random stream depends on this seed and the positions alone
        (not on its id or the batch). None: the engine's seed and the request id.
      stop_token_ids: tokens that end this request (with the engine's own stop ids); the stop token is
        the last output token, as for the engine's stop ids.
      ignore_eos: the engine's own stop ids (the model's end-of-sequence tokens) do not end this request: it
        runs to its budget (benchmarks that need answers of a set length); ``stop_token_ids`` still end it.
      grammar: a `grammar.Grammar` the output must follow (structured output): the target's law at every
        verified position is masked by the grammar's state after the tokens before it, so the output is plain
        constrained decoding's under every policy; the engine's stop ids end the request only where the grammar
        is complete, and the request ends once the grammar is finished. None: unconstrained.
      logprobs: None, or 0..`sampling.MAX_LOGPROBS` (20): report every output token's log-probability and this
        many most likely alternatives (`Completion.logprobs`). The law reported is the target's raw one,
        ``log_softmax(logits)`` at temperature 1 without top-p (vLLM's default ``raw_logprobs``), whatever the
        request samples at; the tokens are the same with or without it.
      prompt_logprobs: None, or 0..20: the same for the prompt's tokens (`Completion.prompt_logprobs`; the
        first prompt token has none). Costs the LM head over every prompt position during the prefill.

    >>> SamplingParams(temperature=0.7, top_p=0.9, seed=3).top_p
    0.9
    """

    temperature: float | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    grammar: grammar.Grammar | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        if self.temperature is not None:
            object.__setattr__(self, "temperature", _checked_temperature(self.temperature))
        if not (isinstance(self.top_p, (int, float, np.floating)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not (isinstance(self.seed, (int, np.integer)) and 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed: expected None or an integer in [0, {MAX_SEED}], got {self.seed!r}")
        ids = tuple(self.stop_token_ids)
        if not all(isinstance(i, (int, np.integer)) and i >= 0 for i in ids):
            raise ValueError(f"stop_token_ids: expected token ids >= 0, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise ValueError(f"ignore_eos: expected a bool, got {self.ignore_eos!r}")
        if self.grammar is not None and not isinstance(self.grammar, grammar.Grammar):
            raise ValueError(f"grammar: expected None or a dspark_jax.grammar.Grammar, got "
                             f"{type(self.grammar).__name__}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not (isinstance(n, (int, np.integer)) and not isinstance(n, (bool, np.bool_))
                                      and 0 <= n <= MAX_LOGPROBS):
                raise ValueError(f"{name}: expected None or an integer in [0, {MAX_LOGPROBS}], got {n!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EngineState:
    """Everything the rounds read and write, on the device."""

    cache: Any  # target KVCache; lengths[s] = committed tokens of slot s (= the anchor's position)
    dcache: Any  # DrafterCache or None
    anchor: jax.Array  # int32 [S] last emitted token, not yet in the cache
    active: jax.Array  # bool [S]
    request: jax.Array  # int32 [S] key id: request id, or SEEDED_KEY_ID for a request with its own seed
    seed: jax.Array  # int32 [S] the request's seed (the engine's unless it gave one)
    temperature: jax.Array  # float32 [S] the request's temperature (0: greedy)
    top_p: jax.Array  # float32 [S] the request's nucleus mass (1: all tokens)
    generated: jax.Array  # int32 [S] tokens emitted so far
    max_new: jax.Array  # int32 [S]
    eos_stops: jax.Array  # bool [S] the engine's stop ids end the slot's request (False: it ignores them)
    conf_hist: jax.Array  # float32 [2, S, G] calibrated confidences of the last two rounds (0 = latest)
    gate: gate.GateState  # the drafter gate's survival averages, acceptance sums and skip counter

    def replace(self, **kw) -> "EngineState":
        return dataclasses.replace(self, **kw)


def engine_state_axes(state: EngineState):
    """Logical axes of an `EngineState` (`sharding.Axes`): everything per slot splits with the slots."""
    from dspark_jax.sharding import Axes, drafter_cache_axes, kv_cache_axes  # noqa: PLC0415

    return EngineState(
        cache=kv_cache_axes(len(state.cache.k)), dcache=None if state.dcache is None else drafter_cache_axes(),
        anchor=Axes("slots"), active=Axes("slots"), request=Axes("slots"), seed=Axes("slots"),
        temperature=Axes("slots"), top_p=Axes("slots"), generated=Axes("slots"),
        max_new=Axes("slots"), eos_stops=Axes("slots"), conf_hist=Axes(None, "slots", None),
        gate=gate.GateState(survival=Axes("slots", None), global_survival=Axes(None), accept_seen=Axes(None),
                            skipped=Axes()))


class DraftOut(NamedTuple):
    tokens: jax.Array  # int32 [R, G]
    probs: jax.Array  # float32 [R, G, W]
    conf: jax.Array  # float32 [R, G] calibrated per-token confidences
    conf_logits: jax.Array  # float32 [R, G] the confidence head's raw logits
    lengths: jax.Array  # int32 [R] scheduled drafts
    batch_tokens: jax.Array  # int32 []
    drafted: jax.Array  # bool [] False when the round skipped the drafter (plain decoding was expected faster)


class RoundOut(NamedTuple):
    emitted: jax.Array  # int32 [R, G + 1]
    counts: jax.Array  # int32 [R] emitted tokens per row
    finished: jax.Array  # bool [R]
    accepted: jax.Array  # int32 [R] accepted drafts
    new_lengths: jax.Array  # int32 [R] committed tokens after the round
    logprobs: "Logprobs"  # of the emitted tokens, per row and column [R, Gv + 1] (zeros unless asked for)


class Logprobs(NamedTuple):
    """Raw log-probabilities of tokens at some positions (`sampling.logprobs_at`), with the top alternatives."""

    chosen: jax.Array  # float32 [...P]
    top_ids: jax.Array  # int32 [...P, K]
    top: jax.Array  # float32 [...P, K]


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
class _Prefilling:
    """A request whose prompt is being prefilled into its slot: ``done`` prompt tokens so far."""

    rid: int
    prompt: list[int]
    max_new: int
    sampling: SamplingParams
    context: bool  # it gets the drafter's context
    done: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # filled chunk by chunk when asked for


def _key(seed, stream: int, request, position):
    """PRNG key per (seed, stream, request, position); vectorised over request/position arrays [R], the seed
    a scalar or one per row [R]."""
    seeds = jnp.broadcast_to(jnp.asarray(seed, jnp.int32), jnp.shape(request))

    def one(s, r, p):
        return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(jax.random.key(s), stream), r), p)

    return jax.vmap(one)(seeds, request, position)


_gate_init = jax.jit(gate.init, static_argnums=(0, 1, 2, 3))  # a fresh gate state, one program
_draft_head_weights = nnx.jit(dr.draft_head_weights)  # the drafter's LM head over its vocabulary, one program

COMPILATION_CACHE_ENV = "DSPARK_JAX_COMPILATION_CACHE"


def use_compilation_cache() -> str | None:
    """Turn on JAX's persistent compilation cache in a user cache folder, so that a second run (a restarted
    server, the next benchmark) reads its programs back instead of compiling them: ``$DSPARK_JAX_COMPILATION_CACHE``
    if set (``0``, ``off`` or ``false``: no cache), else ``$XDG_CACHE_HOME/dspark_jax/jax`` (default
    ``~/.cache/dspark_jax/jax``). A folder the user gave JAX (``jax_compilation_cache_dir``) is left as it is.
    Returns the folder in use, or None. `Engine` calls it unless ``EngineConfig.compilation_cache`` is False.
    """
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    chosen = os.environ.get(COMPILATION_CACHE_ENV, "").strip()
    if chosen.lower() in ("0", "off", "false", "no"):
        return None
    if not chosen:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        chosen = os.path.join(base, "dspark_jax", "jax")
    try:
        os.makedirs(chosen, exist_ok=True)
    except OSError as err:  # a read-only home: run without the cache
        warnings.warn(f"compilation cache: cannot create {chosen} ({err}); compiling without it", stacklevel=3)
        return None
    jax.config.update("jax_compilation_cache_dir", chosen)
    return chosen


def _pow2(n: int, cap: int) -> int:
    r = 1
    while r < n:
        r *= 2
    return min(r, cap)


class Engine:
    """Speculative decoding over a Llama-family target with a DSpark drafter (or none).

    Args:
      target: the loaded target model.
      drafter: the drafter module (None for the ``none`` policy only).
      policy: a `Policy` or its text (`parse_policy`).
      config: slots, capacity, temperature, seed.
      sts_temperatures: the confidence head's STS temperatures: one set [G] for every request, or
        `calibration.STSSets` fitted at several sampling temperatures (each request uses the set fitted
        nearest its own); default: all ones.
      sps: for the ``dspark`` policies, an `SPSTable` (its cost model, when it has one, gives a fresh
        steps/s curve every round for the round's requests and context) or a dense steps/s array [N]
        (default: the packaged table chosen for this host). A table is refused when measured on another
        mesh (`sharding.check_table_mesh`) and warned about, naming both values, when measured on another
        backend, device kind or dtype, with another drafter shape, or short of the engine's largest round.
      mesh: optional ``(data, tensor)`` device mesh (`sharding.make_mesh`): the target's weights, the
        caches, the drafter and the engine state are laid out on it by `sharding.RULES` (slots over
        ``data``; heads, FFN width and vocabulary over ``tensor``) and jit propagates the layout; None: one
        device, as before.
      allow_sps_mesh_mismatch: use a table measured on another mesh anyway (a warning instead).

    `submit` queues a request, `step` runs one round, `run` decodes a list of prompts to the end
    (`dspark_jax.build_engine` builds one from names and paths):

    >>> from dspark_jax.models.llama import LlamaConfig, LlamaModel, init_random_weights
    >>> cfg = LlamaConfig.tiny()
    >>> target = LlamaModel(cfg, init_random_weights(cfg, jax.random.key(0)))
    >>> engine = Engine(target, None, "none", EngineConfig(num_slots=2, capacity=64))
    >>> [len(c.output_ids) for c in engine.run([[1, 2, 3], [4, 5]], max_new_tokens=4)]
    [4, 4]
    """

    def __init__(self, target: LlamaModel, drafter: dr.Drafter | None, policy: Policy | str = "dspark",
                 config: EngineConfig = EngineConfig(), *, sts_temperatures=None, sps=None,
                 stop_ids: Sequence[int] | None = None, mesh=None, allow_sps_mesh_mismatch: bool = False):
        if config.compilation_cache:
            use_compilation_cache()
        self.mesh = mesh
        policy = parse_policy(policy) if isinstance(policy, str) else policy
        if policy.kind in ("dspark", "dspark-async") and (sps is None or isinstance(sps, SPSTable)):
            from dspark_jax.sharding import check_table_mesh  # noqa: PLC0415

            sps = default_sps_table() if sps is None else sps
            # before anything is placed: a table of another mesh prices another machine's rounds
            check_table_mesh(sps, mesh, allow_mismatch=allow_sps_mesh_mismatch)
        if mesh is not None:  # a placed copy: the caller's target keeps its own arrays
            from dspark_jax.sharding import mesh_fit, place_target_weights  # noqa: PLC0415

            for problem in mesh_fit(target.cfg, config.num_slots, mesh):
                warnings.warn(f"mesh: {problem}", stacklevel=2)

            target = LlamaModel(target.cfg, place_target_weights(target.weights, target.cfg, mesh), target.tokenizer)
        self.target, self.cfg = target, config
        self.gate_cfg = config.gate_config()
        if self.gate_cfg.calibrate_times and jax.process_count() > 1:
            # Each process would fold its own clock into the cost model, and processes whose clocks disagree
            # would run different round programs (drafting or not) with different collectives: the table's
            # times decide alike everywhere.
            self.gate_cfg = dataclasses.replace(self.gate_cfg, calibrate_times=False)
        self.policy = policy
        if self.policy.drafts and drafter is None:
            raise ValueError(f"policy {self.policy} needs a drafter; only 'none' runs without one")
        self.drafter = drafter if self.policy.drafts else None
        if self.drafter is not None and self.drafter.cfg.tap_layers is not None and \
                tuple(self.drafter.cfg.tap_layers) != tuple(target.cfg.tap_layers):
            raise ValueError(f"the drafter reads target layers {self.drafter.cfg.tap_layers}, but the target taps "
                             f"{target.cfg.tap_layers} (build.tapped_for gives a target tapping the drafter's)")
        # The round programs are static in the policy's kind; its number (K or C) is passed as an array.
        self._policy_kind = Policy(self.policy.kind)
        self._policy_value = _put(np.float32(self.policy.value))
        S = config.num_slots
        self.G = self.drafter.cfg.block if self.drafter is not None else 1
        if S < 1:
            raise ValueError(f"num_slots: expected an integer >= 1, got {S}")
        most = S * (self.G + 1) if self.drafter is not None else S  # tokens of the largest verification
        if most > BUCKETS[-1]:
            raise ValueError(f"num_slots={S} with block {self.G}: a round may verify {most} tokens, more than the "
                             f"largest verification batch {BUCKETS[-1]}; use at most "
                             f"{BUCKETS[-1] // (self.G + 1) if self.drafter is not None else BUCKETS[-1]} slots")
        if stop_ids is None:
            stop_ids = target.tokenizer.stop_ids if target.tokenizer is not None else ()
        self.stop_ids = np.asarray(sorted(set(int(t) for t in stop_ids)) or [-1], np.int32)
        if self.drafter is not None:
            self.d_graph, self.d_state = nnx.split(self.drafter)
            if mesh is not None:
                from dspark_jax.sharding import place_drafter_state  # noqa: PLC0415

                self.d_state = place_drafter_state(self.d_state, self.drafter.cfg, mesh)
            self.head_w = _draft_head_weights(self.drafter, target.weights.embed, target.weights.lm_head)
            sets = calibration.STSSets.of(np.ones(self.G, np.float32) if sts_temperatures is None
                                          else sts_temperatures)
            if sets.block != self.G:
                raise ValueError(f"sts_temperatures: expected {self.G} values (one per block position), got "
                                 f"{sets.block}")
            # [K], [K, G], [K, G]
            self.temps = _put((np.asarray(sets.at, np.float32), np.asarray(sets.temperatures, np.float32),
                               np.asarray(sets.biases, np.float32)))
            self.draft_vocab = None if self.drafter.cfg.draft_vocab == target.cfg.vocab_size else self.drafter.vocab_ids[...]
        if config.window_rule not in ("step", "pow2"):
            raise ValueError(f"window_rule: expected 'step' or 'pow2', got {config.window_rule!r}")
        self.cost = None
        if self.policy.kind in ("dspark", "dspark-async"):  # sps: a table (checked above) or a dense array
            if isinstance(sps, SPSTable):
                device = mesh.devices.flat[0] if mesh is not None else next(iter(target.weights.embed.devices()))
                sps.check_compatible(drafter=None if self.drafter is None else self.drafter.cfg.to_dict(),
                                     dtype=jnp.dtype(target.weights.embed.dtype).name, backend=device.platform,
                                     device_kind=device.device_kind)
                rows = None if sps.cost_model is None else max(sps.cost_model.rows)
                dense = sps.to_dense()
                self._check_table_reach(len(dense) - 1, rows, config.num_slots)
                if sps.cost_model is not None:
                    if sps.cost_model.block != self.G or sps.cost_model.window_rule != config.window_rule:
                        raise ValueError(
                            f"SPS cost model profiled for block {sps.cost_model.block} and window rule "
                            f"{sps.cost_model.window_rule!r}, but the engine runs block {self.G} with "
                            f"{config.window_rule!r} windows")
                    self.cost = sps.cost_arrays()
                sps = dense
            self.sps = _put(np.asarray(sps, np.float32))
            if self.sps.ndim != 1 or not np.all(np.isfinite(np.asarray(self.sps))) or np.any(np.asarray(self.sps) <= 0):
                raise ValueError("sps: expected a 1-D table of finite, positive steps/s")
        else:
            self.sps = jnp.ones((2,), jnp.float32)
        # The KV layout and the page pool's host side (`cache.pages`): pages of either layout are counted the
        # same way; the slot layout's are fixed per slot (its cache is dense).
        device = mesh.devices.flat[0] if mesh is not None else next(iter(target.weights.embed.devices()))
        self.kv_layout = config.layout_for(device.platform, 1 if mesh is None else mesh.devices.size)
        if self.kv_layout == "pages" and mesh is not None and mesh.devices.size > 1:
            raise ValueError("kv_layout 'pages' runs on one device; a device mesh uses kv_layout 'slots'")
        per_slot_pages = pages_for(config.capacity, config.block_size)
        contiguous = self.kv_layout == "slots"
        num_pages = S * per_slot_pages if contiguous or config.num_pages is None else config.num_pages
        on_mesh = mesh is not None and mesh.devices.size > 1
        if config.enable_prefix_caching and on_mesh:
            raise ValueError("enable_prefix_caching: a device mesh runs without the prefix cache; set it to None "
                             "(on where it runs) or False")
        # The prefix cache: the pool's own pages ("pages" layout) or a store of pages copied to and from the
        # dense slot caches ("slots" layout; `cache.prefix`).
        self.prefix_caching = config.enable_prefix_caching is not False and not on_mesh
        self.pages = PagePool(num_pages=num_pages, page_size=config.block_size, num_slots=S,
                              pages_per_slot=per_slot_pages, contiguous=contiguous,
                              prefix_caching=self.prefix_caching and not contiguous)
        self._tables_version = self.pages.version
        state = self._init_state()
        self.prefix_store: prefix.PrefixStore | None = None
        self._prefix_pages: prefix.PrefixPages | None = None
        if self.prefix_caching and contiguous:
            store_pages = config.num_prefix_pages or max(1, S * per_slot_pages // 2)
            self.prefix_store = prefix.PrefixStore(num_pages=store_pages, page_size=config.block_size)
            self._prefix_pages = jax.jit(functools.partial(prefix.init_prefix_pages, num_pages=store_pages,
                                                           page_size=config.block_size))(state.cache, state.dcache)
        # prompt tokens admitted, and of those taken from the prefix cache instead of prefilled
        self.prefix_counts = {"prompt_tokens": 0, "cached_tokens": 0}
        if mesh is not None:
            from dspark_jax.sharding import place  # noqa: PLC0415

            state = place(state, engine_state_axes(state), mesh)
        # Every program's output state is put back on this layout (`state`), so that each program always
        # sees the same input shardings and compiles once per shape.
        self._state_shardings = jax.tree.map(lambda x: x.sharding, state) if mesh is not None else None
        self.state = state
        # host mirrors
        self.slot_request = np.full(S, -1)
        self.slot_length = np.zeros(S, np.int64)
        self.slot_context = np.zeros(S, bool)  # the request in the slot has the drafter's context
        # Slots whose request is still being prefilled, chunk by chunk: slot -> `_Prefilling` (the slot is
        # taken, its request not yet decoding).
        self.prefilling: dict[int, _Prefilling] = {}
        self._prefilled = 0  # prompt tokens prefilled by the current step
        self._extra_stops: dict[int, frozenset[int]] = {}  # request id -> its own stop token ids
        # request id -> its grammar's state after its output so far (`grammar.Matcher`; constrained requests only)
        self._matchers: dict[int, grammar.Matcher] = {}
        self._mask_words = grammar.mask_words(target.cfg.vocab_size)
        self._no_masks: dict[tuple[int, ...], jax.Array] = {}  # shape -> a device mask no program reads
        self._first_mask_seconds = 0.0  # host time on first-token masks in the current step
        self._ignore_eos: set[int] = set()  # active or queued requests the engine's stop ids do not end
        self._logprobs: dict[int, int] = {}  # active or queued request id -> top alternatives it asked for
        self.admissions = {"context": 0, "no_context": 0}  # requests admitted with and without it
        self.drafter_offs: list[tuple[int, int]] = []  # (round index, row bucket) where the drafter was switched off
        self.requests: dict[int, Completion] = {}
        self.pending: deque[tuple[int, list[int], int, SamplingParams]] = deque()
        self.next_id = 0
        self.rounds: list[RoundStats] = []
        self.finished_ids: list[int] = []  # in the order requests finished
        self.record_confidences = False
        self.record_tokens = False  # RoundStats also hold request ids, drafted and emitted tokens (a trace)
        self._gate_closed = False  # the last round found that the drafter would not pay next round
        # Learned cut-off (drafter_off_after, dspark policies with a cost model only): `gate.CutOff`.
        self._may_drop_context = self.cost is not None and config.drafter_off_after is not None
        # Rows per round: the active requests' count rounded up to a power of two, whose slots' caches the round
        # gathers. With slots split over data-parallel groups, a gather of some slots is a masked read plus an
        # all-reduce of every layer's cache rows across the groups each round; every slot read in place costs
        # only its own group's attention over idle slots, so such a mesh always runs all S rows.
        from dspark_jax.sharding import DATA, mesh_shape  # noqa: PLC0415

        data = mesh_shape(mesh)[DATA]
        self._min_rows = S if data > 1 and S % data == 0 else 1
        self.cutoff = gate.CutOff()
        self._no_conf: dict[int, tuple[jax.Array, jax.Array]] = {}
        self._flag_arrays: dict[bool, jax.Array] = {}
        self.reset_time_scale()
        self.on_token: Callable[[int, int], None] | None = None
        # The programs' static spec (per round shape: `_round_spec`) and their one pytree of constant inputs.
        self._spec = RoundSpec(cfg=target.cfg, block=self.G, capacity=config.capacity, policy=self._policy_kind,
                               gate=self.gate_cfg, sharded_slots=self._min_rows > 1)
        self._specs: dict[tuple[int, int, int], RoundSpec] = {}
        drafting = self.drafter is not None
        self._inputs = RoundInputs(
            weights=target.weights, graph=self.d_graph if drafting else None,
            dstate=self.d_state if drafting else None, head_w=self.head_w if drafting else None,
            temps=self.temps if drafting else None, sps=self.sps, cost=self.cost,
            draft_vocab=self.draft_vocab if drafting else None, stop_ids=_put(self.stop_ids),
            policy_value=self._policy_value)

    # ------------------------------------------------------------------------------------------------ state
    @property
    def state(self) -> EngineState:
        """The device state the rounds read and write (on the mesh's layout when the engine has a mesh)."""
        return self._state

    @state.setter
    def state(self, value: EngineState) -> None:
        if self._state_shardings is not None:  # a no-op where a program kept the layout
            value = jax.device_put(value, self._state_shardings)
        self._state = value

    def _init_gate(self) -> gate.GateState:
        return _gate_init(self.gate_cfg, self.cfg.num_slots, self.G, self.cfg.prior_confidence)

    def _check_table_reach(self, have: int, rows: int | None, num_slots: int) -> None:
        """Warn where the engine's largest round lies beyond what its table measured (``have`` verified tokens,
        ``rows`` requests a round, None: no cost model): rounds of more requests are priced as the largest row
        count, and no round is scheduled past the largest batch."""
        most = num_slots * (self.G + 1)
        if most > have or (rows is not None and num_slots > rows):
            warnings.warn(f"SPS table: measured up to {have} verified tokens"
                          + ("" if rows is None else f" and {rows} requests a round")
                          + f", but this engine's {num_slots} slots may verify {most} tokens a round: larger rounds "
                          f"are priced as the largest measured or not scheduled; profile to that size "
                          f"(python -m profiling.profile_sps --max-tokens {most})", stacklevel=3)

    def _init_state(self) -> EngineState:
        """The empty state, made by one program."""
        return jax.jit(self._empty_state)()

    def _empty_state(self) -> EngineState:
        c, S = self.cfg, self.cfg.num_slots
        if self.kv_layout == "pages":
            pool = self.pages
            cache = init_paged_cache(self.target.cfg, S, num_pages=pool.num_pages, page_size=pool.page_size,
                                     pages_per_slot=pool.pages_per_slot, dtype=self.target.dtype,
                                     block_tables=pool.block_tables)
            dcache = (dr.init_paged_drafter_cache(self.drafter.cfg, pool.num_pages, pool.page_size, cache.dtype)
                      if self.drafter is not None else None)
        else:
            cache = self.target.init_cache(S, c.capacity)
            # the drafter's context in the target's cache dtype (bf16 on accelerators)
            dcache = dr.init_drafter_cache(self.drafter.cfg, S, c.capacity, cache.dtype) if self.drafter is not None else None
        return EngineState(
            cache=cache, dcache=dcache, anchor=jnp.zeros(S, jnp.int32), active=jnp.zeros(S, bool),
            request=jnp.zeros(S, jnp.int32), generated=jnp.zeros(S, jnp.int32), max_new=jnp.zeros(S, jnp.int32),
            seed=jnp.full(S, c.seed, jnp.int32), temperature=jnp.full(S, c.temperature, jnp.float32),
            top_p=jnp.ones(S, jnp.float32), eos_stops=jnp.ones(S, bool),
            conf_hist=jnp.full((2, S, self.G), c.prior_confidence, jnp.float32),
            gate=gate.init(self.gate_cfg, S, self.G, c.prior_confidence),
        )

    def _sync_block_tables(self) -> None:
        """Give the device the host's block tables when an allocation changed them ("pages" layout)."""
        if self.pages.version != self._tables_version:
            tables = _put(np.asarray(self.pages.block_tables, np.int32))
            self.state = self.state.replace(cache=self.state.cache.replace(block_tables=tables))
            self._tables_version = self.pages.version

    def _round_spec(self, R: int, T: int = 0, per_slot: int = 1) -> RoundSpec:
        """The static spec of a round's programs of R rows and T tokens (grid width ``per_slot``), made once."""
        key = (R, T, per_slot)
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = dataclasses.replace(self._spec, rows=R, tokens=T, per_slot=per_slot)
        return spec

    # ------------------------------------------------------------------------------------------------ requests
    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None = None) -> int:
        """Queue a request (chat template already applied); returns its id.

        Args:
          prompt_ids: the prompt's token ids.
          max_new_tokens: at most this many output tokens (>= 1).
          sampling: the request's `SamplingParams` (default: the engine's temperature and seed, top-p 1).
        Raises:
          ValueError: an empty prompt, a budget < 1, a request the slot capacity cannot hold, bad sampling.
        """
        if sampling is None:
            sampling = SamplingParams()
        elif not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling: expected a SamplingParams or None, got {type(sampling).__name__}")
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("prompt_ids: expected at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
        need = len(prompt_ids) + max_new_tokens + self.G + 1
        if need > self.cfg.capacity:
            raise ValueError(f"request needs {need} cache positions (prompt {len(prompt_ids)} + max_new_tokens "
                             f"{max_new_tokens} + block {self.G + 1}) but the slot capacity is {self.cfg.capacity}")
        if not self.pages.fits(need):
            raise ValueError(f"request needs {pages_for(need, self.pages.page_size)} pages of {self.pages.page_size} "
                             f"tokens (prompt {len(prompt_ids)} + max_new_tokens {max_new_tokens} + block "
                             f"{self.G + 1}) but the pool has {self.pages.num_pages}: raise num_pages")
        rid = self.next_id
        self.next_id += 1
        self.requests[rid] = Completion(rid, prompt_ids, [], False,
                                        logprobs=None if sampling.logprobs is None else [])
        if sampling.logprobs is not None:
            self._logprobs[rid] = int(sampling.logprobs)
        if sampling.stop_token_ids:
            self._extra_stops[rid] = frozenset(sampling.stop_token_ids)
        if sampling.ignore_eos:
            self._ignore_eos.add(rid)
        if sampling.grammar is not None:
            if sampling.grammar.tokenizer.vocab_size > self.target.cfg.vocab_size:
                raise ValueError(f"grammar: made for a vocabulary of {sampling.grammar.tokenizer.vocab_size} tokens, "
                                 f"but the model has {self.target.cfg.vocab_size}")
            self._matchers[rid] = sampling.grammar.matcher()
        self.pending.append((rid, prompt_ids, int(max_new_tokens), sampling))
        return rid

    def cancel(self, request_id: int) -> bool:
        """End a request between rounds (a client gone, a stop string found): a queued one leaves the queue, an
        active one frees its slot for the next admission. Its `Completion` keeps what it emitted, with
        ``cancelled`` set, and it counts as finished. Returns False when it had already finished.

        Raises:
          ValueError: an id this engine never gave.
        """
        if request_id not in self.requests:
            raise ValueError(f"cancel: no request {request_id!r} (ids are those submit returned)")
        done = False
        for i, item in enumerate(self.pending):
            if item[0] == request_id:
                del self.pending[i]
                done = True
                break
        if not done:
            slots = np.flatnonzero(self.slot_request == request_id)
            if not slots.size:
                return False
            if int(slots[0]) not in self.prefilling:  # a decoding request's committed pages stay useful
                self._publish(int(slots[0]), self._committed(int(slots[0])), bool(self.slot_context[slots[0]]))
            self._release(int(slots[0]))
        self.requests[request_id].cancelled = True
        self._forget_stops(request_id)
        self.finished_ids.append(request_id)
        return True

    def _release(self, slot: int) -> None:
        """Free ``slot`` (host mirror and device state); its cache rows are overwritten by the next admission."""
        self.slot_request[slot] = -1
        self.prefilling.pop(slot, None)
        self.pages.release(slot)
        self.state = _free_slot(self.state, np.int32(slot))

    def _forget_stops(self, rid: int) -> None:
        self._extra_stops.pop(rid, None)
        self._ignore_eos.discard(rid)
        self._matchers.pop(rid, None)
        self._logprobs.pop(rid, None)

    def _grammar_done(self, rid: int) -> bool:
        """Whether request ``rid``'s grammar is finished (no token may follow: the request ends)."""
        m = self._matchers.get(rid)
        return m is not None and m.finished

    def _eos_ends(self, rid: int, token) -> bool:
        """Whether ``token`` is one of the engine's stop ids and ends request ``rid`` (not under ignore_eos)."""
        return rid not in self._ignore_eos and bool(np.isin(token, self.stop_ids))

    def _stop_cut(self, rid: int, tokens) -> int | None:
        """With the request's own stop ids: the number of ``tokens`` up to and including the first of them, else
        None."""
        stops = self._extra_stops.get(rid)
        if stops:
            for i, t in enumerate(tokens):
                if int(t) in stops:
                    return i + 1
        return None

    def _emit(self, rid: int, tokens, logprobs: Sequence[TokenLogprobs] | None = None) -> None:
        """Append ``tokens`` (and, for a request that asked, their ``logprobs``, one each) to ``rid``'s output."""
        c = self.requests[rid]
        if c.logprobs is not None and logprobs is not None:
            c.logprobs.extend(logprobs[: len(tokens)])
        for t in tokens:
            c.output_ids.append(int(t))
            if self.on_token is not None:
                self.on_token(rid, int(t))

    def _admit(self) -> int:
        """Queued requests take free slots (with the pages of their whole budget), prompts are prefilled within
        the step's token budget (`EngineConfig.max_num_batched_tokens`, after one token per running request),
        and every request whose prompt is done joins with its first token emitted. Returns tokens emitted."""
        free = [s for s in range(self.cfg.num_slots) if self.slot_request[s] < 0]
        decoding = int((self.slot_request >= 0).sum()) - len(self.prefilling)
        load = decoding + len(self.prefilling) + min(len(free), len(self.pending))  # once these have joined
        while free and self.pending:
            s = free[0]
            rid, prompt, max_new, sampling = self.pending[0]
            context = self._admission_context(load)
            # a request that reports its prompt's logprobs prefills every position
            hit = [] if sampling.prompt_logprobs is not None else self._prefix_lookup(prompt, context)
            shared = hit if self.prefix_store is None else ()
            if not self.pages.reserve(s, len(prompt) + max_new + self.G + 1, shared=shared):
                break  # waits, first in first out, for pages a finishing request gives back
            self.pending.popleft()
            free.pop(0)
            self.slot_request[s] = rid
            job = self.prefilling[s] = _Prefilling(
                rid, prompt, max_new, sampling, context,
                prompt_logprobs=None if sampling.prompt_logprobs is None else [None])
            self._prefix_take(s, job, hit)
        budget = None if self.cfg.max_num_batched_tokens is None else self.cfg.max_num_batched_tokens - decoding
        emitted = 0
        for s in list(self.prefilling):  # in admission order
            job = self.prefilling[s]
            while job.done < len(job.prompt) and (budget is None or budget > 0):
                take = len(job.prompt) - job.done if budget is None else min(len(job.prompt) - job.done, budget)
                logits = self._prefill_chunk(s, job, take)
                self._prefilled += take
                budget = None if budget is None else budget - take
            if job.done < len(job.prompt):
                break
            del self.prefilling[s]
            emitted += self._join(s, job, logits)
        return emitted

    # ------------------------------------------------------------------------------------------------ prefixes
    def _namespace(self, context: bool) -> bytes:
        """The prefix cache's namespace of pages written with (b"ctx") or without the drafter's context."""
        return b"ctx" if context and self.drafter is not None else b""

    def _prefix_lookup(self, prompt: list[int], context: bool) -> list[int]:
        """Pages (the pool's, or the slot layout's store's) holding the longest cached run of ``prompt``'s full
        pages: of pages with the drafter's context for a request that gets it; of either kind otherwise (the
        target's K/V are the same)."""
        if not self.prefix_caching:
            return []
        find = self.pages.lookup if self.prefix_store is None else self.prefix_store.lookup
        hit = find(prompt, self._namespace(context))
        if not context and self.drafter is not None:
            other = find(prompt, b"ctx")
            hit = other if len(other) > len(hit) else hit
        return hit

    def _prefix_take(self, slot: int, job: "_Prefilling", hit: list[int]) -> None:
        """Start ``job``'s prefill after the cached pages ``hit``: attached to the slot's block table (pages
        layout) or copied into its caches (slot layout)."""
        self.prefix_counts["prompt_tokens"] += len(job.prompt)
        if not hit:
            return
        if self.prefix_store is None:
            self.pages.attach(slot, hit)
        else:
            self.pages.ensure(slot, len(hit) * self.pages.page_size)
            a, b, n = prefix.as_pairs(list(enumerate(hit)), self.pages.pages_per_slot)
            state = self.state
            cache, dcache = prefix.load_pages(self._prefix_pages, state.cache, state.dcache, np.int32(slot), a, b, n)
            self.state = state.replace(cache=cache, dcache=dcache)
        job.done = len(hit) * self.pages.page_size
        self.prefix_counts["cached_tokens"] += job.done

    def _publish(self, slot: int, tokens: Sequence[int], context: bool) -> None:
        """Keep ``slot``'s full pages of ``tokens`` (its committed tokens, from position 0) in the prefix cache:
        published in the pool (pages layout) or copied into the store (slot layout)."""
        if not self.prefix_caching:
            return
        ns = self._namespace(context)
        if self.prefix_store is None:
            self.pages.publish(slot, tokens, ns)
            return
        pairs = self.prefix_store.add(tokens, ns)
        if pairs:
            a, b, n = prefix.as_pairs(pairs, self.pages.pages_per_slot)
            self._prefix_pages = prefix.save_pages(self._prefix_pages, self.state.cache, self.state.dcache,
                                                   np.int32(slot), a, b, n)

    def _committed(self, slot: int) -> list[int]:
        """The tokens whose K/V ``slot``'s caches hold: its prompt and the output the target has processed."""
        c = self.requests[int(self.slot_request[slot])]
        return (c.prompt_ids + c.output_ids)[: int(self.slot_length[slot])]

    def prefix_cache_stats(self) -> dict[str, float]:
        """The prefix cache's counters: ``hit_rate`` (prompt tokens taken from the cache / prompt tokens
        admitted), ``cached_tokens``, ``prompt_tokens``, ``pages_in_use`` (pages held by requests),
        ``cached_pages`` (pages kept for later requests), ``evictions``.

        >>> from dspark_jax.models.llama import LlamaConfig, LlamaModel, init_random_weights
        >>> cfg = LlamaConfig.tiny()
        >>> e = Engine(LlamaModel(cfg, init_random_weights(cfg, jax.random.key(0))), None, "none",
        ...            EngineConfig(num_slots=2, capacity=128, block_size=4))
        >>> _ = e.run([list(range(1, 12))], 3)
        >>> _ = e.run([list(range(1, 12))], 3)  # the second request finds the first's prompt pages
        >>> e.prefix_cache_stats()["cached_tokens"], e.prefix_cache_stats()["prompt_tokens"]
        (8, 22)
        """
        c = self.prefix_counts
        store = self.prefix_store
        return {
            "hit_rate": c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
            "cached_tokens": c["cached_tokens"], "prompt_tokens": c["prompt_tokens"],
            "pages_in_use": self.pages.used_pages,
            "cached_pages": store.stored_pages if store is not None else self.pages.cached_pages,
            "evictions": store.evictions if store is not None else self.pages.evictions,
        }

    def _join(self, slot: int, job: "_Prefilling", logits) -> int:
        """A prefilled request's first token (from the prompt's last logits), then it decodes from ``slot`` (or
        ends there, its budget one token or its first token a stop). Returns 1, the token emitted."""
        rid, prompt = job.rid, job.prompt
        self._publish(slot, prompt, job.context)
        first, done, logprobs = self._first_token(slot, job, logits)
        if self.drafter is not None:
            self.admissions["context" if job.context else "no_context"] += 1
        self.requests[rid].prompt_logprobs = job.prompt_logprobs
        self._emit(rid, [first], logprobs)
        if done:
            self.slot_request[slot] = -1
            self.pages.release(slot)
            self.requests[rid].finished_by_stop = self._eos_ends(rid, first) or (
                self._stop_cut(rid, [first]) is not None) or self._grammar_done(rid)
            self._forget_stops(rid)
            self.finished_ids.append(rid)
        else:
            self.slot_length[slot] = len(prompt)
            self.slot_context[slot] = job.context
        return 1

    def _admission_context(self, load: int) -> bool:
        """Whether a request joining now gets the drafter's context: not where the learned cut-off
        (``drafter_off_after``) has the drafter off at the ``load`` (active requests) it will decode with:
        those active and those joining with it."""
        if self.drafter is None:
            return False
        if not self._may_drop_context:  # fixed and threshold policies always draft
            return True
        return not gate.drafter_off(self.cutoff, _pow2(load, self.cfg.num_slots))

    def _row_sampling(self, rid: int, sampling: SamplingParams) -> tuple[float, float, int, int]:
        """(temperature, top-p, seed, key id) of a request's slot."""
        temp = self.cfg.temperature if sampling.temperature is None else float(sampling.temperature)
        if sampling.seed is None:
            return temp, float(sampling.top_p), self.cfg.seed, rid
        return temp, float(sampling.top_p), int(sampling.seed), SEEDED_KEY_ID

    def _first_token(self, slot: int, job: "_Prefilling", logits) -> tuple[int, bool, list[TokenLogprobs] | None]:
        """Sample the first token and mark ``slot`` decoding on the device (or not: ``done``, the request ends
        with it); with its logprobs when the request asked for them."""
        rid = job.rid
        temp, top_p, seed, key_id = self._row_sampling(rid, job.sampling)
        matcher = self._matchers.get(rid)
        if matcher is not None:  # the grammar's first mask (the prompt's last chunk may still run meanwhile)
            t0 = time.perf_counter()
            words = np.empty(self._mask_words, np.int32)
            matcher.fill(words)
            mask, constrained = _put(words.view(np.uint32)), self._flag(True)
            self._first_mask_seconds += time.perf_counter() - t0
        else:
            mask, constrained = self._no_mask((self._mask_words,)), self._flag(False)
        want = job.sampling.logprobs is not None
        first, lp = _sample_first(logits, np.int32(key_id), np.int32(len(job.prompt)), np.float32(temp),
                                  np.float32(top_p), np.int32(seed), mask, constrained, self._flag(want))
        logprobs = None
        if want:
            first, lp = _to_host((first, lp))
            logprobs = [_token_logprobs(first, lp.chosen[0], lp.top_ids[0], lp.top[0], job.sampling.logprobs)]
        first = int(first)
        done = job.max_new <= 1 or self._eos_ends(rid, first) or self._stop_cut(rid, [first]) is not None
        if matcher is not None:
            done = matcher.advance([first]) is not None or done
        self.state = _admit_slot(self.state, np.int32(slot), np.int32(key_id), np.int32(first),
                                 np.int32(job.max_new), np.bool_(not done), np.int32(seed), np.float32(temp),
                                 np.float32(top_p), np.bool_(rid not in self._ignore_eos))
        return first, done, logprobs

    def _prefill_chunk(self, slot: int, job: "_Prefilling", take: int):
        """Prefill the next ``take`` prompt tokens of ``job`` into ``slot`` (target cache and, with the job's
        context, the drafter's), in chunks of `PREFILL_CHUNKS` sizes; returns the last chunk's logits [V]."""
        ids = np.asarray(job.prompt[job.done : job.done + take], np.int32)
        self.pages.ensure(slot, job.done + take)
        self._sync_block_tables()
        with_context = self.drafter is not None and job.context
        want = job.prompt_logprobs is not None
        done = 0
        for size, n in prefill_chunks(len(ids)):
            chunk = np.zeros(size, np.int32)
            chunk[:n] = ids[done : done + n]
            start = job.done + done
            # the prompt token after the chunk's last (0 at the prompt's end: the first output token's own)
            follow = np.int32(job.prompt[start + n] if start + n < len(job.prompt) else 0)
            args = (self._spec, self._inputs, self.state, chunk, np.int32(slot), np.int32(start), np.int32(n),
                    follow, self._flag(want))
            if with_context:
                logits, lp, self.state = _write_chunk_context(*args)
            else:
                logits, lp, self.state = _prefill_program(*args, write_context=self._flag(False))
            if want:  # entry p reports prompt token start + p + 1
                chosen, top_ids, top = _to_host(lp)
                n_report = min(n, len(job.prompt) - start - 1)
                job.prompt_logprobs += [_token_logprobs(job.prompt[start + p + 1], chosen[p], top_ids[p], top[p],
                                                        job.sampling.prompt_logprobs) for p in range(n_report)]
            done += n
        job.done += take
        return logits

    def _prefill(self, slot: int, rid: int, prompt: list[int], max_new: int, sampling: SamplingParams | None = None,
                 *, context: bool = True) -> None:
        """Prefill a whole prompt into ``slot`` and sample its first token, emitting nothing (warm-up: the
        programs of every chunk size)."""
        job = _Prefilling(rid, prompt, max_new, sampling or SamplingParams(), context)
        self._first_token(slot, job, self._prefill_chunk(slot, job, len(prompt)))

    def round_shapes(self) -> list[tuple[int, int, int]]:
        """Every (rows R, tokens T, grid width) a round of this engine can run: the verification programs (one
        each; width 1: no drafts). A round of R rows holds n requests, R // 2 < n <= R (any n >= 1 at the
        fewest rows); it verifies B tokens, n without drafts, up to n * (G + 1) with them.

        >>> from dspark_jax.models.llama import LlamaConfig, LlamaModel, init_random_weights
        >>> cfg = LlamaConfig.tiny()
        >>> Engine(LlamaModel(cfg, init_random_weights(cfg, jax.random.key(0))), None, "none",
        ...        EngineConfig(num_slots=4, capacity=64)).round_shapes()
        [(1, 1, 1), (2, 2, 1), (4, 4, 1)]
        """
        S, G = self.cfg.num_slots, self.G
        shapes, R = [], self._min_rows
        while True:
            fewest = 1 if R == self._min_rows else R // 2 + 1
            plain = sorted({bucket_for(b) for b in range(fewest, R + 1)})
            shapes += [(R, T, 1) for T in plain]
            if self.drafter is not None:  # with drafts: B from fewest + 1 to R * (G + 1)
                spec = sorted({bucket_for(b) for b in range(fewest + 1, R * (G + 1) + 1)})
                shapes += [(R, T, _grid_width(R, T, G, self._min_rows)) for T in spec]
            if R >= S:
                return shapes
            R = min(2 * R, S)

    def warm_up(self, max_prompt_tokens: int, *, sampled: bool | None = None) -> int:
        """Compile every program a run with prompts up to ``max_prompt_tokens`` can need, so that no round
        compiles afterwards: the prefill chunks and the first token, admission, and per row bucket the draft
        program and one verification program per token bucket (`round_shapes`). Contexts, temperatures and the
        drafter's context are arrays: one program serves them all. Returns the number of round shapes compiled.
        Leaves the engine's requests and counters untouched.

        ``sampled``: kept for callers; sampled and greedy requests share every program."""
        del sampled
        if not self.idle():
            raise ValueError("warm_up: the engine must be idle")
        # prefill chunks and the first-token sampler, on slot 0 (then released)
        for size in sorted({size for n in range(1, max_prompt_tokens + 1) for size, _ in prefill_chunks(n)}):
            self._prefill(0, 0, [1] * min(size, max_prompt_tokens), 1)
        self.state = _free_slot(self.state, np.int32(0))
        self.pages.release(0)
        self._sync_block_tables()
        if self.prefix_store is not None:  # the prefix store's copies (nothing copied: a count of 0)
            a, b, n = prefix.as_pairs([], self.pages.pages_per_slot)
            self._prefix_pages = prefix.save_pages(self._prefix_pages, self.state.cache, self.state.dcache,
                                                   np.int32(0), a, b, n)
            cache, dcache = prefix.load_pages(self._prefix_pages, self.state.cache, self.state.dcache, np.int32(0),
                                              a, b, n)
            self.state = self.state.replace(cache=cache, dcache=dcache)
        scale = self._time_scale_dev
        drafts: dict[int, DraftOut | None] = {}
        gated: set[int] = set()
        shapes = self.round_shapes()
        for R, T, per_slot in shapes:
            if R not in drafts:
                drafts[R] = (_draft_and_schedule(self._round_spec(R), self._inputs, self.state, scale)
                             if self.drafter is not None else None)
            d = drafts[R] if per_slot > 1 else None
            conf, drafted = self._round_conf(d, R)
            P = self.G + 1 if per_slot > 1 else 2
            self.state, _ = _verify_and_commit(self._round_spec(R, T, per_slot), self._inputs, self.state, d, conf,
                                               drafted, scale, drafting=self._flag(False),
                                               masks=self._no_mask((R, P, self._mask_words)),
                                               constrained=self._flag(False), logprobs=self._flag(False))
            if self.cost is not None and R not in gated:
                gated.add(R)
                _after_round(self._round_spec(R), self._inputs, scale, self.state, np.int32(R), np.int32(0),
                             np.int32(R), drafted)
        # The drafter gate's state starts afresh (warm-up rounds had no requests).
        self.state = self.state.replace(gate=self._init_gate())
        self._gate_closed = False
        jax.block_until_ready(self.state)
        return len(shapes)

    # ------------------------------------------------------------------------------------------------ rounds
    def step(self) -> RoundStats | None:
        """Admit what fits, then run one round over the active requests. None when idle."""
        t0 = time.perf_counter()
        compiles = compile_count()
        finished_before = len(self.finished_ids)
        was_active = self.slot_request >= 0
        was_active[list(self.prefilling)] = False
        self._prefilled = 0
        self._first_mask_seconds = 0.0
        total = self._admit()
        active = self.slot_request >= 0
        active[list(self.prefilling)] = False  # still prefilling: not decoding yet
        active_slots = np.flatnonzero(active)
        n = len(active_slots)
        if n == 0:
            return None
        t_round = time.perf_counter()
        S, G = self.cfg.num_slots, self.G
        for s in active_slots:  # pages for what this round may write: the anchor and up to G drafts
            self.pages.ensure(int(s), min(int(self.slot_length[s]) + G + 1, self.cfg.capacity))
        self._sync_block_tables()
        R = max(_pow2(n, S), self._min_rows)
        longest = int(self.slot_length[active_slots].max())
        # The drafter's context: every active request has it (the gate decides), none has it (plain decoding's
        # rounds: nothing of the drafter runs) or some have it (the drafter waits, contexts are written).
        context = self.slot_context[active_slots]
        drafting = self.drafter is not None and bool(context.any())
        can_draft = drafting and bool(context.all())
        scale = self._time_scale_dev
        # The last round decided this round's gate for the same requests; a new request reopens the question.
        known_closed = (self._gate_closed and not (active & ~was_active).any()) or not can_draft
        rows = _rows_host(active)[:n]
        # constrained rows: their grammars' states, in row order (None: unconstrained)
        matchers = [self._matchers.get(int(self.slot_request[s])) for s in rows]
        constrained = any(m is not None for m in matchers)
        mask_seconds, forbidden, masks = 0.0, 0, None
        if drafting and not known_closed:
            d = _draft_and_schedule(self._round_spec(R), self._inputs, self.state, scale)
            if constrained:  # the masks after the output so far, while the drafter runs
                t_mask = time.perf_counter()
                masks = np.empty((R, G + 1, self._mask_words), np.int32)
                grammar.fill_first(matchers, masks)
                mask_seconds += time.perf_counter() - t_mask
                # what the host needs: the token bucket, and the drafts the masks follow
                B, lengths_all, drafts_host = _to_host((d.batch_tokens, d.lengths, d.tokens))
                t_mask = time.perf_counter()
                ok = grammar.fill_drafts(matchers, drafts_host, lengths_all, masks)
                mask_seconds += time.perf_counter() - t_mask
                # the target runs on the allowed drafts only; a forbidden one is still rejected by the acceptance
                # rule (a sampled row then draws the residual), so a round that cut every draft but kept such a
                # rejection verifies with the drafts' program at its smallest batch
                target_len, accept_len = grammar.allowed_prefix(lengths_all, ok)
                forbidden = int(np.sum(lengths_all[:n] - target_len[:n]))
                B = n + int(np.sum(target_len[:n]))
                if B == n and np.any(accept_len[:n] > 0):
                    B = n + 1
            else:  # what the host needs: the token bucket
                B, lengths_all = _to_host((d.batch_tokens, d.lengths))
            B = int(B)
        else:
            d, B, lengths_all = None, n, np.zeros(R, np.int64)
        T = bucket_for(B)
        per_slot = _grid_width(R, T, G, self._min_rows) if B > n else 1
        P = G + 1 if B > n else 2  # positions a row's masks cover: the drafts' and the anchor's, or the anchor's
        if constrained and masks is None:
            t_mask = time.perf_counter()
            masks = np.empty((R, P, self._mask_words), np.int32)
            grammar.fill_first(matchers, masks)
            mask_seconds += time.perf_counter() - t_mask
        if constrained:
            mask_arr, mask_flag = _put(np.ascontiguousarray(masks[:, :P]).view(np.uint32)), self._flag(True)
        else:
            mask_arr, mask_flag = self._no_mask((R, P, self._mask_words)), self._flag(False)
        conf, drafted_arr = self._round_conf(d, R)
        # logprobs are computed (and read) only in a round where some request asked for them
        want = bool(self._logprobs) and any(int(self.slot_request[s]) in self._logprobs for s in active_slots)
        self.state, out = _verify_and_commit(self._round_spec(R, T, per_slot), self._inputs, self.state,
                                             d if B > n else None, conf, drafted_arr, scale,
                                             drafting=self._flag(drafting), masks=mask_arr, constrained=mask_flag,
                                             logprobs=self._flag(want))
        after = (np.float32(np.nan), np.True_, np.float32(np.nan))
        if self.cost is not None and can_draft:  # the next round's gate, decided on the device
            after = _after_round(self._round_spec(R), self._inputs, scale, self.state, np.int32(n),
                                 np.int32(longest), np.int32(B), drafted_arr)
        # the round's one blocking read (the draft program's token count aside)
        (emitted, counts, finished, accepted, new_len, lp), (predicted, next_gate, gain), drafted = _to_host(
            (out if want else out._replace(logprobs=None), after, d.drafted if d is not None else np.False_))
        drafted = bool(drafted)
        self._gate_closed = not bool(next_gate)
        if self._may_drop_context:
            self.cutoff, off = gate.cutoff_update(self.cutoff, self.gate_cfg, R, n, n - int(np.sum(finished[:n])),
                                                  float(gain), drafting, requests=self.slot_request[active_slots])
            if off:  # the active requests drop their context: plain decoding's programs from the next round
                self.slot_context[:] = False
                self.drafter_offs.append((len(self.rounds), R))
        if compile_count() == compiles:
            self._observe_round(drafted, time.perf_counter() - t_round, float(predicted))
        lengths = lengths_all[:n]
        row_requests = np.asarray([self.slot_request[s] for s in rows], np.int64)
        for i, s in enumerate(rows):
            rid = int(self.slot_request[s])
            tokens = emitted[i, : counts[i]]
            cut = self._stop_cut(rid, tokens)  # the request's own stop ids end it here
            if cut is not None:
                tokens = tokens[:cut]
            if matchers[i] is not None:  # the grammar takes the tokens; once it is finished, the request ends
                t_mask = time.perf_counter()
                done = matchers[i].advance(tokens)
                mask_seconds += time.perf_counter() - t_mask
                if done is not None:
                    tokens, cut = tokens[:done], done
            top_n = self._logprobs.get(rid)
            self._emit(rid, tokens, None if top_n is None else [
                _token_logprobs(t, lp.chosen[i, j], lp.top_ids[i, j], lp.top[i, j], top_n)
                for j, t in enumerate(tokens)])
            total += len(tokens)
            self.slot_length[s] = new_len[i]
            if finished[i] or cut is not None:
                self._publish(int(s), self._committed(int(s)), bool(self.slot_context[s]))
                self.requests[rid].finished_by_stop = self._eos_ends(rid, tokens[-1]) or cut is not None
                self._forget_stops(rid)
                self.finished_ids.append(rid)
                if finished[i]:
                    self.slot_request[s] = -1
                    self.pages.release(int(s))
                else:  # still active on the device
                    self._release(int(s))
        seconds = time.perf_counter() - t0
        record = self.record_confidences and d is not None
        conf = _to_host(d.conf)[:n] if record else None
        conf_logits = _to_host(d.conf_logits)[:n] if record else None
        stats = RoundStats(active=n, scheduled=lengths.astype(np.int64), accepted=accepted[:n].astype(np.int64),
                           emitted=total, batch_tokens=B, padded_tokens=T, seconds=seconds,
                           compiled=compile_count() != compiles, confidences=conf, confidence_logits=conf_logits,
                           finished=len(self.finished_ids) - finished_before, prefilled=self._prefilled,
                           drafted=drafted, context=longest, requests=row_requests,
                           constrained=sum(m is not None for m in matchers),
                           mask_seconds=mask_seconds + self._first_mask_seconds, forbidden_drafts=forbidden)
        if self.record_tokens:
            stats.draft_tokens = np.asarray(d.tokens)[:n] if d is not None else None
            stats.emitted_tokens = [emitted[i, : counts[i]].tolist() for i in range(n)]
        self.rounds.append(stats)
        return stats

    def _round_conf(self, d: DraftOut | None, R: int):
        """(confidences [R, G], drafted []) for the verify program: the draft program's, or zeros and False
        for a round that skipped it; (None, None) for an engine without a drafter."""
        if self.drafter is None:
            return None, None
        if d is not None:
            return d.conf, d.drafted
        if R not in self._no_conf:  # host arrays put on the device: nothing to compile
            # placed as the draft program places its outputs (replicated over a mesh), so that a plain round
            # after a draft program and one without it share one verification program
            where = None if self.mesh is None else jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
            self._no_conf[R] = jax.device_put((np.zeros((R, self.G), np.float32), np.False_), where)
        return self._no_conf[R]

    def _no_mask(self, shape: tuple[int, ...]) -> jax.Array:
        """A uint32 mask of ``shape`` on the device for a program whose ``constrained`` flag is False (never read:
        made once per shape, so an unconstrained round computes and sends no mask)."""
        if shape not in self._no_masks:  # host arrays put on the device: nothing to compile
            self._no_masks[shape] = _put(np.zeros(shape, np.uint32))
        return self._no_masks[shape]

    def _flag(self, value: bool) -> jax.Array:
        """A bool [] on the device, made once (a host bool is put on the device at every call)."""
        if value not in self._flag_arrays:  # host arrays put on the device: nothing to compile
            self._flag_arrays[value] = _put(np.bool_(value))
        return self._flag_arrays[value]

    def _observe_round(self, drafted: bool, seconds: float, predicted: float) -> None:
        """Fold a round's measured time into the correction of the cost model (`gate.observe_round`)."""
        self.round_times = gate.observe_round(self.round_times, self.gate_cfg, drafted, seconds, predicted)

    @property
    def round_times(self) -> gate.RoundTimes:
        """The measured correction of the cost model's round times the gate reads (`gate.RoundTimes`;
        learned with ``calibrate_times``, settable: a correction learned elsewhere)."""
        return self._round_times

    @round_times.setter
    def round_times(self, value: gate.RoundTimes) -> None:
        self._round_times = value
        self._time_scale_dev = _put(np.asarray(gate.time_scale(value), np.float32))  # what the programs read

    def reset_time_scale(self) -> None:
        """Forget the measured corrections of the cost model (trust the table again)."""
        self.round_times = gate.RoundTimes()

    @property
    def time_scale(self) -> tuple[float, float]:
        """Measured / predicted round time, (drafting rounds, plain rounds): (host x drafting excess, host);
        (1, 1) until rounds are seen (`gate.time_scale`)."""
        return gate.time_scale(self.round_times)

    def idle(self) -> bool:
        return not self.pending and not (self.slot_request >= 0).any()

    def run(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Completion]:
        """Submit every prompt, run until all finish, return completions in order."""
        ids = [self.submit(p, max_new_tokens) for p in prompts]
        while not self.idle():
            self.step()
        return [self.requests[i] for i in ids]

    # ------------------------------------------------------------------------------------------------ summary
    def summary(self) -> dict[str, float]:
        """Totals over the rounds run so far (for the generate command and the benchmark)."""
        if not self.rounds:  # every request ended at admission (a budget of one token): no round ran
            return {"rounds": 0, "compiled_rounds": 0, "steady_seconds": 0.0, "emitted_tokens": 0,
                    "tokens_per_s": float("nan"), "mean_active": 0.0, "drafts_per_request": 0.0, "accept_len": 1.0,
                    "rejected_share": 0.0, "mean_batch_tokens": 0.0, "drafted_share": 0.0}
        sched = np.concatenate([r.scheduled for r in self.rounds])
        acc = np.concatenate([r.accepted for r in self.rounds])
        steady = [r for r in self.rounds if not r.compiled]
        secs = sum(r.seconds for r in steady)
        emitted = sum(r.emitted for r in steady)
        return {
            "rounds": len(self.rounds),
            "compiled_rounds": len(self.rounds) - len(steady),
            "steady_seconds": secs,
            "emitted_tokens": sum(r.emitted for r in self.rounds),
            "tokens_per_s": emitted / secs if secs > 0 else float("nan"),
            "mean_active": float(np.mean([r.active for r in self.rounds])),
            "drafts_per_request": float(sched.mean()),
            "accept_len": float(np.mean(acc + 1)),
            "rejected_share": float(1 - acc.sum() / sched.sum()) if sched.sum() > 0 else 0.0,
            "mean_batch_tokens": float(np.mean([r.batch_tokens for r in self.rounds])),
            "drafted_share": float(np.mean([r.drafted for r in self.rounds])),
            "prefix_hit_rate": self.prefix_cache_stats()["hit_rate"],
        }


def _to_host(tree):
    """NumPy copies of device arrays, gathered across processes under ``jax.distributed``."""
    from dspark_jax.sharding import to_host  # noqa: PLC0415

    return to_host(tree)


def _put(tree):
    """Host arrays onto the device (`jax.device_put`: unlike ``jnp.asarray``, nothing compiles)."""
    return jax.device_put(tree)


def _token_logprobs(token, chosen, top_ids, top, n: int) -> TokenLogprobs:
    """A token's `TokenLogprobs` from one position's host arrays, keeping the ``n`` most likely alternatives."""
    return TokenLogprobs(int(token), float(chosen), tuple((int(i), float(v)) for i, v in zip(top_ids[:n], top[:n])))


def _rows_host(active: np.ndarray) -> np.ndarray:
    """Host twin of the device row order: active slots first (ascending), then the others."""
    return np.argsort(~active, kind="stable")


# ---------------------------------------------------------------------------------------------------- jitted parts


@dataclasses.dataclass(frozen=True)
class RoundSpec:
    """The static part of the engine's programs (hashable: one compiled program per value).

    The engine's settings (target config, block, capacity, policy kind, gate settings, whether the cache's slots
    are split over devices) and the shape of a round: ``rows`` R (active slots first, padded to a power of two),
    ``tokens`` T (the packed verification batch, a `BUCKETS` size; 0 for the draft program) and ``per_slot``
    (the verification grid's width: 1 for a round without drafts, else `_grid_width`). Everything else a
    program reads is an array: contexts (the attention reads the caches in parts up to the longest,
    `llama.over_context`), temperatures (a round with no sampled row skips the sampling work under
    ``lax.cond``), which requests have the drafter's context.
    """

    cfg: LlamaConfig
    block: int
    capacity: int
    policy: Policy
    gate: gate.GateConfig
    sharded_slots: bool = False
    rows: int = 0
    tokens: int = 0
    per_slot: int = 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RoundInputs:
    """What the programs read and never write, in one pytree built once per engine: the target's weights, the
    drafter (graph and state; None without one), its LM head over the draft vocabulary [D, W], the STS sets
    (temperatures [K], sets [K, G], offsets [K, G]), the steps/s table [N], the cost model's arrays (or None),
    the draft vocabulary's ids [W] (None: the full vocabulary), the stop ids and the policy's number."""

    weights: Any
    graph: Any
    dstate: Any
    head_w: Any
    temps: Any
    sps: jax.Array
    cost: Any
    draft_vocab: Any
    stop_ids: jax.Array
    policy_value: jax.Array


def _grid_width(R: int, T: int, G: int, min_rows: int) -> int:
    """The verification grid's width of a round with drafts: a round of R rows holds more than R // 2 requests
    (all R when R is the engine's fewest rows, ``min_rows``: then at least one), so its longest row holds at
    most T - that + 1 of the T tokens: the width follows the token bucket without a program per width.

    >>> [_grid_width(1, t, 7, 1) for t in (2, 4, 8)], _grid_width(4, 4, 7, 1), _grid_width(16, 64, 7, 1)
    ([2, 4, 8], 2, 8)
    """
    fewest = 1 if R == min_rows else R // 2 + 1
    return grid_bucket(max(2, min(T - fewest + 1, G + 1)), G + 1)


def _block_tables(cache):
    """The block table of a paged target cache (the drafter's pages follow it), else None."""
    return cache.block_tables if isinstance(cache, PagedKVCache) else None


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def _prefill_program(spec: RoundSpec, inputs: RoundInputs, state: EngineState, chunk, slot, start, n_valid,
                     follow, prompt_logprobs, write_context):
    """Prefill one chunk of a prompt (`llama.prefill`, chunk [P] static) into ``slot`` and, where
    ``write_context`` (bool []), the drafter's context of its tokens. Where ``prompt_logprobs`` (bool []), also
    the prompt's raw logprobs: entry p reports the token after chunk position p (``chunk[p + 1]``, and ``follow``
    (int32 []) after the last valid one), from the LM head over the chunk's final hidden states, which the
    prefill holds anyway (skipped under ``lax.cond`` otherwise: zeros). Returns the last valid token's logits
    [V], `Logprobs` [P] and the state."""
    logits, extras, cache = prefill(inputs.weights, state.cache, chunk, slot, start, n_valid, spec.cfg,
                                    spec.sharded_slots)
    P = chunk.shape[0]
    k = min(MAX_LOGPROBS, spec.cfg.vocab_size)

    def chunk_logprobs():
        nxt = jnp.where(jnp.arange(P) == n_valid - 1, follow, jnp.roll(chunk, -1))  # [P]
        every = logits_from_hidden(inputs.weights, extras.final_hidden)  # [P, V]
        return Logprobs(*logprobs_at(every, jnp.arange(P), nxt, k=k))

    lp = jax.lax.cond(prompt_logprobs, chunk_logprobs,
                      lambda: Logprobs(jnp.zeros((P,), jnp.float32), jnp.zeros((P, k), jnp.int32),
                                       jnp.zeros((P, k), jnp.float32)))
    dcache = state.dcache
    if inputs.dstate is not None:
        drafter = nnx.merge(inputs.graph, inputs.dstate)
        n = chunk.shape[0]
        idx = jnp.arange(n, dtype=jnp.int32)
        dcache = jax.lax.cond(  # (a cond passes the cache through in place: no copy)
            write_context, lambda dc: dr.write_context(drafter, dc, extras.taps, jnp.full((n,), slot, jnp.int32),
                                                       start + idx, idx < n_valid, _block_tables(cache)),
            lambda dc: dc, dcache)
    return logits, lp, state.replace(cache=cache, dcache=dcache)


def _write_chunk_context(spec: RoundSpec, inputs: RoundInputs, state: EngineState, chunk, slot, start, n_valid,
                         follow, prompt_logprobs):
    """A prompt chunk of a request with the drafter's context: `_prefill_program` writing that context too (the
    same compiled program as a chunk without it)."""
    return _prefill_program(spec, inputs, state, chunk, slot, start, n_valid, follow, prompt_logprobs,
                            write_context=np.True_)


@jax.jit
def _sample_first(logits, request, position, temperature, top_p, seed, mask, constrained, logprobs):
    """The first token after prefill: argmax at temperature 0, else a draw from ``top_p(softmax(logits / T))``
    with the request's key (``softmax(logits / T)`` itself at top-p 1); with a grammar (``constrained``), the
    logits masked by its packed mask (uint32 [W]) first; with its raw `Logprobs` [1] (of the logits before any
    mask) where ``logprobs`` (bool []; zeros otherwise)."""
    raw = logits
    logits = jax.lax.cond(constrained, lambda lg: grammar.apply_mask(lg, mask), lambda lg: lg, logits)

    def draw():
        key = _key(seed, 0, request[None], position[None])[0]
        scaled = logits.astype(jnp.float32) / temperature  # [V]
        law = _target_law(scaled[None, None], top_p[None])[0, 0]
        return categorical(key[None], jnp.where(top_p < 1, safe_log(law), scaled)[None])[0].astype(jnp.int32)

    token = jax.lax.cond(temperature > 0, draw, lambda: jnp.argmax(logits).astype(jnp.int32))
    k = min(MAX_LOGPROBS, logits.shape[-1])
    lp = jax.lax.cond(logprobs, lambda: Logprobs(*logprobs_at(raw[None], jnp.zeros(1, jnp.int32), token[None], k=k)),
                      lambda: Logprobs(jnp.zeros((1,), jnp.float32), jnp.zeros((1, k), jnp.int32),
                                       jnp.zeros((1, k), jnp.float32)))
    return token, lp


def _target_law(scaled_logits, top_p):
    """The target's sampling law per row: ``top_p(softmax(scaled_logits))`` for ``scaled_logits`` [R, N, V]
    (already divided by the row's temperature) and ``top_p`` [R]; the nucleus filter runs only when some
    row asks for it (a sort over the vocabulary)."""
    probs = jax.nn.softmax(scaled_logits, axis=-1)  # [R, N, V]
    cut = jnp.broadcast_to(top_p[:, None], probs.shape[:2])  # [R, N]
    return jax.lax.cond(jnp.any(top_p < 1), lambda p: verify.top_p_filter(p, cut), lambda p: p, probs)


@functools.partial(jax.jit, donate_argnames=("state",))
def _free_slot(state, slot):
    """Mark ``slot`` inactive (a cancelled or stopped request); the next admission overwrites the rest."""
    return state.replace(active=state.active.at[slot].set(False))


@functools.partial(jax.jit, donate_argnames=("state",))
def _admit_slot(state, slot, request, first, max_new, live, seed, temperature, top_p, eos_stops):
    return state.replace(
        eos_stops=state.eos_stops.at[slot].set(eos_stops),
        anchor=state.anchor.at[slot].set(first),
        active=state.active.at[slot].set(live),
        request=state.request.at[slot].set(request),
        seed=state.seed.at[slot].set(seed),
        temperature=state.temperature.at[slot].set(temperature),
        top_p=state.top_p.at[slot].set(top_p),
        generated=state.generated.at[slot].set(1),
        max_new=state.max_new.at[slot].set(max_new),
        conf_hist=state.conf_hist.at[:, slot].set(gate.conditional(state.gate.global_survival)),
        gate=gate.admit(state.gate, slot),
    )


def _device_rows(active, R):
    """Active slots first (stable), the first R of them; row_valid marks real requests."""
    rows = jnp.argsort(~active, stable=True)[:R].astype(jnp.int32)
    return rows, active[rows]


def policy_lengths(policy: Policy, value, conf, hist, sps, row_valid, G: int):
    """A drafting policy's verification lengths, before the caps the engine adds (budget, capacity).

    Args:
      policy: a drafting `Policy` (static by its kind).
      value: float32 [] the policy's number (K of ``fixed:K``, C of ``threshold:C``; traced).
      conf: float32 [R, G] calibrated per-token confidences of this round's drafts.
      hist: float32 [R, G] the confidences of two rounds earlier (``dspark-async``'s capacity).
      sps: float32 [N] steps/s by batch tokens; row_valid: bool [R] rows holding a request; G: the block.
    Returns:
      int32 [R] drafts to verify per row.

    >>> policy_lengths(parse_policy("threshold:0.5"), jnp.float32(0.5), jnp.array([[0.9, 0.4, 0.9]]),
    ...                jnp.ones((1, 3)), jnp.ones(8), jnp.array([True]), 3).tolist()
    [1]
    """
    if policy.kind == "fixed":
        return jnp.full(row_valid.shape, jnp.minimum(jnp.round(value).astype(jnp.int32), G), jnp.int32)
    if policy.kind == "threshold":
        return verify.leading_true(conf >= value, jnp.full(row_valid.shape, G, jnp.int32))
    if policy.kind == "dspark":
        return scheduler.schedule(conf, sps, active=row_valid).lengths
    if policy.kind == "dspark-async":
        k = scheduler.capacity(hist, sps, active=row_valid)
        return scheduler.top_k_lengths(conf, k, active=row_valid)
    raise ValueError(f"policy {policy} does not draft")


@functools.partial(jax.jit, static_argnames=("spec",))
def _after_round(spec: RoundSpec, inputs: RoundInputs, time_scale, state: EngineState, n_active, longest,
                 batch_tokens, drafted):
    """After a round, on the committed state: the cost model's time for the round that just ran (drafting or
    plain, with ``n_active`` requests whose longest held ``longest`` tokens; the host compares it with the
    measured time) and the drafter gate of the next round for the requests still active (`gate.decide`, so
    the host can skip the draft program): (predicted seconds, opens, gain). One small program per row bucket
    (``spec.rows``), run where the cost model prices the next round."""
    cost = inputs.cost
    n_active = jnp.maximum(n_active, 1)
    sps = sps_from_cost(cost, n_active, longest)
    predicted = jnp.where(drafted, 1.0 / sps[jnp.clip(scheduler.padded_batch(batch_tokens, BUCKETS), 0,
                                                      sps.shape[0] - 1)],
                          1.0 / plain_sps_from_cost(cost, n_active, longest)).astype(jnp.float32)
    rows, row_valid = _device_rows(state.active, spec.rows)
    opens, _, gain = gate.decide(state.gate, spec.gate, cost, rows, row_valid, state.cache.lengths[rows], time_scale)
    return predicted, opens, gain


@functools.partial(jax.jit, static_argnames=("spec",))
def _draft_and_schedule(spec: RoundSpec, inputs: RoundInputs, state: EngineState, time_scale) -> DraftOut:
    """Draft a block for the first R rows, compute calibrated confidences, apply the policy.

    ``spec.policy`` is static by its kind only; its number (K of ``fixed:K``, C of ``threshold:C``) is the
    traced ``inputs.policy_value``, so every K (every C) runs the same compiled program. Each row drafts at its
    own temperature (one-hot at 0; a round whose rows are all greedy skips the softmax and the draw).

    With a cost model, the ``dspark`` policies first decide whether drafting pays at all this round
    (`gate.decide`, from each request's survival averages over its earlier drafted rounds, which
    cannot depend on this round's drafts). A busy engine whose drafts would not pay for the drafter skips it
    (a `lax.cond`), drafting now and then to refresh the averages.
    """
    drafter = nnx.merge(inputs.graph, inputs.dstate)
    G, R, capacity = spec.block, spec.rows, spec.capacity
    W = inputs.head_w.shape[1]
    embed = inputs.weights.embed
    rows, row_valid = _device_rows(state.active, R)
    ctx_len = state.cache.lengths[rows]
    row_t = jnp.where(row_valid, state.temperature[rows], 0.0)  # [R]; padding rows greedy
    opens, sps = jnp.bool_(True), inputs.sps
    if inputs.cost is not None:  # (dspark policies) this round's curve: draft(R, L) + verify(R, B, L), and the gate
        opens, sps, _ = gate.decide(state.gate, spec.gate, inputs.cost, rows, row_valid, ctx_len, time_scale)

    def run_drafter():
        if R == state.active.shape[0]:  # every slot: its cache read in place, the small outputs put in row order
            # (a gather of the caches by row would be an all-reduce of them across data-parallel groups)
            lens = state.cache.lengths
            keys = _key(state.seed, 1, state.request, lens)  # each request's keys, as in row order
            # idle slots see no context (their stale lengths would lengthen the reads) and draft greedily
            out = dr.draft(drafter, state.dcache, None, jnp.where(state.active, lens, 0), state.anchor, keys,
                           jnp.where(state.active, state.temperature, 0.0), embed, inputs.head_w,
                           block_tables=_block_tables(state.cache))
            return tuple(x[rows] for x in out)
        keys = _key(state.seed[rows], 1, state.request[rows], ctx_len)
        return dr.draft(drafter, state.dcache, rows, jnp.where(row_valid, ctx_len, 0), state.anchor[rows], keys,
                        row_t, embed, inputs.head_w, block_tables=_block_tables(state.cache))

    def skip():
        return (jnp.zeros((R, G), jnp.int32), jnp.zeros((R, G, W), jnp.float32), jnp.zeros((R, G), jnp.float32))

    tokens, probs, conf_logits = jax.lax.cond(opens, run_drafter, skip)
    at, sets, offsets = inputs.temps  # [K] sampling temperatures the STS sets were fitted at, [K, G], [K, G]
    conf = calibration.apply_sts(conf_logits, calibration.sts_for_rows(at, sets, row_t),
                                 calibration.sts_for_rows(at, offsets, row_t))  # [R, G]
    hist = state.conf_hist[1][rows]
    lengths = jnp.where(row_valid & opens,
                        policy_lengths(spec.policy, inputs.policy_value, conf, hist, sps, row_valid, G), 0)
    if spec.gate.fill and spec.policy.kind in ("dspark", "dspark-async"):  # the padded batch's free room (lossless)
        lengths = scheduler.fill_to_bucket(conf, lengths, BUCKETS, active=row_valid & opens)
    # Caps that never look at the drafts: the request's remaining budget and the slot's capacity.
    remaining = state.max_new[rows] - state.generated[rows]
    lengths = jnp.clip(lengths, 0, jnp.minimum(remaining - 1, capacity - ctx_len - 1))
    lengths = jnp.where(row_valid, lengths, 0).astype(jnp.int32)
    batch = jnp.sum(jnp.where(row_valid, 1 + lengths, 0)).astype(jnp.int32)
    return DraftOut(tokens, probs, conf, conf_logits, lengths, batch, opens)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def _verify_and_commit(spec: RoundSpec, inputs: RoundInputs, state: EngineState, d: DraftOut | None, conf,
                       drafted, time_scale, *, drafting, masks, constrained, logprobs) -> tuple[EngineState, RoundOut]:
    """Pack the scheduled tokens, verify them with one target pass, accept, commit, emit.

    With a drafter (``inputs.dstate``), ``conf`` [R, G] and ``drafted`` [] are the round's calibrated
    confidences and whether the drafter ran (zeros and False when the host skipped the draft program), and
    ``drafting`` (bool []) says whether some request of the round has the drafter's context: then its context
    cache is written for every committed token, drafted round or not, and the gate's bookkeeping
    (`gate.update`) follows the round; else the round is plain decoding's (both skipped under ``lax.cond``).
    Without a drafter, ``conf`` and ``drafted`` are None (``drafting`` is not read). ``spec.per_slot`` is the verification grid's width:
    with the drafts ``d``, `_grid_width` of the round's shape (the attention's reads grow with it), or 1 with
    ``d = None`` for a round that scheduled no drafts (a plain round then costs what plain decoding costs).
    Each row accepts by its own rule: argmax at temperature 0, `verify.speculative_accept` against
    ``top_p(softmax(logits / T))`` otherwise (computed only when some row samples).

    Grammars (``constrained``, bool []: some row has one): ``masks`` uint32 [R, P, W] holds each row's packed
    token mask at each of its positions (P = G + 1 with drafts, 2 without; all ones for unconstrained rows; not
    read when ``constrained`` is False). The target's logits at every verified position are masked before the
    argmax and the sampling law, so acceptance, residual and bonus all follow the masked law. A row's target pass
    covers only its drafts up to the first one its grammar forbids (`grammar.device_leading_allowed`, the host's
    count too, which chose T); that draft still enters the acceptance rule, which rejects it with certainty.
    Where ``logprobs`` (bool []), the emitted tokens' raw logprobs and top alternatives (`sampling.logprobs_at`
    over the packed logits, gathered to rows: `Logprobs` [R, Gv + 1]); zeros otherwise (skipped under
    ``lax.cond``). They only read the logits: the tokens are the same either way.
    """
    R, T, G, per_slot = spec.rows, spec.tokens, spec.block, spec.per_slot
    rows, row_valid = _device_rows(state.active, R)
    ctx_len = state.cache.lengths[rows]  # [R] anchor positions
    anchors = state.anchor[rows]
    plain = per_slot == 1  # no row verifies a draft: unpack one position per row
    if plain != (d is None):
        raise ValueError("per_slot == 1 exactly when no drafts are passed")
    Gv = 1 if plain else G
    if not plain:
        drafts, lengths = d.tokens, d.lengths
        # the target's drafts (up to the first forbidden one) and the acceptance rule's (that one too)
        ok = jax.lax.cond(constrained, lambda: grammar.device_leading_allowed(masks, drafts, lengths),
                          lambda: lengths)
        target_len, accept_len = jnp.minimum(lengths, ok), jnp.minimum(lengths, ok + 1)
    else:
        drafts, lengths = jnp.zeros((R, Gv), jnp.int32), jnp.zeros((R,), jnp.int32)
        target_len = accept_len = lengths
    # ---- pack: row r contributes [anchor, x1..x_l] at positions ctx_len[r] + j
    n_tok = jnp.where(row_valid, 1 + target_len, 0)  # [R]
    ends = jnp.cumsum(n_tok)
    starts = ends - n_tok
    t = jnp.arange(T, dtype=jnp.int32)
    tok_row = jnp.clip(jnp.searchsorted(ends, t, side="right"), 0, R - 1).astype(jnp.int32)  # [T]
    col = t - starts[tok_row]
    valid = t < ends[-1]
    seq = jnp.concatenate([anchors[:, None], drafts], axis=1)  # [R, Gv + 1]
    tokens = seq[tok_row, jnp.clip(col, 0, Gv)]
    slots = rows[tok_row]
    positions = jnp.where(valid, ctx_len[tok_row] + col, 0)
    # R rows of all S slots: the grid reads every slot's cache in place; fewer: only the rows' caches (gathered)
    row_slots = None if R == state.cache.num_slots else rows
    logits, extras, cache = forward_packed(inputs.weights, state.cache, tokens, slots, positions, valid, spec.cfg,
                                           per_slot, row_slots)
    raw_logits = logits  # what logprobs report: the target's law before any grammar
    # grammars: each packed token's logits masked by its row's mask at its position ([T, W] gathered, then bits)
    logits = jax.lax.cond(constrained, lambda lg: grammar.apply_mask(lg, masks[tok_row, jnp.clip(col, 0, Gv)]),
                          lambda lg: lg, logits)
    # ---- unpack to rows: logits of [anchor, x1..x_Gv] -> [R, Gv + 1, V]
    idx = jnp.clip(starts[:, None] + jnp.arange(Gv + 1)[None, :], 0, T - 1)
    # argmax over the T packed tokens, then gathered into rows: not over R x (Gv + 1) padded logit rows
    n_acc, nxt = verify.greedy_accept_tokens(drafts, first_argmax(logits)[idx], accept_len)
    temp = state.temperature[rows]  # [R]
    sampled = (temp > 0) & row_valid
    if not plain:
        probs, vocab = d.probs, inputs.draft_vocab
    else:  # no drafts: the next token is drawn from the target alone (the draft tables are never read)
        probs, vocab = jnp.zeros((R, Gv, 1), jnp.float32), jnp.zeros((1,), jnp.int32)

    def sampled_row(x):
        """One row's acceptance against ``top_p(softmax(logits / T))`` (rows one at a time: the laws over the
        vocabulary are [Gv + 1, V] per row, not [R, Gv + 1, V] for the round, so a program's workspace, which
        XLA:CPU allocates at every call, stays small)."""
        row_idx, t, p, key, row_drafts, row_probs, n = x
        scaled = logits[row_idx] / t  # [Gv + 1, V]
        target_probs = _target_law(scaled[None], p[None])
        s_acc, s_nxt = verify.speculative_accept(key[None], row_drafts[None], row_probs[None], target_probs, n[None],
                                                 vocab)
        return s_acc[0], s_nxt[0]

    def sampled_accept():
        keys = _key(state.seed[rows], 2, state.request[rows], ctx_len)
        xs = (idx, jnp.where(sampled, temp, 1.0), state.top_p[rows], keys, drafts, probs, accept_len)
        s_acc, s_nxt = jax.lax.map(
            lambda x: jax.lax.cond(x[0], sampled_row, lambda _: (jnp.int32(0), jnp.int32(0)), x[1:]), (sampled, *xs))
        return jnp.where(sampled, s_acc, n_acc), jnp.where(sampled, s_nxt, nxt)

    n_acc, nxt = jax.lax.cond(jnp.any(sampled), sampled_accept, lambda: (n_acc, nxt))
    # ---- emit [x1..x_n, next], cut at the first stop token and at the request's budget
    drafts_g = jnp.pad(drafts, ((0, 0), (0, G - Gv)))  # [R, G]
    emitted = jnp.where(jnp.arange(G + 1)[None, :] < n_acc[:, None], jnp.pad(drafts_g, ((0, 0), (0, 1))), 0)
    emitted = emitted.at[jnp.arange(R), n_acc].set(nxt)
    is_stop = (jnp.isin(emitted, inputs.stop_ids) & state.eos_stops[rows][:, None]
               & (jnp.arange(G + 1)[None, :] <= n_acc[:, None]))
    first_stop = jnp.where(is_stop.any(axis=1), jnp.argmax(is_stop, axis=1), G + 1)
    remaining = state.max_new[rows] - state.generated[rows]
    counts = jnp.minimum(jnp.minimum(n_acc + 1, first_stop + 1), remaining)
    counts = jnp.where(row_valid, counts, 0).astype(jnp.int32)
    finished = row_valid & ((first_stop < counts) | (counts >= remaining))
    k = min(MAX_LOGPROBS, spec.cfg.vocab_size)
    lp = jax.lax.cond(  # column j of a row: emitted token j, predicted at packed position idx[r, j]
        logprobs, lambda: Logprobs(*logprobs_at(raw_logits, idx, emitted[:, : Gv + 1], k=k)),
        lambda: Logprobs(jnp.zeros((R, Gv + 1), jnp.float32), jnp.zeros((R, Gv + 1, k), jnp.int32),
                         jnp.zeros((R, Gv + 1, k), jnp.float32)))
    # ---- commit: the anchor and the accepted drafts enter the cache; the next token is the new anchor
    new_len = ctx_len + 1 + n_acc
    cache = commit(cache, jnp.where(row_valid, rows, cache.num_slots), new_len)
    dcache = state.dcache
    write = jnp.where(row_valid, rows, state.anchor.shape[0])  # padding rows write nothing
    hist, gate_state = state.conf_hist, state.gate
    if inputs.dstate is not None:
        drafter = nnx.merge(inputs.graph, inputs.dstate)
        dcache = jax.lax.cond(  # (a cond passes the cache through in place: no copy)
            drafting, lambda dc: dr.write_context(drafter, dc, extras.taps, slots, positions, valid,
                                                  _block_tables(cache)), lambda dc: dc, dcache)
        # a round that skipped the drafter keeps the history it decided on; a round where no request has the
        # drafter's context is plain decoding's (the gate does not count it)
        new = hist.at[1].set(hist[0]).at[0, write].set(conf, mode="drop")
        hist = jnp.where(drafted, new, hist)
        updated = gate.update(gate_state, spec.gate, rows, row_valid, conf, lengths, n_acc, drafted)
        gate_state = jax.tree.map(lambda a, b: jnp.where(drafting, a, b), updated, gate_state)
    new_state = state.replace(
        cache=cache, dcache=dcache, conf_hist=hist, gate=gate_state,
        anchor=state.anchor.at[write].set(nxt, mode="drop"),
        generated=state.generated.at[write].add(counts, mode="drop"),
        active=state.active.at[write].set(~finished, mode="drop"),
    )
    out = RoundOut(emitted, counts, finished, n_acc.astype(jnp.int32), new_len.astype(jnp.int32), lp)
    return new_state, out
