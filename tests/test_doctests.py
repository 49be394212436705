"""The docstring examples of the pure-function modules run and hold."""

import doctest

import pytest

from dspark_jax import calibration, scheduler, sharding, sps, verify


@pytest.mark.parametrize("module", [scheduler, verify, sps, calibration, sharding])
def test_doctests(module):
    result = doctest.testmod(module, extraglobs={"jnp": __import__("jax.numpy").numpy}, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    if module is not sps:
        assert result.attempted > 0
