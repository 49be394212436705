"""JAX's persistent compilation cache in a user cache folder (`use_compilation_cache`)."""

from __future__ import annotations

import os
import warnings

import jax

__all__ = ["COMPILATION_CACHE_ENV", "use_compilation_cache"]

COMPILATION_CACHE_ENV = "DSPARK_JAX_COMPILATION_CACHE"


def use_compilation_cache() -> str | None:
    """Turn on JAX's persistent compilation cache in a user cache folder, so that a second run (a restarted
    server, the next benchmark) reads its programs back instead of compiling them: ``$DSPARK_JAX_COMPILATION_CACHE``
    if set (``0``, ``off`` or ``false``: no cache), else ``$XDG_CACHE_HOME/dspark_jax/jax`` (default
    ``~/.cache/dspark_jax/jax``). A folder the user gave JAX (``jax_compilation_cache_dir``) is left as it is.
    Returns the folder in use, or None. `Engine` calls it unless ``EngineConfig.compilation_cache`` is False.
    """
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    chosen = os.environ.get(COMPILATION_CACHE_ENV, "").strip()
    if chosen.lower() in ("0", "off", "false", "no"):
        return None
    if not chosen:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        chosen = os.path.join(base, "dspark_jax", "jax")
    try:
        os.makedirs(chosen, exist_ok=True)
    except OSError as err:  # a read-only home: run without the cache
        warnings.warn(f"compilation cache: cannot create {chosen} ({err}); compiling without it", stacklevel=3)
        return None
    jax.config.update("jax_compilation_cache_dir", chosen)
    return chosen
