"""The engine's jitted programs: pure functions of a static `RoundSpec`, the constant `RoundInputs` and the
`EngineState` (with a few arrays of the round).

A round runs as two programs with static shapes:

1. `draft_and_schedule` (per row bucket R): the drafter's backbone pass and sequential sampling scan for
   the active rows, calibrated confidences, and the scheduling policy -> verification lengths [R];
2. `verify_and_commit` (per row bucket R and token bucket T): pack only the scheduled tokens of every
   active row into one flat batch of T tokens, run the target once, accept with `verify.speculative_accept`
   (or the argmax at temperature 0), commit the accepted prefix to the target cache and the drafter's context
   cache, and emit tokens;

and, with a cost model, `verify_and_commit` also decides the drafter gate of the next round on the state it
commits (one program and one host read a round besides the draft program's token count). Admission runs
`prefill_program` (`write_chunk_context` with the drafter's context) per prompt chunk, `sample_first` for the
first token, `admit_slot` and `free_slot`.

Axis legend: S slots, R rows of a round, G block, T packed tokens, P chunk or positions, V vocabulary,
W draft vocabulary.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import calibration, gate, grammar, scheduler, verify
from dspark_jax.engine.policy import policy_lengths
from dspark_jax.engine.state import EngineState, RoundInputs, RoundSpec
from dspark_jax.models import drafter as dr
from dspark_jax.models.llama import (BUCKETS, PagedKVCache, commit, first_argmax, forward_packed,
                                     logits_from_hidden, prefill)
from dspark_jax.sampling import MAX_LOGPROBS, categorical, logprobs_at, safe_log
from dspark_jax.sps import plain_sps_from_cost, sps_from_cost

__all__ = ["DraftOut", "RoundOut", "Logprobs", "prefill_program", "write_chunk_context", "sample_first",
           "free_slot", "admit_slot", "draft_and_schedule", "verify_and_commit"]


class DraftOut(NamedTuple):
    """What `draft_and_schedule` gives `verify_and_commit` (and the host: the batch size B)."""

    tokens: jax.Array  # int32 [R, G]
    probs: jax.Array  # float32 [R, G, W]
    conf: jax.Array  # float32 [R, G] calibrated per-token confidences
    conf_logits: jax.Array  # float32 [R, G] the confidence head's raw logits
    lengths: jax.Array  # int32 [R] scheduled drafts
    batch_tokens: jax.Array  # int32 []
    drafted: jax.Array  # bool [] False when the round skipped the drafter (plain decoding was expected faster)


class RoundOut(NamedTuple):
    """What `verify_and_commit` gives the host: the emitted tokens and counters of every row."""

    emitted: jax.Array  # int32 [R, G + 1]
    counts: jax.Array  # int32 [R] emitted tokens per row
    finished: jax.Array  # bool [R]
    accepted: jax.Array  # int32 [R] accepted drafts
    new_lengths: jax.Array  # int32 [R] committed tokens after the round
    logprobs: "Logprobs"  # of the emitted tokens, per row and column [R, Gv + 1] (zeros unless asked for)
    # With a cost model and the drafter's context (else nan, True, nan): the cost model's time for this round
    # (seconds, float32 []: the host compares it with the measured one), whether the drafter gate opens for the
    # next round (bool []) and the gain its estimate expects (float32 []), from `gate.decide` on the new state.
    predicted: jax.Array
    next_gate: jax.Array
    gain: jax.Array


class Logprobs(NamedTuple):
    """Raw log-probabilities of tokens at some positions (`sampling.logprobs_at`), with the top alternatives."""

    chosen: jax.Array  # float32 [...P]
    top_ids: jax.Array  # int32 [...P, K]
    top: jax.Array  # float32 [...P, K]


def _key(seed, stream: int, request, position):
    """PRNG key per (seed, stream, request, position); vectorised over request/position arrays [R], the seed
    a scalar or one per row [R]."""
    seeds = jnp.broadcast_to(jnp.asarray(seed, jnp.int32), jnp.shape(request))

    def one(s, r, p):
        return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(jax.random.key(s), stream), r), p)

    return jax.vmap(one)(seeds, request, position)


def _block_tables(cache):
    """The block table of a paged target cache (the drafter's pages follow it), else None."""
    return cache.block_tables if isinstance(cache, PagedKVCache) else None


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def prefill_program(spec: RoundSpec, inputs: RoundInputs, state: EngineState, chunk, slot, start, n_valid,
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


def write_chunk_context(spec: RoundSpec, inputs: RoundInputs, state: EngineState, chunk, slot, start, n_valid,
                        follow, prompt_logprobs):
    """A prompt chunk of a request with the drafter's context: `prefill_program` writing that context too (the
    same compiled program as a chunk without it)."""
    return prefill_program(spec, inputs, state, chunk, slot, start, n_valid, follow, prompt_logprobs,
                            write_context=np.True_)


@jax.jit
def sample_first(logits, request, position, temperature, top_p, seed, mask, constrained, logprobs):
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
def free_slot(state, slot):
    """Mark ``slot`` inactive (a cancelled or stopped request); the next admission overwrites the rest."""
    return state.replace(active=state.active.at[slot].set(False))


@functools.partial(jax.jit, donate_argnames=("state",))
def admit_slot(state, slot, request, first, max_new, live, seed, temperature, top_p, eos_stops):
    """A prefilled request joins ``slot`` with its first token ``first`` as the anchor (decoding where ``live``),
    its key id, sampling settings and budget; its gate state and confidence history start afresh."""
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


def _next_gate(spec: RoundSpec, inputs: RoundInputs, time_scale, state: EngineState, n_active, longest, drafted):
    """After a round, on the committed state: the cost model's time for the round that just ran (drafting at the
    round's token bucket ``spec.tokens``, or plain, with ``n_active`` requests whose longest held ``longest``
    tokens) and the drafter gate of the next round for the requests still active (`gate.decide`, so the host can
    skip the draft program): (predicted seconds, opens, gain)."""
    cost = inputs.cost
    n_active = jnp.maximum(n_active, 1)
    sps = sps_from_cost(cost, n_active, longest)
    predicted = jnp.where(drafted, 1.0 / sps[min(spec.tokens, sps.shape[0] - 1)],
                          1.0 / plain_sps_from_cost(cost, n_active, longest)).astype(jnp.float32)
    rows, row_valid = _device_rows(state.active, spec.rows)
    opens, _, gain = gate.decide(state.gate, spec.gate, cost, rows, row_valid, state.cache.lengths[rows], time_scale)
    return predicted, opens, gain


@functools.partial(jax.jit, static_argnames=("spec",))
def draft_and_schedule(spec: RoundSpec, inputs: RoundInputs, state: EngineState, time_scale) -> DraftOut:
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
def verify_and_commit(spec: RoundSpec, inputs: RoundInputs, state: EngineState, d: DraftOut | None, conf,
                      drafted, time_scale, *, drafting, masks, constrained, logprobs) -> tuple[EngineState, RoundOut]:
    """Pack the scheduled tokens, verify them with one target pass, accept, commit, emit.

    With a drafter (``inputs.dstate``), ``conf`` [R, G] and ``drafted`` [] are the round's calibrated
    confidences and whether the drafter ran (zeros and False when the host skipped the draft program), and
    ``drafting`` (bool []) says whether some request of the round has the drafter's context: then its context
    cache is written for every committed token, drafted round or not, and the gate's bookkeeping
    (`gate.update`) follows the round; else the round is plain decoding's (both skipped under ``lax.cond``).
    Without a drafter, ``conf`` and ``drafted`` are None (``drafting`` is not read). ``spec.per_slot`` is the verification grid's width:
    with the drafts ``d``, `grid_width` of the round's shape (the attention's reads grow with it), or 1 with
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
    With a cost model (``inputs.cost``, the dspark policies) and ``drafting``, the round's predicted time and the
    next round's gate (`gate.decide` on the committed state) come back in `RoundOut` (nan, True, nan otherwise).
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
    unknown = (jnp.float32(jnp.nan), jnp.bool_(True), jnp.float32(jnp.nan))
    after = unknown
    if inputs.cost is not None and inputs.dstate is not None:  # the next round's gate, where a request drafts
        n_active = jnp.sum(row_valid, dtype=jnp.int32)
        longest = jnp.max(jnp.where(row_valid, ctx_len, 0))
        after = jax.lax.cond(drafting, lambda: _next_gate(spec, inputs, time_scale, new_state, n_active, longest,
                                                          drafted), lambda: unknown)
    out = RoundOut(emitted, counts, finished, n_acc.astype(jnp.int32), new_len.astype(jnp.int32), lp, *after)
    return new_state, out
