"""Drafter evaluation: speculative decoding at a fixed block length through the engine, reporting the
accepted length, per-position survival and conditional acceptance, and calibration of the confidence head."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dspark_jax import calibration
from dspark_jax.build import LoadedDrafter, build_engine
from dspark_jax.data import load_prompts, prompt_files
from dspark_jax.engine import Engine, RoundStats


def fixed_block_rounds(model, drafter, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float,
                       concurrency: int = 8, seed: int = 0, sts_temperatures=None, mesh=None
                       ) -> tuple[list[RoundStats], Engine]:
    """Decode ``prompts`` verifying the whole block every round (policy fixed:G), recording confidences
    (on a device ``mesh`` when one is given)."""
    own = LoadedDrafter(drafter, sts_temperatures, prior_confidence=0.5, path=None)  # the prior is unused by fixed:G
    engine = build_engine(model, f"fixed:{drafter.cfg.block}", draft=own, num_slots=concurrency,
                          max_prompt_tokens=max(len(p) for p in prompts), max_new_tokens=max_new_tokens,
                          temperature=temperature, seed=seed, mesh=mesh)
    engine.record_confidences = True
    engine.run(prompts, max_new_tokens)
    return list(engine.rounds), engine


def pooled(rounds: Sequence[RoundStats]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(confidence logits [N, G], accepted [N], verified [N]) over every request-round."""
    logits = np.concatenate([r.confidence_logits for r in rounds])
    acc = np.concatenate([r.accepted for r in rounds])
    ver = np.concatenate([r.scheduled for r in rounds])
    return logits, acc, ver


def acceptance_report(accepted: np.ndarray, verified: np.ndarray, block: int) -> dict:
    """Accepted length tau (bonus included, pooled over rounds) and per-position survival and conditional
    acceptance, over rounds that verified at least k drafts."""
    accepted, verified = np.asarray(accepted), np.asarray(verified)
    per = []
    for k in range(1, block + 1):
        seen = verified >= k
        prev = seen & (accepted >= k - 1)
        per.append({
            "position": k,
            "rounds": int(seen.sum()),
            "survival": float(np.mean(accepted[seen] >= k)) if seen.any() else float("nan"),
            "conditional": float(np.mean(accepted[prev] >= k)) if prev.any() else float("nan"),
        })
    return {"accept_len": float(np.mean(accepted + 1)), "rounds": int(len(accepted)), "per_position": per}


def per_request(rounds: Sequence[RoundStats], labels: Sequence | None = None) -> list[dict]:
    """Rounds and accepted drafts of each request, by request id: ``{"request", "rounds", "accepted"}`` (its
    accepted length is ``1 + accepted / rounds``), with ``"prompt": labels[request]`` when ``labels`` are given
    (request ids count the engine's submissions from 0)."""
    req = np.concatenate([r.requests for r in rounds])
    acc = np.concatenate([r.accepted for r in rounds])
    ids = np.unique(req)
    out = []
    for rid in ids:
        row = {"request": int(rid), "rounds": int(np.sum(req == rid)), "accepted": int(acc[req == rid].sum())}
        if labels is not None:
            row["prompt"] = labels[int(rid)]
        out.append(row)
    return out


def evaluate_rounds(rounds: Sequence[RoundStats], block: int, sts_temperatures=None, sts_biases=None,
                    labels: Sequence | None = None) -> dict:
    """Acceptance and calibration of recorded rounds (the JSON the evaluate command writes); ``sts_biases``
    [G]: the STS set's logit offsets (`calibration.fit_sts_bias`), if any; ``labels``: a JSON-ready label per
    request id for the per-request rows (`per_request`)."""
    logits, acc, ver = pooled(rounds)
    out = acceptance_report(acc, ver, block)
    cal = calibration.calibration_report(logits, acc, ver, sts_temperatures, sts_biases)
    for row, c in zip(out["per_position"], cal["per_position"]):
        row.update({k: v for k, v in c.items() if k not in ("position", "n")})
    out.update(ece_raw=cal["ece_raw"], brier_raw=cal["brier_raw"], auroc_raw=cal["auroc_raw"])
    if sts_temperatures is not None:
        out.update(ece_sts=cal["ece_sts"], brier_sts=cal["brier_sts"], auroc=cal["auroc_sts"],
                   temperatures=cal["temperatures"], **({"biases": cal["biases"]} if "biases" in cal else {}))
    else:
        out.update(ece_sts=None, auroc=cal["auroc_raw"])
    out["reliability_raw"] = cal["reliability_raw"]
    if sts_temperatures is not None:
        out["reliability_sts"] = cal["reliability_sts"]
    out["per_request"] = per_request(rounds, labels)
    return out


def split_half(items: Sequence, half: str) -> list:
    """Deterministic halves of a prompt list: ``calib`` (even positions), ``eval`` (odd), ``all``."""
    if half == "all":
        return list(items)
    if half not in ("calib", "eval"):
        raise ValueError(f"half: expected 'calib', 'eval' or 'all', got {half!r}")
    return list(items[0 if half == "calib" else 1 :: 2])


def half_per_file(paths, half: str, limit: int | None = None) -> list[list]:
    """The prompts of each JSONL file ``paths`` name (a folder: its ``*.jsonl`` files), split by `split_half`,
    the first ``limit`` of each half: one list per file, so that every domain contributes alike.

    Raises:
      ValueError: bad paths (`data.prompt_files`), prompt lines or ``half``.
    """
    return [split_half(load_prompts([f]), half)[:limit] for f in prompt_files(paths)]


def encode_chosen(tokenizer, chosen_per_file: Sequence[Sequence], max_prompt_tokens: int
                  ) -> list[tuple[int, int, list[int]]]:
    """Each chosen prompt's first turn with the chat template, in order, dropping those over
    ``max_prompt_tokens`` tokens: ``(file, index, ids)`` per kept prompt, ``index`` its position in its file's
    chosen list (so that a report can be cut to the prompts a smaller ``--limit`` would have chosen).

    Raises:
      ValueError: naming ``--max-prompt-tokens`` when no prompt fits.
    """
    kept = [(f, i, ids) for f, chosen in enumerate(chosen_per_file)
            for i, ids in enumerate(tokenizer.encode_chat([pr.turns[0]]) for pr in chosen)
            if len(ids) <= max_prompt_tokens]
    if not kept:
        raise ValueError(f"--prompts: no chosen prompt fits in --max-prompt-tokens {max_prompt_tokens}")
    return kept


def encode_first_turns(tokenizer, chosen_per_file: Sequence[Sequence], max_prompt_tokens: int) -> list[list[int]]:
    """The token ids of `encode_chosen`'s prompts, in order.

    Raises:
      ValueError: naming ``--max-prompt-tokens`` when no prompt fits.
    """
    return [ids for _, _, ids in encode_chosen(tokenizer, chosen_per_file, max_prompt_tokens)]
