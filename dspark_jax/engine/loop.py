"""The engine's host loop: `Engine` admits requests into slots (prefix cache, chunked prefill within the step's
token budget, grammars, logprobs), runs each round's programs (`programs`) and collects what they emit.

A round runs as two jitted programs with static shapes (`programs.draft_and_schedule`, then
`programs.verify_and_commit`); between the two the host reads one scalar, the batch size B, to pick the token
bucket T. With the ``dspark`` policies the verification program also decides whether drafting will pay in the
next round for the same requests; when it will not and nobody joined, the next round skips the first program and
its host read. The host only admits new requests and collects finished ones (see the package's docstring for the
whole picture).

Axis legend: S slots, R rows of a round, G block, T packed tokens, V vocabulary, W draft vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import warnings
from collections import deque
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import calibration, gate, grammar
from dspark_jax.cache import prefix
from dspark_jax.cache.pages import PagePool, pages_for
from dspark_jax.engine import programs
from dspark_jax.engine.compilation import use_compilation_cache
from dspark_jax.engine.config import SEEDED_KEY_ID, EngineConfig, SamplingParams
from dspark_jax.engine.policy import Policy, parse_policy
from dspark_jax.engine.programs import DraftOut
from dspark_jax.engine.requests import (Completion, History, Prefilling, RoundStats, StepOutput, TokenLogprobs,
                                        token_logprobs)
from dspark_jax.engine.shapes import grid_width, round_shapes, row_bucket
from dspark_jax.engine.state import EngineState, RoundInputs, RoundSpec, engine_state_axes, init_state
from dspark_jax.models import drafter as dr
from dspark_jax.models.llama import BUCKETS, LlamaModel, bucket_for, prefill_chunks
from dspark_jax.sps import SPSTable, default_sps_table
from dspark_jax.timing import compile_count

__all__ = ["Engine"]

_gate_init = jax.jit(gate.init, static_argnums=(0, 1, 2, 3))  # a fresh gate state, one program
_draft_head_weights = nnx.jit(dr.draft_head_weights)  # the drafter's LM head over its vocabulary, one program


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
        ``data``; heads, FFN width and vocabulary over ``tensor``; the "pages" layout's pool over ``tensor``
        only, replicated over ``data``: `sharding.paged_cache_axes`) and jit propagates the layout; None: one
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
        self.gate_cfg = config.gate  # the gate's settings as this engine runs them
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
        per_slot_pages = pages_for(config.capacity, config.block_size)
        contiguous = self.kv_layout == "slots"
        num_pages = S * per_slot_pages if contiguous or config.num_pages is None else config.num_pages
        # The slot layout's prefix store is not laid out on a mesh; the "pages" layout's pool is (replicated over
        # 'data'), and its one host index serves every data group.
        store_on_mesh = contiguous and mesh is not None and mesh.devices.size > 1
        if config.enable_prefix_caching and store_on_mesh:
            raise ValueError("enable_prefix_caching: kv_layout 'slots' on a device mesh runs without the prefix "
                             "cache; use kv_layout 'pages' (its pool keeps prefixes on a mesh), or set it to None "
                             "(on where it runs) or False")
        # The prefix cache: the pool's own pages ("pages" layout) or a store of pages copied to and from the
        # dense slot caches ("slots" layout; `cache.prefix`).
        self.prefix_caching = config.enable_prefix_caching is not False and not store_on_mesh
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
            from dspark_jax.sharding import kv_pool_units, place  # noqa: PLC0415

            state = place(state, engine_state_axes(state), mesh, units=kv_pool_units(target.cfg))
        # Every program's output state is put back on this layout (`state`), so that each program always
        # sees the same input shardings and compiles once per shape.
        self._state_shardings = jax.tree.map(lambda x: x.sharding, state) if mesh is not None else None
        self.state = state
        # host mirrors
        self.slot_request = np.full(S, -1)
        self.slot_length = np.zeros(S, np.int64)
        self.slot_context = np.zeros(S, bool)  # the request in the slot has the drafter's context
        # Slots whose request is still being prefilled, chunk by chunk: slot -> `Prefilling` (the slot is
        # taken, its request not yet decoding).
        self.prefilling: dict[int, Prefilling] = {}
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
        # the last `EngineConfig.max_history` rounds and finished request ids (in the order they finished), indexed
        # from the first (`requests.History`)
        self.rounds: History[RoundStats] = History(config.max_history)
        self.finished_ids: History[int] = History(config.max_history)
        self.record_confidences = False
        self.record_tokens = False  # RoundStats also hold request ids, drafted and emitted tokens (a trace)
        self._gate_closed = False  # the last round found that the drafter would not pay next round
        # Learned cut-off (`gate.GateConfig.off_after`, dspark policies with a cost model only): `gate.CutOff`.
        self._may_drop_context = self.cost is not None and self.gate_cfg.off_after is not None
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
        self._out = StepOutput()  # what the current step gave (`step` returns it)
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
        # A round where no request has the drafter's context runs plain decoding's program: without the drafter
        # in its inputs, the verification compiles to what `none` runs (the drafter's caches and gate pass
        # through untouched). With them, skipping the context write and the gate under their conditions still
        # cost ~4% of a round at 4 users on a 2-core CPU (docs/design.md, the drafter off).
        self._plain_inputs = dataclasses.replace(self._inputs, graph=None, dstate=None, head_w=None, temps=None,
                                                 cost=None, draft_vocab=None)

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
        """The empty state, made by one program (`state.init_state`)."""
        return jax.jit(lambda: init_state(self.target, self.drafter, self.cfg, self.gate_cfg, self.G, self.kv_layout,
                                          self.pages))()

    def _forward_mesh(self):
        """The engine's mesh made current (`jax.set_mesh`) around the programs that run the target's forward over
        the page pool ("pages" layout on a mesh), whose attention kernels then run per device (`kernels.per_device`:
        XLA does not partition a Pallas kernel); else nothing. Those programs always run under it, so each compiles
        once."""
        if self.mesh is None or self.kv_layout != "pages":
            return contextlib.nullcontext()
        return jax.set_mesh(self.mesh)

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
        self.state = programs.free_slot(self.state, np.int32(slot))

    def _finished(self, rid: int) -> None:
        """Request ``rid`` ended in this step (its ``finished_by_stop`` set): its reason goes to the step's output."""
        self._forget_stops(rid)
        self.finished_ids.append(rid)
        self._out.finished[rid] = "stop" if self.requests[rid].finished_by_stop else "length"

    def pop_completion(self, request_id: int) -> Completion | None:
        """Take a finished request's `Completion` out of the engine (a server that streamed its tokens keeps
        nothing of it); None when the engine holds none (an unknown id, or taken already). A request still queued
        or decoding keeps its record.

        >>> from dspark_jax.models.llama import LlamaConfig, LlamaModel, init_random_weights
        >>> cfg = LlamaConfig.tiny()
        >>> e = Engine(LlamaModel(cfg, init_random_weights(cfg, jax.random.key(0))), None, "none",
        ...            EngineConfig(num_slots=1, capacity=64))
        >>> (done,) = e.run([[1, 2, 3]], 2)
        >>> e.pop_completion(done.request_id) is done, e.pop_completion(done.request_id)
        (True, None)
        """
        if request_id in self.pending_ids() or request_id in self.slot_request:
            return None
        return self.requests.pop(request_id, None)

    def pending_ids(self) -> list[int]:
        """The ids of the requests queued for a slot, first in first out."""
        return [item[0] for item in self.pending]

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
            self._out.logprobs.setdefault(rid, []).extend(logprobs[: len(tokens)])
        if len(tokens):
            self._out.tokens.setdefault(rid, []).extend(int(t) for t in tokens)
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
            self._out.admitted.append(rid)
            job = self.prefilling[s] = Prefilling(
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

    def _prefix_take(self, slot: int, job: "Prefilling", hit: list[int]) -> None:
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

    def _join(self, slot: int, job: "Prefilling", logits) -> int:
        """A prefilled request's first token (from the prompt's last logits), then it decodes from ``slot`` (or
        ends there, its budget one token or its first token a stop). Returns 1, the token emitted."""
        rid, prompt = job.rid, job.prompt
        self._publish(slot, prompt, job.context)
        first, done, logprobs = self._first_token(slot, job, logits)
        if self.drafter is not None:
            self.admissions["context" if job.context else "no_context"] += 1
        self.requests[rid].prompt_logprobs = job.prompt_logprobs
        if job.prompt_logprobs is not None:
            self._out.prompt_logprobs[rid] = job.prompt_logprobs
        self._emit(rid, [first], logprobs)
        if done:
            self.slot_request[slot] = -1
            self.pages.release(slot)
            self.requests[rid].finished_by_stop = self._eos_ends(rid, first) or (
                self._stop_cut(rid, [first]) is not None) or self._grammar_done(rid)
            self._finished(rid)
        else:
            self.slot_length[slot] = len(prompt)
            self.slot_context[slot] = job.context
        return 1

    def _admission_context(self, load: int) -> bool:
        """Whether a request joining now gets the drafter's context: not where the learned cut-off
        (``GateConfig.off_after``) has the drafter off at the ``load`` (active requests) it will decode with:
        those active and those joining with it."""
        if self.drafter is None:
            return False
        if not self._may_drop_context:  # fixed and threshold policies always draft
            return True
        return not gate.drafter_off(self.cutoff, row_bucket(load, self.cfg.num_slots))

    def _row_sampling(self, rid: int, sampling: SamplingParams) -> tuple[float, float, int, int]:
        """(temperature, top-p, seed, key id) of a request's slot."""
        temp = self.cfg.temperature if sampling.temperature is None else float(sampling.temperature)
        if sampling.seed is None:
            return temp, float(sampling.top_p), self.cfg.seed, rid
        return temp, float(sampling.top_p), int(sampling.seed), SEEDED_KEY_ID

    def _first_token(self, slot: int, job: "Prefilling", logits) -> tuple[int, bool, list[TokenLogprobs] | None]:
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
        first, lp = programs.sample_first(logits, np.int32(key_id), np.int32(len(job.prompt)), np.float32(temp),
                                          np.float32(top_p), np.int32(seed), mask, constrained, self._flag(want))
        logprobs = None
        if want:
            first, lp = _to_host((first, lp))
            logprobs = [token_logprobs(first, lp.chosen[0], lp.top_ids[0], lp.top[0], job.sampling.logprobs)]
        first = int(first)
        done = job.max_new <= 1 or self._eos_ends(rid, first) or self._stop_cut(rid, [first]) is not None
        if matcher is not None:
            done = matcher.advance([first]) is not None or done
        self.state = programs.admit_slot(self.state, np.int32(slot), np.int32(key_id), np.int32(first),
                                         np.int32(job.max_new), np.bool_(not done), np.int32(seed),
                                         np.float32(temp), np.float32(top_p), np.bool_(rid not in self._ignore_eos))
        return first, done, logprobs

    def _prefill_chunk(self, slot: int, job: "Prefilling", take: int):
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
            with self._forward_mesh():
                if with_context:
                    logits, lp, self.state = programs.write_chunk_context(*args)
                else:
                    logits, lp, self.state = programs.prefill_program(*args, write_context=self._flag(False))
            if want:  # entry p reports prompt token start + p + 1
                chosen, top_ids, top = _to_host(lp)
                n_report = min(n, len(job.prompt) - start - 1)
                job.prompt_logprobs += [token_logprobs(job.prompt[start + p + 1], chosen[p], top_ids[p], top[p],
                                                        job.sampling.prompt_logprobs) for p in range(n_report)]
            done += n
        job.done += take
        return logits

    def _prefill(self, slot: int, rid: int, prompt: list[int], max_new: int, sampling: SamplingParams | None = None,
                 *, context: bool = True) -> None:
        """Prefill a whole prompt into ``slot`` and sample its first token, emitting nothing (warm-up: the
        programs of every chunk size)."""
        job = Prefilling(rid, prompt, max_new, sampling or SamplingParams(), context)
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
        return round_shapes(self.cfg.num_slots, self.G, self._min_rows, self.drafter is not None)

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
        self.state = programs.free_slot(self.state, np.int32(0))
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
        shapes = self.round_shapes()
        for R, T, per_slot in shapes:
            if R not in drafts:
                drafts[R] = (programs.draft_and_schedule(self._round_spec(R), self._inputs, self.state, scale)
                             if self.drafter is not None else None)
            d = drafts[R] if per_slot > 1 else None
            # (inputs, confidences, drafted) of each program of this shape: the engine's own, and for a plain round
            # of an engine whose cut-off can switch the drafter off, the one where no request has its context
            variants = [(self._inputs, *self._round_conf(d, R))]
            if per_slot == 1 and self.drafter is not None and self._may_drop_context:
                variants.append((self._plain_inputs, None, None))
            P = self.G + 1 if per_slot > 1 else 2
            with self._forward_mesh():
                for inputs, conf, drafted in variants:
                    self.state, _ = programs.verify_and_commit(
                        self._round_spec(R, T, per_slot), inputs, self.state, d, conf, drafted, scale,
                        drafting=self._flag(False), masks=self._no_mask((R, P, self._mask_words)),
                        constrained=self._flag(False), logprobs=self._flag(False))
        # The drafter gate's state starts afresh (warm-up rounds had no requests).
        self.state = self.state.replace(gate=self._init_gate())
        self._gate_closed = False
        jax.block_until_ready(self.state)
        return len(shapes)

    # ------------------------------------------------------------------------------------------------ rounds
    def step(self) -> StepOutput:
        """Admit what fits, then run one round over the active requests. Returns what the step gave: tokens per
        request, the requests that finished with their reasons, the round's `RoundStats` (None when no request
        was decoding: an idle engine, or every admitted request still prefilling or ended at admission)."""
        step_out = self._out = StepOutput()
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
            return self._step_done(step_out, None)
        t_round = time.perf_counter()
        S, G = self.cfg.num_slots, self.G
        for s in active_slots:  # pages for what this round may write: the anchor and up to G drafts
            self.pages.ensure(int(s), min(int(self.slot_length[s]) + G + 1, self.cfg.capacity))
        self._sync_block_tables()
        R = max(row_bucket(n, S), self._min_rows)
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
            d = programs.draft_and_schedule(self._round_spec(R), self._inputs, self.state, scale)
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
        per_slot = grid_width(R, T, G, self._min_rows) if B > n else 1
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
        conf, drafted_arr = self._round_conf(d, R) if drafting else (None, None)
        # logprobs are computed (and read) only in a round where some request asked for them
        want = bool(self._logprobs) and any(int(self.slot_request[s]) in self._logprobs for s in active_slots)
        with self._forward_mesh():
            self.state, out = programs.verify_and_commit(self._round_spec(R, T, per_slot),
                                                         self._inputs if drafting else self._plain_inputs, self.state,
                                                         d if B > n else None, conf, drafted_arr, scale,
                                                         drafting=self._flag(drafting), masks=mask_arr,
                                                         constrained=mask_flag, logprobs=self._flag(want))
        # the round's one blocking read (the draft program's token count aside)
        out, drafted = _to_host((out if want else out._replace(logprobs=None),
                                 d.drafted if d is not None else np.False_))
        emitted, counts, finished, accepted, new_len, lp = out[:6]
        # the next round's gate, decided on the device where every request has the drafter's context
        predicted, next_gate, gain = ((out.predicted, out.next_gate, out.gain) if self.cost is not None and can_draft
                                      else (np.float32(np.nan), np.True_, np.float32(np.nan)))
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
                token_logprobs(t, lp.chosen[i, j], lp.top_ids[i, j], lp.top[i, j], top_n)
                for j, t in enumerate(tokens)])
            total += len(tokens)
            self.slot_length[s] = new_len[i]
            if finished[i] or cut is not None:
                self._publish(int(s), self._committed(int(s)), bool(self.slot_context[s]))
                self.requests[rid].finished_by_stop = self._eos_ends(rid, tokens[-1]) or cut is not None
                self._finished(rid)
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
        return self._step_done(step_out, stats)

    def _step_done(self, out: StepOutput, stats: RoundStats | None) -> StepOutput:
        """The step's output, completed with the round's stats and the slots' and the queue's counts."""
        out.stats, out.running, out.waiting = stats, int((self.slot_request >= 0).sum()), len(self.pending)
        return out

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
        times = gate.observe_round(self.round_times, self.gate_cfg, drafted, seconds, predicted)
        if times is not self.round_times:  # unchanged (no prediction, or not calibrating): nothing to send
            self.round_times = times

    @property
    def round_times(self) -> gate.RoundTimes:
        """The measured correction of the cost model's round times the gate reads (`gate.RoundTimes`;
        learned with ``GateConfig.calibrate_times``, settable: a correction learned elsewhere)."""
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
        """Totals over the rounds run so far (for the generate command and the benchmark): over the last
        `EngineConfig.max_history` rounds, those the engine keeps."""
        rounds = list(self.rounds)
        if not rounds:  # every request ended at admission (a budget of one token): no round ran
            return {"rounds": 0, "compiled_rounds": 0, "steady_seconds": 0.0, "emitted_tokens": 0,
                    "tokens_per_s": float("nan"), "mean_active": 0.0, "drafts_per_request": 0.0, "accept_len": 1.0,
                    "rejected_share": 0.0, "mean_batch_tokens": 0.0, "drafted_share": 0.0}
        sched = np.concatenate([r.scheduled for r in rounds])
        acc = np.concatenate([r.accepted for r in rounds])
        steady = [r for r in rounds if not r.compiled]
        secs = sum(r.seconds for r in steady)
        emitted = sum(r.emitted for r in steady)
        return {
            "rounds": len(rounds),
            "compiled_rounds": len(rounds) - len(steady),
            "steady_seconds": secs,
            "emitted_tokens": sum(r.emitted for r in rounds),
            "tokens_per_s": emitted / secs if secs > 0 else float("nan"),
            "mean_active": float(np.mean([r.active for r in rounds])),
            "drafts_per_request": float(sched.mean()),
            "accept_len": float(np.mean(acc + 1)),
            "rejected_share": float(1 - acc.sum() / sched.sum()) if sched.sum() > 0 else 0.0,
            "mean_batch_tokens": float(np.mean([r.batch_tokens for r in rounds])),
            "drafted_share": float(np.mean([r.drafted for r in rounds])),
            "prefix_hit_rate": self.prefix_cache_stats()["hit_rate"],
        }


def _to_host(tree):
    """NumPy copies of device arrays, gathered across processes under ``jax.distributed``."""
    from dspark_jax.sharding import to_host  # noqa: PLC0415

    return to_host(tree)


def _put(tree):
    """Host arrays onto the device (`jax.device_put`: unlike ``jnp.asarray``, nothing compiles)."""
    return jax.device_put(tree)


def _rows_host(active: np.ndarray) -> np.ndarray:
    """Host twin of the device row order: active slots first (ascending), then the others."""
    return np.argsort(~active, kind="stable")
