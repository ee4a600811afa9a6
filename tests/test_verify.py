"""The acceptance rule on hand-built cases, and its losslessness as a distribution test."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.config import SamplingConfig
from dspark_jax.decoding.verify import verify
from dspark_jax.sampling import SamplingParams, probabilities, request_keys

V, GAMMA = 6, 3
GREEDY = SamplingConfig()
NO_STOP = jnp.zeros((0,), jnp.int32)


def one_hot_logits(argmaxes, vocab=V):
    """Target logits whose argmax at each position is given."""
    return jnp.asarray(np.eye(vocab)[np.asarray(argmaxes)] * 5.0, jnp.float32)


def greedy_q(tokens, vocab=V):
    return jnp.asarray(np.eye(vocab)[np.asarray(tokens)], jnp.float32)


def run(tokens, target_argmax, lengths, stop=NO_STOP, config=GREEDY):
    tokens = jnp.asarray(tokens, jnp.int32)
    batch = tokens.shape[0]
    return verify(
        tokens, greedy_q(tokens), one_hot_logits(target_argmax), jnp.asarray(lengths, jnp.int32),
        SamplingParams.broadcast(config, batch), request_keys(range(batch)), stop,
    )


def test_all_accepted_gets_the_bonus_token():
    out = run([[1, 2, 3]], [[1, 2, 3, 4]], [3])
    assert int(out.num_accepted_B[0]) == 3
    np.testing.assert_array_equal(out.emitted_BxE[0], [1, 2, 3, 4])
    assert int(out.num_emitted_B[0]) == 4 and not bool(out.stopped_B[0])


def test_first_rejected_emits_the_target_token():
    out = run([[1, 2, 3]], [[5, 2, 3, 4]], [3])
    assert int(out.num_accepted_B[0]) == 0
    np.testing.assert_array_equal(out.emitted_BxE[0], [5, -1, -1, -1])


def test_rejection_in_the_middle():
    out = run([[1, 2, 3]], [[1, 0, 3, 4]], [3])
    np.testing.assert_array_equal(out.emitted_BxE[0], [1, 0, -1, -1])
    assert int(out.num_emitted_B[0]) == 2


def test_verify_length_zero_is_one_plain_decode_step():
    out = run([[1, 2, 3]], [[4]], [0])  # width 1: only the anchor was scored
    np.testing.assert_array_equal(out.emitted_BxE[0], [4, -1, -1, -1])
    assert int(out.num_accepted_B[0]) == 0


def test_a_length_past_the_scored_drafts_counts_the_scored_ones():
    """Width 3 scores the anchor and two drafts: ℓ = 3 verifies those two, and when both pass the
    bonus comes from the last scored position (not a residual against an unscored third draft)."""
    out = run([[1, 2, 3]], [[1, 2, 4]], [3])
    assert int(out.num_accepted_B[0]) == 2
    np.testing.assert_array_equal(out.emitted_BxE[0], [1, 2, 4, -1])


def test_per_row_verify_lengths():
    tokens = [[1, 2, 3], [1, 2, 3], [1, 2, 3]]
    target = [[1, 2, 3, 4]] * 3
    out = run(tokens, target, [3, 1, 0])
    np.testing.assert_array_equal(out.num_accepted_B, [3, 1, 0])
    np.testing.assert_array_equal(out.emitted_BxE, [[1, 2, 3, 4], [1, 2, -1, -1], [1, -1, -1, -1]])


def test_greedy_rows_get_the_same_verdict_in_a_batch_that_samples():
    """All-greedy batches skip the residual draw (argmax of a one-hot); mixed batches draw.
    The greedy rows' verdicts must not depend on which branch ran."""
    tokens = jnp.asarray([[1, 2, 3], [1, 2, 3], [4, 4, 4]], jnp.int32)
    target = one_hot_logits([[1, 0, 3, 4], [1, 2, 3, 5], [0, 1, 2, 3]])
    lengths = jnp.asarray([3, 3, 2], jnp.int32)
    keys = request_keys(range(3))
    verdicts = [
        verify(tokens, greedy_q(tokens), target, lengths, SamplingParams.from_configs(configs), keys, NO_STOP)
        for configs in ([GREEDY] * 3, [GREEDY, SamplingConfig(temperature=1.0), GREEDY])
    ]
    for verdict in verdicts:
        np.testing.assert_array_equal(np.asarray(verdict.emitted_BxE)[[0, 2]], [[1, 0, -1, -1], [0, -1, -1, -1]])
    np.testing.assert_array_equal(verdicts[0].emitted_BxE[1], [1, 2, 3, 5])


def test_stop_id_inside_the_accepted_span_ends_the_request():
    out = run([[1, 2, 3], [1, 5, 5]], [[1, 2, 3, 4], [1, 0, 0, 0]], [3, 3], stop=jnp.asarray([2, 0]))
    np.testing.assert_array_equal(out.emitted_BxE[0], [1, 2, -1, -1])
    assert bool(out.stopped_B[0]) and int(out.num_emitted_B[0]) == 2
    # Row 1 is rejected at x_2 and the target's own token there is the stop id.
    np.testing.assert_array_equal(out.emitted_BxE[1], [1, 0, -1, -1])
    assert bool(out.stopped_B[1])


def _first_emitted_distribution(q_row, p_row, config, n, broken=False):
    """Frequencies of the first emitted token when x_1 ~ q and the target's distribution is p."""
    q = jnp.asarray(q_row, jnp.float32)
    p_logits = jnp.log(jnp.asarray(p_row, jnp.float32))
    params = SamplingParams.broadcast(config, n)
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * n)
    q_sampled = probabilities(jnp.log(q)[None], SamplingParams.broadcast(config, 1))[0]
    draft = jax.vmap(lambda k: jax.random.categorical(k, jnp.log(q_sampled)))(keys[:n]).astype(jnp.int32)
    q_BxGxV = jnp.broadcast_to(q_sampled, (n, 1, V))
    target = jnp.broadcast_to(p_logits, (n, 2, V))
    out = verify(draft[:, None], q_BxGxV, target, jnp.ones((n,), jnp.int32), params, keys[n:], NO_STOP)
    first = np.asarray(out.emitted_BxE[:, 0])
    if broken:  # a wrong rule: keep every draft token (ignores p entirely)
        first = np.asarray(draft)
    return np.bincount(first, minlength=V) / n


@pytest.mark.parametrize(
    "config",
    [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.8), SamplingConfig(temperature=1.0, top_k=3)],
    ids=["t1", "t0.7-top-p", "top-k"],
)
def test_emitted_token_follows_the_target_distribution(config):
    """Speculative sampling is lossless: the first emitted token ~ p, whatever q is."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(V))
    q = rng.dirichlet(np.ones(V) * 0.5)
    n = 40000
    expected = np.asarray(probabilities(jnp.log(jnp.asarray(p, jnp.float32))[None], SamplingParams.broadcast(config, 1)))[0]
    got = _first_emitted_distribution(q, p, config, n)
    support = expected > 0
    assert got[~support].sum() == 0
    chi2 = n * (((got - expected) ** 2)[support] / expected[support]).sum()
    assert chi2 < 25.0, (chi2, got, expected)  # 99.99% quantile for <= 5 dof is ~25.7
    # The same test rejects a broken acceptance rule (the test has power).
    broken = _first_emitted_distribution(q, p, config, n, broken=True)
    chi2_broken = n * (((broken - expected) ** 2)[support] / expected[support]).sum() if (broken[~support] == 0).all() else np.inf
    assert chi2_broken > 100.0


def test_a_rejection_with_a_tiny_residual_still_draws_from_the_residual():
    """A rejection happens with probability equal to the residual mass, so however small that
    mass, the token after a rejection must come from it: here the residual is all on token 1,
    and falling back to ``p`` (as a residual under 1e-6 once did) emits token 0 instead. The
    reference falls back only at or below 1e-8, where float32 ``p − q`` is rounding."""
    delta, n = 9e-7, 1 << 23  # about 7 of the 8.4M rows reject draft 0 (u ≥ 1 − δ)
    config = SamplingConfig(temperature=1.0)
    target = jnp.broadcast_to(jnp.log(jnp.asarray([1.0 - delta, delta], jnp.float32)), (n, 2, 2))
    q_BxGxV = jnp.broadcast_to(jnp.asarray([1.0, 0.0], jnp.float32), (n, 1, 2))
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    out = verify(jnp.zeros((n, 1), jnp.int32), q_BxGxV, target, jnp.ones((n,), jnp.int32),
                 SamplingParams.broadcast(config, n), keys, NO_STOP)
    rejected = np.asarray(out.num_accepted_B) == 0
    assert rejected.sum() >= 1
    np.testing.assert_array_equal(np.asarray(out.emitted_BxE[rejected, 0]), 1)


def test_a_draft_id_outside_the_vocabulary_ends_the_verified_prefix():
    """A broken drafter's id is never accepted or committed: the target's token follows the
    drafts before it. (A -1 used to wrap onto the last token, pass, and be committed as -1.)"""
    tokens = jnp.asarray([[1, -1, 3], [1, 2, V]], jnp.int32)
    q = jnp.full((2, GAMMA, V), 1.0 / V)
    target = one_hot_logits([[1, V - 1, 3, 4], [1, 2, 0, 4]])
    out = verify(tokens, q, target, jnp.asarray([3, 3], jnp.int32), SamplingParams.broadcast(GREEDY, 2),
                 request_keys(range(2)), NO_STOP)
    np.testing.assert_array_equal(out.num_accepted_B, [1, 2])
    np.testing.assert_array_equal(out.emitted_BxE, [[1, V - 1, -1, -1], [1, 2, 0, -1]])
    np.testing.assert_array_equal(out.num_emitted_B, [2, 3])
    np.testing.assert_array_equal(out.out_of_vocab_B, [True, True])
    assert not run([[1, 2, 3]], [[1, 2, 3, 4]], [3]).out_of_vocab_B.any()
