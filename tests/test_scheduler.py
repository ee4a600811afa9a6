"""The hardware-aware prefix scheduler: Algorithm 1, its non-anticipation, and the decoder with it."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.config import SamplingConfig
from dspark_jax.decoding.autoregressive import AutoregressiveGenerator
from dspark_jax.decoding.speculative import (
    FixedPolicy,
    SpeculativeDecoder,
    ThresholdPolicy,
    parse_policy,
)
from dspark_jax.decoding.verify import verify
from dspark_jax.diagnostics import count_compilations
from dspark_jax.sampling import SamplingParams
from dspark_jax.scheduler.prefix import (
    PLAIN,
    Calibration,
    SchedulerPolicy,
    calibration_for,
    calibration_index,
    prefix_lengths,
    survival,
)
from dspark_jax.scheduler.profile import (
    load_cost_tables,
    profile_round_costs,
    profiled,
    save_cost_tables,
)
from dspark_jax.training.calibrate import calibrated
from tests.prompts import mixed_prompts, random_drafter


def greedy(batch):
    return SamplingParams.broadcast(SamplingConfig(), batch)


def algorithm_1(a_BxG, active_B, widths, costs, baseline_cost=None, floor=0):
    """Paper Algorithm 1 as a plain loop (the oracle): admit candidates by ``a`` until Θ stops
    rising, starting from ``floor`` drafts for every active row."""
    batch, gamma = a_BxG.shape
    floor = min(floor, gamma)
    candidates = sorted(
        ((float(a_BxG[r, j]), j + 1, r) for r in range(batch) if active_B[r] for j in range(floor, gamma)),
        key=lambda c: (-c[0], c[1], c[2]),
    )

    def cost(longest):
        return costs[next(i for i, w in enumerate(widths) if w >= longest + 1)]

    lengths = [floor if active_B[r] else 0 for r in range(batch)]
    tokens = float(sum(active_B)) + sum(float(a_BxG[r, :floor].sum()) for r in range(batch) if active_B[r])
    if floor and any(active_B):
        best = tokens / cost(floor)
    else:
        best = tokens / (cost(0) if baseline_cost is None else baseline_cost)
    for a, j, r in candidates:
        tokens += a
        longest = max(max(lengths), j)
        theta = tokens / cost(longest)
        if not theta > best:
            break
        lengths[r], best = j, theta
    return lengths


# As the decoder runs it (inside jit): the tests below call it hundreds of times, which op by op
# would dispatch every primitive eagerly.
jitted_prefix_lengths = jax.jit(prefix_lengths, static_argnames=("widths", "costs", "baseline_cost"))


def random_survival(rng, batch, gamma):
    c = 1.0 - rng.beta(1.0, 4.0, (batch, gamma))  # mostly confident, some not
    c[rng.uniform(size=c.shape) < 0.1] = 1.0  # exact ties inside a request
    return np.cumprod(c, axis=1).astype(np.float32)


CURVES = {
    "flat": ((1, 2, 4, 8), (1.0, 1.05, 1.1, 1.2)),
    "steep": ((1, 2, 4, 8), (1.0, 1.3, 1.9, 3.0)),
    "jagged": ((1, 2, 4, 8), (1.0, 1.3, 1.3, 1.8)),
}


@pytest.mark.parametrize("curve", sorted(CURVES))
def test_matches_algorithm_1(curve):
    widths, costs = CURVES[curve]
    rng = np.random.default_rng(0)
    chosen = set()
    for _ in range(200):
        batch = int(rng.integers(1, 5))
        a = random_survival(rng, batch, 7)
        active = rng.uniform(size=batch) < 0.8
        got = np.asarray(jitted_prefix_lengths(jnp.asarray(a), jnp.asarray(active), widths, costs))
        assert got.tolist() == algorithm_1(a, active, widths, costs)
        assert (got[~active] == 0).all()
        chosen.update(got[active].tolist())
        # Against a cheaper "verify nothing" (a round without a draft), fewer drafts pay.
        plain = 0.8 * costs[0]
        cheaper = np.asarray(jitted_prefix_lengths(jnp.asarray(a), jnp.asarray(active), widths, costs, baseline_cost=plain))
        assert cheaper.tolist() == algorithm_1(a, active, widths, costs, baseline_cost=plain)
        assert cheaper.tolist() in (got.tolist(), [0] * batch)  # only the first admission differs
        # From a planned floor: those drafts first, then the search as from zero.
        floor = int(rng.integers(0, 9))
        planned = np.asarray(jitted_prefix_lengths(jnp.asarray(a), jnp.asarray(active), widths, costs, floor=jnp.int32(floor)))
        assert planned.tolist() == algorithm_1(a, active, widths, costs, floor=floor)
        assert (planned[active] >= min(floor, 7)).all() and (planned[~active] == 0).all()
    assert len(chosen) >= 3, chosen  # the cases exercise several prefix lengths


def test_appendix_a_counterexample_stops_before_looking_at_c2():
    """R = 1, γ = 2, a_1 = 0.8, SPS(1, 2, 3) = (1, 0.5, 0.45): Θ_1 = 0.9 < Θ_0 = 1 stops the search,
    whatever c_2 is; a search for the path's maximum would take ℓ = 2 when c_2 = 0.9 (Θ_2 = 1.134)."""
    widths, costs = (1, 2, 3), (1.0, 1 / 0.5, 1 / 0.45)
    for c2 in (0.9, 0.0):
        a = jnp.asarray([[0.8, 0.8 * c2]], jnp.float32)
        assert prefix_lengths(a, jnp.ones((1,), bool), widths, costs).tolist() == [0]


def _appendix_a_output(n, global_search):
    """Output frequencies of the first token in Appendix A's setting: vocabulary {A, B},
    p_t = (0.7, 0.3), q = (0.5, 0.5), c_1 = 0.8 and c_2 = 0.9 after A, 0 after B."""
    widths, costs = (1, 2, 3), (1.0, 2.0, 1 / 0.45)
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    drafts = jax.random.bernoulli(keys[0], 0.5, (n, 2)).astype(jnp.int32)  # 0 = A, 1 = B
    c2 = jnp.where(drafts[:, 0] == 0, 0.9, 0.0)
    a = jnp.stack([jnp.full((n,), 0.8), 0.8 * c2], axis=1)
    if global_search:  # the best point of the whole path: it looks at c_2, which depends on x_1
        theta = jnp.stack([jnp.ones(n), (1 + a[:, 0]) * 0.5, (1 + a[:, 0] + a[:, 1]) * 0.45], axis=1)
        lengths = jnp.argmax(theta, axis=1).astype(jnp.int32)
    else:
        lengths = jax.vmap(lambda row: prefix_lengths(row[None], jnp.ones((1,), bool), widths, costs)[0])(a)
    q = jnp.full((n, 2, 2), 0.5)
    target_logits = jnp.broadcast_to(jnp.log(jnp.asarray([0.7, 0.3])), (n, 3, 2))
    config = SamplingConfig(temperature=1.0)
    out = verify(drafts, q, target_logits, lengths, SamplingParams.broadcast(config, n),
                 jax.random.split(keys[1], n), jnp.zeros((0,), jnp.int32))
    return np.bincount(np.asarray(out.emitted_BxE[:, 0]), minlength=2) / n


def test_early_stop_keeps_the_output_distribution_exact():
    n, expected = 40000, np.asarray([0.7, 0.3])
    chi2 = n * (((_appendix_a_output(n, global_search=False) - expected) ** 2) / expected).sum()
    assert chi2 < 15.0  # 1 dof: p ≈ 1e-4
    broken = _appendix_a_output(n, global_search=True)
    np.testing.assert_allclose(broken, [0.85, 0.15], atol=0.01)  # the paper's biased distribution


@pytest.mark.parametrize("curve", sorted(CURVES))
def test_admission_of_a_draft_does_not_depend_on_the_draft_itself(curve):
    """Whether x_{r,k} is verified may depend on a_{r,≤k} and other requests, never on
    a_{r,k+1..} (which depend on x_{r,k}): re-drawing the later confidences keeps ``ℓ_r ≥ k``."""
    widths, costs = CURVES[curve]
    rng = np.random.default_rng(1)
    active = jnp.ones((3,), bool)
    for case in range(120):
        floor = 0 if case < 60 else int(rng.integers(1, 7))  # a planned floor: the same must hold above it
        c = rng.uniform(0.05, 1.0, (3, 7))
        base = np.asarray(jitted_prefix_lengths(jnp.asarray(np.cumprod(c, 1), jnp.float32), active, widths, costs, floor=floor))
        r, k = int(rng.integers(3)), int(rng.integers(1, 7))
        for _ in range(5):
            changed = c.copy()
            changed[r, k:] = rng.uniform(0.0, 1.0, 7 - k)
            got = np.asarray(jitted_prefix_lengths(jnp.asarray(np.cumprod(changed, 1), jnp.float32), active, widths, costs,
                                            floor=floor))
            assert (got[r] >= k) == (base[r] >= k)


def test_survival_applies_the_calibration():
    z = jnp.asarray([[2.0, -1.0, 0.5]])
    np.testing.assert_allclose(survival(z), np.cumprod(1 / (1 + np.exp(-np.asarray(z))), axis=1), rtol=1e-6)
    t, b = (2.0, 0.5, 1.0), (0.0, 0.3, -1.5)
    np.testing.assert_allclose(survival(z, t, b), survival(z / jnp.asarray(t) + jnp.asarray(b)), rtol=1e-6)
    # The numpy twin the calibration is fitted with agrees.
    np.testing.assert_allclose(survival(z, t, b), calibrated(np.asarray(z), t, b), rtol=1e-6)
    assert Calibration([2.0, 0.5, 1.0], [0, 0.3, -1.5]) == Calibration(t, b)  # lists become hashable tuples
    with pytest.raises(ValueError, match="positive"):
        Calibration((1.0, -1.0), (0.0, 0.0))
    with pytest.raises(ValueError, match="2 calibration temperatures but 1 biases"):
        Calibration((1.0, 1.0), (0.0,))
    with pytest.raises(ValueError, match="finite"):
        Calibration((1.0,), (float("nan"),))


def test_each_request_is_served_by_the_calibration_of_its_own_sampling():
    greedy_fit = Calibration((0.5,) * 3, (0.2,) * 3, SamplingConfig())
    t1_fit = Calibration((1.5,) * 3, (-0.6,) * 3, SamplingConfig(temperature=1.0))
    t07_fit = Calibration((1.2,) * 3, (-0.3,) * 3, SamplingConfig(temperature=0.7, top_k=20, top_p=0.8))
    any_fit = Calibration((2.0,) * 3, (0.0,) * 3)
    rows = [SamplingConfig(), SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=20, top_p=0.8),
            SamplingConfig(temperature=0.8), SamplingConfig(temperature=0.9, top_p=0.8), SamplingConfig(temperature=1.6),
            SamplingConfig(temperature=0.7), SamplingConfig(temperature=0.7, top_k=50, top_p=0.8)]
    params = SamplingParams.from_configs(rows)

    def index(*calibrations):
        return np.asarray(calibration_index(calibrations, params)).tolist()

    # Greedy rows take the greedy fit; sampled rows the nearest temperature, then top-p, then top-k.
    assert index(greedy_fit, t1_fit, t07_fit) == [0, 1, 2, 2, 1, 1, 2, 2]
    assert index(t07_fit, t1_fit, Calibration((1.0,) * 3, (0.1,) * 3, SamplingConfig(temperature=0.7))) == [3, 1, 0, 2, 1, 1, 2, 0]
    # A mode without a fit of its own falls back to the fit for any decoding, else to none (raw σ(z)).
    assert index(greedy_fit) == [0] + [1] * 7
    assert index(t1_fit) == [1] + [0] * 7
    assert index(any_fit, greedy_fit) == [1] + [0] * 7
    assert index(any_fit) == [0] * 8 and index() == [0] * 8
    for config in rows:  # the host-side lookup is the same rule
        expected = index(greedy_fit, t1_fit, t07_fit)[rows.index(config)]
        assert calibration_for((greedy_fit, t1_fit, t07_fit), config) == (greedy_fit, t1_fit, t07_fit)[expected]
    assert calibration_for((greedy_fit,), SamplingConfig(temperature=1.0)) is None

    # In one batch, each row's survival is computed with its own fit, and none means σ(z).
    z = jnp.asarray(np.random.default_rng(0).normal(0.0, 2.0, (len(rows), 3)), jnp.float32)
    policy = SchedulerPolicy(calibrations=(greedy_fit, t1_fit))
    got = np.asarray(policy._survival(z, 3, params))
    for row, config in enumerate(rows):
        fit = calibration_for(policy.calibrations, config)
        expected = survival(z[row:row + 1]) if fit is None else survival(z[row:row + 1], fit.temperatures, fit.biases)
        np.testing.assert_allclose(got[row:row + 1], expected, rtol=1e-6)


def test_policy_errors_name_the_problem(tmp_path):
    table = {1: {1: 0.03, 2: 0.035, 4: 0.04, 8: 0.05}}
    policy = SchedulerPolicy.from_tables(table)
    z = jnp.zeros((2, 7))
    with pytest.raises(ValueError, match="no batch size 2"):
        policy.lengths(z, 7, jnp.ones((2,), bool), greedy(2))
    with pytest.raises(ValueError, match="confidence head"):
        policy.lengths(None, 7, jnp.ones((1,), bool), greedy(1))
    with pytest.raises(ValueError, match="no cost table yet"):
        SchedulerPolicy().lengths(z[:1], 7, jnp.ones((1,), bool), greedy(1))
    with pytest.raises(ValueError, match="a calibration of 3 positions"):
        SchedulerPolicy.from_tables(table, [Calibration((1.0,) * 3, (0.0,) * 3)]).lengths(z[:1], 7, jnp.ones((1,), bool),
                                                                                        greedy(1))
    with pytest.raises(ValueError, match="two calibrations for the same sampling"):
        SchedulerPolicy(calibrations=[Calibration((1.0,), (0.0,)), Calibration((2.0,), (0.0,))])
    with pytest.raises(ValueError, match="different lengths"):
        SchedulerPolicy(calibrations=[Calibration((1.0,), (0.0,)), Calibration((1.0,) * 2, (0.0,) * 2, SamplingConfig())])
    with pytest.raises(ValueError, match="positive"):
        SchedulerPolicy.from_tables({1: {1: 0.0, 8: 1.0}})
    with pytest.raises(ValueError, match="same verify widths"):
        SchedulerPolicy.from_tables({1: {1: 0.1, 8: 0.2}, 2: {1: 0.1, 4: 0.1, 8: 0.2}})
    with pytest.raises(ValueError, match="widest verify bucket"):
        prefix_lengths(jnp.ones((1, 7)), jnp.ones((1,), bool), (1, 4), (1.0, 2.0))
    with pytest.raises(FileNotFoundError, match="dspark profile"):
        parse_policy(f"scheduler:{tmp_path / 'missing.json'}")
    with pytest.raises(ValueError, match="is a directory"):
        parse_policy(f"scheduler:{tmp_path}")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not a dspark-jax-cost-table"):
        load_cost_tables(bad)
    for tables, problem in (({"1": {"1": 0.1, "01": 0.2}}, "batch 1's width '01' is not a whole number"),
                            ({"1": {"1": True}}, "True is not a number of seconds"),
                            ({"1": {"1": "0.1"}}, "'0.1' is not a number of seconds")):
        bad.write_text(json.dumps({"format": "dspark-jax-cost-table", "version": 1, "tables": tables}))
        with pytest.raises(ValueError, match=problem):
            load_cost_tables(bad)
    bad.write_text(json.dumps({"format": "dspark-jax-cost-table", "version": "1", "tables": {}}))
    with pytest.raises(ValueError, match="has version '1'; this code reads version 1"):
        load_cost_tables(bad)
    bad.write_bytes(b"\x89PNG\r\n")
    with pytest.raises(ValueError, match="bad.json is not JSON"):
        load_cost_tables(bad)
    with pytest.raises(ValueError, match="is a directory: give the cost table a file name"):
        save_cost_tables(tmp_path, table)
    path = save_cost_tables(tmp_path / "costs.json", table, note="test")
    assert parse_policy(f"scheduler:{path}") == policy
    for text in ("scheduler:", "scheduler-ahead: "):  # what "scheduler:$COSTS" gives with $COSTS unset
        with pytest.raises(ValueError, match="names no cost table after the colon"):
            parse_policy(text)
    assert parse_policy("scheduler") == SchedulerPolicy()
    assert parse_policy(f"scheduler-ahead:{path}") == dataclasses.replace(policy, plan_ahead=True)
    assert parse_policy("scheduler-ahead") == SchedulerPolicy(plan_ahead=True)



def test_cost_tables_are_taken_exactly_as_given():
    """A table is a mapping ``{batch: {width: seconds}}``, as the docstring says, in Python or as
    JSON gives it ("8"); keys that would silently truncate or merge, and seconds that are not
    numbers, are refused by name."""
    table = {1: {1: 0.03, 2: 0.035, 8: 0.05}}
    assert SchedulerPolicy(costs=table) == SchedulerPolicy.from_tables(table) == SchedulerPolicy.from_tables(
        {"1": {"1": 0.03, "2": 0.035, "8": 0.05}})
    for tables, problem in (({1: {2.5: 0.1, 8: 0.2}}, "batch 1's width must be an int, got 2.5"),
                            ({1.9: {1: 0.1, 8: 0.2}}, "batch size must be an int, got 1.9"),
                            ({1: {1: 0.1, 8: 0.2}, "1": {1: 0.1, 8: 0.3}}, "batch size 1 has two cost tables"),
                            ({"1.0": {1: 0.1, 8: 0.2}}, "batch size '1.0' is not a whole number"),
                            ({1: {1: True, 8: 0.2}}, "batch 1, width 1: True is not a number of seconds"),
                            ({0: {1: 0.1, 8: 0.2}}, "a cost table for batch size 0: batch sizes are >= 1"),
                            ([(1, 0.1)], "cost tables map batch sizes to {width: seconds}, got list")):
        with pytest.raises(ValueError, match=re.escape(problem)):
            SchedulerPolicy.from_tables(tables)
    with pytest.raises(ValueError, match=r"times \[1, 2, 8\]: time this decoder's widths \(`dspark profile`"):
        SchedulerPolicy.from_tables(table).check_widths((1, 2, 4, 8))
    with pytest.raises(ValueError, match="confidence threshold must be a number in"):
        ThresholdPolicy("0.5")

@pytest.fixture(scope="module")
def real(shallow_target):
    """Real weights and prompts (the embedded target's first 4 layers: what the scheduler decides
    does not depend on depth, and compiling is most of these tests), an untrained drafter, and
    target-only greedy output."""
    target, tokenizer = shallow_target
    prompts = mixed_prompts(tokenizer)
    reference = AutoregressiveGenerator(target).generate(prompts, max_new_tokens=24, max_len=256)
    return target, random_drafter(target.cfg, 7, tap_layers=(1, 2)), prompts, reference


@pytest.fixture(scope="module")
def real_decoder(real):
    """One decoder for the scheduler variants below: ``with_policy`` shares its compiled prefill
    and verify programs, so each variant compiles only its draft step."""
    target, drafter, _, _ = real
    return SpeculativeDecoder(target, drafter)


@pytest.mark.parametrize("plan_ahead", [False, True], ids=["algorithm-1", "ahead"])
def test_decoder_with_the_scheduler_is_exact_and_compiles_once(real, real_decoder, plan_ahead):
    """A synthetic cost table (so the test does not hang on timing): lengths vary with the
    drafter's confidences, greedy output equals target-only, nothing compiles after warm-up
    (a planned floor is data, not a shape)."""
    target, drafter, prompts, reference = real
    costs = {len(prompts): {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1}, 1: {1: 1.0, 2: 1.3, 4: 1.6, 8: 2.0}}
    decoder = real_decoder.with_policy(SchedulerPolicy.from_tables(costs, plan_ahead=plan_ahead))
    decoder.warmup(len(prompts), max(len(p) for p in prompts), 256)
    decoder.warmup(1, len(prompts[2]), 256)
    with count_compilations() as counter:
        batched = decoder.generate(prompts, max_new_tokens=24, max_len=256)
        alone = decoder.generate(prompts[2:3], max_new_tokens=24, max_len=256)
    assert counter.count == 0
    assert batched.tokens == reference.tokens
    assert alone.tokens[0] == reference.tokens[2]
    assert batched.plain_rounds == alone.plain_rounds == 0  # no plain cost in the table: always draft
    lengths = np.concatenate(batched.verify_lengths)
    assert len(set(lengths.tolist())) > 1, "the scheduler never varied the verify length"
    # A steeper curve for one row than for four: the single request verifies less.
    assert np.concatenate(alone.verify_lengths).mean() < lengths.mean()
    with pytest.raises(ValueError, match=r"verifies at widths \[1, 8\] but the scheduler's cost table times \[1, 2, 4, 8\]"):
        SpeculativeDecoder(target, drafter, policy=SchedulerPolicy.from_tables(costs), verify_widths=(1, 8))
    with pytest.raises(ValueError, match="a calibration of 3 positions for a drafter of γ=7"):
        decoder.with_policy(SchedulerPolicy.from_tables(costs, [Calibration((1.0,) * 3, (0.0,) * 3)]))


def test_profiling_fills_in_the_cost_table(real):
    target, drafter, _, _ = real
    decoder = SpeculativeDecoder(target, drafter, policy=SchedulerPolicy())
    costs = profile_round_costs(decoder, 1, max_len=256, repeats=1)
    assert sorted(costs) == [PLAIN, 1, 2, 4, 8] and all(s > 0 for s in costs.values())
    scheduled = profiled(decoder, (1,), max_len=256, repeats=1)
    assert scheduled.policy.widths == (1, 2, 4, 8) and scheduled._verify is decoder._verify
    assert profiled(scheduled) is scheduled  # already profiled: unchanged
    fixed = SpeculativeDecoder(target, drafter, policy=FixedPolicy(3))
    assert profiled(fixed) is fixed
    with pytest.raises(ValueError, match="cannot hold"):
        profile_round_costs(decoder, 1, max_len=64, repeats=20)


def test_a_decoder_is_profiled_with_the_sampling_it_will_decode_with(real, monkeypatch):
    """Sampled rounds filter and softmax every verified position, so they are timed as such."""
    from dspark_jax.eval.compare import make_decoder

    target, drafter, _, _ = real
    timed = []

    def fake_profile(decoder, batch, **kwargs):
        timed.append((batch, kwargs.get("sampling")))
        return {PLAIN: 1.0, 1: 1.0, 2: 1.1, 4: 1.2, 8: 1.3}

    monkeypatch.setattr("dspark_jax.scheduler.profile.profile_round_costs", fake_profile)
    sampled = SamplingConfig(temperature=0.7, top_k=20, top_p=0.8)
    decoder = make_decoder(target, drafter, SchedulerPolicy(), profile_batches=(1, 4), profile_sampling=sampled)
    assert timed == [(1, sampled), (4, sampled)] and decoder.policy.costs is not None


def plan_oracle(a_BxG, active_B, widths, costs, plain=None):
    """The next round's plan as a plain loop: the best Θ over a plain round and every width,
    each row verifying all its drafts up to the width; ties to the cheaper."""
    gamma = a_BxG.shape[1]
    rows = [r for r in range(len(active_B)) if active_B[r]]
    options = [] if plain is None else [(len(rows) / plain, -1)]
    for w, cost in zip(widths, costs):
        ell = min(w - 1, gamma)
        options.append(((len(rows) + sum(float(a_BxG[r, :ell].sum()) for r in rows)) / cost, ell))
    best = max(theta for theta, _ in options)
    return next(ell for theta, ell in options if theta >= best * (1 - 1e-6))


def test_the_next_rounds_plan_is_a_global_search_over_widths():
    table = {1: {PLAIN: 0.6, 1: 1.0, 2: 1.1, 4: 1.2, 8: 1.4}}
    z = jnp.asarray([[3.0] * 7])  # σ ≈ 0.95 each: the whole block pays
    active = jnp.ones((1,), bool)
    ahead = SchedulerPolicy.from_tables(table, plan_ahead=True)
    assert int(ahead.plan_next_round(z, active, greedy(1))) == 7
    assert int(ahead.plan_next_round(-z, active, greedy(1))) == -1  # σ ≈ 0.05: plain
    no_plain = SchedulerPolicy.from_tables({1: {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.4}}, plan_ahead=True)
    assert int(no_plain.plan_next_round(-z, active, greedy(1))) == 0  # nothing cheaper than drafting
    rng = np.random.default_rng(3)
    plans = set()
    for _ in range(100):
        batch = int(rng.integers(1, 5))
        costs = np.sort(rng.uniform(1.0, 2.0, 4)).tolist()
        plain = float(rng.uniform(0.5, 1.0)) if rng.uniform() < 0.5 else None
        tables = {batch: dict(zip((1, 2, 4, 8), costs)) | ({} if plain is None else {PLAIN: plain})}
        logits = jnp.asarray(rng.normal(1.0, 2.0, (batch, 7)), jnp.float32)
        rows = rng.uniform(size=batch) < 0.8
        plan = int(SchedulerPolicy.from_tables(tables, plan_ahead=True).plan_next_round(logits, jnp.asarray(rows),
                                                                                       greedy(batch)))
        assert plan == plan_oracle(np.asarray(survival(logits)), rows, (1, 2, 4, 8), costs, plain)
        plans.add(plan)
    assert len(plans) >= 4, plans  # the cases exercise plain rounds and several widths


def test_without_planning_ahead_the_next_round_drafts_if_algorithm_1_would_have_drafted():
    """Algorithm 1 against the plain round's cost, on random batches: the next round drafts
    (floor 0) exactly when it admits a draft of this round."""
    table = {1: {PLAIN: 0.6, 1: 1.0, 2: 1.1, 4: 1.2, 8: 1.4}}
    z, active = jnp.asarray([[3.0] * 7]), jnp.ones((1,), bool)
    assert int(SchedulerPolicy.from_tables(table).plan_next_round(z, active, greedy(1))) == 0
    assert int(SchedulerPolicy.from_tables(table).plan_next_round(-z, active, greedy(1))) == -1
    no_plain = SchedulerPolicy.from_tables({1: {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.4}})
    assert int(no_plain.plan_next_round(-z, active, greedy(1))) == 0  # nothing cheaper than drafting
    rng = np.random.default_rng(3)
    drafted = set()
    for _ in range(100):
        batch = int(rng.integers(1, 5))
        policy = SchedulerPolicy.from_tables({batch: {PLAIN: float(rng.uniform(0.5, 1.0)), 1: 1.0, 2: 1.3, 4: 1.6, 8: 2.0}})
        logits = jnp.asarray(rng.normal(0.5, 2.0, (batch, 7)), jnp.float32)
        rows = jnp.asarray(rng.uniform(size=batch) < 0.8)
        widths, seconds, plain = policy._table(batch)
        full = prefix_lengths(survival(logits), rows, widths, seconds, baseline_cost=plain)
        plan = int(policy.plan_next_round(logits, rows, greedy(batch)))
        assert plan == (0 if bool(jnp.any(full > 0)) else -1)
        drafted.add(plan)
    assert drafted == {0, -1}
    assert SchedulerPolicy.from_tables(table).widths == (1, 2, 4, 8)  # the plain entry is not a width


def test_planning_ahead_drafts_past_the_cliff_that_stops_algorithm_1():
    """Four rows at c = 0.8 every slot (a = 0.8, 0.64, 0.51, ...); a round costs 1.05, 1.15, 1.5
    and 2.6 plain rounds at widths 1, 2, 4 and 8. Algorithm 1 admits the four first drafts
    (Θ = 7.2 / 1.15 ≈ 6.26 tokens a plain round's time), then the first second draft widens all
    four rows for one row's 0.64 (Θ = 7.84 / 1.5 ≈ 5.23) and it stops, while three drafts a row
    pay (Θ = 11.81 / 1.5 ≈ 7.87). The plan finds that width, and the next round starts from it."""
    table = {4: {PLAIN: 1.0, 1: 1.05, 2: 1.15, 4: 1.5, 8: 2.6}}
    z = jnp.full((4, 7), jnp.log(0.8 / 0.2))  # σ = 0.8 at every slot
    active, params = jnp.ones((4,), bool), greedy(4)
    algorithm1 = SchedulerPolicy.from_tables(table)
    planning = SchedulerPolicy.from_tables(table, plan_ahead=True)
    assert algorithm1.lengths(z, 7, active, params).tolist() == [1, 1, 1, 1]
    floor = planning.plan_next_round(z, active, params)
    assert int(floor) == 3
    assert planning.lengths(z, 7, active, params, floor=floor).tolist() == [3, 3, 3, 3]
    assert algorithm1.lengths(z, 7, active, params, floor=floor).tolist() == [1, 1, 1, 1]  # it ignores plans
    # Above the floor Algorithm 1 still weighs the round's own drafts: where width 8 costs little
    # more than 4, four more drafts of a sure row pay for it (and then every other draft rides free).
    cheap_8 = SchedulerPolicy.from_tables({4: {PLAIN: 1.0, 1: 1.05, 2: 1.15, 4: 1.5, 8: 1.6}}, plan_ahead=True)
    assert cheap_8.lengths(z, 7, active, params, floor=floor).tolist() == [3, 3, 3, 3]
    sure = z.at[0].set(10.0)
    assert planning.lengths(sure, 7, active, params, floor=floor).tolist() == [3, 3, 3, 3]
    assert cheap_8.lengths(sure, 7, active, params, floor=floor).tolist() == [7, 7, 7, 7]


def test_plain_rounds_skip_the_draft_and_keep_greedy_output(real):
    """A random drafter's drafts never pay against a cheap plain round: the loop skips drafting
    (backing off up to MAX_PLAIN_ROUNDS), output stays the target's, nothing compiles."""
    from dspark_jax.decoding.speculative import MAX_PLAIN_ROUNDS

    target, drafter, prompts, reference = real
    costs = {len(prompts): {PLAIN: 0.5, 1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1}}
    decoder = SpeculativeDecoder(target, drafter, policy=SchedulerPolicy.from_tables(costs))
    decoder.warmup(len(prompts), max(len(p) for p in prompts), 256)
    with count_compilations() as counter:
        result = decoder.generate(prompts, max_new_tokens=24, max_len=256)
    assert counter.count == 0
    assert result.tokens == reference.tokens
    drafted = result.rounds - result.plain_rounds
    assert result.plain_rounds > drafted > 0  # it kept probing, and mostly skipped
    assert len(result.confidence_per_round) == drafted
    assert result.plain_rounds <= MAX_PLAIN_ROUNDS * drafted


def test_profiling_refuses_a_cache_longer_than_the_target_reads(real):
    target, drafter, _, _ = real
    with pytest.raises(ValueError, match="max_len 9000 is past the target's 8192 positions"):
        profile_round_costs(SpeculativeDecoder(target, drafter), 1, max_len=9000)
