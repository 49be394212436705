"""Measure what a decoding round costs and turn it into an SPS table with a cost model (spec section 3).

A round is the drafter's block for every active request, then one packed verification by the target.
Both are measured as the engine runs them, on the backend JAX selects (or the one asked for):

* verification: ``llama.forward_packed`` with ``T`` tokens (a bucket), the grid width the engine takes for
  rows of ``ceil(B / R)`` tokens (``llama.grid_bucket``), a grid of
  ``R`` rows (``row_slots``) and the attention window ``Wv = window(L + G + 1)``, every row holding ``L``
  committed tokens;
* drafting: ``drafter.draft`` for ``R`` rows (the module split once, a jitted pure function of its
  state) reading the window ``Wd = window(L)`` of its cache.

``window`` is ``sps.context_window`` under a rule: ``"pow2"`` (default, the engine's: powers of two from
128) or ``"step"`` (multiples of 128, ``llama.context_bucket``).

A whole engine round costs more than these two programs: the host's share (admission, emission, the
transfers), the engine's small bookkeeping programs and the drafter's context write. That remainder is
measured last by running the engine itself at every row count, for drafting and for plain rounds
(:func:`profile_round_overhead`), and stored as the cost model's ``overhead_s`` (drafting rounds also by
the padded batch they verify, ``draft_overhead_s``).

Every measurement warms up (compilation excluded), blocks until ready, repeats and keeps the median and
the spread (``timing.time_call``), and is put at the host's median speed over the profile
(:class:`HostSpeed`: a small reference program timed between measurements). Cache contents are zeros: no
operation's cost depends on the values.

Axis legend: R rows (active requests, padded to a row bucket), T verification tokens (padded to a
bucket), B valid verification tokens (``B <= R * (G + 1)``), G block size, L context tokens held per
request, W attention window.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import platform
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

from dspark_jax.models.drafter import (Drafter, DrafterConfig, draft, draft_head_weights,
                                       init_drafter_cache)
from dspark_jax.models.llama import (BUCKETS, CONTEXT_STEP, LlamaConfig, LlamaWeights, bucket_for, forward_packed,
                                     grid_bucket, init_cache)
from dspark_jax.sharding import (drafter_cache_axes, kv_cache_axes, mesh_of, mesh_shape, place,
                                 place_drafter_state, place_target_weights)
from dspark_jax.sps import (DEFAULT_WINDOW_RULE, DRAFTER_SHAPE_FIELDS, OVERHEAD_KINDS, CostModel, SPSMetadata, SPSPoint, SPSTable, host_cpu,
                            realistic_rows, round_windows)
from dspark_jax.timing import Timing, interleaved, time_call

__all__ = [
    "DEFAULT_BLOCK",
    "DEFAULT_CONTEXT_LENGTHS",
    "DEFAULT_MAX_TOKENS",
    "available_backends",
    "select_device",
    "model_label",
    "token_buckets",
    "row_buckets",
    "verify_cells",
    "diagonal_cells",
    "random_drafter",
    "verify_batch",
    "time_verify",
    "time_draft",
    "profile_cost_model",
    "sps_points",
    "profile_sps_table",
    "profile_round_overhead",
    "add_round_overhead",
    "HostSpeed",
    "timed_jobs",
]

DEFAULT_BLOCK = 7
# Tokens held per request: each fills a power-of-two window exactly (L + G + 1 = 128, 256, 512, 1024 for
# G = 7), so every window the engine uses up to 1024 is measured, not interpolated.
DEFAULT_CONTEXT_LENGTHS = (120, 248, 504, 1016)
DEFAULT_MAX_TOKENS = 512
# The shipped drafter's shape (weights do not change the cost): 3 layers, FFN 1536, Markov rank 256, 8192 draft
# tokens, its tapped layers normed (tests/test_assets.py checks it against the shipped config).
SHIPPED_DRAFTER = dict(n_layers=3, ffn_dim=1536, rank=256, draft_vocab_size=8192, qk_norm=True, tap_norm=False)
_KNOWN_BACKENDS = ("cpu", "gpu", "tpu")
# What a table's simple points are (metadata).
POINTS_NOTE = ("rounds/s = 1 / (draft(R) + verify(R, B) + overhead(drafting, R, B)) at the reference context, "
               "R = realistic_rows(B)")


# ----------------------------------------------------------------------------------------------------
# Devices and names


def available_backends() -> list[str]:
    """The backends this process can use, among cpu, gpu and tpu."""
    out = []
    for name in _KNOWN_BACKENDS:
        try:
            if jax.devices(name):
                out.append(name)
        except RuntimeError:
            pass
    return out


def select_device(backend: str | None = None) -> jax.Device:
    """The first device of ``backend`` (default: the backend JAX selects); ``ValueError`` naming the
    available backends when it is missing."""
    if backend is None:
        return jax.devices()[0]
    try:
        return jax.devices(backend)[0]
    except RuntimeError:
        raise ValueError(f"backend {backend!r} is not available on this machine; available backends: "
                         f"{available_backends()} (JAX selects {jax.default_backend()!r} by default)") from None


def model_label(path: str | os.PathLike) -> str:
    """The model name a table records for a GGUF file: its file name."""
    return Path(path).name


# ----------------------------------------------------------------------------------------------------
# What to measure


def token_buckets(max_tokens: int, buckets: Sequence[int] = BUCKETS) -> tuple[int, ...]:
    """The verification buckets up to the one that holds ``max_tokens``.

    >>> token_buckets(300)
    (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    """
    if max_tokens < 1 or max_tokens > buckets[-1]:
        raise ValueError(f"max_tokens: expected 1..{buckets[-1]} (the largest verification bucket), got {max_tokens}")
    top = next(b for b in buckets if b >= max_tokens)
    return tuple(b for b in buckets if b <= top)


def row_buckets(max_tokens: int, block: int) -> tuple[int, ...]:
    """Powers of two from 1 up to the first that can hold ``max_tokens`` tokens at ``block + 1`` per row.

    >>> row_buckets(512, 7)
    (1, 2, 4, 8, 16, 32, 64)
    """
    need = -(-int(max_tokens) // (block + 1))
    out = [1]
    while out[-1] < need:
        out.append(out[-1] * 2)
    return tuple(out)


def _ceil_to(values: Sequence[int], x: int) -> int:
    """The smallest of ``values`` (increasing) that is ``>= x``, else the last."""
    return next((v for v in values if v >= x), values[-1])


def verify_cells(rows: Sequence[int], batch_tokens: Sequence[int], block: int) -> list[tuple[int, int]]:
    """Every (rows, tokens) cell a round can use: row bucket ``rows[i]`` serves ``rows[i-1] + 1 ..
    rows[i]`` requests, so ``B`` runs from ``rows[i-1] + 1`` to ``rows[i] * (block + 1)`` (each ceiled to a
    measured bucket). The largest row count also gets every larger bucket, where missing cells are filled
    from (:class:`~dspark_jax.sps.CostModel`).

    >>> verify_cells((1, 2, 4), (8, 16, 32, 64), 7)
    [(1, 8), (2, 8), (2, 16), (4, 8), (4, 16), (4, 32), (4, 64)]
    """
    rows, batch_tokens = sorted(rows), sorted(batch_tokens)
    cells = []
    for i, r in enumerate(rows):
        lo = _ceil_to(batch_tokens, (rows[i - 1] if i else 0) + 1)
        hi = batch_tokens[-1] if i == len(rows) - 1 else _ceil_to(batch_tokens, r * (block + 1))
        cells += [(r, t) for t in batch_tokens if lo <= t <= hi]
    return cells


def diagonal_cells(batch_tokens: Sequence[int], *, max_rows: int, block: int) -> list[tuple[int, int]]:
    """One cell per bucket, at :func:`~dspark_jax.sps.realistic_rows` (the simple curve; ``--quick``),
    plus the largest row count at the largest bucket.

    >>> diagonal_cells((8, 64, 256), max_rows=64, block=7)
    [(2, 8), (16, 64), (64, 256)]
    """
    cells = [(realistic_rows(t, max_rows=max_rows), t) for t in sorted(batch_tokens)]
    top = (max(r for r, _ in cells), max(batch_tokens))
    bad = [(r, t) for r, t in cells if t > r * (block + 1)]
    if bad:
        raise ValueError(f"cells {bad}: a batch cannot hold more than rows * (block + 1) tokens")
    return cells if top in cells else cells + [top]


def random_drafter(target_cfg: LlamaConfig, *, block: int = DEFAULT_BLOCK, seed: int = 0) -> Drafter:
    """A randomly initialised drafter of the shipped shape (:data:`SHIPPED_DRAFTER`) for ``target_cfg``;
    for a target with fewer than 8192 tokens (tiny test models) the draft vocabulary is the whole one and
    the FFN is the target's."""
    over = dict(SHIPPED_DRAFTER, block=block)
    if target_cfg.vocab_size < over["draft_vocab_size"]:
        over.update(draft_vocab_size=0, ffn_dim=target_cfg.ffn_dim, rank=min(over["rank"], target_cfg.dim))
    cfg = DrafterConfig.for_target(target_cfg, **over)
    return Drafter(cfg, rngs=nnx.Rngs(seed), vocab_ids=np.arange(cfg.draft_vocab, dtype=np.int32))


# ----------------------------------------------------------------------------------------------------
# Measurements


def _device_of(x: jax.Array) -> jax.Device:
    return next(iter(x.devices()))


def _put_like(x: jax.Array):
    """``jax.device_put`` to where ``x`` lies: its device, or replicated on its mesh (a target placed on a
    mesh is measured there; `sharding.place_target_weights`)."""
    mesh = mesh_of(x)
    if mesh is None:
        return functools.partial(jax.device_put, device=_device_of(x))
    return functools.partial(jax.device_put, device=NamedSharding(mesh, PartitionSpec()))


def verify_batch(*, rows: int, batch_tokens: int, context: int, block: int, vocab_size: int,
                 plain: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The packed batch :func:`time_verify` runs: ``B = min(T, R * (G + 1))`` valid tokens dealt round-robin
    over slots ``0..R-1`` at positions ``L, L + 1, ...``, then padding.

    Returns:
      tokens, slots, positions (int32 [T]) and valid (bool [T]).
    """
    idx = np.arange(batch_tokens)
    n_valid = min(batch_tokens, rows if plain else rows * (block + 1))
    tokens = (idx % vocab_size).astype(np.int32)
    slots = (idx % rows).astype(np.int32)
    positions = (context + np.minimum(idx // rows, block)).astype(np.int32)
    return tokens, slots, positions, idx < n_valid


def _verify_step(weights: LlamaWeights, cfg: LlamaConfig, *, rows: int, batch_tokens: int, context: int,
                 block: int, window_rule: str, plain: bool, state: dict | None = None):
    """A thunk running the packed verification :func:`time_verify` times (its cache donated and replaced at
    each call), and a function that frees the cache. ``state``: a dict holding the cache under ``"cache"``,
    shared by the thunks of one (rows, context), whose caches have one shape (allocated by the first)."""
    if rows < 1 or batch_tokens < 1 or context < 0:
        raise ValueError(f"rows, batch_tokens >= 1 and context >= 0 expected, got {rows}, {batch_tokens}, {context}")
    batch = verify_batch(rows=rows, batch_tokens=batch_tokens, context=context, block=block,
                         vocab_size=cfg.vocab_size, plain=plain)
    n_valid = int(batch[3].sum())
    M = 1 if plain else grid_bucket(max(2, -(-n_valid // rows)), block + 1)  # as the engine: rows of B / R tokens
    W, _ = round_windows(context, block, CONTEXT_STEP, window_rule)
    # Every input committed to the weights' device, as the donated cache returned by each call is: otherwise
    # the second call compiles again (committed and uncommitted arguments compile separately).
    put = _put_like(weights.embed)
    tokens, slots, positions, valid = (put(a) for a in batch)
    row_slots = put(np.arange(rows, dtype=np.int32))  # [R]

    def fresh():
        return init_cache(cfg, rows, W, weights.embed.dtype).replace(lengths=jnp.full((rows,), context, jnp.int32))

    mesh = mesh_of(weights.embed)
    state = {} if state is None else state
    if "cache" not in state:
        cache = fresh()
        state["cache"] = put(cache) if mesh is None else place(cache, kv_cache_axes(cfg.n_layers), mesh)
    elif [a.shape for a in jax.tree.leaves(state["cache"])] != [a.shape for a in jax.tree.leaves(jax.eval_shape(fresh))]:
        raise ValueError("_verify_step: the shared cache has another shape (rows or window differ)")

    def step():
        logits, extras, state["cache"] = forward_packed(weights, state["cache"], tokens, slots, positions, valid,
                                                        cfg, max_per_slot=M, row_slots=row_slots, context=W)
        return logits, extras

    return step, state.clear


def time_verify(weights: LlamaWeights, cfg: LlamaConfig, *, rows: int, batch_tokens: int, context: int,
                block: int = DEFAULT_BLOCK, window_rule: str = "pow2", repeats: int = 5, warmup: int = 1,
                max_seconds: float | None = None, plain: bool = False) -> Timing:
    """Seconds per packed verification of ``batch_tokens`` (T, padded size) over ``rows`` (R) requests that
    each hold ``context`` (L) tokens, as the engine runs it.

    ``B = min(T, R * (G + 1))`` tokens are valid, dealt round-robin over the rows (positions ``L, L + 1,
    ...``); the rest is padding. The cache has R slots of ``Wv = window(L + G + 1)`` positions, all read.
    ``plain``: a round that verifies no drafts, as the engine runs it: one token per row (``B = R``) and
    ``max_per_slot = 1``.
    """
    step, free = _verify_step(weights, cfg, rows=rows, batch_tokens=batch_tokens, context=context, block=block,
                              window_rule=window_rule, plain=plain)
    try:
        return time_call(step, repeats=repeats, warmup=warmup, max_seconds=max_seconds)
    finally:
        free()


class HostSpeed:
    """How fast the host runs at each moment of a profile, from a small reference program timed between
    the measurements: a plain round (one row, no drafts) at ``context``.

    A shared machine's speed drifts while a profile runs (other tenants, clocks: the reference program took
    0.75 to 2.06 x its median during one 22-minute profile on the 2-core host this project is developed
    on), and a table measured cell after cell then prices the cells measured in a slow stretch too high,
    and with them the ratio the drafter gate reads, a drafting round against a plain one (the plain rounds
    used to be measured last). Each measurement is rescaled by ``reference /
    local``: ``local`` the reference program's time around it (the median of the ``window`` probes nearest
    it), ``reference`` the median over the whole profile, or the value a table recorded (so that a part
    measured later, :func:`add_round_overhead`, lands at the table's speed).
    """

    def __init__(self, weights: LlamaWeights, cfg: LlamaConfig, *, context: int, block: int = DEFAULT_BLOCK,
                 window_rule: str = "pow2", probe_seconds: float = 0.1, window: int = 5,
                 reference: float | None = None):
        if not probe_seconds > 0 or window < 1:
            raise ValueError(f"probe_seconds > 0 and window >= 1 expected, got {probe_seconds} and {window}")
        if reference is not None and not reference > 0:
            raise ValueError(f"reference: a positive time in seconds expected, got {reference}")
        self.context, self.window = int(context), window
        self.describe = reference_label(self.context, window_rule)
        self._step, _ = _verify_step(weights, cfg, rows=1, batch_tokens=1, context=self.context, block=block,
                                     window_rule=window_rule, plain=True)
        once = time_call(self._step, repeats=3, warmup=1).median  # the warm-up call compiles
        # A probe is the median of ``calls`` calls lasting about ``probe_seconds`` together (3 to 100 calls):
        # a fast program's single calls are mostly dispatch jitter.
        self.calls = int(np.clip(np.ceil(probe_seconds / max(once, 1e-9)), 3, 100))
        self.probes: list[float] = []
        self._reference = reference

    def warm(self) -> None:
        """Compile the reference program again (after ``jax.clear_caches``), outside any probe."""
        jax.block_until_ready(self._step())

    def probe(self) -> int:
        """Time the reference program now (the median of ``calls`` calls); returns the probe's index."""
        self.probes.append(time_call(self._step, repeats=self.calls, warmup=0).median)
        return len(self.probes) - 1

    @property
    def reference(self) -> float:
        """Seconds of the reference program at the speed every measurement is put at (fixed once read)."""
        if self._reference is None:
            if not self.probes:
                raise ValueError("HostSpeed: no probe yet")
            self._reference = float(np.median(self.probes))
        return self._reference

    def factor(self, between: tuple[int, int]) -> float:
        """``reference / local`` for a measurement taken between the probes ``between`` (indices)."""
        return host_factor(self.probes, between, self.reference, self.window)


def reference_label(context: int, window_rule: str) -> str:
    """What :class:`HostSpeed` times, as a table's metadata records it (``host_reference``)."""
    return f"plain round, 1 row, L={int(context)}, window rule {window_rule!r}"


def table_host_speed(table: SPSTable, weights: LlamaWeights, cfg: LlamaConfig) -> HostSpeed:
    """A :class:`HostSpeed` for measuring more of ``table``: at the reference speed the table recorded
    (``host_reference_s``), or, for a table that recorded none (or another reference program), at the
    median speed of the new measurement."""
    cm = table.cost_model
    extra = table.metadata.extra
    label = reference_label(cm.context_lengths[0], cm.window_rule)
    recorded = extra.get("host_reference_s") if extra.get("host_reference") == label else None
    return HostSpeed(weights, cfg, context=cm.context_lengths[0], block=cm.block, window_rule=cm.window_rule,
                     reference=None if recorded is None else float(recorded))


def host_factor(probes: Sequence[float], between: tuple[int, int], reference: float, window: int = 5) -> float:
    """``reference / local``: ``local`` the median of the ``window`` probes nearest the span ``between``
    (probe indices, inclusive), the span's own probes always among them."""
    lo, hi = between
    if not 0 <= lo <= hi < len(probes):
        raise ValueError(f"probe span {between} outside 0..{len(probes) - 1}")
    n = len(probes)
    a = int(np.clip(round((lo + hi) / 2 - (window - 1) / 2), 0, max(n - window, 0)))
    a, b = min(a, lo), max(a + window, hi + 1)
    return float(reference / np.median(probes[a:b]))


def rescaled(tm: Timing, factor: float) -> Timing:
    """``tm`` at another host speed: every quantile times ``factor``."""
    return Timing(tm.median * factor, tm.p25 * factor, tm.p75 * factor, tm.repeats)


def timed_jobs(jobs: Sequence[Any], run, speed: HostSpeed | None, *, progress: bool = False, desc: str = "profiling",
               label=str, group=None) -> list[Timing]:
    """``run(job)`` (a :class:`Timing`, or a dict of them) for every job, each rescaled to the reference speed
    of ``speed`` (probed before the first job, between jobs and after the last; None: as measured).

    ``group(job)``: where it changes between two jobs, the compiled programs are dropped
    (``jax.clear_caches``) and the reference program compiled again before its next probe. Every cell
    compiles programs of its own shape, and a profile's cells together outgrow the host's memory."""
    out = []
    bar = tqdm(jobs, disable=not progress, desc=desc, unit="cell")
    spans = []
    last_group = None
    for i, job in enumerate(bar):
        bar.set_postfix_str(label(job))
        if group is not None:
            g = group(job)
            if i > 0 and g != last_group:
                jax.clear_caches()
                if speed is not None:
                    speed.warm()
            last_group = g
        before = speed.probe() if speed is not None else 0
        out.append(run(job))
        spans.append(before)
    if speed is None:
        return out
    last = speed.probe()
    spans = [(b, spans[i + 1] if i + 1 < len(spans) else last) for i, b in enumerate(spans)]
    return [{k: rescaled(v, speed.factor(span)) for k, v in tm.items()} if isinstance(tm, dict)
            else rescaled(tm, speed.factor(span)) for tm, span in zip(out, spans)]


@functools.lru_cache(maxsize=8)
def _draft_step(graphdef):
    """``draft`` as a jitted pure function of the drafter's state (one per drafter structure, so equal
    shapes compile once per process)."""

    @functools.partial(jax.jit, static_argnames=("context",))
    def run(params, cache, slots, ctx_len, anchors, keys, temperature, embed, head_w, *, context):
        return draft(nnx.merge(graphdef, params), cache, slots, ctx_len, anchors, keys, temperature, embed, head_w,
                     context=context)

    return run


def time_draft(drafter: Drafter, embed: jax.Array, *, rows: int, context: int, window_rule: str = "pow2",
               repeats: int = 5, warmup: int = 1, max_seconds: float | None = None) -> Timing:
    """Seconds per drafted block for ``rows`` requests that each hold ``context`` tokens (sampling at
    temperature 1; greedy costs the same: both branches are computed). The drafter cache has ``Wd =
    window(L)`` positions and ``draft`` reads them all (``context=Wd``, as the engine calls it)."""
    return time_call(_draft_thunk(drafter, embed, rows=rows, context=context, window_rule=window_rule),
                     repeats=repeats, warmup=warmup, max_seconds=max_seconds)


def _draft_thunk(drafter: Drafter, embed: jax.Array, *, rows: int, context: int, window_rule: str):
    """A thunk running the draft program :func:`time_draft` times."""
    if rows < 1 or context < 0:
        raise ValueError(f"rows >= 1 and context >= 0 expected, got {rows}, {context}")
    cfg = drafter.cfg
    _, W = round_windows(context, cfg.block, CONTEXT_STEP, window_rule)
    graphdef, params = nnx.split(drafter)
    head_w = draft_head_weights(drafter, embed)  # [D, W_vocab]
    run = _draft_step(graphdef)
    args = (params, init_drafter_cache(cfg, rows, W), jnp.arange(rows, dtype=jnp.int32),  # float32, as the engine's
            jnp.full((rows,), context, jnp.int32), jnp.zeros((rows,), jnp.int32),
            jax.random.split(jax.random.key(0), rows), jnp.float32(1.0), embed, head_w)
    mesh = mesh_of(embed)
    if mesh is None:
        args = jax.device_put(args, _device_of(embed))
    else:  # as the engine lays them out: the drafter's weights and cache by the rules, the rest replicated
        args = (place_drafter_state(params, cfg, mesh), place(args[1], drafter_cache_axes(), mesh),
                *_put_like(embed)(args[2:7]), embed, head_w)
    return lambda: run(*args, context=W)


def profile_cost_model(weights: LlamaWeights, cfg: LlamaConfig, drafter: Drafter | None, *,
                       context_lengths: Sequence[int], batch_tokens: Sequence[int],
                       rows: Sequence[int] | None = None, cells: Sequence[tuple[int, int]] | None = None,
                       block: int = DEFAULT_BLOCK, window_rule: str = "pow2", repeats: int = 5, warmup: int = 1,
                       max_seconds: float | None = None, min_seconds: float = 1.0, speed: HostSpeed | None = None,
                       progress: bool = False) -> CostModel:
    """Measure a :class:`~dspark_jax.sps.CostModel`: the verification ``cells`` (default: every feasible
    cell, :func:`verify_cells`), a plain round (no drafts) and the drafter at every row count, at every
    context length.

    The programs of one (context, rows) group (the drafter, the plain round, every verification cell) are
    timed in turns (:func:`~dspark_jax.timing.interleaved`), so a host whose speed drifts moves them alike:
    the ratios the scheduler and the drafter gate read (a drafting round against a plain one at the same
    rows) come from side-by-side calls, and :class:`HostSpeed` puts each group at the profile's speed.

    Args:
      weights, cfg: the target.
      drafter: the drafter (its ``block`` must equal ``block``), or None to record no draft cost (zeros).
      context_lengths: tokens held per request; they must fall in distinct attention windows.
      batch_tokens: verification buckets to measure (T).
      rows: row buckets (default :func:`row_buckets` of the largest bucket).
      cells: (rows, tokens) pairs to measure; the rows axis becomes the rows they use.
      block: G, drafted tokens per request (verification holds G + 1 per request).
      window_rule: how the engine picks attention windows (``sps.context_window``).
      repeats, warmup: timed turns (at least) and untimed calls of each program of a group.
      min_seconds: a group takes more turns (up to 4 x ``repeats``) until its timed calls add up to this.
      max_seconds: a group stops taking turns once past it (keeping at least three).
      speed: rescale every measurement to its reference host speed (:class:`HostSpeed`); None: as measured.
      progress: show a progress bar.
    """
    if drafter is not None and drafter.cfg.block != block:
        raise ValueError(f"drafter block {drafter.cfg.block} differs from block {block}")
    batch_tokens = tuple(sorted(int(t) for t in batch_tokens))
    contexts = tuple(sorted(int(c) for c in context_lengths))
    if not contexts or contexts[0] < 0:
        raise ValueError(f"context_lengths: expected at least one length >= 0, got {list(context_lengths)}")
    pairs = [round_windows(c, block, CONTEXT_STEP, window_rule) for c in contexts]
    for i in range(1, len(contexts)):
        for k, what, holds in ((0, "verification", f"L + {block + 1}"), (1, "draft", "L")):
            if pairs[i][k] == pairs[i - 1][k]:
                raise ValueError(f"context lengths {contexts[i - 1]} and {contexts[i]} share the {what} window "
                                 f"{pairs[i][k]} (it holds {holds} tokens, rule {window_rule!r}): pick lengths in "
                                 f"different windows, e.g. W - {block + 1} for windows W")
    if cells is None:
        rows = tuple(sorted(rows)) if rows is not None else row_buckets(batch_tokens[-1], block)
        cells = verify_cells(rows, batch_tokens, block)
    else:
        cells = sorted({(int(r), int(t)) for r, t in cells})
        bad = [(r, t) for r, t in cells if t not in batch_tokens or r < 1]
        if bad:
            raise ValueError(f"cells {bad}: tokens must be among batch_tokens {batch_tokens} and rows >= 1")
        rows = tuple(sorted({r for r, _ in cells}))
        if (rows[-1], batch_tokens[-1]) not in cells:
            cells.append((rows[-1], batch_tokens[-1]))
    r_index, t_index = {r: i for i, r in enumerate(rows)}, {t: i for i, t in enumerate(batch_tokens)}
    C, R, T = len(contexts), len(rows), len(batch_tokens)
    verify = [[[None] * T for _ in range(R)] for _ in range(C)]
    verify_spread = [[[None] * T for _ in range(R)] for _ in range(C)]
    draft_s = [[0.0] * R for _ in range(C)]
    draft_spread = [[0.0] * R for _ in range(C)]
    members = {r: ([("draft", 0)] if drafter is not None else []) + [("plain", bucket_for(r))]
               + [("verify", t) for rr, t in sorted(cells) if rr == r] for r in rows}
    jobs = [(c, r) for c in range(C) for r in rows]

    def run(job):
        c, r = job
        shared, thunks = {}, {}
        try:
            for kind, t in members[r]:
                if kind == "draft":
                    thunks[kind, t] = _draft_thunk(drafter, weights.embed, rows=r, context=contexts[c],
                                                   window_rule=window_rule)
                else:
                    thunks[kind, t], _ = _verify_step(weights, cfg, rows=r, batch_tokens=t, context=contexts[c],
                                                      block=block, window_rule=window_rule, plain=kind == "plain",
                                                      state=shared)
            return interleaved(thunks, repeats=repeats, warmup=warmup, min_seconds=min_seconds,
                               max_seconds=max_seconds)
        finally:
            shared.clear()

    def label(job):
        c, r = job
        return f"L={contexts[c]} R={r}: {len(members[r])} programs"

    plain_s = [[0.0] * R for _ in range(C)]
    plain_spread = [[0.0] * R for _ in range(C)]
    groups = timed_jobs(jobs, run, speed, progress=progress, label=label, group=lambda job: job[0])
    for (c, r), timings in zip(jobs, groups):
        for (kind, t), tm in timings.items():
            if kind == "draft":
                draft_s[c][r_index[r]], draft_spread[c][r_index[r]] = tm.median, tm.spread
            elif kind == "plain":
                plain_s[c][r_index[r]], plain_spread[c][r_index[r]] = tm.median, tm.spread
            else:
                verify[c][r_index[r]][t_index[t]] = tm.median
                verify_spread[c][r_index[r]][t_index[t]] = tm.spread
    return CostModel(block=block, context_step=CONTEXT_STEP, window_rule=window_rule, context_lengths=contexts,
                     windows=[w for w, _ in pairs], draft_windows=[w for _, w in pairs], rows=rows,
                     batch_tokens=batch_tokens, verify_s=verify, verify_spread_s=verify_spread, draft_s=draft_s,
                     draft_spread_s=draft_spread, plain_s=plain_s, plain_spread_s=plain_spread)


def sps_points(cost: CostModel, context: int) -> tuple[SPSPoint, ...]:
    """The simple SPS(B) curve at ``context``: rounds per second ``1 / (draft + verify)`` at each measured
    bucket with :func:`~dspark_jax.sps.realistic_rows` rows (the draft cost is folded in)."""
    curve = cost.curve(context)
    steps = 1.0 / curve["step_s"]
    spread = curve["spread_s"] * steps**2  # d(1/t) = dt / t^2
    return tuple(SPSPoint(int(b), float(s), float(d)) for b, s, d in zip(curve["batch_tokens"], steps, spread))


def profile_sps_table(weights: LlamaWeights, cfg: LlamaConfig, *, model: str,
                      context_lengths: Sequence[int] = DEFAULT_CONTEXT_LENGTHS,
                      max_tokens: int = DEFAULT_MAX_TOKENS, batch_tokens: Sequence[int] | None = None,
                      reference_context: int | None = None,
                      rows: Sequence[int] | None = None, diagonal: bool = False, block: int = DEFAULT_BLOCK,
                      window_rule: str = DEFAULT_WINDOW_RULE,
                      drafter: Drafter | None = None, with_drafter: bool = True, repeats: int = 5,
                      warmup: int = 1, max_seconds: float | None = None, min_seconds: float = 1.0,
                      device: jax.Device | None = None,
                      round_overhead: bool = True, overhead_row_count: int | None = None,
                      host_speed: bool = True, progress: bool = False,
                      extra: dict[str, Any] | None = None, mesh: Mesh | None = None) -> SPSTable:
    """Profile a whole table on ``device`` (default: JAX's choice), or on a device ``mesh``: cost model, simple
    curve, metadata (with the mesh's shape, ``extra["mesh"]``, which the engine checks).

    Args:
      weights, cfg: the target; ``model``: its name for the metadata (:func:`model_label`).
      context_lengths: tokens held per request; ``reference_context`` (default: the smallest) is where the
        simple SPS(B) points are read.
      max_tokens: the largest verification batch (rounded up to a bucket); ``batch_tokens`` (default: every
        bucket up to it, :func:`token_buckets`) picks the buckets to measure.
      rows: row buckets (default: powers of two up to what ``max_tokens`` needs).
      diagonal: measure one cell per bucket (:func:`diagonal_cells`) instead of every feasible cell.
      drafter: the drafter to time (default: :func:`random_drafter`, the shipped shape); ``with_drafter``
        False records no draft cost.
      repeats, warmup, max_seconds, min_seconds, progress: as in :func:`profile_cost_model`.
      round_overhead: with a drafter, also measure what an engine round costs beyond the programs
        (:func:`profile_round_overhead`, greedy) at the smallest ``overhead_row_count`` row counts
        (default: all of them; the others take the largest one's value).
      host_speed: put every measurement at the host's median speed over the profile (:class:`HostSpeed`;
        recorded as ``host_reference_s``, with the probes' range as ``host_drift``).
      extra: more metadata.
      mesh: a ``(data, tensor)`` mesh (`sharding.make_mesh`): the target, drafter and caches are laid out on
        it as the engine lays them out, and the programs and engine rounds are timed there.
    """
    if mesh is not None:
        device = mesh.devices.flat[0]
    device = select_device() if device is None else device
    buckets = token_buckets(max_tokens) if batch_tokens is None else tuple(sorted(int(b) for b in batch_tokens))
    contexts = sorted(int(c) for c in context_lengths)
    ref = contexts[0] if reference_context is None else int(reference_context)
    if ref not in contexts:
        raise ValueError(f"reference_context {ref} must be one of the context lengths {contexts}")
    with jax.default_device(device):
        weights = jax.device_put(weights, device) if mesh is None else place_target_weights(weights, cfg, mesh)
        if with_drafter and drafter is None:
            drafter = random_drafter(cfg, block=block)
        drafter = drafter if with_drafter else None
        if diagonal:
            max_rows = rows[-1] if rows else row_buckets(buckets[-1], block)[-1]
            cells = diagonal_cells(buckets, max_rows=max_rows, block=block)
        else:
            cells = None
        speed = (HostSpeed(weights, cfg, context=contexts[0], block=block, window_rule=window_rule)
                 if host_speed else None)
        cost = profile_cost_model(weights, cfg, drafter, context_lengths=contexts, batch_tokens=buckets, rows=rows,
                                  cells=cells, block=block, window_rule=window_rule, repeats=repeats, warmup=warmup,
                                  max_seconds=max_seconds, min_seconds=min_seconds, speed=speed, progress=progress)
        if round_overhead and drafter is not None:
            from dspark_jax.models.llama import LlamaModel

            measure = cost.rows if overhead_row_count is None else cost.rows[:max(1, overhead_row_count)]
            cost = dataclasses.replace(cost, **profile_round_overhead(LlamaModel(cfg, weights), drafter, cost,
                                                                      rows=measure, speed=speed,
                                                                      progress=progress))
    meta_extra = {
        "jax_version": jax.__version__,
        "host": f"{platform.machine()} {os.cpu_count()} cores",
        **({"cpu": host_cpu()} if device.platform == "cpu" else {}),
        "device_count": jax.device_count(device.platform),
        "mesh": mesh_shape(mesh),
        "context_lengths": list(cost.context_lengths),
        "windows": list(cost.windows),
        "draft_windows": list(cost.draft_windows),
        "window_rule": window_rule,
        "rows": list(cost.rows),
        "block": block,
        "repeats": repeats,
        "cells": "diagonal" if diagonal else "all",
        "drafter": None if drafter is None else {k: v for k, v in drafter.cfg.to_dict().items()
                                                 if k in DRAFTER_SHAPE_FIELDS},
        "points": POINTS_NOTE,
    }
    if cost.overhead_s is not None:
        meta_extra["round_overhead_temperature"] = 0.0
    if speed is not None:
        meta_extra["host_reference"] = speed.describe
        meta_extra["host_reference_s"] = speed.reference
        meta_extra["host_drift"] = [float(min(speed.probes) / speed.reference),
                                    float(max(speed.probes) / speed.reference)]
    meta_extra.update(extra or {})
    meta = SPSMetadata(device_kind=device.device_kind, backend=device.platform, model=model,
                       dtype=str(jnp.dtype(weights.embed.dtype)), context_length=ref,
                       date=datetime.date.today().isoformat(), extra=meta_extra)
    return SPSTable(sps_points(cost, ref), meta, cost)


def profile_plain_rounds(weights: LlamaWeights, cfg: LlamaConfig, *, context_lengths: Sequence[int],
                         rows: Sequence[int], block: int = DEFAULT_BLOCK, window_rule: str = "pow2",
                         repeats: int = 5, warmup: int = 1, max_seconds: float | None = None,
                         speed: HostSpeed | None = None,
                         progress: bool = False) -> tuple[list[list[float]], list[list[float]]]:
    """Seconds and spreads of a plain round (no drafts, :func:`time_verify` with ``plain=True``) at every
    context length and row count: ``[C][R]`` each, the cost model's ``plain_s`` and ``plain_spread_s``."""
    plain_s = [[0.0] * len(rows) for _ in context_lengths]
    plain_spread = [[0.0] * len(rows) for _ in context_lengths]
    jobs = [(c, r) for c in range(len(context_lengths)) for r in range(len(rows))]

    def run(job):
        c, r = job
        return time_verify(weights, cfg, rows=rows[r], batch_tokens=bucket_for(rows[r]), context=context_lengths[c],
                           block=block, window_rule=window_rule, plain=True, repeats=repeats, warmup=warmup,
                           max_seconds=max_seconds)

    for (c, r), tm in zip(jobs, timed_jobs(jobs, run, speed, progress=progress, desc="plain rounds")):
        plain_s[c][r], plain_spread[c][r] = tm.median, tm.spread
    return plain_s, plain_spread


def add_plain_rounds(table: SPSTable, weights: LlamaWeights, cfg: LlamaConfig, *, repeats: int = 5,
                     warmup: int = 1, max_seconds: float | None = None, host_speed: bool = True,
                     progress: bool = False) -> SPSTable:
    """``table`` with its cost model's plain rounds (re)measured at every context and row count, on the
    device that holds ``weights`` (for tables profiled before plain rounds were part of the profile);
    ``host_speed``: at the table's reference host speed (:func:`table_host_speed`)."""
    cm = table.cost_model
    if cm is None:
        raise ValueError("add_plain_rounds: the table has no cost model to extend")
    speed = table_host_speed(table, weights, cfg) if host_speed else None
    plain_s, plain_spread = profile_plain_rounds(weights, cfg, context_lengths=cm.context_lengths, rows=cm.rows,
                                                 block=cm.block, window_rule=cm.window_rule, repeats=repeats,
                                                 warmup=warmup, max_seconds=max_seconds, speed=speed,
                                                 progress=progress)
    cost = dataclasses.replace(cm, plain_s=plain_s, plain_spread_s=plain_spread)
    meta = dataclasses.replace(table.metadata, extra={**table.metadata.extra,
                                                      "plain_rounds_date": datetime.date.today().isoformat()})
    return SPSTable(table.points, meta, cost)


def _forced_table(cost: CostModel, kind: str, tokens: int | None = None, mesh: Mesh | None = None) -> SPSTable:
    """A table under which the dspark engine drafts every round (``kind="drafting"``: verification flat up
    to ``tokens`` batch tokens (default: every batch) and priced out beyond, plain rounds priced out, so each
    round fills that batch) or never runs the drafter after its first round (``"plain"``: the drafter priced
    out), recorded as measured on ``mesh`` (the engine it drives checks it). Only :func:`profile_round_overhead`
    uses it."""
    C, R = len(cost.context_lengths), len(cost.rows)
    slow = [[1e3] * R for _ in range(C)]
    zeros = [[0.0] * R for _ in range(C)]
    cost = cost.without_overhead()
    if kind == "drafting":
        flat = float(np.nanmin(cost.filled_verify()[0]))
        limit = cost.max_tokens if tokens is None else int(tokens)
        price = [flat if b <= limit else 1e3 for b in cost.batch_tokens]
        verify = [[[None if v is None else price[t] for t, v in enumerate(row)] for row in ctx]
                  for ctx in cost.verify_s]
        forced = dataclasses.replace(cost, verify_s=verify, plain_s=slow, plain_spread_s=zeros)
    else:
        forced = dataclasses.replace(cost, draft_s=slow)
    return SPSTable(sps_points(forced, forced.context_lengths[0]), SPSMetadata(extra={"mesh": mesh_shape(mesh)}),
                    cost_model=forced)


def overhead_batches(cost: CostModel, rows: int) -> tuple[int, ...]:
    """The padded batches a drafting round of ``rows`` requests can verify: the buckets above ``rows`` up to
    the one that holds every row's whole block (``rows * (G + 1)``), within the profile."""
    full = bucket_for(min(rows * (cost.block + 1), cost.max_tokens))
    return tuple(b for b in cost.batch_tokens if rows < b <= full)


def profile_round_overhead(target, drafter: Drafter, cost: CostModel, *, rows: Sequence[int] | None = None,
                           context: int | None = None, rounds: int = 12, warmup: int = 2, temperature: float = 0.0,
                           speed: HostSpeed | None = None, progress: bool = False) -> dict[str, list]:
    """What a whole engine round costs beyond the profiled programs, at each row count of ``cost``.

    For every row count R (default: all of ``cost.rows``) an engine with the ``dspark`` policy serves R
    requests of ``context`` random prompt tokens (default: the second smallest profiled context plus 10
    tokens, in the next window, so the windows stay put while it runs): for each padded batch a drafting
    round can verify (:func:`overhead_batches`: ``2R, 4R, 8R`` for G = 7), a drafting kind forced to fill
    that batch every round, and a plain kind where the engine skips the drafter; the engines of one row
    count take turns round by round, so the host's drift moves them alike. Each round's measured wall
    time minus the cost model's time for the same round (:meth:`CostModel.step_times` at its padded batch,
    :meth:`CostModel.plain_step_time`) is one sample; rounds that compiled are left out.

    Args:
      target: a ``LlamaModel`` (the weights' device is where it runs).
      drafter: a drafter of the profiled shape (random weights cost the same).
      cost: the measured cost model (any overhead it already has is ignored).
      rounds: timed rounds per (kind, R, batch) after ``warmup`` rounds.
      temperature: the engine's sampling temperature (0: greedy).
      speed: put each round's time at this reference host speed (:class:`HostSpeed`, probed between cycles
        of rounds) before the cost model's time is taken from it; None: as measured.

    Returns:
      The cost model's overhead fields: ``overhead_s`` and ``overhead_spread_s``, ``[2][R]`` over
      (drafting at the full block, plain) x ``cost.rows``, and ``draft_overhead_s`` and
      ``draft_overhead_spread_s``, ``[R][T]`` over ``cost.rows`` x ``cost.batch_tokens`` (None where not
      measured): the median of the samples and half their interquartile range, in seconds. A negative
      median means the isolated programs measured slower than the same work inside the engine; it is kept
      (a correction either way), down to half the fastest profiled round of its kind at that row count (and
      batch). Row counts not in ``rows`` take the values of the next measured one (the last measured for
      larger), at the batches they can verify.
    """
    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.gate import GateConfig

    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds >= 1 and warmup >= 0 expected, got {rounds} and {warmup}")
    if drafter.cfg.block != cost.block:
        raise ValueError(f"drafter block {drafter.cfg.block} differs from the cost model's block {cost.block}")
    base = cost.without_overhead()
    measure = tuple(sorted(set(cost.rows if rows is None else (int(r) for r in rows))))
    if not measure or any(r not in cost.rows for r in measure):
        raise ValueError(f"rows {list(measure)} must be among the cost model's rows {list(cost.rows)}")
    if context is None:
        context = (cost.context_lengths[1] if len(cost.context_lengths) > 1 else cost.context_lengths[0]) + 10
    G = cost.block
    attempts = warmup + 3 * rounds  # room for rounds that compile (a new bucket or window)
    max_new = attempts * (G + 1) + 1
    capacity = -(-(context + max_new + G + 2) // CONTEXT_STEP) * CONTEXT_STEP
    vocab = target.cfg.vocab_size
    rng = np.random.default_rng(0)
    samples: dict[tuple[int, int], list[float]] = {}  # (R, padded batch; 0 = plain round) -> seconds
    timed = []  # (key, index in samples[key], measured seconds, predicted, probe before it) of a row count
    for R in tqdm(measure, disable=not progress, desc="round overhead", unit="row count"):
        # One engine per kind of round, stepped in turn, so that a host that drifts while this runs (a shared
        # machine) moves every kind alike and the ratios between them hold.
        kinds = (0, *overhead_batches(cost, R))  # plain, then each padded batch
        engines = {}
        mesh = mesh_of(target.weights.embed)
        for batch in kinds:
            with warnings.catch_warnings():  # its forced table is meant to stop short of the largest rounds
                warnings.filterwarnings("ignore", message="SPS table: measured up to")
                engines[batch] = Engine(target, drafter, "dspark",
                                        EngineConfig(num_slots=R, capacity=capacity, temperature=temperature,
                                                     window_rule=cost.window_rule,
                                                     gate=GateConfig(probe_every=10**9, calibrate_times=False,
                                                                     off_after=None)),
                                        sps=_forced_table(base, "drafting" if batch else "plain", batch or None,
                                                          mesh),
                                        stop_ids=(), mesh=mesh)
            for _ in range(R):
                engines[batch].submit(rng.integers(0, vocab, context).tolist(), max_new)
        for i in range(attempts):
            if all(len(samples.get((R, b), ())) >= rounds for b in engines):
                break
            probe = speed.probe() if speed is not None else None
            for batch, engine in engines.items():
                if len(samples.get((R, batch), ())) >= rounds:
                    continue
                st = engine.step().stats
                if st is None or i < warmup or st.compiled or st.drafted != bool(batch):
                    continue
                if batch:
                    padded = bucket_for(st.batch_tokens)
                    predicted = float(base.step_times(st.active, st.context)[padded])
                else:
                    padded, predicted = 0, base.plain_step_time(st.active, st.context)
                samples.setdefault((R, padded), []).append(st.seconds - predicted)
                timed.append(((R, padded), len(samples[(R, padded)]) - 1, st.seconds, predicted, probe))
        del engines
        if speed is not None:  # each cycle of rounds between two probes, at the reference speed
            speed.probe()
            for key, j, seconds, predicted, probe in timed:
                samples[key][j] = seconds * speed.factor((probe, probe + 1)) - predicted
        timed.clear()
        for batch in kinds:
            if not samples.get((R, batch)):
                raise RuntimeError(f"round overhead: no steady {'drafting' if batch else 'plain'} round at R={R}"
                                   + (f", B={batch}" if batch else "") + f" in {attempts} rounds")
    fastest = base.fastest_round_s()  # [2, R]
    floor = base.drafting_rounds_s().min(axis=0)  # [R, T]
    Rn, T = len(cost.rows), len(cost.batch_tokens)
    overhead, spread = [[0.0] * Rn for _ in OVERHEAD_KINDS], [[0.0] * Rn for _ in OVERHEAD_KINDS]
    by_batch = [[None] * T for _ in range(Rn)]
    by_batch_spread = [[None] * T for _ in range(Rn)]

    def stats(xs, lowest):
        q1, med, q3 = np.percentile(xs, [25, 50, 75])
        # The correction holds at the measured context; at the shortest profiled one it may take at most half
        # of the fastest round of its kind away (a round is never free).
        return max(float(med), -0.5 * float(lowest)), float(q3 - q1) / 2

    for i, r in enumerate(cost.rows):
        src = next((m for m in measure if m >= r), measure[-1])
        overhead[1][i], spread[1][i] = stats(samples[(src, 0)], fastest[1, i])
        measured = sorted(b for (m, b) in samples if m == src and b)
        mine = overhead_batches(cost, r)
        for t, b in enumerate(cost.batch_tokens):
            if b not in mine:
                continue
            want = b * src // r  # the same drafts per row at the source row count
            at = next((x for x in measured if x >= want), measured[-1])
            by_batch[i][t], by_batch_spread[i][t] = stats(samples[(src, at)], floor[i, t])
        if mine:  # the full block: the largest batch this row count verifies
            full = cost.batch_tokens.index(mine[-1])
            # clamped again against the fastest drafting round of this row count (a smaller batch may be
            # faster than the full block's floor), so that no round is free
            overhead[0][i] = max(by_batch[i][full], -0.5 * float(fastest[0, i]))
            spread[0][i] = by_batch_spread[i][full]
        else:  # no drafting round fits this row count in the profile
            overhead[0][i], spread[0][i] = stats(samples[(src, measured[-1])], fastest[0, i])
    return dict(overhead_s=overhead, overhead_spread_s=spread, draft_overhead_s=by_batch,
                draft_overhead_spread_s=by_batch_spread)


def add_round_overhead(table: SPSTable, target, drafter: Drafter, *, host_speed: bool = True,
                       progress: bool = False, **kw) -> SPSTable:
    """``table`` with its cost model's round overhead (re)measured (:func:`profile_round_overhead`, keyword
    arguments passed on) and its simple curve recomputed to include it; ``host_speed``: the rounds at the
    table's reference host speed (:func:`table_host_speed`)."""
    cm = table.cost_model
    if cm is None:
        raise ValueError("add_round_overhead: the table has no cost model to extend")
    speed = table_host_speed(table, target.weights, target.cfg) if host_speed else None
    cost = dataclasses.replace(cm, **profile_round_overhead(target, drafter, cm, speed=speed, progress=progress,
                                                            **kw))
    extra = {**table.metadata.extra, "round_overhead_date": datetime.date.today().isoformat(),
             "round_overhead_temperature": float(kw.get("temperature", 0.0)),
             "points": POINTS_NOTE}
    meta = dataclasses.replace(table.metadata, extra=extra)
    return SPSTable(sps_points(cost, table.metadata.context_length), meta, cost)
