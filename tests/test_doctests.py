"""The docstring examples of the pure-function modules run and hold."""

import doctest

import pytest

from dspark_jax import (build, calibration, cli, data, device_check, gate, grammar, io, sampling, scheduler, sharding,
                        stages, timing, verify)
from dspark_jax.cache import pages, plan, prefix
from dspark_jax.models import presets
from dspark_jax.sps import cost_model, dense, tables


@pytest.mark.parametrize("module", [scheduler, verify, calibration, cost_model, dense, tables, data, io, build, sharding,
                                    stages, timing, gate, sampling, cli, plan, pages, prefix, presets,
                                    device_check, grammar])
def test_doctests(module):
    result = doctest.testmod(module, extraglobs={"jnp": __import__("jax.numpy").numpy}, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    if module is not io:
        assert result.attempted > 0
