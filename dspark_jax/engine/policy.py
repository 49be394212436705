"""Scheduling policies: which drafts a round verifies.

Policies (`parse_policy`): ``none`` (plain decoding, no drafter), ``fixed:K``, ``threshold:C`` (verify up to
the first calibrated per-token confidence below C), ``dspark`` (Algorithm 1, first drop, on the SPS table)
and ``dspark-async`` (capacity K by the greedy-path argmax over the confidences of two rounds earlier, then
the top-K drafts by current survival). All are lossless: whether draft ``x_k`` is verified never depends on
``x_k`` itself. The argmax over fresh confidences is deliberately not offered (spec appendix A).

Axis legend: R rows of a round, G block, N batch tokens of the steps/s table.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dspark_jax import scheduler, verify

__all__ = ["POLICY_NAMES", "Policy", "parse_policy", "policy_lengths"]

POLICY_NAMES = ("none", "fixed:K", "threshold:C", "dspark", "dspark-async")


@dataclasses.dataclass(frozen=True)
class Policy:
    """A scheduling policy (hashable: a static argument of the round programs)."""

    kind: str  # none | fixed | threshold | dspark | dspark-async
    k: int = 0
    threshold: float = 0.0

    @property
    def drafts(self) -> bool:
        return self.kind != "none"

    @property
    def value(self) -> float:
        """The policy's number: K of ``fixed:K``, C of ``threshold:C`` (0 for the others)."""
        return float(self.k) if self.kind == "fixed" else self.threshold

    @property
    def needs_confidence(self) -> bool:
        return self.kind in ("threshold", "dspark", "dspark-async")

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.k}"
        if self.kind == "threshold":
            return f"threshold:{self.threshold:g}"
        return self.kind


def parse_policy(text: str) -> Policy:
    """``none``, ``fixed:K`` (K >= 0), ``threshold:C`` (0 <= C <= 1), ``dspark`` or ``dspark-async``."""
    text = str(text).strip()
    if text in ("none", "dspark", "dspark-async"):
        return Policy(text)
    kind, _, arg = text.partition(":")
    try:
        if kind == "fixed":
            k = int(arg)
            if k < 0:
                raise ValueError
            return Policy("fixed", k=k)
        if kind == "threshold":
            c = float(arg)
            if not 0.0 <= c <= 1.0:
                raise ValueError
            return Policy("threshold", threshold=c)
    except ValueError:
        pass
    raise ValueError(f"policy {text!r}: expected one of {', '.join(POLICY_NAMES)} "
                     f"(K an integer >= 0, C a number in [0, 1])")


def policy_lengths(policy: Policy, value, conf, hist, sps, row_valid, G: int):
    """A drafting policy's verification lengths, before the caps the engine adds (budget, capacity).

    Args:
      policy: a drafting `Policy` (static by its kind).
      value: float32 [] the policy's number (K of ``fixed:K``, C of ``threshold:C``; traced).
      conf: float32 [R, G] calibrated per-token confidences of this round's drafts.
      hist: float32 [R, G] the confidences of two rounds earlier (``dspark-async``'s capacity).
      sps: float32 [N] steps/s by batch tokens; row_valid: bool [R] rows holding a request; G: the block.
    Returns:
      int32 [R] drafts to verify per row.

    >>> policy_lengths(parse_policy("threshold:0.5"), jnp.float32(0.5), jnp.array([[0.9, 0.4, 0.9]]),
    ...                jnp.ones((1, 3)), jnp.ones(8), jnp.array([True]), 3).tolist()
    [1]
    """
    if policy.kind == "fixed":
        return jnp.full(row_valid.shape, jnp.minimum(jnp.round(value).astype(jnp.int32), G), jnp.int32)
    if policy.kind == "threshold":
        return verify.leading_true(conf >= value, jnp.full(row_valid.shape, G, jnp.int32))
    if policy.kind == "dspark":
        return scheduler.schedule(conf, sps, active=row_valid).lengths
    if policy.kind == "dspark-async":
        k = scheduler.capacity(hist, sps, active=row_valid)
        return scheduler.top_k_lengths(conf, k, active=row_valid)
    raise ValueError(f"policy {policy} does not draft")
