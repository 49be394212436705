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
positions, 33 verification programs and 7 draft programs, and for an engine whose learned cut-off can switch the
drafter off, the 7 plain verifications without it): the attention reads the caches in parts up to the round's
longest context (`llama.over_context`), a round whose requests are all greedy skips the sampling work under
``lax.cond``, and a round where no request has the drafter's context runs plain decoding's verification (the
drafter left out of its inputs).
Between the two the host reads one scalar, the batch size B, to pick the token bucket T (the shape of the
second program); everything else stays on the device. With the ``dspark`` policies the second program also
decides, on the state it commits, whether drafting will pay in the next round for the same requests (the drafter
gate, `dspark_jax.gate`: the engine only calls its pure functions and keeps its state; its answer comes back in
the round's one host read); when it will not and nobody joined, the next round skips the first program and its
host read: a plain round of a drafting engine costs a plain round plus the drafter's context update and the
gate's bookkeeping. Where the gate's estimate stays below its bar long enough at a load, the drafter is switched
off there (``GateConfig.off_after``): the requests drop their context and the rounds are plain decoding's, until a
retry. The host only admits new requests and collects finished ones. Rows are the active slots moved to the
front (a stable argsort of ``~active``) and padded to a power of two, so the drafter's cost follows the load, not
the slot count.

Policies: `policy` (`parse_policy`).

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

The package, one concern per module (data flows down the list):

- `config`: `EngineConfig` (static settings; the drafter gate's in ``gate``, a `gate.GateConfig`) and
  `SamplingParams` (one request's sampling);
- `policy`: `Policy`, `parse_policy`, `policy_lengths` (which drafts a round verifies);
- `requests`: the host's records (`Completion`, `TokenLogprobs`, `RoundStats`, `StepOutput`, `History`);
- `shapes`: row buckets, verification grid widths, every round shape (`round_shapes`);
- `state`: `EngineState` (on the device), the static `RoundSpec` and the constant `RoundInputs`;
- `programs`: the jitted round, prefill and first-token programs (pure functions of spec, inputs and state);
- `compilation`: JAX's persistent compilation cache (`use_compilation_cache`);
- `loop`: `Engine`, the host loop (submit, step, cancel, warm-up, summary).

Axis legend: S slots, R rows of a round, G block, T packed tokens, V vocabulary, W draft vocabulary.
"""

from dspark_jax.engine.compilation import COMPILATION_CACHE_ENV, use_compilation_cache
from dspark_jax.engine.config import MAX_SEED, SEEDED_KEY_ID, EngineConfig, SamplingParams
from dspark_jax.engine.loop import Engine
from dspark_jax.engine.policy import POLICY_NAMES, Policy, parse_policy, policy_lengths
from dspark_jax.engine.requests import Completion, History, RoundStats, StepOutput, TokenLogprobs
from dspark_jax.engine.state import EngineState, RoundInputs, RoundSpec, engine_state_axes

__all__ = ["Policy", "parse_policy", "POLICY_NAMES", "EngineConfig", "Engine", "RoundStats", "Completion",
           "SamplingParams", "TokenLogprobs", "StepOutput", "engine_state_axes", "policy_lengths"]
