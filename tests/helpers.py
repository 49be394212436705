"""Small test utilities shared by several test modules."""

from __future__ import annotations

import contextlib

from dspark_jax.timing import compile_count


@contextlib.contextmanager
def count_compilations():
    """Counts XLA backend compilations inside the block: ``with count_compilations() as n: ...; n()``."""
    start = compile_count()
    yield lambda: compile_count() - start
