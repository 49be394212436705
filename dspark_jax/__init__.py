"""dspark-jax: DSpark confidence-scheduled, hardware-aware speculative decoding in JAX.

The public API. Pure functions that live inside a user's own jitted decoding loop:

* `survival_probs`, `schedule` (Algorithm 1; `schedule_checked` validates its input on the host first),
  `capacity` and `top_k_lengths` (the production variant), `sps_lookup`: which drafts each request verifies,
  given per-token confidences and a steps/s table;
* `speculative_accept` (sampled) and `greedy_accept` (temperature 0; `greedy_accept_tokens` from the target's
  argmax tokens): lossless verification with a verification length per request;
* `fit_sts`, `apply_sts`: Sequential Temperature Scaling of the confidence head (`fit_sts_bias`: with a logit
  offset per position); `STSSets` and `sts_for_rows`: sets fitted at several sampling temperatures, each row
  taking the one nearest its own.

Tables and engines:

* `SPSTable` (from measured arrays, to the dense array the scheduler reads), `load_sps_table`;
* `Engine`, `EngineConfig`, `SamplingParams`: continuous batching over slots with the jitted rounds, each
  request with its own sampling; `GateConfig` (``EngineConfig.gate``): the ``dspark`` policies' drafter gate;
* `load_target` (a GGUF file or a Hugging Face folder), `load_drafter_for`, `build_engine`.
"""

from dspark_jax.build import build_engine, load_drafter_for, load_target
from dspark_jax.calibration import STSSets, apply_sts, fit_sts, fit_sts_bias, sts_for_rows
from dspark_jax.engine import Engine, EngineConfig, SamplingParams
from dspark_jax.gate import GateConfig
from dspark_jax.scheduler import (Schedule, capacity, schedule, schedule_checked, sps_lookup, survival_probs,
                                  top_k_lengths)
from dspark_jax.sps import SPSTable, load_sps_table
from dspark_jax.verify import greedy_accept, greedy_accept_tokens, speculative_accept

__version__ = "0.1.0"

__all__ = [
    "survival_probs", "schedule", "schedule_checked", "Schedule", "capacity", "top_k_lengths", "sps_lookup",
    "speculative_accept", "greedy_accept", "greedy_accept_tokens",
    "fit_sts", "fit_sts_bias", "apply_sts", "STSSets", "sts_for_rows",
    "SPSTable", "load_sps_table",
    "Engine", "EngineConfig", "SamplingParams", "GateConfig",
    "load_target", "load_drafter_for", "build_engine",
]
