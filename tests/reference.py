"""Plain-Python references written straight from the spec, for tests only."""

from __future__ import annotations

import numpy as np

from dspark_jax.scheduler import algorithm1_loop as algorithm1  # noqa: F401  (the plain loop)


def survival(conf, active=None):
    a = np.cumprod(np.asarray(conf, np.float32), axis=1, dtype=np.float32)
    a = np.where(a >= np.finfo(np.float32).tiny, a, np.float32(0))  # subnormal survival counts as zero
    if active is not None:
        a = np.where(np.asarray(active)[:, None], a, np.float32(0))
    return a


def sps_at(sps, b):
    return float(sps[b]) if 0 <= b < len(sps) else 0.0


def greedy_path(conf, sps, active=None):
    """The greedy admission order and Theta along it (Theta_0 first), in float64.

    Returns (order, thetas): order is the list of (r, j) candidates with a > 0 sorted by survival
    descending, ties by row-major order (Python's sort is stable); thetas[n] = Theta after n admissions,
    over the feasible prefix of the order (B < N).
    """
    a = survival(conf, active)
    rows, block = a.shape
    r_act = rows if active is None else int(np.sum(active))
    cands = [(r, j) for r in range(rows) for j in range(block) if a[r, j] > 0]
    cands.sort(key=lambda rj: -float(a[rj]))
    b, tau = r_act, float(r_act)
    thetas = [tau * sps_at(sps, b)]
    order = []
    for r, j in cands:
        if b + 1 >= len(sps):
            break
        b += 1
        tau += float(a[r, j])
        order.append((r, j))
        thetas.append(tau * sps_at(sps, b))
    return order, thetas, a, r_act


def argmax_rule(conf, sps, active=None):
    """Best point of the greedy path. Returns (lengths, n, theta, rel_gap_to_runner_up)."""
    order, thetas, a, _ = greedy_path(conf, sps, active)
    thetas = np.array(thetas)
    n = int(np.argmax(thetas))
    others = np.delete(thetas, n)
    best = thetas[n]
    gap = np.inf if others.size == 0 or best <= 0 else float(np.min(np.abs(best - others)) / best)
    lengths = np.zeros(a.shape[0], int)
    for r, j in order[:n]:
        lengths[r] = j + 1
    return lengths, n, best, gap
