"""Drafter training data at scale (stage 1): the target answers every training prompt several times.

`generate_responses` runs plain decoding with continuous batching over ``num_slots`` slots: a slot that frees
takes the next answer at once, so every step decodes a full batch (on a CPU one read of the weights serves every
row). A prompt is prefilled once; its other samples copy the prompt's cache rows into their own slot
(`models.llama.copy_slot`) and draw their first token from the prompt's stored logits.

Sample j of a prompt is drawn at ``temperatures[j]`` (0: greedy) with the key
``fold_in(fold_in(key(seed), rid), position)``, ``rid = prompt.index * len(temperatures) + j``: an answer does not
depend on the slot, the batch or the run that produced it.

Output, in ``out_dir``: ``shard_{k:05d}.npz`` (compressed token ids) for prompts ``[k * P, (k + 1) * P)`` of the
list given, written atomically once its last answer has ended, and ``manifest.json`` (the settings; per shard its
answers, tokens and the run's tokens/s when it was written). A restarted run skips the shards on disk; one with
other settings is refused before any work. `load_responses` reads the shards back as records for
`data.build_target_cache`.
"""

from __future__ import annotations

import dataclasses
import datetime
import glob
import hashlib
import json
import os
import time
from collections import deque
from pathlib import Path
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from dspark_jax.data import Prompt
from dspark_jax.decoding import sample_tokens
from dspark_jax.io import atomic_write_file, atomic_write_text, read_json_object
from dspark_jax.models.llama import CONTEXT_STEP, LlamaModel, context_bucket, copy_slot

__all__ = ["generate_responses", "load_responses", "shard_path"]


def shard_path(out_dir: str | os.PathLike, k: int) -> Path:
    return Path(out_dir) / f"shard_{k:05d}.npz"


@dataclasses.dataclass
class _Shard:
    """The answers of one shard while they are generated."""

    k: int
    prompts: list[Prompt]
    prompt_ids: list[list[int] | None]  # None: longer than the prompt limit (skipped)
    outputs: dict[tuple[int, int], list[int]]  # (prompt row, sample) -> answer tokens
    finished: dict[tuple[int, int], bool]
    remaining: int


@dataclasses.dataclass
class _Request:
    shard: _Shard
    row: int  # the prompt's row in its shard
    sample: int
    rid: int  # the sampling key's request id
    temperature: float

    @property
    def prompt_ids(self) -> list[int]:
        return self.shard.prompt_ids[self.row]

    @property
    def output(self) -> list[int]:
        return self.shard.outputs[(self.row, self.sample)]


def _settings(model: LlamaModel, prompts: Sequence[Prompt], temperatures, max_new_tokens, max_prompt_tokens,
              shard_prompts, seed, model_name) -> dict:
    digest = hashlib.sha256(json.dumps([[p.index, p.domain, list(p.turns)] for p in prompts]).encode()).hexdigest()
    return {"model": model_name, "vocab_size": int(model.cfg.vocab_size), "temperatures": [float(t) for t in temperatures],
            "max_new_tokens": int(max_new_tokens), "max_prompt_tokens": int(max_prompt_tokens),
            "shard_prompts": int(shard_prompts), "seed": int(seed), "prompts": len(prompts),
            "prompts_sha256": digest}


def generate_responses(model: LlamaModel, prompts: Sequence[Prompt], out_dir: str | os.PathLike, *,
                       temperatures: Sequence[float], max_new_tokens: int, max_prompt_tokens: int, num_slots: int,
                       shard_prompts: int, seed: int = 0, model_name: str = "", max_shards: int | None = None,
                       progress: bool = True, log: Callable[[str], None] = print) -> dict:
    """Answer every prompt ``len(temperatures)`` times (first turn, chat template), shard by shard, resumably.

    Args:
      model: the target (with its tokenizer).
      prompts: the prompts, in the order the shards take them.
      out_dir: the shards' folder (created).
      temperatures: one per sample of each prompt (>= 0; 0 = greedy).
      max_new_tokens: answer budget; an answer ends at a stop token (kept) or there.
      max_prompt_tokens: prompts longer than this after the chat template are skipped (recorded as such).
      num_slots: answers decoded together.
      shard_prompts: prompts per shard.
      seed: the sampling seed.
      model_name: recorded in the manifest (a resumed run must name the same model).
      max_shards: stop after writing this many shards in this call (None: all).
    Returns:
      ``{"shards": written in this call, "tokens": answer tokens generated, "seconds": ..., "tokens_per_s": ...}``.
    Raises:
      ValueError: bad settings, or ``out_dir`` holds shards made with other settings.
    """
    temperatures = [float(t) for t in temperatures]
    if not temperatures or any(not (t >= 0) for t in temperatures):
        raise ValueError(f"temperatures: expected one or more values >= 0, got {temperatures}")
    for name, value in (("max_new_tokens", max_new_tokens), ("max_prompt_tokens", max_prompt_tokens),
                        ("num_slots", num_slots), ("shard_prompts", shard_prompts)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
    if not prompts:
        raise ValueError("prompts: none given")
    tok = model.tokenizer
    if tok is None:
        raise ValueError("the model has no tokenizer; the prompts need its chat template")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = out_dir / "manifest.json"
    settings = _settings(model, prompts, temperatures, max_new_tokens, max_prompt_tokens, shard_prompts, seed,
                         model_name)
    manifest = read_json_object(manifest_path, required=False) or {"settings": settings, "shards": {}}
    if manifest.get("settings") != settings:
        old = manifest.get("settings") or {}
        diff = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
        raise ValueError(f"{out_dir} holds shards made with other settings (recorded, asked): {diff}; "
                         f"use another --out or the recorded settings")
    atomic_write_text(manifest_path, json.dumps(manifest, indent=1) + "\n")  # probes the folder too

    n_shards = -(-len(prompts) // shard_prompts)
    todo = [k for k in range(n_shards) if not shard_path(out_dir, k).exists()]
    if max_shards is not None:
        todo = todo[:max_shards]
    if not todo:
        log(f"{out_dir}: all {n_shards} shards are written")
        return {"shards": 0, "tokens": 0, "seconds": 0.0, "tokens_per_s": float("nan")}
    G, S = len(temperatures), num_slots
    stop = frozenset(int(s) for s in tok.stop_ids)
    capacity = context_bucket(max_prompt_tokens + max_new_tokens, 1 << 30)
    cache = model.init_cache(S, capacity)
    token_dtype = np.uint16 if model.cfg.vocab_size <= 1 << 16 else np.int32

    def shard_requests(k: int) -> tuple[_Shard, list[_Request]]:
        chunk = list(prompts[k * shard_prompts:(k + 1) * shard_prompts])
        ids = [tok.encode_chat([p.turns[0]]) for p in chunk]
        ids = [list(map(int, x)) if 0 < len(x) <= max_prompt_tokens else None for x in ids]
        shard = _Shard(k, chunk, ids, {}, {}, 0)
        reqs = []
        for row, p in enumerate(chunk):
            if ids[row] is None:
                continue
            for j, t in enumerate(temperatures):
                shard.outputs[(row, j)] = []
                reqs.append(_Request(shard, row, j, p.index * G + j, t))
        shard.remaining = len(reqs)
        return shard, reqs

    def write_shard(shard: _Shard) -> None:
        kept = [r for r, x in enumerate(shard.prompt_ids) if x is not None]
        keys = sorted(shard.outputs)
        row_of = {r: i for i, r in enumerate(kept)}
        arrays = {
            "prompt_index": np.array([p.index for p in shard.prompts], np.int32),
            "domain": np.array([p.domain for p in shard.prompts]),
            "skipped": np.array([x is None for x in shard.prompt_ids]),
            "prompt_length": np.array([len(shard.prompt_ids[r]) for r in kept], np.int32),
            "prompt_tokens": np.array([t for r in kept for t in shard.prompt_ids[r]], token_dtype),
            "sample_prompt": np.array([row_of[r] for r, _ in keys], np.int32),
            "sample": np.array([j for _, j in keys], np.int32),
            "sample_temperature": np.array([temperatures[j] for _, j in keys], np.float64),
            "output_length": np.array([len(shard.outputs[key]) for key in keys], np.int32),
            "finished": np.array([shard.finished[key] for key in keys], bool),
            "output_tokens": np.array([t for key in keys for t in shard.outputs[key]], token_dtype),
        }
        atomic_write_file(shard_path(out_dir, shard.k), lambda f: np.savez_compressed(f, **arrays))

    from tqdm import tqdm  # noqa: PLC0415

    bar = tqdm(total=len(todo) * shard_prompts * G, desc="answers", unit="ans", disable=not progress)
    queue: deque[_Request] = deque()
    pending_shards = deque(todo)
    open_shards: dict[int, _Shard] = {}
    slot_req: list[_Request | None] = [None] * S
    slot_prefix: list[tuple[int, int] | None] = [None] * S  # (shard, prompt row) whose prompt the slot's cache holds
    first_logits: dict[tuple[int, int], tuple[object, int]] = {}  # prompt -> (logits [V], samples still to admit)
    next_token = np.zeros(S, np.int32)
    generated, written, t0 = 0, 0, time.perf_counter()

    def refill() -> None:
        while not queue and pending_shards:
            shard, reqs = shard_requests(pending_shards.popleft())
            open_shards[shard.k] = shard
            queue.extend(reqs)
            bar.update((shard_prompts - len(shard.prompts)) * G + sum(x is None for x in shard.prompt_ids) * G)
            if not reqs:
                finish_shard(shard)

    def finish_shard(shard: _Shard) -> None:
        nonlocal written
        write_shard(shard)
        del open_shards[shard.k]
        written += 1
        elapsed = time.perf_counter() - t0
        n_tok = sum(len(v) for v in shard.outputs.values())
        manifest["shards"][str(shard.k)] = {"answers": len(shard.outputs), "tokens": n_tok,
                                            "run_tokens_per_s": round(generated / elapsed, 2),
                                            "written": datetime.datetime.now(datetime.timezone.utc)
                                            .isoformat(timespec="seconds")}
        atomic_write_text(manifest_path, json.dumps(manifest, indent=1) + "\n")
        log(f"shard {shard.k}: {len(shard.outputs)} answers, {n_tok} tokens; this run {generated} tokens in "
            f"{elapsed:.0f} s, {generated / elapsed:.1f} tokens/s")

    def emit(s: int, token: int) -> bool:
        """Record slot s's token; True when its answer has ended (the slot is then free)."""
        nonlocal generated
        req = slot_req[s]
        req.output.append(token)
        generated += 1
        ended = token in stop or len(req.output) >= max_new_tokens
        if ended:
            key = (req.row, req.sample)
            req.shard.finished[key] = token in stop
            req.shard.remaining -= 1
            slot_req[s] = None
            bar.update(1)
            if req.shard.remaining == 0:
                finish_shard(req.shard)
        else:
            next_token[s] = token
        return ended

    def admit(s: int, req: _Request) -> None:
        nonlocal cache
        key = (req.shard.k, req.row)
        n = len(req.prompt_ids)
        holder = next((h for h in range(S) if slot_prefix[h] == key), None)
        logits, left = first_logits.get(key, (None, G))
        if logits is not None and holder is not None:  # the prompt's rows are in a slot's cache: copy them
            cache = copy_slot(cache, np.int32(holder), np.int32(s), np.int32(n))
        else:
            logits, _, cache = model.prefill(cache, req.prompt_ids, s)
        slot_prefix[s] = key
        if left > 1:
            first_logits[key] = (logits, left - 1)
        else:
            first_logits.pop(key, None)
        slot_req[s] = req
        token = sample_tokens(logits[None], seed, jnp.asarray([req.rid], jnp.int32), jnp.asarray([n], jnp.int32),
                             jnp.asarray([req.temperature], jnp.float32))
        emit(s, int(token[0]))

    rids = np.zeros(S, np.int32)
    temps = np.zeros(S, np.float32)
    refill()
    while queue or pending_shards or any(r is not None for r in slot_req):
        for s in range(S):
            while slot_req[s] is None and (queue or pending_shards):
                refill()
                if not queue:
                    break
                admit(s, queue.popleft())
        active = np.array([r is not None for r in slot_req])
        if not active.any():
            continue
        positions = np.array([len(r.prompt_ids) + len(r.output) if r is not None else 0 for r in slot_req],
                             np.int32)
        for s, r in enumerate(slot_req):
            rids[s], temps[s] = (r.rid, r.temperature) if r is not None else (0, 0.0)
        context = context_bucket(int(positions[active].max()) + 1, capacity, CONTEXT_STEP)
        logits, _, cache = model.decode(cache, next_token, active, context=context)
        tokens = np.asarray(sample_tokens(logits, seed, jnp.asarray(rids), jnp.asarray(positions), jnp.asarray(temps)))
        for s in np.flatnonzero(active):
            emit(int(s), int(tokens[s]))
    bar.close()
    elapsed = time.perf_counter() - t0
    return {"shards": written, "tokens": generated, "seconds": elapsed, "tokens_per_s": generated / elapsed}


def load_responses(data_dir: str | os.PathLike, shards: Sequence[int] | None = None) -> dict[str, list[dict]]:
    """The shards of `generate_responses` as records, per shard name in order: ``{"index", "domain",
    "sample", "temperature", "finished", "prompt_ids", "output_ids"}`` for every non-empty answer.
    ``shards``: only those shard numbers, in that order (e.g. ``range(0, 80)``), which must all be there."""
    files = sorted(glob.glob(str(Path(data_dir) / "shard_*.npz")))
    if not files:
        raise ValueError(f"no generated shards (shard_*.npz) in {data_dir}; run train.generate_data first")
    if shards is not None:
        want = [str(shard_path(data_dir, k)) for k in shards]
        missing = sorted(set(want) - set(files))
        if not want:
            raise ValueError(f"shards {shards}: an empty range; expected at least one shard number")
        if len(set(want)) != len(want):
            raise ValueError(f"shards {list(shards)}: a shard is asked for twice; expected each at most once")
        if missing:
            raise ValueError(f"{data_dir}: {len(want)} shards are asked for, but {len(missing)} are missing "
                             f"({Path(missing[0]).name}, ...); generate them first (train.generate_data)")
        files = want
    out = {}
    for f in files:
        with np.load(f) as z:
            kept = np.flatnonzero(~z["skipped"])
            p_off = np.concatenate([[0], np.cumsum(z["prompt_length"])])
            o_off = np.concatenate([[0], np.cumsum(z["output_length"])])
            prompt_tokens, output_tokens = z["prompt_tokens"].astype(np.int64), z["output_tokens"].astype(np.int64)
            recs = []
            for i, row in enumerate(z["sample_prompt"]):
                if z["output_length"][i] == 0:
                    continue
                p = kept[row]
                recs.append({"index": int(z["prompt_index"][p]), "domain": str(z["domain"][p]),
                             "sample": int(z["sample"][i]),
                             "temperature": float(z["sample_temperature"][i]), "finished": bool(z["finished"][i]),
                             "prompt_ids": prompt_tokens[p_off[row]:p_off[row + 1]].tolist(),
                             "output_ids": output_tokens[o_off[i]:o_off[i + 1]].tolist()})
        out[Path(f).name[: -len(".npz")]] = recs
    return out
