"""Small test utilities shared by several test modules."""

from __future__ import annotations

import contextlib

import jax

_COMPILES = [0]


def _listener(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_listener)


@contextlib.contextmanager
def count_compilations():
    """Counts XLA backend compilations inside the block: ``with count_compilations() as n: ...; n()``."""
    start = _COMPILES[0]
    yield lambda: _COMPILES[0] - start
