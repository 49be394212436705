"""What a stacked KV cache costs the attention of a decode step on XLA:CPU, in one run.

    python -m profiling.bench_attention --quick                 # < 1 min
    python -m profiling.bench_attention --slots 64 --context 1280

The measurement behind the target's per-layer cache (`models.llama` once ran its layers in one `lax.scan`
over a cache stacked as [L, S, K, E, C], each layer reading its slice ``cache[i]``). This times the attention
products alone (scores, softmax, values; one query row per slot, the target's head shapes) over L layers three ways on the same data: (1) the scan with ``cache[i]`` (dynamic index,
the old layout), (2) an unrolled loop over a stacked cache with static ``cache[i]``, (3) an unrolled
loop over per-layer arrays (what `models.llama` holds now). Medians of ``--repeats`` calls after the first
(compile) call, and each way's ratio to (3).
"""

from __future__ import annotations

import argparse
import datetime
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dspark_jax.cli import parse_with_quick, positive_int
from dspark_jax.timing import device_info, format_table


def _layer(x, keys, values):
    """x [S, K, Q, E], keys [S, K, E, C], values [S, K, C, E] -> x + attention (scaled down to stay finite)."""
    probs = jax.nn.softmax(jnp.einsum("skqe,skec->skqc", x, keys), axis=-1)
    return x + 1e-3 * jnp.einsum("skqc,skce->skqe", probs, values)


@jax.jit
def scanned(k, v, x):
    def body(carry, _):
        y, i = carry
        return (_layer(y, k[i], v[i]), i + 1), None

    (y, _), _ = lax.scan(body, (x, jnp.int32(0)), None, length=k.shape[0])
    return y


@jax.jit
def unrolled_static(k, v, x):
    for i in range(k.shape[0]):
        x = _layer(x, k[i], v[i])
    return x


@jax.jit
def unrolled_lists(ks, vs, x):
    for k, v in zip(ks, vs):
        x = _layer(x, k, v)
    return x


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m profiling.bench_attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=positive_int, default=30)
    p.add_argument("--slots", type=positive_int, nargs="+", default=[16, 64])
    p.add_argument("--context", type=positive_int, nargs="+", default=[256, 1280])
    p.add_argument("--kv-heads", type=positive_int, default=3)
    p.add_argument("--group", type=positive_int, default=3, help="query heads per KV head")
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--quick", action="store_true", help="8 layers, 16 slots, context 256")
    args = parse_with_quick(p, argv, layers=8, slots=[16], context=[256], repeats=3)
    L, K, Q, E = args.layers, args.kv_heads, args.group, args.head_dim
    rows = []
    for S in args.slots:
        for C in args.context:
            rng = np.random.default_rng(0)
            k = jnp.asarray(rng.standard_normal((L, S, K, E, C), np.float32))
            v = jnp.asarray(rng.standard_normal((L, S, K, C, E), np.float32))
            x = jnp.asarray(rng.standard_normal((S, K, Q, E), np.float32))
            ks, vs = [k[i] for i in range(L)], [v[i] for i in range(L)]
            row = {"slots": S, "context": C}
            outs = {}
            for name, fn, a in (("scan_dynamic_ms", scanned, (k, v, x)), ("unrolled_static_ms", unrolled_static, (k, v, x)),
                                ("per_layer_arrays_ms", unrolled_lists, (ks, vs, x))):
                outs[name] = fn(*a).block_until_ready()
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    fn(*a).block_until_ready()
                    times.append(time.perf_counter() - t0)
                row[name] = float(np.median(times) * 1e3)
            ref = outs["per_layer_arrays_ms"]
            assert all(np.allclose(o, ref, atol=1e-5) for o in outs.values())
            row["scan_over_arrays"] = row["scan_dynamic_ms"] / row["per_layer_arrays_ms"]
            row["static_over_arrays"] = row["unrolled_static_ms"] / row["per_layer_arrays_ms"]
            row["cache_mb"] = 2 * L * S * K * E * C * 4 / 2**20
            rows.append(row)
    print(f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}  {device_info()}  "
          f"L={L} K={K} Q={Q} E={E} float32")
    print(format_table(rows, list(rows[0])))
    return rows


if __name__ == "__main__":
    main()
