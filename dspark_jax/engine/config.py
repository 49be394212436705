"""The engine's static settings (`EngineConfig`) and one request's sampling settings (`SamplingParams`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from dspark_jax import gate, grammar
from dspark_jax.models.llama import PREFILL_CHUNKS
from dspark_jax.sampling import MAX_LOGPROBS, effective_temperature
from dspark_jax.sps import DEFAULT_WINDOW_RULE

__all__ = ["EngineConfig", "SamplingParams", "SEEDED_KEY_ID", "MAX_SEED"]


def _checked_temperature(t) -> float:
    """A sampling temperature as decoded (`sampling.effective_temperature`); ValueError unless finite and >= 0."""
    if not (isinstance(t, (int, float, np.floating)) and np.isfinite(t) and t >= 0):
        raise ValueError(f"temperature: expected a finite number >= 0 (0: greedy), got {t!r}")
    return effective_temperature(t)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static settings of an `Engine`: slots, cache capacity per slot, sampling, and the drafter gate
    (``gate``: a `gate.GateConfig`, validated where it is declared).

    >>> EngineConfig(num_slots=4, capacity=512, temperature=0.7).num_slots
    4
    >>> EngineConfig(gate=gate.GateConfig(margin=0.1, calibrate_times=False)).gate.margin
    0.1
    """

    num_slots: int = 16
    capacity: int = 1024
    temperature: float = 0.0
    seed: int = 0
    # Starting value of the engine-wide average confidence per position, which a request with no history
    # yet takes as its stale confidences (dspark-async) and average (the gate); the average then follows
    # the drafted rounds.
    prior_confidence: float = 0.7
    # The dspark policies' drafter gate (`gate.GateConfig`: probes, margin, filled schedules, the learned cut-off
    # `off_after`, the round-time correction `calibrate_times`), one frozen value whose defaults are the gate's own.
    gate: gate.GateConfig = dataclasses.field(default_factory=gate.GateConfig)
    # Attention windows over the caches: "step" = multiples of 128 (reads little beyond the context held),
    # "pow2" = powers of two (fewer shapes to compile). SPS cost models record the rule they were profiled with.
    window_rule: str = DEFAULT_WINDOW_RULE
    # Where the KV caches live. "pages": a page pool per layer (target and drafter, one block table) that requests
    # take pages from as their tokens are written and give back when they end, read by the ragged paged
    # attention kernels (`dspark_jax.kernels`); "slots": one dense run of ``capacity`` positions per slot, read in
    # place (XLA:CPU's gather of pages costs several times the attention's own read); "auto": "pages" on a GPU or
    # TPU (one device or a mesh), "slots" on a CPU. On a device mesh the page pool splits over 'tensor' on its KV
    # heads and is replicated over 'data' (`sharding.paged_cache_axes`: reads stay within a data group, one host
    # pool and prefix index serve the mesh), so every data group holds the whole pool: `num_pages` counts the
    # pages of one tensor-parallel group.
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
    # `cache.prefix`). None: on wherever it runs (either layout on one device; the "pages" layout on a device
    # mesh too, whose one pool keeps one index); True: required (the "slots" layout on a device mesh refuses it:
    # its store is not laid out on a mesh); False: off.
    enable_prefix_caching: bool | None = None
    # Pages of the slot layout's prefix store (`cache.prefix`: pages are copied there and back, the slot caches
    # being dense); None: half as many as the slots hold. The "pages" layout keeps prefixes in its pool.
    num_prefix_pages: int | None = None
    # Rounds (`Engine.rounds`) and finished request ids (`Engine.finished_ids`) the engine keeps: a server runs
    # indefinitely, so older entries are dropped, and both stay indexed from the engine's first (`requests.History`:
    # ``len`` counts every entry, ``rounds[n:]`` is what came since ``n = len(rounds)``).
    max_history: int = 100_000

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
        if not (isinstance(self.max_history, (int, np.integer)) and self.max_history >= 1):
            raise ValueError(f"max_history: expected an integer >= 1, got {self.max_history!r}")
        if self.enable_prefix_caching not in (None, True, False):
            raise ValueError(f"enable_prefix_caching: expected None, True or False, got {self.enable_prefix_caching!r}")
        least = self.num_slots + PREFILL_CHUNKS[0]
        if self.max_num_batched_tokens is not None and not (
                isinstance(self.max_num_batched_tokens, (int, np.integer)) and self.max_num_batched_tokens >= least):
            raise ValueError(f"max_num_batched_tokens: expected None or an integer >= num_slots + "
                             f"{PREFILL_CHUNKS[0]} = {least} (every running request's token and a prefill chunk), "
                             f"got {self.max_num_batched_tokens!r}")
        if not isinstance(self.gate, gate.GateConfig):
            raise ValueError(f"gate: expected a dspark_jax.GateConfig (dspark_jax.gate.GateConfig), got "
                             f"{type(self.gate).__name__}")

    @property
    def max_num_seqs(self) -> int:
        """vLLM's name of ``num_slots``: requests decoded together."""
        return self.num_slots

    @property
    def max_model_len(self) -> int:
        """vLLM's name of ``capacity``: the most positions one request holds (prompt, answer and a block)."""
        return self.capacity

    def layout_for(self, device_platform: str, mesh_devices: int) -> str:
        """The KV layout ``kv_layout`` resolves to on a platform ("cpu", "gpu", "tpu") and device count
        (``mesh_devices``: the mesh's; "auto" picks by the platform alone, a mesh taking either layout).

        >>> EngineConfig().layout_for("gpu", 8), EngineConfig().layout_for("cpu", 8)
        ('pages', 'slots')
        """
        del mesh_devices  # either layout runs on a mesh (`sharding.paged_cache_axes`)
        if self.kv_layout != "auto":
            return self.kv_layout
        return "pages" if device_platform in ("gpu", "tpu", "cuda", "rocm") else "slots"


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
