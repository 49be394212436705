"""Where the time of a decoding step and of a decoding round goes, beside the target's weights-only floor.

The floor (:func:`weights_only_forward`) runs the target's weight matmuls only: the embedding lookup, the
same per-layer RMSNorms, Q/K/V/O projections and FFN, and the LM head, with no attention and no
cache. A decode or verification step over ``T`` tokens cannot cost less than the floor at ``T`` tokens, so
its ratio to the floor is what attention, the cache and the packing add (:func:`target_step_rows`).

A drafting round is cut into the programs it runs (:func:`round_stage_rows`): the drafter's layers, the LM
head over the draft vocabulary, the sequential and confidence heads, the schedule, the verification of
1..G+1 tokens per request, the drafter's context write, and a host round trip; then whole engine rounds
(``none`` and ``fixed:K``) give the round ratios and what the programs leave to the host.

Every figure of one call is measured in one process, the thunks taking turns call by call
(:func:`interleaved`), so that a host whose speed drifts (a shared machine) moves them alike and their
ratios hold. Cache contents are zeros: no operation's cost depends on the values.

Axis legend: T tokens of a call, S cache slots, R rows (requests), M tokens per slot, G block size, D width,
W draft vocabulary, V vocabulary, L context tokens held per request, C cache capacity.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from dspark_jax import scheduler
from dspark_jax.gate import GateConfig
from dspark_jax.models.drafter import Drafter, draft, draft_head_weights, init_drafter_cache, write_context
from dspark_jax.models.llama import (BUCKETS, LayerWeights, LlamaConfig, LlamaModel, LlamaWeights, bucket_for,
                                     context_bucket, decode_step, forward_packed, grid_bucket, init_cache,
                                     init_paged_cache,
                                     logits_from_hidden, rms_norm)
from dspark_jax.timing import interleaved

__all__ = ["SHUT_GATE", "interleaved", "round_stage_rows", "target_step_rows", "weights_only_forward"]


@functools.partial(jax.jit, static_argnames=("cfg",))
def weights_only_forward(weights: LlamaWeights, tokens: jax.Array, cfg: LlamaConfig) -> jax.Array:
    """The target's weight matmuls alone: what a step over ``T`` tokens cannot go below.

    The layers run unrolled over per-layer weights, as in the model; in place of attention each query head is
    multiplied by its key/value head's ``k + v`` (an elementwise stand-in that keeps the K and V projections
    live), so no cache is read or written.

    Args:
        weights: model weights.
        tokens: int [T] token ids.
        cfg: static config.
    Returns:
        float32 logits [T, V].

    >>> cfg = LlamaConfig.tiny()
    >>> from dspark_jax.models.llama import init_random_weights
    >>> weights_only_forward(init_random_weights(cfg, jax.random.key(0)), jnp.arange(3), cfg).shape
    (3, 64)
    """
    T = tokens.shape[0]
    H, K, E = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def layer(x, lw: LayerWeights):
        h = rms_norm(x, lw.attn_norm, cfg.norm_eps)
        q, k, v = h @ lw.wq, h @ lw.wk, h @ lw.wv  # [T, H*E], [T, K*E], [T, K*E]
        mixed = q.reshape(T, K, H // K, E) * (k + v).reshape(T, K, 1, E)  # [T, K, Q, E]
        x = x + mixed.reshape(T, H * E) @ lw.wo
        h = rms_norm(x, lw.mlp_norm, cfg.norm_eps)
        x = x + (jax.nn.silu(h @ lw.w_gate) * (h @ lw.w_up)) @ lw.w_down
        return x

    x = weights.embed[tokens]  # [T, D]
    for lw in weights.layers:
        x = layer(x, lw)
    return logits_from_hidden(weights, rms_norm(x, weights.final_norm, cfg.norm_eps))


def _floor_thunk(weights: LlamaWeights, cfg: LlamaConfig, tokens: int) -> Callable[[], jax.Array]:
    ids = jnp.zeros((tokens,), jnp.int32)
    return lambda: weights_only_forward(weights, ids, cfg)


def _held_cache(weights, cfg, *, slots: int, capacity: int, context: int, cache_dtype=None, kv_layout: str = "slots",
                page_size: int = 16):
    """A cache of ``slots`` slots that each hold ``context`` tokens, in ``cache_dtype`` (default: the weights'):
    dense per slot (``kv_layout`` "slots") or a page pool whose pages are dealt to the slots in a shuffled order
    ("pages": a block table as an allocator leaves it)."""
    dtype = weights.embed.dtype if cache_dtype is None else cache_dtype
    lengths = jnp.full((slots,), context, jnp.int32)
    if kv_layout == "slots":
        return init_cache(cfg, slots, capacity, dtype).replace(lengths=lengths)
    per_slot = -(-capacity // page_size)
    tables = np.random.default_rng(0).permutation(slots * per_slot).astype(np.int32).reshape(slots, per_slot)
    return init_paged_cache(cfg, slots, num_pages=slots * per_slot, page_size=page_size, pages_per_slot=per_slot,
                            dtype=dtype, block_tables=tables).replace(lengths=lengths)


def _decode_thunk(weights, cfg, *, slots: int, context: int, window: int, capacity: int, cache_dtype=None,
                  kv_layout: str = "slots"):
    """Plain decode of one token in each of ``slots`` slots that hold ``context`` tokens (it stays there)."""
    state = {"cache": _held_cache(weights, cfg, slots=slots, capacity=capacity, context=context,
                                  cache_dtype=cache_dtype, kv_layout=kv_layout)}
    tokens, active = jnp.zeros((slots,), jnp.int32), jnp.ones((slots,), bool)

    def step():
        logits, _, cache = decode_step(weights, state["cache"], tokens, active, cfg, window)
        state["cache"] = cache.replace(lengths=cache.lengths - 1)
        return logits

    return step


def _verify_thunk(weights, cfg, *, rows: int, per_row: int, max_per_slot: int, context: int, window: int,
                  capacity: int, cache_dtype=None, kv_layout: str = "slots"):
    """Packed verification as the engine runs it: ``per_row`` tokens of each of ``rows`` requests (slots
    0..R-1) at positions L, L + 1, ..., padded to a bucket; the grid of ``max_per_slot`` cells per row."""
    n = rows * per_row
    T = bucket_for(n)
    idx = np.arange(T)
    tokens = jnp.asarray(idx % cfg.vocab_size, jnp.int32)
    slots = jnp.asarray(np.minimum(idx // per_row, rows - 1), jnp.int32)
    positions = jnp.asarray(context + idx % per_row, jnp.int32)
    valid = jnp.asarray(idx < n)
    row_slots = jnp.arange(rows, dtype=jnp.int32)
    state = {"cache": _held_cache(weights, cfg, slots=rows, capacity=capacity, context=context,
                                  cache_dtype=cache_dtype, kv_layout=kv_layout)}

    def step():
        logits, _, state["cache"] = forward_packed(weights, state["cache"], tokens, slots, positions, valid, cfg,
                                                   max_per_slot, row_slots, window)
        return logits

    return step


def target_step_rows(weights: LlamaWeights, cfg: LlamaConfig, *, slots: Sequence[int] = (1, 4, 16, 64),
                     contexts: Sequence[int] = (256, 1024), per_slot: Sequence[int] = (1, 8), repeats: int = 5,
                     burst: int = 2, progress: Callable[[str], None] | None = None,
                     cache_dtype: Any = None, kv_layout: str = "slots") -> list[dict[str, Any]]:
    """The target's decode and verification steps beside the weights-only floor at the same token count.

    For every context L and slot count S: the decode step (``per_slot`` 1: one token per slot,
    `decode_step`) and the packed verification of M tokens per slot (each other ``per_slot`` M, T = S * M,
    `forward_packed` on the slot grid), every slot holding L tokens and the attention window
    ``context_bucket(L + M)``; the floor at the same T. One group of thunks (the steps and their floors at
    one (L, S)) is timed in turns (:func:`interleaved`).

    Args:
        weights, cfg: the target.
        slots: slot counts S; contexts: tokens held per slot L; per_slot: tokens per slot M (1: decode).
        repeats: timed calls of each thunk; burst: calls per turn, the last timed (:func:`interleaved`).
        progress: called with a label before each group (e.g. ``print``).
        cache_dtype: the KV cache's dtype (default: the weights'); the floor holds no cache.
        kv_layout: "slots" (dense caches, read in place) or "pages" (a page pool read through the block table,
          by the ragged paged attention kernel of the backend: what the engine runs on one GPU or TPU).
    Returns:
        rows ``{"kind": "decode" | "verify", "slots", "context", "per_slot", "tokens", "window", "step_ms",
        "floor_ms", "ratio"}``; ratio = step / floor.
    """
    rows = []
    for L in contexts:
        for S in slots:
            if progress is not None:
                progress(f"target steps: context {L}, {S} slots")
            capacity = context_bucket(L + max(per_slot), 1 << 30)
            thunks, meta = {}, {}
            for M in per_slot:
                window = context_bucket(L + M, capacity)
                if M == 1:
                    thunks["step:1"] = _decode_thunk(weights, cfg, slots=S, context=L, window=window,
                                                     capacity=capacity, cache_dtype=cache_dtype, kv_layout=kv_layout)
                else:
                    thunks[f"step:{M}"] = _verify_thunk(weights, cfg, rows=S, per_row=M, max_per_slot=M, context=L,
                                                        window=window, capacity=capacity,
                                                        cache_dtype=cache_dtype, kv_layout=kv_layout)
                meta[M] = (S * M, window)
                thunks.setdefault(f"floor:{S * M}", _floor_thunk(weights, cfg, S * M))
            times = interleaved(thunks, repeats=repeats, burst=burst)
            for M, (T, window) in meta.items():
                step, floor = times[f"step:{M}"].median, times[f"floor:{T}"].median
                rows.append({"kind": "decode" if M == 1 else "verify", "slots": S, "context": L, "per_slot": M,
                             "tokens": T, "window": window, "step_ms": 1e3 * step, "floor_ms": 1e3 * floor,
                             "ratio": step / floor})
            del thunks
    return rows


# ----------------------------------------------------------------------------------------------------
# A drafting round, stage by stage


def _drafter_stage_thunks(drafter: Drafter, target: LlamaModel, *, rows: int, context: int, window: int
                          ) -> dict[str, Callable[[], Any]]:
    """Thunks for the stages of the draft program at ``rows`` requests holding ``context`` tokens."""
    cfg = drafter.cfg
    G = cfg.block
    graphdef, params = nnx.split(drafter)
    embed = target.weights.embed
    head_w = draft_head_weights(drafter, embed, target.weights.lm_head)  # [D, W]
    dcache = init_drafter_cache(cfg, rows, window)  # float32, as the engine's
    slots = jnp.arange(rows, dtype=jnp.int32)
    ctx_len = jnp.full((rows,), context, jnp.int32)
    anchors = jnp.zeros((rows,), jnp.int32)
    keys = jax.random.split(jax.random.key(0), rows)
    temperature = jnp.float32(0.0)
    h = jnp.zeros((rows, G, cfg.dim), embed.dtype)  # [R, G, D]

    @jax.jit
    def layers(params, cache):
        d = nnx.merge(graphdef, params)
        ctx_k, ctx_v = cache.k[:, slots, :window], cache.v[:, slots, :window]  # [L, R, C, K, E]
        mask = (jnp.arange(window)[None, :] < ctx_len[:, None])[:, None, :]  # [R, 1, C]
        return d.hidden(ctx_k, ctx_v, mask, anchors[:, None], ctx_len[:, None], embed)

    @jax.jit
    def lm_head(h):
        return jnp.einsum("rgd,dw->rgw", h, head_w).astype(jnp.float32)  # [R, G, W]

    @jax.jit
    def heads(params, h):
        d = nnx.merge(graphdef, params)
        if not cfg.uses_prev_token and not cfg.confidence:
            return jnp.zeros((rows, G), jnp.float32)
        e = d.prev_embedding(jnp.zeros((rows, G), jnp.int32)) if cfg.uses_prev_token else None

        def step(state, xs):  # one slot after the other, as the block is sampled
            h_k, e_k = xs
            bias, conf, state = d.head_step(h_k, e_k, state)
            out = (jnp.zeros((rows,)) if bias is None else jnp.sum(bias, -1)) + (0.0 if conf is None else conf)
            return state, out

        e = jnp.zeros((rows, G, cfg.rank), h.dtype) if e is None else e
        _, out = lax.scan(step, jnp.zeros((rows, cfg.rank), h.dtype), (jnp.moveaxis(h, 1, 0), jnp.moveaxis(e, 1, 0)))
        return out

    @jax.jit
    def confidence(params, h):
        d = nnx.merge(graphdef, params)
        if not cfg.confidence:
            return jnp.zeros((rows, G), jnp.float32)
        e = jnp.zeros((rows, G, cfg.rank), h.dtype)
        return d.conf(jnp.concatenate([h, e], axis=-1))[..., 0]  # [R, G]

    @functools.partial(jax.jit, static_argnames=("window",))
    def whole(params, cache, *, window):
        return draft(nnx.merge(graphdef, params), cache, slots, ctx_len, anchors, keys, temperature, embed, head_w,
                     context=window)

    return {"drafter layers": lambda: layers(params, dcache), "LM head": lambda: lm_head(h),
            "sequential + confidence heads": lambda: heads(params, h),
            "confidence head": lambda: confidence(params, h),
            "draft program": lambda: whole(params, dcache, window=window)}


def _schedule_thunk(rows: int, G: int):
    """Algorithm 1 and the fill to the bucket on [R, G] confidences, against a flat steps/s curve."""
    conf = jnp.full((rows, G), 0.7, jnp.float32)
    sps = jnp.linspace(20.0, 5.0, BUCKETS[-1] + 1).astype(jnp.float32)
    buckets = jnp.asarray(BUCKETS, jnp.int32)

    @jax.jit
    def run(conf):
        lengths = scheduler.schedule(conf, sps).lengths
        return scheduler.fill_to_bucket(conf, lengths, buckets)

    return lambda: run(conf)


def _write_thunk(drafter: Drafter, *, tokens: int, capacity: int, dtype):
    """The drafter's context write of ``tokens`` verified tokens' taps."""
    cfg = drafter.cfg
    graphdef, params = nnx.split(drafter)
    taps = jnp.zeros((tokens, cfg.n_taps, cfg.dim), dtype)  # [T, N, D]
    idx = jnp.arange(tokens, dtype=jnp.int32)
    state = {"cache": init_drafter_cache(cfg, 1, capacity)}  # float32, as the engine's

    @functools.partial(jax.jit, donate_argnums=(1,))
    def run(params, cache):
        return write_context(nnx.merge(graphdef, params), cache, taps, jnp.zeros_like(idx), idx % capacity,
                             jnp.ones((tokens,), bool))

    def step():
        state["cache"] = run(params, state["cache"])
        return state["cache"].k

    return step


def _round_trip_thunk():
    """One host round trip: a tiny program, its result brought back to the host (what each sync costs)."""
    x = jnp.zeros((8,), jnp.int32)
    run = jax.jit(lambda x: x + 1)
    return lambda: np.asarray(run(x))


SHUT_GATE = "dspark, gate shut"  # the round row of a dspark engine whose drafter gate never opens


def _engine_rounds(target: LlamaModel, drafter: Drafter, *, users: int, context: int, policies: Sequence[str],
                   rounds: int, warmup: int, seed: int = 0, sps: Any = None) -> dict[str, float]:
    """Median seconds of a steady round (nothing compiled, no admission) of each policy's engine, the engines
    stepped in turns. ``SHUT_GATE``: a ``dspark`` engine on the cost model of ``sps`` whose gate never opens
    nor probes (what a drafting engine pays in a round it does not draft: the drafter's context write and the
    gate's bookkeeping and decision)."""
    from dspark_jax.build import LoadedDrafter, build_engine  # noqa: PLC0415 (build imports the engine)

    G = drafter.cfg.block
    bare = LlamaModel(target.cfg, target.weights, None)  # no stop tokens: requests run to their budget
    own = LoadedDrafter(drafter, sts_temperatures=None, prior_confidence=0.7, path=None)
    max_new = (warmup + 3 * rounds) * (G + 1) + 2
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, target.cfg.vocab_size, context).tolist() for _ in range(users)]
    engines = {}
    shut = GateConfig(margin=1e6, probe_every=10**9, probe_budget=float("inf"), off_after=None,
                      calibrate_times=False)
    for pol in policies:
        extra = dict(sps=sps, gate=shut) if pol == SHUT_GATE else {}
        eng = build_engine(bare, "dspark" if pol == SHUT_GATE else pol, draft=own, num_slots=users,
                           max_prompt_tokens=context, max_new_tokens=max_new, **extra)
        for p in prompts:
            eng.submit(p, max_new)
        engines[pol] = eng
    samples: dict[str, list[float]] = {pol: [] for pol in policies}
    for i in range(warmup + 3 * rounds):
        if all(len(s) >= rounds for s in samples.values()):
            break
        for pol, eng in engines.items():
            st = eng.step().stats
            if st is None or i < warmup or st.compiled or len(samples[pol]) >= rounds:
                continue
            samples[pol].append(st.seconds)
    for pol, s in samples.items():
        if not s:
            raise RuntimeError(f"no steady round of policy {pol} at {users} users in {warmup + 3 * rounds} rounds")
    return {pol: float(np.median(s)) for pol, s in samples.items()}


def round_stage_rows(target: LlamaModel, drafter: Drafter, *, users: Sequence[int] = (1, 4, 16),
                     context: int = 140, verify_tokens: Sequence[int] = (1, 2, 4, 8),
                     drafts: Sequence[int] = (1, 3, 7), repeats: int = 5, rounds: int = 8, warmup: int = 2,
                     burst: int = 2, progress: Callable[[str], None] | None = None,
                     sps: Any = None) -> list[dict[str, Any]]:
    """One decoding round cut into stages at each number of users, beside the weights-only floor and the
    engine's own rounds.

    Stages (each its own program, timed in turns with the others of the same user count): the drafter's
    layers, the LM head over the draft vocabulary, the sequential and confidence heads (their scan over the
    block) and the confidence head alone, the whole draft program, the schedule (Algorithm 1 and the
    bucket fill), the verification of k tokens per request (k in ``verify_tokens``; k = 1 is a plain round's
    step) and the floor at the same padded token count, the drafter's context write for a full block, and
    one host round trip (a round syncs twice: the batch size, then the round's results). Then whole engine
    rounds: ``none`` and ``fixed:K`` for K in ``drafts`` (random drafter: nearly nothing is accepted, so each
    round verifies K + 1 tokens per request), and, given an SPS table with a cost model (``sps``), a ``dspark``
    engine whose gate stays shut (``SHUT_GATE``: a plain round plus the drafter's context and the gate), the
    engines stepped in turns.

    A stage run alone pays its own dispatch, which inside the draft program it does not; the round rows say
    what the programs leave to the host (``rest`` = round - draft program - schedule - verification -
    context write).

    Args:
        target: the target model; drafter: a drafter for it (random weights cost the same).
        users: numbers of requests decoded together (R); context: tokens each holds (L).
        verify_tokens: tokens per request of the verification rows; drafts: K of the ``fixed:K`` rounds.
        repeats: timed calls per stage; burst: calls per turn, the last timed (:func:`interleaved`);
        rounds, warmup: steady engine rounds timed, and rounds skipped first.
        progress: called with a label before each group.
        sps: an `SPSTable` with a cost model for the target and drafter (adds the shut-gate round), or None.
    Returns:
        rows ``{"users", "stage", "ms", "of_plain_round", "of_floor"}`` (the ratios to the plain round and
        to the floor at ``users`` tokens), the round rows with ``"tokens"`` (padded verification tokens)
        and ``"rest_ms"``.
    """
    G = drafter.cfg.block
    cfg = target.cfg
    dtype = target.weights.embed.dtype
    out = []
    for R in users:
        if progress is not None:
            progress(f"round stages: {R} users")
        window_d = context_bucket(context, 1 << 30)
        thunks = _drafter_stage_thunks(drafter, target, rows=R, context=context, window=window_d)
        thunks["schedule"] = _schedule_thunk(R, G)
        thunks["context write"] = _write_thunk(drafter, tokens=bucket_for(R * (G + 1)),
                                               capacity=window_d + bucket_for(R * (G + 1)), dtype=dtype)
        thunks["host round trip"] = _round_trip_thunk()
        for k in verify_tokens:
            window_v = context_bucket(context + k, 1 << 30)
            thunks[f"verify {k}"] = _verify_thunk(target.weights, cfg, rows=R, per_row=k,
                                                  max_per_slot=1 if k == 1 else grid_bucket(k, G + 1), context=context,
                                                  window=window_v, capacity=window_v)
            T = bucket_for(R * k)
            thunks.setdefault(f"floor {T}", _floor_thunk(target.weights, cfg, T))
        times = {name: t.median for name, t in interleaved(thunks, repeats=repeats, burst=burst).items()}
        del thunks
        if progress is not None:
            progress(f"engine rounds: {R} users")
        policies = ["none"] + [f"fixed:{k}" for k in drafts] + ([SHUT_GATE] if sps is not None else [])
        rounds_s = _engine_rounds(target, drafter, users=R, context=context, policies=policies, rounds=rounds,
                                  warmup=warmup, sps=sps)
        plain, floor = rounds_s["none"], times[f"floor {bucket_for(R)}"]
        for name, s in times.items():
            out.append({"users": R, "stage": name, "ms": 1e3 * s, "of_plain_round": s / plain, "of_floor": s / floor})
        for pol, s in rounds_s.items():
            if pol == SHUT_GATE:  # one token a request, what plain decoding verifies
                out.append({"users": R, "stage": f"round {pol}", "ms": 1e3 * s, "of_plain_round": s / plain,
                            "of_floor": s / floor, "tokens": bucket_for(R), "rest_ms": None})
                continue
            k = 0 if pol == "none" else int(pol.split(":")[1])
            T = bucket_for(R * (k + 1))
            verify = times.get(f"verify {k + 1}")
            drafting = 0.0 if k == 0 else times["draft program"] + times["schedule"]
            rest = None if verify is None else s - verify - drafting - (times["context write"] if k else 0.0)
            out.append({"users": R, "stage": f"round {pol}", "ms": 1e3 * s, "of_plain_round": s / plain,
                        "of_floor": s / floor, "tokens": T, "rest_ms": None if rest is None else 1e3 * rest})
    return out
