"""Plain (non-speculative) batched decoding over cache slots: the baseline the speculative engine is compared to.

Requests wait in a queue; each free slot takes the next one, prefills its prompt and then decodes one token per
step together with the other active slots. The sampling key of a token is derived from (seed, request index,
position), so a request's output does not depend on which other requests share the batch.

Axis legend: S slots, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.models.llama import (CONTEXT_STEP, KVCache, LlamaModel, context_bucket, copy_slot, first_argmax,
                                     prefill, prefill_chunks)
from dspark_jax.sampling import GREEDY_TEMPERATURE, categorical


@jax.jit
def sample_tokens(logits: jax.Array, seed: jax.Array, request_ids: jax.Array, positions: jax.Array,
                  temperature: jax.Array) -> jax.Array:
    """Sample one token per row from softmax(logits / temperature); temperature 0 is greedy argmax.

    Args:
      logits: float [S, V].
      seed: int scalar run seed.
      request_ids: int [S] request index of each row.
      positions: int [S] position of the token being sampled (its index in the request's full sequence).
      temperature: float scalar or [S] (one per row) >= 0; below `sampling.GREEDY_TEMPERATURE` greedy.
    Returns:
      int32 [S] tokens; row r uses the key fold_in(fold_in(key(seed), request_ids[r]), positions[r]).

    >>> sample_tokens(jnp.array([[0., 5., 1.]]), 0, jnp.array([0]), jnp.array([3]), 0.0).tolist()
    [1]
    >>> sample_tokens(jnp.array([[0., 5., 1.], [9., 0., 0.]]), 0, jnp.array([0, 1]), jnp.array([3, 3]),
    ...               jnp.array([0.0, 1e-3])).tolist()
    [1, 0]
    """
    base = jax.random.key(seed)
    keys = jax.vmap(lambda r, p: jax.random.fold_in(jax.random.fold_in(base, r), p))(request_ids, positions)
    logits = logits.astype(jnp.float32)
    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), request_ids.shape)  # [S]
    sampled_rows = temperature >= GREEDY_TEMPERATURE  # below it: greedy (sampling.effective_temperature)
    safe_t = jnp.where(sampled_rows, temperature, 1.0)
    sampled = categorical(keys, logits / safe_t[:, None])
    return jnp.where(sampled_rows, sampled, first_argmax(logits)).astype(jnp.int32)


@dataclasses.dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]  # generated tokens, the stop token included when one was produced
    finished_by_stop: bool


@dataclasses.dataclass
class GenerationStats:
    generated_tokens: int
    seconds: float  # wall time of the generation loop (prefill + decode), compilation excluded when warmed up
    decode_steps: int

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else float("nan")


def plain_generate(model: LlamaModel, prompt_ids_list: Sequence[Sequence[int]], max_new_tokens: int,
                   temperature: float = 0.0, seed: int = 0, num_slots: int = 4, *,
                   stop_ids: Sequence[int] | None = None, capacity: int | None = None, warmup: bool = True,
                   on_token: Callable[[int, int], None] | None = None
                   ) -> tuple[list[GenerationResult], GenerationStats]:
    """Generate up to `max_new_tokens` for every prompt with plain batched decoding over `num_slots` slots.

    Args:
      model: the target.
      prompt_ids_list: token ids of each prompt (chat template already applied).
      max_new_tokens: generation limit per request (>= 1).
      temperature: 0 for greedy decoding.
      seed: sampling seed; token keys come from (seed, request index, position).
      num_slots: cache slots decoded together.
      stop_ids: tokens that end a request (default: the tokenizer's stop ids); the stop token is kept.
      capacity: positions per slot (default: the longest prompt plus max_new_tokens, rounded up to a bucket).
      warmup: compile the step functions before the clock starts.
      on_token: called as on_token(request_index, token_id) for every generated token, in order.
    Returns:
      One GenerationResult per prompt, in order, and the run's GenerationStats.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    if not prompt_ids_list or any(len(p) == 0 for p in prompt_ids_list):
        raise ValueError("prompt_ids_list must hold at least one prompt, and no prompt may be empty")
    if stop_ids is None:
        stop_ids = model.tokenizer.stop_ids if model.tokenizer is not None else ()
    stop = frozenset(int(s) for s in stop_ids)
    longest = max(len(p) for p in prompt_ids_list)
    need = longest + max_new_tokens
    capacity = capacity or -(-need // 64) * 64
    if capacity < need:
        raise ValueError(f"capacity {capacity} < longest prompt {longest} + max_new_tokens {max_new_tokens}")
    S = num_slots
    cache = model.init_cache(S, capacity)
    temp = jnp.float32(temperature)
    if warmup:
        shortest = min(len(p) for p in prompt_ids_list)
        contexts = {context_bucket(n, capacity) for n in range(shortest + 1, capacity + 1, CONTEXT_STEP)} | {capacity}
        cache = warm_up(model, cache, prefill_sizes={size for p in prompt_ids_list for size, _ in prefill_chunks(len(p))},
                        contexts=contexts, temperature=temp, seed=seed)

    def sample(logits, requests, positions):
        return np.asarray(sample_tokens(logits, seed, jnp.asarray(requests, jnp.int32),
                                        jnp.asarray(positions, jnp.int32), temp))

    results = [GenerationResult(list(map(int, p)), [], False) for p in prompt_ids_list]
    pending = deque(range(len(prompt_ids_list)))
    slot_request = np.full(S, -1)  # request index held by each slot, -1 when free
    next_token = np.zeros(S, np.int32)
    generated, steps = 0, 0
    start = time.perf_counter()

    def emit(i: int, token: int) -> bool:
        """Record a token of request i; True when the request is finished."""
        nonlocal generated
        results[i].output_ids.append(token)
        generated += 1
        if on_token is not None:
            on_token(i, token)
        results[i].finished_by_stop = token in stop
        return results[i].finished_by_stop or len(results[i].output_ids) >= max_new_tokens

    while pending or (slot_request >= 0).any():
        for s in np.flatnonzero(slot_request < 0):  # admit queued requests into free slots
            while pending:
                i = pending.popleft()
                prompt = results[i].prompt_ids
                logits, _, cache = model.prefill(cache, prompt, int(s))
                token = int(sample(logits[None], [i], [len(prompt)])[0])
                if not emit(i, token):
                    slot_request[s], next_token[s] = i, token
                    break
        active = slot_request >= 0
        if not active.any():
            continue
        positions = np.array([len(results[i].prompt_ids) + len(results[i].output_ids) if i >= 0 else 0
                              for i in slot_request])
        context = context_bucket(int(positions[active].max()) + 1, capacity)
        logits, _, cache = model.decode(cache, next_token, active, context=context)
        tokens = sample(logits, np.maximum(slot_request, 0), positions)
        steps += 1
        for s in np.flatnonzero(active):
            if emit(int(slot_request[s]), int(tokens[s])):
                slot_request[s] = -1
            else:
                next_token[s] = tokens[s]
    seconds = time.perf_counter() - start
    return results, GenerationStats(generated_tokens=generated, seconds=seconds, decode_steps=steps)


def warm_up(model: LlamaModel, cache: KVCache, *, prefill_sizes, contexts, temperature=0.0, seed: int = 0,
            copy: bool = False) -> KVCache:
    """Compile what a plain decoding loop over ``cache`` runs, before a clock starts: the prefill of each chunk
    size, a decode step at each attention window, the sampler over all rows and over one row, and (``copy``)
    `copy_slot`. Writes land in slot 0 and nothing is committed that a later prefill does not overwrite.

    Args:
      model: the target. cache: the loop's cache (donated; the returned one replaces it).
      prefill_sizes: chunk sizes (each of `models.llama.PREFILL_CHUNKS` the prompts need).
      contexts: attention windows (`context_bucket` values) the loop can use.
      temperature: the sampler's temperature as the loop passes it: a scalar, or one per row ([S]).
      seed: the sampler's seed.
    Returns:
      the cache.
    """
    S = cache.num_slots
    for size in sorted(prefill_sizes):  # one valid token: any chunk size fits any capacity
        _, _, cache = prefill(model.weights, cache, jnp.zeros(size, jnp.int32), jnp.int32(0), jnp.int32(0),
                              jnp.int32(1), model.cfg)
    if copy:
        cache = copy_slot(cache, np.int32(0), np.int32(1 % S), np.int32(1))
    logits = None
    for context in sorted(contexts):
        logits, _, cache = model.decode(cache, np.zeros(S, np.int32), np.zeros(S, bool), context=context)
    temperature = jnp.asarray(temperature, jnp.float32)
    one = temperature if temperature.ndim == 0 else temperature[:1]
    z = jnp.zeros(S, jnp.int32)
    sample_tokens(logits, seed, z, z, temperature).block_until_ready()
    sample_tokens(logits[:1], seed, z[:1], z[:1], one).block_until_ready()
    return cache
