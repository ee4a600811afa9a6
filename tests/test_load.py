"""Serving under load (``engine.load``): arrival times, per-request timing, the Pareto front."""

import math

import numpy as np
import pytest

from dspark_jax.decoding.autoregressive import AutoregressiveGenerator
from dspark_jax.diagnostics import count_compilations
from dspark_jax.engine.load import ServingRun, pareto_front, poisson_arrivals, serve, warm_up
from tests.refills import counting_refills
from tests.tiny import sharp_tiny_target


def test_poisson_arrivals_have_the_asked_rate_and_repeat_with_the_seed():
    times = poisson_arrivals(4000, rate_per_s=8.0, seed=3)
    assert times[0] == 0 and np.all(np.diff(times) >= 0)
    # 3999 exponential gaps of mean 1/8 s: their mean is within 3 standard errors (1.6% each).
    assert abs(np.diff(times).mean() * 8.0 - 1) < 3 / math.sqrt(3999)
    assert np.array_equal(times, poisson_arrivals(4000, 8.0, seed=3))
    assert not np.array_equal(times, poisson_arrivals(4000, 8.0, seed=4))
    assert np.array_equal(poisson_arrivals(3, math.inf), np.zeros(3))  # a closed batch
    for count, rate, message in [(0, 1.0, "count"), (2, 0.0, "rate_per_s"), (2, -1.0, "rate_per_s"),
                                 (2, float("nan"), "rate_per_s"), (2, "fast", "rate_per_s")]:
        with pytest.raises(ValueError, match=message):
            poisson_arrivals(count, rate)


def test_a_runs_latencies_throughput_and_per_user_speed():
    run = ServingRun(arrival_s=np.array([0.0, 1.0, 1.5]), first_token_s=np.array([0.5, 1.25, 3.0]),
                     finish_s=np.array([2.5, 2.25, 3.0]), num_tokens=np.array([5, 3, 1]), wall_s=3.0, result=None)
    np.testing.assert_allclose(run.ttft_s, [0.5, 0.25, 1.5])
    np.testing.assert_allclose(run.latency_s, [2.5, 1.25, 1.5])
    np.testing.assert_allclose(run.tpot_s, [0.5, 0.5, np.nan])  # a one-token answer has no TPOT
    assert run.throughput == 3.0 and run.per_user_tokens_per_s == 2.0
    summary = run.summary()
    assert summary["tokens"] == 9 and summary["requests"] == 3 and "tau" not in summary
    assert summary["latency_s"]["p50"] == 1.5 and summary["tpot_s"]["mean"] == 0.5


def test_the_pareto_front_keeps_the_points_nothing_beats_on_both():
    points = [(10.0, 1.0), (5.0, 3.0), (4.0, 2.0), (10.0, 0.5), (1.0, 3.0), (float("nan"), 9.0), (7.0, 2.0)]
    # (4, 2) is beaten by (7, 2); (10, 0.5) by (10, 1); (1, 3) by (5, 3); NaN is never on the front.
    assert pareto_front(points) == [1, 6, 0]
    assert pareto_front([(1.0, 1.0), (1.0, 1.0)]) == [0, 1]  # equal points do not beat each other


def test_serving_times_each_request_from_its_arrival():
    """After ``warm_up``, nothing compiles while serving (prompts of two prefill widths, rows
    refilled while others decode, with and without batch buckets); every request's first token
    comes after its arrival."""
    target = sharp_tiny_target()
    generator = AutoregressiveGenerator(target)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 12, size=n).tolist() for n in rng.integers(2, 12, size=13)]
    # prompts[2] stops at its second token and [9] at its first: their rows are refilled while the
    # other row decodes. The 20-token prompt pads to another prefill width.
    prompts = [prompts[0], prompts[2], prompts[3], prompts[9], (np.arange(20) % 11 + 1).tolist(), prompts[4]]
    arrivals = [0.0, 0.0, 0.0, 0.0, 0.2, 0.4]
    kwargs = dict(max_new_tokens=8, stop_ids=[2], max_len=32)
    warm_up(generator, prompts, batch_size=2, max_len=32)
    refills = counting_refills(generator)
    with count_compilations() as compiled:
        run = serve(generator, prompts, arrivals, batch_size=2, **kwargs)
    assert compiled.count == 0 and refills, "no row was refilled while another decoded"
    assert run.result.tokens == generator.generate(prompts, **kwargs).tokens
    assert list(run.num_tokens) == [len(t) for t in run.result.tokens]
    assert np.all(run.ttft_s >= 0) and np.all(run.latency_s >= run.ttft_s)
    assert np.all(run.first_token_s >= run.arrival_s) and run.wall_s >= run.finish_s.max() >= 0.4
    assert run.throughput == pytest.approx(run.num_tokens.sum() / run.wall_s)
    assert run.summary()["mean_batch_rows"] == 2
    # Batch buckets: the warm-up covers one row too, and the resizes; the last request runs alone.
    warm_up(generator, prompts, batch_size=2, max_len=32, batch_buckets=True)
    with count_compilations() as compiled:
        bucketed = serve(generator, prompts, arrivals, batch_size=2, batch_buckets=True, **kwargs)
    assert compiled.count == 0 and bucketed.result.tokens == run.result.tokens
    assert bucketed.result.rows_per_step[-1] == 1 and 1 < bucketed.summary()["mean_batch_rows"] < 2
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        serve(generator, prompts, arrivals, max_new_tokens=0, batch_size=2)
