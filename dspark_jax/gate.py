"""The drafter gate of the ``dspark`` policies: whether drafting will pay in the next round, as pure functions.

The drafter's own pass is paid before the schedule exists, so whether to draft at all is decided from
estimates made before this round's drafts: each request's average survival (cumulative product of calibrated
confidences) per position over its earlier drafted rounds, the cost model's round times and what
verification accepted per predicted draft recently. Three pieces, each an explicit state with pure functions
(as optax writes its transformations), so a loop of one's own can use them as the engine does:

- on the device, `GateState` (a pytree): `init`, `admit` (a joining request starts from the engine-wide
  average), `update` (the bookkeeping after a round) and `decide` (open the gate or not; a closed gate still
  probes now and then, since the averages move only in drafted rounds);
- on the host, `CutOff`: per load (row bucket), the request-rounds in a row whose estimate stayed below the
  bar, each request counting at most its share; past `GateConfig.off_after` of them from at least
  `GateConfig.off_requests` requests the drafter is switched off at that load, and tried again after
  `GateConfig.off_retry` rounds (`cutoff_update`, `drafter_off`);
- on the host, `RoundTimes`: the measured correction of the cost model's drafting and plain round times
  (`observe_round`, `time_scale`), which `decide` reads as ``time_scale`` [2].

Every decision reads nothing drawn in the round it decides, so the output stays lossless whatever it decides.

Axis legend: S slots, R rows of a round, G block, N batch tokens of a steps/s curve.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import scheduler
from dspark_jax.models.llama import BUCKETS
from dspark_jax.sps import plain_sps_from_cost, sps_from_cost

__all__ = ["GateConfig", "GateState", "init", "admit", "update", "decide", "conditional", "CutOff",
           "cutoff_update", "drafter_off", "RoundTimes", "observe_round", "time_scale"]


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_share(x, lo_open: bool = True) -> bool:
    """A number in (0, 1] (``lo_open``) or [0, 1]."""
    return isinstance(x, (int, float, np.floating)) and (0 < x <= 1 if lo_open else 0 <= x <= 1)


@dataclasses.dataclass(frozen=True)
class GateConfig:
    """The gate's static settings (frozen and hashable: a static argument of jitted programs); an engine takes
    them as `EngineConfig.gate`, where they act with the ``dspark`` policies only.

    Attributes:
      probe_every: a closed gate drafts anyway (a probe, refreshing its estimates, which move only in drafted
        rounds) after at least this many skipped rounds (integer >= 1) ...
      probe_budget: ... and after at least as many as keep the probes' expected loss under this share of
        the time (> 0; inf: every ``probe_every`` rounds). A probe's expected loss is a drafting round's time
        times the share of plain decoding's throughput it is expected to lose (from the cost model and the same
        estimates): near break-even a probe costs little and comes often; at high load a probe loses most of
        a round that costs several plain ones, so it comes rarely. Either way the decision is made from
        counters and earlier rounds alone, so probes keep the output lossless.
      margin: draft only when the estimate beats plain decoding's throughput by ``1 + margin`` (finite, >= 0).
        The cost model's drafting/plain ratio moves by up to ~10% between measurements on a shared 2-core host,
        and the per-request confidence averages are noisy, so a gate that opens on any expected gain opens on
        estimates that are too high (docs/design.md, the drafter gate). 0 trusts the estimates as they are.
      fill: extend each round's schedule with the next-ranked drafts up to the padded batch the verification
        runs anyway (`scheduler.fill_to_bucket`, lossless), and price the drafting round at that padded batch
        with the filled schedule's expected tokens, as the engine runs it.
      off_after: once the estimate has stayed below the bar (drafting not expected to pay by ``1 + margin``;
        probes aside) for this many request-rounds in a row at one load (row bucket: 1, 2, 3-4, 5-8, ... active
        requests), from at least ``off_requests`` distinct requests, the drafter is switched off at that load:
        the active requests drop the drafter's context (the rounds become plain decoding's own programs at once) and
        requests joining at that load are admitted without one. A gate that opens on its estimate at a load
        resets that load's count. Integer >= 1; None: never (the gate alone decides, every request keeps its
        context).
      off_requests: the distinct requests that evidence comes from, each counting at most
        ``ceil(off_after / off_requests)`` of its rounds (integer >= 1). Counted in request-rounds, a busy
        engine decides within a few rounds (128 at 16 users: 8 rounds); over distinct requests, an idle one
        needs several answers' evidence (8 answers at one user), never one long answer that happens not to draft
        well.
      off_retry: rounds with the drafter off at a load before it is tried there again (integer >= 1): joining
        requests get the context again and, once the requests without one have finished, the gate looks afresh
        (the traffic, and so the drafts' acceptance, may have changed). Counted in rounds so that the wait for
        those requests to finish, a few hundred rounds, stays a small share.
      calibrate_times: fold measured round times into the cost model's (`observe_round`: a host factor and the
        drafting rounds' excess over it, `Engine.time_scale`); False ignores them. On by default: a table
        measured on another host, or on this one while it was busy, can misprice the two kinds of round against
        each other by half (docs/design.md). The output stays lossless either way; with it, which rounds draft
        depends on timings, so sampled tokens (not their law) can differ between runs of the same seed: False
        for reproducible samples. An engine turns it off under jax.distributed (several processes), where every
        process must take the same decisions.
      request_ema: weight of the newest drafted round in a request's survival average, in (0, 1].
      global_ema: weight of the newest drafted round in the engine-wide average, in (0, 1].
      accept_decay: per drafted round, decay of the (predicted, accepted) sums, in (0, 1].
      accept_prior: the pseudo-count both sums start from (> 0, finite: ratio 1 until drafts are seen).
      time_ema: weight of the newest round in the measured round-time correction, in (0, 1].

    >>> GateConfig(margin=0.1).margin
    0.1
    >>> GateConfig(probe_every=0)
    Traceback (most recent call last):
    ...
    ValueError: probe_every: expected an integer >= 1, got 0
    """

    probe_every: int = 2
    probe_budget: float = 0.02
    margin: float = 0.05
    fill: bool = True
    off_after: int | None = 128
    off_requests: int = 8
    off_retry: int = 2048
    calibrate_times: bool = True
    request_ema: float = 0.2
    global_ema: float = 0.3
    accept_decay: float = 0.98
    accept_prior: float = 4.0
    time_ema: float = 0.1

    def __post_init__(self):
        if not (_is_int(self.probe_every) and self.probe_every >= 1):
            raise ValueError(f"probe_every: expected an integer >= 1, got {self.probe_every!r}")
        if not (isinstance(self.probe_budget, (int, float, np.floating)) and self.probe_budget > 0):
            raise ValueError(f"probe_budget: expected a share > 0 (inf: probe every probe_every rounds), "
                             f"got {self.probe_budget!r}")
        if not (isinstance(self.margin, (int, float, np.floating)) and np.isfinite(self.margin)
                and self.margin >= 0):
            raise ValueError(f"margin: expected a finite share >= 0, got {self.margin!r}")
        if not isinstance(self.fill, (bool, np.bool_)):
            raise ValueError(f"fill: expected True or False, got {self.fill!r}")
        if self.off_after is not None and not (_is_int(self.off_after) and self.off_after >= 1):
            raise ValueError(f"off_after: expected None or a number of request-rounds >= 1, got {self.off_after!r}")
        if not (_is_int(self.off_requests) and self.off_requests >= 1):
            raise ValueError(f"off_requests: expected an integer >= 1, got {self.off_requests!r}")
        if not (_is_int(self.off_retry) and self.off_retry >= 1):
            raise ValueError(f"off_retry: expected an integer >= 1, got {self.off_retry!r}")
        if not isinstance(self.calibrate_times, (bool, np.bool_)):
            raise ValueError(f"calibrate_times: expected True or False, got {self.calibrate_times!r}")
        for name in ("request_ema", "global_ema", "accept_decay", "time_ema"):
            if not _is_share(getattr(self, name)):
                raise ValueError(f"{name}: expected a weight in (0, 1], got {getattr(self, name)!r}")
        if not (isinstance(self.accept_prior, (int, float, np.floating)) and np.isfinite(self.accept_prior)
                and self.accept_prior > 0):
            raise ValueError(f"accept_prior: expected a finite pseudo-count > 0, got {self.accept_prior!r}")


class GateState(NamedTuple):
    """The gate's device state (a pytree; every leaf an array of fixed shape)."""

    survival: jax.Array  # float32 [S, G] per-request average survival per position over its drafted rounds
    global_survival: jax.Array  # float32 [G] engine-wide average survival (a joining request's start)
    accept_seen: jax.Array  # float32 [2] decayed sums over drafted rounds of (predicted, accepted) drafts
    skipped: jax.Array  # int32 [] consecutive rounds that skipped the drafter


def init(config: GateConfig, num_slots: int, block: int, prior_confidence: float) -> GateState:
    """A fresh gate: every survival average ``prior_confidence ** k`` at position k, sums at the prior.

    Args:
      config: the gate's settings (``accept_prior``).
      num_slots: S, the request slots.
      block: G, drafts per block.
      prior_confidence: the per-position confidence the averages start from, in [0, 1].
    Returns:
      A `GateState` with survival [S, G], global_survival [G], accept_seen [2], skipped [].

    >>> s = init(GateConfig(), 2, 3, 0.5)
    >>> s.survival.shape, s.global_survival.tolist(), s.accept_seen.tolist(), int(s.skipped)
    ((2, 3), [0.5, 0.25, 0.125], [4.0, 4.0], 0)
    """
    if not (_is_int(num_slots) and num_slots >= 1 and _is_int(block) and block >= 1):
        raise ValueError(f"num_slots, block: expected integers >= 1, got {num_slots!r}, {block!r}")
    if not _is_share(prior_confidence, lo_open=False):
        raise ValueError(f"prior_confidence: expected a number in [0, 1], got {prior_confidence!r}")
    prior = jnp.cumprod(jnp.full((block,), prior_confidence, jnp.float32))  # [G]
    return GateState(survival=jnp.broadcast_to(prior, (num_slots, block)), global_survival=prior,
                     accept_seen=jnp.full((2,), config.accept_prior, jnp.float32), skipped=jnp.int32(0))


def admit(state: GateState, slot) -> GateState:
    """A request joining ``slot`` (int32 []) starts from the engine-wide average survival.

    >>> s = init(GateConfig(), 2, 2, 0.5)._replace(global_survival=jnp.array([0.9, 0.8]))
    >>> admit(s, 1).survival.tolist()
    [[0.5, 0.25], [0.8999999761581421, 0.800000011920929]]
    """
    return state._replace(survival=state.survival.at[slot].set(state.global_survival))


def update(state: GateState, config: GateConfig, rows, row_valid, conf, lengths, accepted, drafted) -> GateState:
    """The gate's bookkeeping after a round of a drafting engine.

    In a drafted round, each valid row's survival average moves towards the round's survival by
    ``request_ema``, the engine-wide average towards the rows' mean by ``global_ema``, and the (predicted,
    accepted) sums decay by ``accept_decay`` and add the round's predicted drafts (survival summed over the
    verified positions) and accepted ones (only when something was predicted); the skip counter resets. A
    round that skipped the drafter only counts itself skipped.

    Args:
      state: the gate before the round.
      config: its settings (static).
      rows: int32 [R] the slot of each row; row_valid: bool [R] rows holding a request.
      conf: float32 [R, G] the round's calibrated confidences (anything when not ``drafted``).
      lengths: int32 [R] drafts verified per row; accepted: int32 [R] drafts accepted per row.
      drafted: bool [] whether the drafter ran this round.
    Returns:
      The new `GateState`.

    >>> s = init(GateConfig(), 1, 2, 0.5)
    >>> t = update(s, GateConfig(), jnp.array([0]), jnp.array([True]), jnp.array([[1.0, 1.0]]),
    ...            jnp.array([2]), jnp.array([1]), jnp.bool_(True))
    >>> [round(x, 4) for x in t.survival[0].tolist()], [round(x, 4) for x in t.accept_seen.tolist()]
    ([0.6, 0.4], [5.92, 4.92])
    """
    S = state.survival.shape[0]
    G = conf.shape[1]
    write = jnp.where(row_valid, rows, S)  # padding rows write nothing
    surv = jnp.cumprod(conf, axis=1)  # [R, G]
    avg = state.survival.at[write].set(config.request_ema * surv + (1 - config.request_ema) * state.survival[rows],
                                       mode="drop")
    survival = jnp.where(drafted, avg, state.survival)
    mean = jnp.sum(jnp.where(row_valid[:, None], surv, 0), 0) / jnp.maximum(jnp.sum(row_valid), 1)  # [G]
    glob = jnp.where(drafted & jnp.any(row_valid),
                     config.global_ema * mean + (1 - config.global_ema) * state.global_survival,
                     state.global_survival)
    skipped = jnp.where(drafted, 0, state.skipped + 1).astype(jnp.int32)
    verified = jnp.arange(G)[None, :] < lengths[:, None]  # [R, G]
    predicted = jnp.sum(jnp.where(verified & row_valid[:, None], surv, 0.0))
    got = jnp.sum(jnp.where(row_valid, accepted, 0)).astype(jnp.float32)
    seen = config.accept_decay * state.accept_seen + jnp.stack([predicted, got])
    accept_seen = jnp.where(drafted & (predicted > 0), seen, state.accept_seen)
    return GateState(survival=survival, global_survival=glob, accept_seen=accept_seen, skipped=skipped)


def decide(state: GateState, config: GateConfig, cost, rows, row_valid, context, time_scale):
    """Whether drafting pays in the next round for the rows' requests (the gate opens) or not.

    The expected tokens/s of the schedule on each request's average survival, with the drafter's cost and
    the drafting round priced at the padded batch the engine would run (with ``config.fill``, the schedule
    filled to it), against plain decoding's; the expected accepted drafts are scaled by what verification
    accepted per predicted draft (``accept_seen``). It opens when that gain beats ``1 + margin``, or as a
    probe once ``skipped`` reaches the wait that keeps the probes' expected loss, in plain rounds
    ``(t_draft / t_plain) * max(1 + margin - gain, 0)``, under ``probe_budget`` of the time (at least
    ``probe_every`` rounds).

    Args:
      state: the gate.
      config: its settings (static).
      cost: the cost model's arrays (`SPSTable.cost_arrays`).
      rows: int32 [R] slots of the rows; row_valid: bool [R] rows holding a request.
      context: int32 [R] committed tokens of each row's request (the longest valid one prices the round).
      time_scale: float32 [2] measured / predicted round time (drafting, plain): `time_scale`'s values.
    Returns:
      (open: bool [], sps: float32 [N] the cost model's steps/s curve for these requests and context (what
      the schedule reads), gain: float32 [] the estimate's throughput over plain decoding's).
    """
    n_active = jnp.sum(row_valid, dtype=jnp.int32)
    longest = jnp.max(jnp.where(row_valid, context, 0))
    sps = sps_from_cost(cost, jnp.maximum(n_active, 1), longest)  # [N]
    plain_round = time_scale[1] / plain_sps_from_cost(cost, jnp.maximum(n_active, 1), longest)  # seconds
    plain = n_active.astype(jnp.float32) / plain_round
    conf = conditional(state.survival[rows])  # [R, G] the schedule of the average survival
    lengths = scheduler.schedule(conf, sps, active=row_valid).lengths
    if config.fill:
        lengths = scheduler.fill_to_bucket(conf, lengths, BUCKETS, active=row_valid)
    padded = scheduler.padded_batch(n_active + jnp.sum(lengths), BUCKETS)
    draft_round = time_scale[0] / sps[jnp.clip(padded, 0, sps.shape[0] - 1)]
    drafts = scheduler.expected_tokens(conf, lengths, active=row_valid) - n_active  # expected accepted drafts
    realised = state.accept_seen[1] / state.accept_seen[0]  # what verification accepted per predicted draft
    expected = (n_active + realised * drafts) / draft_round
    gain = expected / jnp.maximum(plain, 1e-30)
    loss = draft_round / plain_round * jnp.maximum(1.0 + config.margin - gain, 0.0)  # a probe's, in plain rounds
    wait = jnp.maximum(config.probe_every, jnp.ceil(loss / config.probe_budget))
    return (gain > 1.0 + config.margin) | (state.skipped >= wait), sps, gain.astype(jnp.float32)


def conditional(survival):
    """Per-position confidences whose running product is ``survival`` [..., G] (non-increasing in the last
    axis): ``c_k = S_k / S_{k-1}``, 0 after a zero survival.

    >>> conditional(jnp.array([0.8, 0.4, 0.0, 0.0])).tolist()
    [0.800000011920929, 0.5, 0.0, 0.0]
    """
    prev = jnp.concatenate([jnp.ones_like(survival[..., :1]), survival[..., :-1]], axis=-1)
    return jnp.where(prev > 0, survival / jnp.where(prev > 0, prev, 1.0), 0.0)


# ---------------------------------------------------------------------------------------------- host: cut-off


class CutOff(NamedTuple):
    """The learned cut-off (host side): per row bucket, request-rounds in a row with the gate's estimate
    below its bar, the rounds each request counted in them (at most its share, `cutoff_update`), and the
    buckets where the drafter is off with the rounds run there since. Never mutated: `cutoff_update` returns
    a new one."""

    below_bar: dict[int, int] = {}
    off_rounds: dict[int, int] = {}
    streak_requests: dict[int, dict[int, int]] = {}


def cutoff_update(cut: CutOff, config: GateConfig, bucket: int, n: int, left: int, gain: float,
                  drafting: bool, requests=None) -> tuple[CutOff, bool]:
    """Count a round of ``n`` requests at row bucket ``bucket`` (``left`` of them still active after it).

    Where the drafter is off at ``bucket``, a round without it counts towards ``off_retry``; at the retry
    the bucket is forgotten (requests joining there get the drafter again). Elsewhere the gate's ``gain``
    (nan when it did not look) counts: above ``1 + margin`` it resets the bucket's count, below it adds
    ``n`` request-rounds, one for each of the round's ``requests`` (their ids) up to a request's share
    ``ceil(off_after / off_requests)``; ``off_after`` of those, from at least ``off_requests`` distinct
    requests, switch the drafter off there. ``requests`` None: the ids are not known, the ``n``
    request-rounds alone count.

    Returns:
      (the new `CutOff`, whether the drafter was switched off at ``bucket`` by this round).

    >>> cfg = GateConfig(off_after=4, off_requests=2)
    >>> cut = CutOff()
    >>> for _ in range(5):  # one long answer: it counts two request-rounds at most
    ...     cut, off = cutoff_update(cut, cfg, 1, 1, 1, 0.5, True, requests=[7])
    >>> off, cut.below_bar[1], cut.streak_requests[1]
    (False, 5, {7: 2})
    >>> cut, off = cutoff_update(cut, cfg, 1, 1, 1, 0.5, True, requests=[8])
    >>> cut, off = cutoff_update(cut, cfg, 1, 1, 1, 0.5, True, requests=[8])
    >>> off, drafter_off(cut, 1), drafter_off(cut, 2)
    (True, True, False)
    """
    below, off, seen = dict(cut.below_bar), dict(cut.off_rounds), dict(cut.streak_requests)
    if bucket in off:
        if not drafting:
            off[bucket] += 1
            if off[bucket] >= config.off_retry:
                del off[bucket]  # requests joining at this load get the drafter's context again
                below.pop(bucket, None)
                seen.pop(bucket, None)
        return CutOff(below, off, seen), False
    if config.off_after is None or not math.isfinite(gain) or left == 0:  # never, or the gate looked at nobody
        return cut, False
    if gain > 1.0 + config.margin:
        below[bucket] = 0
        seen[bucket] = {}
        return CutOff(below, off, seen), False
    below[bucket] = below.get(bucket, 0) + n
    if requests is None:
        enough = below[bucket] >= config.off_after
    else:
        share = -(-config.off_after // config.off_requests)
        counted = dict(seen.get(bucket, {}))
        for r in requests:
            counted[int(r)] = min(counted.get(int(r), 0) + 1, share)
        seen[bucket] = counted
        enough = sum(counted.values()) >= config.off_after and len(counted) >= config.off_requests
    if enough:
        off[bucket] = 0
        return CutOff(below, off, seen), True
    return CutOff(below, off, seen), False


def drafter_off(cut: CutOff, bucket: int) -> bool:
    """Whether the drafter is off at row bucket ``bucket``."""
    return bucket in cut.off_rounds


# ---------------------------------------------------------------------------------------------- host: round times


class RoundTimes(NamedTuple):
    """The measured correction of the cost model's round times (host side): running means of logs of the
    host factor (measured / predicted) and of the drafting rounds' excess over it, with the counts of rounds
    seen (drafting rounds, all rounds). The default is the table trusted as it is."""

    log_host: float = 0.0
    log_excess: float = 0.0
    drafted_rounds: int = 0
    rounds: int = 0


def observe_round(times: RoundTimes, config: GateConfig, drafted: bool, seconds: float,
                  predicted: float) -> RoundTimes:
    """Fold one round's measured time into the correction (unchanged without ``config.calibrate_times``,
    a finite prediction > 0 or a time > 0).

    Both factors are running means of logs, the table counting as one observation, then exponential with
    weight ``time_ema``; each observation is clipped to ``[-2, 2]``. A plain round updates the host factor;
    a drafting round updates the excess with its log ratio less the host factor of the moment, then the host
    factor with what a plain round would have shown. Host drift thus moves both kinds of round together,
    while a closed gate sees plain rounds only.

    >>> t = observe_round(RoundTimes(), GateConfig(), False, 2.0, 1.0)
    >>> [round(x, 4) for x in time_scale(t)]
    [1.4142, 1.4142]
    """
    if not config.calibrate_times or not math.isfinite(predicted) or predicted <= 0 or seconds <= 0:
        return times
    x = float(np.clip(np.log(seconds / predicted), -2.0, 2.0))
    log_excess, drafted_rounds = times.log_excess, times.drafted_rounds
    if drafted:
        drafted_rounds += 1
        w = max(config.time_ema, 1.0 / (drafted_rounds + 1))
        log_excess = (1 - w) * log_excess + w * float(np.clip(x - times.log_host, -2.0, 2.0))
        x = x - log_excess  # what the host factor would have been for a plain round
    rounds = times.rounds + 1
    w = max(config.time_ema, 1.0 / (rounds + 1))
    return RoundTimes((1 - w) * times.log_host + w * x, log_excess, drafted_rounds, rounds)


def time_scale(times: RoundTimes) -> tuple[float, float]:
    """Measured / predicted round time, (drafting rounds, plain rounds) = (host x drafting excess, host).

    >>> time_scale(RoundTimes())
    (1.0, 1.0)
    """
    host = float(np.exp(times.log_host))
    return (float(np.exp(times.log_host + times.log_excess)), host)
