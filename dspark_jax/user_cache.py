"""What dspark keeps between runs so that a second run starts fast: compiled XLA programs (the
``dspark`` command line turns on JAX's persistent compilation cache) and float32 copies of GGUF
targets (``checkpoints.gguf.load_gguf``), both under one directory.

The directory is ``$DSPARK_CACHE_DIR``, else ``$XDG_CACHE_HOME/dspark-jax``, else
``~/.cache/dspark-jax``; ``DSPARK_CACHE_DIR=off`` turns both off. Deleting it at any time is
safe: whatever is missing is rebuilt.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_VARIABLE = "DSPARK_CACHE_DIR"
OFF = "off"
# Bounds the compiled programs; JAX evicts the least recently used beyond it. A session of the
# command line writes a few MB (sampling, drafting and every verify width of a decoder).
COMPILATION_CACHE_MAX_BYTES = 2 << 30


def user_cache_root() -> Path | None:
    """The cache directory (not created here), or None when ``DSPARK_CACHE_DIR=off``."""
    named = os.environ.get(CACHE_DIR_VARIABLE)
    if named is not None:
        return None if named.strip().lower() == OFF else Path(named).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dspark-jax"


def enable_compilation_cache() -> Path | None:
    """Turn on JAX's persistent compilation cache in ``<root>/xla``, unless the process already
    has one (``JAX_COMPILATION_CACHE_DIR`` or ``jax.config``: that one is kept) or caching is off.
    Returns the directory in use, if any. Call it before the first compilation.

    Every program is cached, however fast it compiled: a decoder compiles dozens of small ones
    (sampling, drafting, each verify width) whose seconds add up. XLA checks on load that a cached
    program suits this machine's CPU, so a directory shared between machines stays safe.
    """
    import jax

    if jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    root = user_cache_root()
    if root is None:
        return None
    directory = root / "xla"
    jax.config.update("jax_compilation_cache_dir", str(directory))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
        # A size limit also makes JAX lock the directory: concurrent runs never read a half-written entry.
        jax.config.update("jax_compilation_cache_max_size", COMPILATION_CACHE_MAX_BYTES)
    return directory
