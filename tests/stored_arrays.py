"""Comparing what a target cache stores per token when two forwards computed it."""

import numpy as np


def assert_within_one_bf16_step(got, want, name: str) -> None:
    """Float32 values that agree to rounding (1e-5), each then stored as bf16, are at most one
    bf16 step (2^-7 of the larger value) apart."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert (np.abs(got - want) <= 2.0**-7 * np.maximum(np.abs(got), np.abs(want)) + 1e-5).all(), name


def assert_same_stored_arrays(got, want, head) -> None:
    """Two ``(features, hidden, lse)`` of the same tokens from forwards that round differently:
    features and hidden within one bf16 step, and lse no further apart than the two hidden
    states' logits (lse is 1-Lipschitz in the max norm)."""
    for name, a, b in zip(("features", "hidden"), got, want):
        assert_within_one_bf16_step(a, b, name)
    hidden_gap = np.abs(np.asarray(got[1], np.float32) - np.asarray(want[1], np.float32))
    logit_gap = (hidden_gap @ np.abs(np.asarray(head, np.float32)).T).max(axis=-1)
    assert (np.abs(np.asarray(got[2]) - np.asarray(want[2])) <= logit_gap + 1e-4).all(), "lse"
