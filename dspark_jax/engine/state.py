"""What the round programs read and write: the device state (`EngineState`, made by `init_state`), the static
spec of a round (`RoundSpec`) and the engine's constant inputs (`RoundInputs`).

Axis legend: S slots, G block, K STS sets, N batch tokens of the steps/s table, W draft vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dspark_jax import gate
from dspark_jax.models import drafter as dr
from dspark_jax.models.llama import LlamaConfig, PagedKVCache, init_paged_cache
from dspark_jax.engine.policy import Policy

__all__ = ["EngineState", "engine_state_axes", "init_state", "RoundSpec", "RoundInputs"]


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
    """Logical axes of an `EngineState` (`sharding.Axes`) in either KV layout: everything per slot splits with
    the slots; the "pages" layout's page pools split over ``tensor`` on their KV heads and are replicated over
    ``data`` (`sharding.paged_cache_axes`: each data group holds the whole pool, so the pool is sized as for one
    tensor-parallel group), while their block tables split with the slots. Place the target's pool with
    `sharding.kv_pool_units`."""
    from dspark_jax.sharding import (Axes, drafter_cache_axes, kv_cache_axes, paged_cache_axes,  # noqa: PLC0415
                                     paged_drafter_cache_axes)

    if isinstance(state.cache, PagedKVCache):
        cache = paged_cache_axes(len(state.cache.pages))
    else:
        cache = kv_cache_axes(len(state.cache.k))
    if state.dcache is None:
        dcache = None
    elif isinstance(state.dcache, dr.PagedDrafterCache):
        dcache = paged_drafter_cache_axes()
    else:
        dcache = drafter_cache_axes()
    return EngineState(
        cache=cache, dcache=dcache,
        anchor=Axes("slots"), active=Axes("slots"), request=Axes("slots"), seed=Axes("slots"),
        temperature=Axes("slots"), top_p=Axes("slots"), generated=Axes("slots"),
        max_new=Axes("slots"), eos_stops=Axes("slots"), conf_hist=Axes(None, "slots", None),
        gate=gate.GateState(survival=Axes("slots", None), global_survival=Axes(None), accept_seen=Axes(None),
                            skipped=Axes()))


def init_state(target, drafter, config, gate_cfg: gate.GateConfig, block: int, kv_layout: str, pages) -> EngineState:
    """The empty state of an engine (to be called under ``jax.jit``: one program): the target's cache and the
    drafter's (None without a ``drafter``) in ``kv_layout`` ("pages": from the page pool ``pages``, a
    `cache.pages.PagePool`; "slots": ``config.capacity`` positions per slot), every slot idle, and the gate's
    fresh state.

    Args:
      target: the `LlamaModel`; drafter: the `Drafter` or None; config: the `EngineConfig`;
      gate_cfg: the drafter gate's settings; block: G (1 without a drafter).
    """
    c, S = config, config.num_slots
    if kv_layout == "pages":
        pool = pages
        cache = init_paged_cache(target.cfg, S, num_pages=pool.num_pages, page_size=pool.page_size,
                                 pages_per_slot=pool.pages_per_slot, dtype=target.dtype,
                                 block_tables=pool.block_tables)
        dcache = (dr.init_paged_drafter_cache(drafter.cfg, pool.num_pages, pool.page_size, cache.dtype)
                  if drafter is not None else None)
    else:
        cache = target.init_cache(S, c.capacity)
        # the drafter's context in the target's cache dtype (bf16 on accelerators)
        dcache = dr.init_drafter_cache(drafter.cfg, S, c.capacity, cache.dtype) if drafter is not None else None
    return EngineState(
        cache=cache, dcache=dcache, anchor=jnp.zeros(S, jnp.int32), active=jnp.zeros(S, bool),
        request=jnp.zeros(S, jnp.int32), generated=jnp.zeros(S, jnp.int32), max_new=jnp.zeros(S, jnp.int32),
        seed=jnp.full(S, c.seed, jnp.int32), temperature=jnp.full(S, c.temperature, jnp.float32),
        top_p=jnp.ones(S, jnp.float32), eos_stops=jnp.ones(S, bool),
        conf_hist=jnp.full((2, S, block), c.prior_confidence, jnp.float32),
        gate=gate.init(gate_cfg, S, block, c.prior_confidence),
    )


@dataclasses.dataclass(frozen=True)
class RoundSpec:
    """The static part of the engine's programs (hashable: one compiled program per value).

    The engine's settings (target config, block, capacity, policy kind, gate settings, whether the cache's slots
    are split over devices) and the shape of a round: ``rows`` R (active slots first, padded to a power of two),
    ``tokens`` T (the packed verification batch, a `BUCKETS` size; 0 for the draft program) and ``per_slot``
    (the verification grid's width: 1 for a round without drafts, else `grid_width`). Everything else a
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
