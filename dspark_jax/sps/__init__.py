"""Steps-per-second (SPS) tables: measured target step rates against verification batch size.

A table holds measured points (batch tokens B -> steps/s, with spread) and metadata about where they
were measured. The scheduler indexes a dense float32 array ``sps[b]`` for ``b = 0..N-1``; this module
turns the sparse measurements into that array:

* ``interpolation="linear"`` (default): step time (1 / steps/s) is interpolated linearly between
  measured points; below the first point the first point's step time is used.
* ``interpolation="ceil"``: a batch of ``b`` tokens costs what the next measured batch ``>= b`` costs.
  This is exact for an engine that pads batches to buckets, when the measured points are the buckets.
* ``envelope=True``: replace step time by its suffix minimum, ``t(b) = min_{b' >= b} t(b')``. A batch
  can always be padded to a larger one, so a smaller batch never needs to be slower; the result is a
  non-decreasing step time (non-increasing SPS), free of measurement jitter that would otherwise make
  the scheduler's path jagged.

The dense table ends at the largest measured batch: larger batches are infeasible for the scheduler.

The points are the simple case, one curve ``SPS(B)``. A table may also hold a :class:`CostModel`, the
cost of a whole round measured on a grid (spec section 3, "Cost model")::

    step_time(R, B, L) = draft(R, Wd(L)) + verify(R, bucket(B), Wv(L)) + overhead(drafting, R, B)
    plain_time(R, L) = plain(R, Wv(L)) + overhead(plain, R)      (a round without the drafter)

with ``R`` the active requests (charged at the smallest measured row count ``>= R``, the engine's row
bucket), ``B`` the verification tokens, ``L`` the longest context held by a request, and the attention
windows the engine compiles: ``Wv(L) = window(L + G + 1)`` for verification (the context and up to
``G + 1`` new tokens) and ``Wd(L) = window(L)`` for the drafter, where ``window(n)`` is the smallest power
of two ``>= max(n, 128)`` (rule ``"pow2"``, ``dspark_jax.engine``) or ``n`` rounded up to a multiple of
128 (rule ``"step"``, ``llama.context_bucket``); see :func:`context_window`. Between measured windows
each part is linear in its window (attention reads ``R x W`` positions); beyond the largest it is
extrapolated along the last segment (never downwards), below the smallest it is clamped.
:meth:`SPSTable.sps_for` gives the dense array for one ``(R, L)``; :func:`sps_from_cost` is the same
inside ``jit`` with ``R`` and ``L`` as arrays, so an engine rebuilds the table every round without
compiling again.

Modules: `cost_model` (the grid and its prices), `dense` (windows and arrays for jit), `tables` (files,
validation, the packaged table for this host), `host` (what machine this is).
"""

from dspark_jax.sps.cost_model import (INTERPOLATIONS, OVERHEAD_KINDS, CostModel, monotone_minorant, nondecreasing,
                                       realistic_rows)
from dspark_jax.sps.dense import (DEFAULT_WINDOW_RULE, WINDOW_RULES, CostArrays, context_window, plain_sps_from_cost, round_windows,
                                  sps_from_cost)
from dspark_jax.sps.host import cpu_similarity, host_cpu
from dspark_jax.sps.tables import (DEFAULT_TABLE, DRAFTER_SHAPE_FIELDS, PACKAGED_TABLES, SPSMetadata, SPSPoint, SPSTable,
                                   default_sps_table, load_sps_table, packaged_tables, select_packaged_table)

__all__ = ["SPSPoint", "SPSMetadata", "SPSTable", "CostModel", "CostArrays", "OVERHEAD_KINDS", "INTERPOLATIONS",
           "DEFAULT_TABLE", "DRAFTER_SHAPE_FIELDS", "PACKAGED_TABLES", "host_cpu", "cpu_similarity",
           "select_packaged_table", "packaged_tables", "WINDOW_RULES", "DEFAULT_WINDOW_RULE", "context_window", "round_windows", "realistic_rows", "sps_from_cost",
           "plain_sps_from_cost", "load_sps_table", "default_sps_table", "nondecreasing", "monotone_minorant"]
