"""The shapes of the engine's rounds: row buckets, verification grid widths, every (R, T, width) a round runs.

A round's rows are its active slots padded to a power of two (`row_bucket`), its packed verification batch a
`llama.BUCKETS` size (`llama.bucket_for`), and its verification grid as wide as the token bucket allows
(`grid_width`): few programs serve a whole run (`round_shapes`).

Axis legend: S slots, R rows of a round, G block, T packed tokens.
"""

from __future__ import annotations

from dspark_jax.models.llama import bucket_for, grid_bucket

__all__ = ["row_bucket", "grid_width", "round_shapes"]


def row_bucket(n: int, cap: int) -> int:
    """The rows of a round of ``n`` requests: the power of two >= n, at most ``cap`` (the slot count).

    >>> [row_bucket(n, 12) for n in (1, 2, 3, 5, 9, 12)]
    [1, 2, 4, 8, 12, 12]
    """
    r = 1
    while r < n:
        r *= 2
    return min(r, cap)


def grid_width(R: int, T: int, G: int, min_rows: int) -> int:
    """The verification grid's width of a round with drafts: a round of R rows holds more than R // 2 requests
    (all R when R is the engine's fewest rows, ``min_rows``: then at least one), so its longest row holds at
    most T - that + 1 of the T tokens: the width follows the token bucket without a program per width.

    >>> [grid_width(1, t, 7, 1) for t in (2, 4, 8)], grid_width(4, 4, 7, 1), grid_width(16, 64, 7, 1)
    ([2, 4, 8], 2, 8)
    """
    fewest = 1 if R == min_rows else R // 2 + 1
    return grid_bucket(max(2, min(T - fewest + 1, G + 1)), G + 1)


def round_shapes(num_slots: int, block: int, min_rows: int, drafts: bool) -> list[tuple[int, int, int]]:
    """Every (rows R, tokens T, grid width) a round of an engine of ``num_slots`` slots, block ``block`` (G) and
    fewest rows ``min_rows`` can run: the verification programs (one each; width 1: no drafts; ``drafts``: the
    engine has a drafter). A round of R rows holds n requests, R // 2 < n <= R (any n >= 1 at the fewest rows);
    it verifies B tokens, n without drafts, up to n * (G + 1) with them.

    >>> round_shapes(4, 1, 1, False)
    [(1, 1, 1), (2, 2, 1), (4, 4, 1)]
    """
    S, G = num_slots, block
    shapes, R = [], min_rows
    while True:
        fewest = 1 if R == min_rows else R // 2 + 1
        plain = sorted({bucket_for(b) for b in range(fewest, R + 1)})
        shapes += [(R, T, 1) for T in plain]
        if drafts:  # with drafts: B from fewest + 1 to R * (G + 1)
            spec = sorted({bucket_for(b) for b in range(fewest + 1, R * (G + 1) + 1)})
            shapes += [(R, T, grid_width(R, T, G, min_rows)) for T in spec]
        if R >= S:
            return shapes
        R = min(2 * R, S)
