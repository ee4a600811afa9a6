"""Sampling transforms against a plain-numpy reference of HF's temperature -> top-k -> top-p."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.config import SamplingConfig
from dspark_jax.sampling import (
    TOP_CANDIDATES,
    SamplingParams,
    filtered_logits,
    probabilities,
    request_keys,
    sample,
    step_keys,
)


def reference_probs(logits, temperature, top_k, top_p):
    """HF's warpers, one row, in numpy."""
    if temperature == 0:
        out = np.zeros_like(logits)
        out[np.argmax(logits)] = 1.0
        return out
    x = logits / temperature
    if top_k > 0:
        kth = np.sort(x)[::-1][min(top_k, len(x)) - 1]
        x = np.where(x < kth, -np.inf, x)
    if top_p < 1.0:
        order = np.argsort(-x, kind="stable")
        p = np.exp(x[order] - x[order][0])
        p /= p.sum()
        before = np.cumsum(p) - p
        remove = order[before >= top_p]
        x = x.copy()
        x[remove] = -np.inf
    e = np.exp(x - x.max())
    return e / e.sum()


CASES = [
    SamplingConfig(),
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.7),
    SamplingConfig(temperature=1.0, top_k=5),
    SamplingConfig(temperature=0.7, top_p=0.8),
    SamplingConfig(temperature=1.3, top_k=10, top_p=0.5),
    SamplingConfig(temperature=1.0, top_k=1),
    SamplingConfig(temperature=1.0, top_p=1e-6),
]


def test_probabilities_match_reference_per_row():
    """Every row gets its own parameters; each row matches the reference."""
    logits = np.random.default_rng(0).normal(size=(len(CASES), 50)).astype(np.float32) * 3
    params = SamplingParams.from_configs(CASES)
    got = np.asarray(probabilities(jnp.asarray(logits), params))
    for row, c in enumerate(CASES):
        ref = reference_probs(logits[row].astype(np.float64), c.temperature, c.top_k, c.top_p)
        np.testing.assert_allclose(got[row], ref, atol=1e-6, err_msg=str(c))


def test_large_vocab_rows_match_reference_and_do_not_depend_on_batch():
    """With more tokens than ``TOP_CANDIDATES``: rows settled by the partial sort (small top-k,
    top-p cut early) and rows that need the full sort (top-k above the candidates, top-p past
    them) all match the reference, and each row alone equals itself in the mixed batch."""
    vocab = 4 * TOP_CANDIDATES
    rng = np.random.default_rng(5)
    peaked = rng.normal(size=vocab) * 4
    flat = rng.normal(size=vocab) * 0.1
    rows = [
        (peaked, SamplingConfig(temperature=1.0, top_k=7)),
        (peaked, SamplingConfig(temperature=0.7, top_p=0.9)),
        (flat, SamplingConfig(temperature=1.0, top_p=0.9)),  # cutoff far past the candidates
        (flat, SamplingConfig(temperature=1.0, top_k=TOP_CANDIDATES + 50)),
        (flat, SamplingConfig(temperature=1.0, top_k=TOP_CANDIDATES + 50, top_p=0.5)),
        (peaked, SamplingConfig(temperature=1.0, top_k=3, top_p=1.0)),
        (flat, SamplingConfig(temperature=1.0)),
        (peaked, SamplingConfig()),
    ]
    logits = jnp.asarray(np.stack([r for r, _ in rows]), jnp.float32)
    params = SamplingParams.from_configs([c for _, c in rows])
    batched = np.asarray(probabilities(logits, params))
    batched_filtered = np.asarray(filtered_logits(logits, params))
    for row, (_, c) in enumerate(rows):
        ref = reference_probs(np.asarray(logits[row], np.float64), c.temperature, c.top_k, c.top_p)
        assert ((batched[row] > 0) == (ref > 0)).all(), c
        np.testing.assert_allclose(batched[row], ref, atol=1e-6, err_msg=str(c))
        # Filtering is elementwise once the cutoff is known: equal cutoffs give equal bits.
        alone = np.asarray(filtered_logits(logits[row : row + 1], SamplingParams.from_configs([c])))[0]
        np.testing.assert_array_equal(alone, batched_filtered[row], err_msg=str(c))


def test_top_k_keeps_ties_and_top_p_keeps_argmax():
    logits = jnp.asarray([[3.0, 2.0, 2.0, 1.0, 0.0]])
    p = probabilities(logits, SamplingParams.broadcast(SamplingConfig(temperature=1.0, top_k=2), 1))
    assert (np.asarray(p)[0] > 0).tolist() == [True, True, True, False, False]
    p = probabilities(logits, SamplingParams.broadcast(SamplingConfig(temperature=1.0, top_p=0.01), 1))
    np.testing.assert_allclose(np.asarray(p)[0], [1, 0, 0, 0, 0])


def test_unfiltered_rows_skip_the_sort_and_agree():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(2, 30)), jnp.float32)
    plain = SamplingParams.broadcast(SamplingConfig(temperature=0.9), 2)
    mixed = SamplingParams.from_configs([SamplingConfig(temperature=0.9), SamplingConfig(temperature=0.9, top_k=3)])
    a = filtered_logits(logits, plain)
    b = filtered_logits(logits, mixed)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_allclose(a[0], logits[0] / 0.9, rtol=1e-6)


def test_greedy_sample_is_argmax():
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(4, 40)), jnp.float32)
    tokens = sample(logits, SamplingParams.broadcast(SamplingConfig(), 4), request_keys(range(4)))
    np.testing.assert_array_equal(tokens, np.argmax(logits, -1))


def test_greedy_rows_agree_whether_or_not_the_batch_samples():
    """An all-greedy batch takes the argmax-only branch; a mixed batch runs the full draw. A
    greedy row must get the same token and one-hot distribution from both."""
    logits = jnp.asarray(np.random.default_rng(5).normal(size=(3, 300)), jnp.float32)
    keys = request_keys(range(3))
    all_greedy = SamplingParams.broadcast(SamplingConfig(), 3)
    mixed = SamplingParams.from_configs([SamplingConfig(), SamplingConfig(temperature=1.0, top_k=20), SamplingConfig()])
    argmax = np.argmax(np.asarray(logits), -1)
    for params in (all_greedy, mixed):
        tokens = np.asarray(sample(logits, params, keys))
        probs = np.asarray(probabilities(logits, params))
        np.testing.assert_array_equal(tokens[[0, 2]], argmax[[0, 2]])
        np.testing.assert_array_equal(probs[[0, 2]], np.eye(300)[argmax[[0, 2]]])
    sampled_alone = sample(logits[1:2], SamplingParams.from_configs([SamplingConfig(temperature=1.0, top_k=20)]), keys[1:2])
    assert int(sample(logits, mixed, keys)[1]) == int(sampled_alone[0])
    np.testing.assert_allclose(np.asarray(probabilities(logits, mixed))[1].sum(), 1.0, rtol=1e-5)


def test_samples_follow_the_distribution():
    """Empirical frequencies over many keys match `probabilities` (chi-square, small vocab)."""
    config = SamplingConfig(temperature=0.8, top_k=6, top_p=0.9)
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(1, 12)), jnp.float32)
    n = 20000
    params = SamplingParams.broadcast(config, n)
    keys = jax.random.split(jax.random.PRNGKey(7), n)
    draws = np.asarray(sample(jnp.repeat(logits, n, 0), params, keys))
    probs = np.asarray(probabilities(logits, SamplingParams.broadcast(config, 1)))[0]
    counts = np.bincount(draws, minlength=12)
    assert counts[probs == 0].sum() == 0, "sampled a filtered-out token"
    support = probs > 0
    expected = n * probs[support]
    chi2 = (((counts[support] - expected) ** 2) / expected).sum()
    # 99.9% quantile of chi-square with <= 5 degrees of freedom is 20.5.
    assert chi2 < 20.5, (chi2, counts, probs)


def test_request_keys_below_2_32_are_the_seeds_prng_keys():
    """Golden outputs (and every run so far) were drawn with these keys."""
    seeds = [0, 5, 2**31 - 1, 2**31, 2**32 - 1]
    expected = np.stack([np.asarray(jax.random.PRNGKey(s)) for s in seeds])
    np.testing.assert_array_equal(np.asarray(request_keys(seeds)), expected)
    assert request_keys([]).shape == (0, 2)


def test_every_64_bit_seed_has_its_own_key():
    seeds = [0, 2**32, -1, 2**32 - 1, 2**63 - 1, -(2**63), 7, 2**32 + 7, -(2**32) + 7, 123456789012]
    keys = np.asarray(request_keys(seeds))
    assert keys.shape == (len(seeds), 2) and keys.dtype == np.uint32
    assert len({tuple(key) for key in keys}) == len(seeds)
    # A row's key does not depend on the other seeds, and vmaps like any key.
    np.testing.assert_array_equal(np.asarray(request_keys(seeds[3:5])), keys[3:5])
    assert step_keys(request_keys(seeds), jnp.zeros(len(seeds), jnp.int32)).shape == (len(seeds), 2)


def test_request_keys_name_only_the_seeds_out_of_range():
    with pytest.raises(ValueError) as error:
        request_keys([1, 2**64, 3, -(2**63) - 1])
    assert str(error.value) == f"seeds must fit in a signed 64-bit integer, got {[2**64, -(2**63) - 1]}"


def test_per_request_keys_do_not_depend_on_batch():
    logits = jnp.asarray(np.random.default_rng(4).normal(size=(3, 100)), jnp.float32)
    config = SamplingConfig(temperature=1.0)
    keys = request_keys([11, 12, 13])
    steps = jnp.asarray([5, 5, 5])
    batched = sample(logits, SamplingParams.broadcast(config, 3), step_keys(keys, steps))
    for row in range(3):
        alone = sample(
            logits[row : row + 1], SamplingParams.broadcast(config, 1), step_keys(keys[row : row + 1], steps[:1])
        )
        assert int(alone[0]) == int(batched[row])


def test_sampling_jits_without_recompiling_for_new_values():
    f = jax.jit(sample)
    logits = jnp.zeros((2, 10))
    keys = request_keys([0, 1])
    f(logits, SamplingParams.broadcast(SamplingConfig(temperature=1.0), 2), keys)
    before = f._cache_size()
    f(logits, SamplingParams.from_configs([SamplingConfig(), SamplingConfig(temperature=2.0, top_k=3)]), keys)
    assert f._cache_size() == before


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("inf")), "finite"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=1e-30), r"0 \(greedy\) or a finite number >= 1e-05"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(top_k=2**31), r"\[0, 2\*\*31\)"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_bad_sampling_configs_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_sampling_params_need_requests():
    with pytest.raises(ValueError, match="one SamplingConfig per request"):
        SamplingParams.from_configs([])


def test_sampling_params_hold_each_requests_values_as_float32_and_int32():
    """Per request, in order; ``broadcast`` as one config per request would give."""
    configs = [SamplingConfig(temperature=0.7, top_k=20, top_p=0.8), SamplingConfig(),
               SamplingConfig(temperature=1.3, top_p=0.95)]
    params = SamplingParams.from_configs(configs)
    assert [x.dtype for x in params] == [jnp.float32, jnp.int32, jnp.float32]
    np.testing.assert_array_equal(params.temperature_B, np.float32([0.7, 0.0, 1.3]))
    np.testing.assert_array_equal(params.top_k_B, [20, 0, 0])
    np.testing.assert_array_equal(params.top_p_B, np.float32([0.8, 1.0, 0.95]))
    for config in configs:
        broadcast, copies = SamplingParams.broadcast(config, 5), SamplingParams.from_configs([config] * 5)
        for got, want in zip(broadcast, copies):
            assert got.shape == (5,) and got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
