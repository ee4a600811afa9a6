"""Speculative decoding end to end: greedy exactness and stochastic losslessness."""

import dataclasses
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.config import DrafterConfig, SamplingConfig
from dspark_jax.decoding.autoregressive import (
    AutoregressiveGenerator,
    prepare_requests,
    prompt_width,
)
from dspark_jax.decoding.speculative import (
    FixedPolicy,
    SpeculativeDecoder,
    ThresholdPolicy,
    parse_policy,
    speculative_generate,
    stop_id_array,
)
from dspark_jax.diagnostics import count_compilations
from dspark_jax.drafter.model import Drafter
from dspark_jax.sampling import SamplingParams, request_keys
from tests.multidevice import run_on_eight_devices
from tests.prompts import mixed_prompts, random_drafter
from tests.tiny import cast_target, sharp_tiny_target, tiny_target

GAMMA = 7


@pytest.fixture(scope="module")
def real(shallow_target):
    """Real weights and real prompts on the embedded target's first 4 layers: what these tests check
    (exactness for every verify length, the accept path, stop tokens, shapes) does not depend on
    depth, and 4 layers compile several times faster than 30. All 30 decode exactly with the
    shipped drafters in tests/test_exactness.py and tests/test_replay.py."""
    target, tokenizer = shallow_target
    drafter = random_drafter(target.cfg, GAMMA, tap_layers=(1, 2))
    prompts = mixed_prompts(tokenizer)
    reference = AutoregressiveGenerator(target).generate(prompts, max_new_tokens=32, max_len=256)
    return target, drafter, prompts, reference


@pytest.fixture(scope="module")
def real_decoder(real):
    """One decoder for the policies below: ``with_policy`` shares its compiled prefill and verify
    programs, so each policy compiles only its draft step."""
    target, drafter, _, _ = real
    return SpeculativeDecoder(target, drafter)


@pytest.mark.parametrize("k", [0, 1, 3, GAMMA])
def test_greedy_equals_target_only_with_a_random_drafter(real, real_decoder, k):
    target, drafter, prompts, reference = real
    decoder = real_decoder.with_policy(FixedPolicy(k))
    batched = decoder.generate(prompts, max_new_tokens=32, max_len=256)
    assert batched.tokens == reference.tokens
    alone = decoder.generate(prompts[2:3], max_new_tokens=32, max_len=256)
    assert alone.tokens[0] == reference.tokens[2]
    assert set(batched.verify_widths) <= {1, 2, 4, 8}
    assert all((lengths == k).all() for lengths in batched.verify_lengths)
    # fixed:0 drafts once (plain rounds reuse that block's shapes), then steps the target alone.
    assert batched.plain_rounds == (batched.rounds - 1 if k == 0 else 0)


class OracleDecoder(SpeculativeDecoder):
    """Drafts the true greedy continuation (from a target-only run), so every draft is accepted.

    Exercises the accept path: bonus tokens, multi-token commits of the target cache and the
    drafter context.
    """

    def __init__(self, *args, continuation_BxN, prompt_lens, **kwargs):
        super().__init__(*args, **kwargs)
        draft = self._draft
        truth = jnp.asarray(continuation_BxN)
        lens = jnp.asarray(prompt_lens)

        def oracle_draft(params, drafter_state, state, keys, sampling, active, floor):
            block, lengths, confidence = draft(params, drafter_state, state, keys, sampling, active, floor)
            done = state.target_cache.lengths_B - lens  # generated tokens already in the cache
            index = jnp.clip(done[:, None] + 1 + jnp.arange(GAMMA), 0, truth.shape[1] - 1)
            tokens = jnp.take_along_axis(truth, index, axis=1)
            q = jax.nn.one_hot(tokens, block.q_BxGxV.shape[-1], dtype=jnp.float32)
            return block._replace(tokens_BxG=tokens, q_BxGxV=q), lengths, confidence

        self._draft = oracle_draft


@pytest.mark.parametrize("k", [3, GAMMA])
def test_greedy_equals_target_only_when_every_draft_is_accepted(real, k):
    target, drafter, prompts, _ = real
    reference = AutoregressiveGenerator(target).generate(prompts, max_new_tokens=40, max_len=256)
    truth = np.zeros((len(prompts), 48), np.int32)
    for row, tokens in enumerate(reference.tokens):
        truth[row, : len(tokens)] = tokens
    decoder = OracleDecoder(
        target, drafter, policy=FixedPolicy(k), continuation_BxN=truth, prompt_lens=[len(p) for p in prompts]
    )
    result = decoder.generate(prompts, max_new_tokens=32, max_len=256)
    assert result.tokens == [t[:32] for t in reference.tokens]
    assert result.tau == pytest.approx(k + 1, rel=0.15)  # all accepted, except where 32 cuts a round
    np.testing.assert_array_equal(result.per_position_acceptance(GAMMA)[:k], 1.0)


def test_a_stop_token_among_the_accepted_drafts_ends_the_round_without_the_targets_token(real):
    """Spec §6.4 step 4: the round's accept length counts the drafts up to the stop, no bonus, and
    τ is the mean of those lengths (an accepted stop is not counted as accepted + 1)."""
    target, drafter, prompts, _ = real
    prompt = prompts[:1]
    answer = AutoregressiveGenerator(target).generate(prompt, max_new_tokens=40, max_len=256).tokens[0]
    # Every oracle round commits answer[1 + 8r .. 8 + 8r], the last of them the target's token:
    # a stop at any other index is an accepted draft. Its first occurrence, so decoding stops there.
    at = next(j for j in range(2, 32) if j % (GAMMA + 1) and answer.index(answer[j]) == j)
    truth = np.zeros((1, 48), np.int32)
    truth[0, : len(answer)] = answer
    decoder = OracleDecoder(target, drafter, policy=FixedPolicy(GAMMA), continuation_BxN=truth,
                            prompt_lens=[len(prompt[0])])
    result = decoder.generate(prompt, max_new_tokens=32, max_len=256, stop_ids=[answer[at]])
    assert result.tokens[0] == answer[: at + 1] and result.finish_reasons == ["stop"]
    committed = np.concatenate(result.committed_per_round)
    accepted = np.concatenate(result.accepted_per_round)
    assert 1 + committed.sum() == at + 1  # the prefill's token and every round's commit
    assert committed[-1] == (at - 1) % (GAMMA + 1) + 1 and accepted[-1] == GAMMA  # drafts past the stop pass too
    np.testing.assert_array_equal(committed[:-1], accepted[:-1] + 1)
    assert result.tau == pytest.approx(committed.mean()) and result.tau < np.mean(accepted + 1)


@dataclasses.dataclass(frozen=True)
class ScrambledPolicy:
    """Verify lengths that jump around from row to row and round to round (data, not shapes)."""

    def lengths(self, confidence_BxG, gamma, active_B, sampling):
        return jnp.abs(confidence_BxG[:, 0] * 1e4).astype(jnp.int32) % (gamma + 1)


def test_no_recompilation_with_varying_verify_lengths(real):
    """Lengths vary per row and per round; nothing compiles after warm-up."""
    target, drafter, prompts, _ = real
    decoder = SpeculativeDecoder(target, drafter, policy=ScrambledPolicy())
    decoder.warmup(len(prompts), max(len(p) for p in prompts), 256)
    decoder.warmup(1, len(prompts[2]), 256)
    with count_compilations() as counter:
        batched = decoder.generate(
            [p[:-1] for p in prompts], max_new_tokens=12, max_len=256, stop_ids=[2],
            sampling=[SamplingConfig(), SamplingConfig(temperature=0.8), SamplingConfig(), SamplingConfig(top_k=3, temperature=1.0)],
            seeds=[1, 2, 3, 4],
        )
        single = decoder.generate(prompts[2:3], max_new_tokens=24, max_len=256, sampling=SamplingConfig(temperature=1.0), seeds=[5])
    lengths = np.concatenate(batched.verify_lengths + single.verify_lengths)
    assert len(set(lengths.tolist())) > 2, "verify lengths did not vary"
    assert len(set(single.verify_widths)) > 1, "verify widths did not vary"
    assert counter.count == 0


def test_threshold_policy_truncates_at_the_first_unconfident_slot():
    greedy = SamplingParams.broadcast(SamplingConfig(), 3)  # fixed and threshold policies do not read it
    z = jnp.asarray([[2.0, 2.0, -2.0, 2.0], [-2.0, 2.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0]])
    np.testing.assert_array_equal(ThresholdPolicy(0.5).lengths(z, 4, jnp.ones((3,), bool), greedy), [2, 0, 4])
    np.testing.assert_array_equal(FixedPolicy(9).lengths(z, 4, jnp.ones((3,), bool), greedy), [4, 4, 4])
    with pytest.raises(ValueError, match="confidence head"):
        ThresholdPolicy(0.5).lengths(None, 4, jnp.ones((3,), bool), greedy)


def test_bad_input_is_a_clear_error(real):
    target, drafter, prompts, _ = real
    decoder = SpeculativeDecoder(target, drafter, policy=FixedPolicy(3))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        decoder.generate([[1] * 8180], max_new_tokens=8)
    with pytest.raises(ValueError, match="verify slack"):
        decoder.generate([[1] * 250], max_new_tokens=4, max_len=256)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        decoder.generate([[]], max_new_tokens=4)
    assert decoder.generate(prompts, max_new_tokens=0).tokens == [[]] * len(prompts)


def test_parse_policy():
    assert parse_policy("fixed:3") == FixedPolicy(3)
    assert parse_policy("threshold:0.4") == ThresholdPolicy(0.4)
    with pytest.raises(ValueError, match="fixed:K"):
        parse_policy("greedy")
    with pytest.raises(ValueError, match="k >= 0"):
        parse_policy("fixed:-1")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        parse_policy("threshold:1.5")
    with pytest.raises(ValueError):
        parse_policy("fixed:three")


# ------------------------------------------------------------------------------------------
# stochastic losslessness on a tiny model


@pytest.fixture(scope="module")
def tiny():
    target = sharp_tiny_target()
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, tap_layers=(0, 2), mask_token_id=5, block_size=3, markov_rank=4)
    return target, Drafter(cfg, rngs=nnx.Rngs(1))


def test_a_drafter_with_its_own_head_counts_serves_the_target(tiny):
    """Only the width and the vocabulary tie a drafter to its target: one with other head counts
    and head size loads, drafts and decodes exactly."""
    target, _ = tiny
    backbone = dataclasses.replace(target.cfg, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)
    cfg = DrafterConfig(backbone=backbone, tap_layers=(0, 2), mask_token_id=5, block_size=3, markov_rank=4)
    cfg.check_target(target.cfg)
    drafter = Drafter(cfg, rngs=nnx.Rngs(2))
    prompts = [[3, 1, 4], [2, 7, 1, 8, 2]]
    reference = AutoregressiveGenerator(target).generate(prompts, max_new_tokens=12, max_len=32)
    result = SpeculativeDecoder(target, drafter, policy=FixedPolicy(3)).generate(prompts, max_new_tokens=12, max_len=32)
    assert result.tokens == reference.tokens and result.tau > 1.0


def test_bfloat16_weights_decode_the_bfloat16_targets_tokens_in_strict_mode():
    """``--dtype bfloat16``: the target and drafter in bf16. Strict mode's verify and its
    reference's target-only steps run the same shapes, so greedy speculative decoding is token for
    token the bf16 target's, whose KV cache is bf16 too."""
    target = sharp_tiny_target(scale=4.0)  # peaked enough to accept drafts, not so much as to repeat one token
    half = cast_target(target, jnp.bfloat16)
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, tap_layers=(0, 1), mask_token_id=5, block_size=3,
                                   markov_rank=4)
    half_drafter = Drafter(cfg, rngs=nnx.Rngs(1), dtype=jnp.bfloat16)
    assert half.dtype == jnp.bfloat16 and half.new_cache(1, 8).keys[0].dtype == jnp.bfloat16
    decoder = SpeculativeDecoder(half, half_drafter, policy=FixedPolicy(3), strict=True)
    prompts = [[3, 1, 4], [2, 7, 1, 8, 2]]
    result = decoder.generate(prompts, max_new_tokens=16, max_len=48)
    reference = decoder.reference_generator().generate(prompts, max_new_tokens=16, max_len=48)
    assert result.tokens == reference.tokens and result.tau > 1.0
    float32 = AutoregressiveGenerator(target).generate(prompts, max_new_tokens=16, max_len=48)
    assert float32.tokens != reference.tokens, "bf16 rounding changed no token: the test cannot tell the dtypes apart"


def in_one_program(decoder, prompts, *, max_new_tokens, sampling, seeds, stop_ids, max_len):
    """``(host, device)``: ``decoder.generate``'s result, and ``speculative_generate``'s for the
    same requests and verify widths under a caller's own ``jax.jit`` (the drafter passed as its
    state, merged inside) as a dict in the host result's terms: ``tokens`` (a list a request),
    ``finish_reasons``, ``tau`` and ``width_histogram``."""
    target, policy = decoder.target, decoder.policy
    host = decoder.generate(prompts, max_new_tokens=max_new_tokens, sampling=sampling, seeds=seeds,
                            stop_ids=stop_ids, max_len=max_len)
    requests = prepare_requests(prompts, target.cfg.vocab_size, max_new_tokens, sampling, seeds, stop_ids)
    tokens = requests.padded_BxP[:, : prompt_width(max(requests.lens), max_len)]  # the host's prefill shape
    graph, drafter_state = decoder.drafter_graph, decoder.drafter_state

    @jax.jit
    def generate(params, drafter_state, tokens, lens, keys, sampling, stop_ids, limits):
        return speculative_generate(target, nnx.merge(graph, drafter_state), policy, params, tokens, lens, keys,
                                    sampling, stop_ids, limits, max_new_tokens=requests.max_new_tokens,
                                    max_len=max_len, verify_widths=decoder.verify_widths)

    out = generate(target.params, drafter_state, tokens, jnp.asarray(requests.lens), requests.keys_B, requests.params,
                   stop_id_array(stop_ids), jnp.asarray(requests.limits))
    num = np.asarray(out.num_tokens_B)
    assert (np.asarray(out.tokens_BxN)[np.arange(out.tokens_BxN.shape[1])[None, :] >= num[:, None]] == -1).all()
    device = dict(tokens=[row[:n].tolist() for row, n in zip(np.asarray(out.tokens_BxN), num)],
                  finish_reasons=["stop" if s else "length" for s in np.asarray(out.stopped_B)],
                  tau=int(out.committed_B.sum()) / int(out.rounds_B.sum()),
                  width_histogram={w: n for w, n in zip(decoder.verify_widths, np.asarray(out.rounds_per_width).tolist())
                                   if n})
    return host, device


@pytest.mark.parametrize("strict", [False, True], ids=["widths", "strict"])
@pytest.mark.parametrize("policy", [FixedPolicy(1), ThresholdPolicy(0.5)], ids=["fixed", "threshold"])
def test_a_generation_in_one_jitted_program_emits_the_decoders_tokens(tiny, policy, strict):
    """``speculative_generate``: for greedy and sampled requests of several prompt lengths and
    limits, with stop ids (one the prefill's token), each request's tokens, its finish, τ and the rounds at each verify
    width are those of ``SpeculativeDecoder.generate``, with the widths it picks from (1, 2, 4)
    or in strict mode (4 alone), and drafts were accepted."""
    target, drafter = tiny
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 12, size=n).tolist() for n in (2, 9, 5, 3, 7, 4)]
    sampling = [SamplingConfig(temperature=1.0, top_k=6), SamplingConfig()] * 3
    # Requests 1 and 5 stop mid-answer, request 3 on its prefill's token; the last is request 1
    # again, cut just before its stop id.
    prompts, sampling = prompts + prompts[1:2], sampling + sampling[1:2]
    decoder = SpeculativeDecoder(target, drafter, policy=policy, strict=strict)
    host, device = in_one_program(decoder, prompts, max_new_tokens=[20, 20, 7, 1, 13, 20, 8], sampling=sampling,
                                  seeds=5, stop_ids=[0, 11, 1], max_len=48)
    assert device == {"tokens": host.tokens, "finish_reasons": host.finish_reasons, "tau": pytest.approx(host.tau),
                      "width_histogram": host.width_histogram}
    assert "stop" in host.finish_reasons and "length" in host.finish_reasons
    assert (host.tokens[3], host.finish_reasons[3]) == ([1], "stop")
    assert host.tau > 1.2, "the drafter should get drafts accepted on a 12-token vocabulary"
    if strict or isinstance(policy, FixedPolicy):
        assert set(host.verify_widths) == ({4} if strict else {2})
    else:
        assert len(set(host.verify_widths)) > 1, "the threshold policy should verify at several widths"


@pytest.mark.parametrize("change, error, match", [
    (dict(columns=32), ValueError, "a prefill of 32 columns does not fit the cache length 24"),
    (dict(max_new_tokens=20), ValueError,
     r"a one-token prompt \+ max_new_tokens 20 \+ verify width 4 does not fit the cache length 24"),
    (dict(policy="fixed:3"), TypeError, r"parse_policy\('fixed:3'\)"),
    (dict(verify_widths=(2, 9)), ValueError, r"verify_widths \[9\] are outside 1..4"),
])
def test_a_generation_in_one_program_refuses_what_the_decoder_refuses(tiny, change, error, match):
    """Named before anything traces: a cache the prefill or the answers cannot fit, and what
    ``SpeculativeDecoder`` refuses (a policy that is not one, widths past a full block)."""
    target, drafter = tiny
    given = dict(columns=8, max_new_tokens=4, policy=FixedPolicy(3), verify_widths=None) | change
    with pytest.raises(error, match=match):
        speculative_generate(target, drafter, given["policy"], target.params, jnp.ones((1, given["columns"]), jnp.int32),
                             jnp.asarray([2]), request_keys([0]), SamplingParams.broadcast(SamplingConfig(), 1),
                             stop_id_array([2]), jnp.asarray([given["max_new_tokens"]]),
                             max_new_tokens=given["max_new_tokens"], max_len=24, verify_widths=given["verify_widths"])


def test_a_generation_in_one_program_clamps_each_limit_to_what_it_can_hold(tiny):
    """Limits are data, so a traced program cannot refuse them: below 1 a request still gets its
    prefill's token, past ``max_new_tokens`` it gets that many."""
    target, drafter = tiny
    out = jax.jit(lambda limits: speculative_generate(
        target, drafter, FixedPolicy(3), target.params, jnp.asarray([[3, 1, 4], [1, 5, 9]], jnp.int32),
        jnp.asarray([3, 3]), request_keys([0, 1]), SamplingParams.broadcast(SamplingConfig(), 2), stop_id_array([]),
        limits, max_new_tokens=6, max_len=24))(jnp.asarray([0, 99]))
    assert np.asarray(out.num_tokens_B).tolist() == [1, 6]
    assert (np.asarray(out.tokens_BxN)[0, 1:] == -1).all() and (np.asarray(out.tokens_BxN)[1] >= 0).all()


def test_a_drafter_that_proposes_an_id_outside_the_vocabulary_is_an_error(tiny):
    """A broken ``SpeculativeDrafter`` is named at its first bad draft, not decoded around."""
    target, drafter = tiny
    decoder = SpeculativeDecoder(target, drafter, policy=FixedPolicy(3))
    draft = decoder._draft

    def broken_draft(*args):
        block, lengths, confidence = draft(*args)
        return block._replace(tokens_BxG=block.tokens_BxG.at[:, 1].set(-1)), lengths, confidence

    decoder._draft = broken_draft
    with pytest.raises(ValueError, match=r"outside the target's vocabulary \[0, 12\)"):
        decoder.generate([[3, 1, 4]], max_new_tokens=8, max_len=32)


def exact_first_two(target, prompt, config):
    """P(t1, t2) under target-only sampling, from the target's own (transformed) distributions."""
    from dspark_jax.sampling import SamplingParams, probabilities

    vocab = target.cfg.vocab_size
    seqs = jnp.asarray([prompt + [t] for t in range(vocab)], jnp.int32)
    logits = target.apply(target.params, seqs, target.new_cache(vocab, 16)).logits
    params = SamplingParams.broadcast(config, vocab)
    p1 = np.asarray(probabilities(logits[:1, len(prompt) - 1], SamplingParams.broadcast(config, 1)))[0]
    p2 = np.asarray(probabilities(logits[:, len(prompt)], params))
    return p1[:, None] * p2


def sampled_first_two(decoder_or_generator, prompt, config, n):
    result = decoder_or_generator.generate([prompt] * n, max_new_tokens=2, sampling=config, seeds=list(range(n)), max_len=32)
    pairs = np.asarray([t[:2] for t in result.tokens])
    vocab = 12
    return np.bincount(pairs[:, 0] * vocab + pairs[:, 1], minlength=vocab * vocab).reshape(vocab, vocab) / n, result


def chi2(freq, expected, n):
    support = expected > 1e-4
    assert freq[~support].sum() * n <= 2, "samples where the target has (almost) no mass"
    return n * (((freq - expected) ** 2)[support] / expected[support]).sum(), support.sum() - 1


@pytest.mark.parametrize(
    "config",
    # The sharpened target is near-deterministic at T < 1 (top-p at T=0.7 keeps a single pair of
    # first two tokens, a test with no power), so top-p is tested where it keeps 5 pairs and cuts.
    [SamplingConfig(temperature=1.0), SamplingConfig(temperature=3.0, top_p=0.8), SamplingConfig(temperature=1.0, top_k=4)],
    ids=["t1", "t3-top-p", "top-k"],
)
def test_speculative_sampling_matches_the_target_distribution(tiny, config):
    target, drafter = tiny
    prompt = [3, 1, 4]
    n = 3000
    expected = exact_first_two(target, prompt, config)
    decoder = SpeculativeDecoder(target, drafter, policy=FixedPolicy(3))
    freq, result = sampled_first_two(decoder, prompt, config, n)
    stat, dof = chi2(freq, expected, n)
    # 99.9 % quantile of chi-square: dof + 3.1·sqrt(2·dof) + 5 is a safe bound for dof in 10..140.
    assert stat < dof + 3.1 * np.sqrt(2 * dof) + 5, (stat, dof)
    assert result.tau > 1.1, "the random drafter should get some tokens accepted on a 12-token vocab"
    # Target-only sampling passes the same test (sanity of the exact reference).
    freq_ar, _ = sampled_first_two(AutoregressiveGenerator(target), prompt, config, n)
    stat_ar, _ = chi2(freq_ar, expected, n)
    assert stat_ar < dof + 3.1 * np.sqrt(2 * dof) + 5


def test_a_planned_floor_keeps_the_target_distribution(tiny):
    """The scheduler planning ahead: the first round verifies nothing (one draft would widen all
    3000 rows for one row's gain), its plan makes the second verify three drafts a row. The third
    token, committed by that second round, still follows the target."""
    from dspark_jax.sampling import probabilities
    from dspark_jax.scheduler.prefix import SchedulerPolicy

    target, drafter = tiny
    prompt, config, n, vocab = [3, 1, 4], SamplingConfig(temperature=1.0), 3000, 12
    pairs = jnp.asarray([prompt + [t1, t2] for t1 in range(vocab) for t2 in range(vocab)], jnp.int32)
    logits = target.apply(target.params, pairs, target.new_cache(len(pairs), 16)).logits[:, -1]
    p3 = np.asarray(probabilities(logits, SamplingParams.broadcast(config, len(pairs))))
    expected = (exact_first_two(target, prompt, config).reshape(-1, 1) * p3).sum(axis=0)
    policy = SchedulerPolicy.from_tables({n: {1: 1.0, 2: 1.3, 4: 1.35}}, plan_ahead=True)
    decoder = SpeculativeDecoder(target, drafter, policy=policy, verify_widths=(1, 2, 4))
    result = decoder.generate([prompt] * n, max_new_tokens=3, sampling=config, seeds=list(range(n)), max_len=32)
    assert result.verify_lengths[0].max() == 0 and result.verify_lengths[1].min() == 3, "the plan did not run"
    freq = np.bincount([t[2] for t in result.tokens], minlength=vocab) / n
    stat, dof = chi2(freq, expected, n)
    assert stat < dof + 3.1 * np.sqrt(2 * dof) + 5, (stat, dof)


def test_a_broken_acceptance_rule_fails_the_same_test(tiny, monkeypatch):
    """A classic bug: judging drafts against a q other than the one they were sampled from."""
    import dspark_jax.decoding.speculative as speculative_module

    real_verify = speculative_module.verify

    def verify_with_wrong_q(tokens, q, *args):
        return real_verify(tokens, jnp.full_like(q, 1.0 / q.shape[-1]), *args)

    monkeypatch.setattr(speculative_module, "verify", verify_with_wrong_q)
    target, drafter = tiny
    config = SamplingConfig(temperature=1.0)
    decoder = SpeculativeDecoder(target, drafter, policy=FixedPolicy(3))
    n = 3000
    freq, _ = sampled_first_two(decoder, [3, 1, 4], config, n)
    stat, dof = chi2(freq, exact_first_two(target, [3, 1, 4], config), n)
    assert stat > 2 * (dof + 3.1 * np.sqrt(2 * dof) + 5), (stat, dof)


# ------------------------------------------------------------------------------------------
# data parallel: a batch split by rows across devices


def test_eight_device_decoding_equals_one_device_and_each_device_drafts_and_verifies_its_own_rows():
    """``SpeculativeDecoder(mesh=...)`` on 8 simulated devices (fresh process) emits the 1-device
    decoder's tokens, round for round, for a batch of greedy and sampled requests, with a fixed
    policy and with the scheduler (whose choice weighs the whole batch: decided per device it
    would verify more, see below); its compiled prefill, draft and verify have no collective,
    the scheduler's draft only ones over the ``[B, γ]`` survivals; the scheduler's cost table can
    be profiled on the mesh; continuous batching on the mesh (refills of a row per device written
    into the split batch) gives every request, speculative or target-only, its one-batch tokens,
    and so do batch buckets (16 rows, then 8);
    a batch that cannot split is refused by name."""
    script = textwrap.dedent("""
        import json
        import jax, jax.numpy as jnp
        import numpy as np
        from flax import nnx
        from jax.sharding import AxisType, Mesh
        assert len(jax.devices()) == 8, jax.devices()
        from dspark_jax.config import DrafterConfig, SamplingConfig
        from dspark_jax.decoding.autoregressive import AutoregressiveGenerator
        from dspark_jax.decoding.speculative import NO_FLOOR, FixedPolicy, SpeculativeDecoder, stop_id_array
        from dspark_jax.drafter.model import Drafter
        from dspark_jax.sampling import SamplingParams, request_keys
        from dspark_jax.scheduler.prefix import SchedulerPolicy
        from dspark_jax.scheduler.profile import profile_round_costs
        from tests.multidevice import collectives, value_errors
        from tests.refills import counting_refills
        from tests.tiny import sharp_tiny_target
        target = sharp_tiny_target()
        drafter = Drafter(DrafterConfig.for_target(target.cfg, num_layers=1, tap_layers=(0, 2), mask_token_id=5,
                                                   block_size=3, markov_rank=4), rngs=nnx.Rngs(1))
        rng = np.random.default_rng(0)
        prompts = [rng.integers(1, 12, size=n).tolist() for n in rng.integers(2, 12, size=16)]
        sampling = [SamplingConfig(temperature=1.0, top_k=6), SamplingConfig()] * 8
        # Over the batch of 16 a second draft is not worth a width-4 round; over one device's 2 rows it is.
        table = {16: {0: 1.0, 1: 1.0, 2: 1.0, 4: 1.02}}
        scheduler = SchedulerPolicy.from_tables(table)
        planned = SchedulerPolicy.from_tables(table, plan_ahead=True)  # three drafts a row pay: the floor after round 1
        mesh = Mesh(np.asarray(jax.devices()), ("data",))
        decoders = {name: SpeculativeDecoder(target, drafter, policy=FixedPolicy(3), verify_widths=(1, 2, 4), mesh=m)
                    for name, m in (("one", None), ("eight", mesh))}
        runs = {}
        for name, decoder in decoders.items():
            for policy, d in (("fixed", decoder), ("scheduler", decoder.with_policy(scheduler)),
                              ("planned", decoder.with_policy(planned))):
                r = d.generate(prompts, max_new_tokens=24, sampling=sampling, seeds=7, stop_ids=[2], max_len=48)
                runs[f"{policy}-{name}"] = {"tokens": r.tokens, "widths": r.verify_widths,
                                            "lengths": [x.tolist() for x in r.verify_lengths],
                                            "accepted": [x.tolist() for x in r.accepted_per_round]}
        # Continuous batching on the mesh: 16 requests through 8 rows, refills of 8 (a row a device).
        kwargs = dict(max_new_tokens=24, sampling=sampling, seeds=7, stop_ids=[2], max_len=48)
        continuous = {"speculative-whole": runs["fixed-one"]["tokens"],
                      "target-whole": AutoregressiveGenerator(target).generate(prompts, **kwargs).tokens}
        refills, bucket_rows = {}, {}
        for kind, runner in (("speculative", decoders["eight"]), ("target", AutoregressiveGenerator(target, mesh=mesh))):
            refills[kind] = counting_refills(runner)
            continuous[f"{kind}-eight"] = runner.generate(prompts, batch_size=8, **kwargs).tokens
            # Batch buckets on the mesh: 16 rows, then 8 (a row a device) once 8 or fewer decode
            # (the limits fall, so requests finish one by one); each request's tokens are its
            # one-batch tokens, cut at its limit.
            limits = [24 - i for i in range(16)]
            bucketed = runner.generate(prompts, batch_size=16, batch_buckets=True, **dict(kwargs, max_new_tokens=limits))
            continuous[f"{kind}-buckets"] = [t + continuous[f"{kind}-whole"][i][limits[i]:]
                                             for i, t in enumerate(bucketed.tokens)]
            bucket_rows[kind] = sorted(set(getattr(bucketed, "rows_per_round", None) or bucketed.rows_per_step))
        d = decoders["eight"]
        params, keys, active, lengths, tokens, lens = d.rows.on_rows((
            SamplingParams.from_configs(sampling), request_keys(range(16)), jnp.ones((16,), bool),
            jnp.zeros((16,), jnp.int32), jnp.ones((16, 16), jnp.int32), jnp.full((16,), 3, jnp.int32)))
        _, state = d.prefill(16, 48, np.ones((16, 16), np.int32), [3] * 16, keys, params)
        block, _, _ = d._draft(d.params, d.drafter_state, state, keys, params, active, NO_FLOOR)
        programs = {
            "prefill": d._prefill.lower(d.params, d.drafter_state, d._new_cache(16, 48),
                                        d._new_context(16, 48, jnp.float32), tokens, lens, keys, params),
            "draft": d._draft.lower(d.params, d.drafter_state, state, keys, params, active, NO_FLOOR),
            "verify": d._verify.lower(d.params, d.drafter_state, state, block, lengths, keys, params, active,
                                      stop_id_array([2]), width=4),
            "scheduler draft": d.with_policy(scheduler)._draft.lower(d.params, d.drafter_state, state, keys, params,
                                                                    active, NO_FLOOR),
        }
        found = {name: collectives(p) for name, p in programs.items()}
        # The scheduler's cost table is timed on the decoder it will run on, mesh included.
        costs = profile_round_costs(d, 16, max_len=48, prompt_len=8, repeats=1)
        errors = value_errors(lambda: d.generate(prompts[:3], max_new_tokens=4),
                              lambda: SpeculativeDecoder(target, drafter, mesh=Mesh(np.asarray(jax.devices()), ("model",))))
        # jax.make_mesh's Explicit axes (its default in newer JAX), passed in and also set as JAX's
        # context mesh, with refills (a refill's row scatter once failed on Explicit types).
        explicit = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
        explicit_runs = {}
        for kind, make in (("speculative", lambda m: SpeculativeDecoder(target, drafter, policy=FixedPolicy(3),
                                                                         verify_widths=(1, 2, 4), mesh=m)),
                           ("target", lambda m: AutoregressiveGenerator(target, mesh=m))):
            explicit_runs[f"{kind}-explicit"] = make(explicit).generate(prompts, batch_size=8, **kwargs).tokens
            with jax.set_mesh(explicit):
                explicit_runs[f"{kind}-within"] = make(explicit).generate(prompts, batch_size=8, **kwargs).tokens
        print(json.dumps({"runs": runs, "collectives": found, "errors": errors, "costs": costs,
                          "continuous": continuous, "refills": refills, "explicit": explicit_runs,
                          "bucket_rows": bucket_rows}))
    """)
    report = run_on_eight_devices(script)
    runs, found = report["runs"], report["collectives"]
    for policy in ("fixed", "scheduler", "planned"):
        # Per-request seeds and per-row steps: a request's tokens do not depend on the split.
        assert runs[f"{policy}-eight"] == runs[f"{policy}-one"], policy
    fixed, scheduled = runs["fixed-one"], runs["scheduler-one"]
    assert sum(map(sum, fixed["accepted"])) > 0, "the random drafter should get drafts accepted on a 12-token vocab"
    assert {ell for r in fixed["lengths"] for ell in r} == {3}
    # The batch-wide choice: one draft per row (two rows' worth of survivals would buy the width-4 round).
    assert {ell for r in scheduled["lengths"] for ell in r} == {1}
    assert {ell for r in runs["planned-one"]["lengths"][1:] for ell in r} == {3}, runs["planned-one"]["lengths"]
    assert {k: len(v) for k, v in found.items() if k != "scheduler draft"} == {"prefill": 0, "draft": 0, "verify": 0}, found
    # The scheduler's sort over every row's survivals: collectives of at most B·γ = 48 numbers.
    sizes = [int(np.prod([int(n) for n in dims.split(",") if n])) for line in found["scheduler draft"]
             for dims in re.findall(r"\[([\d,]*)\]", line.split(" all-")[0])]
    assert sizes and max(sizes) <= 48, found["scheduler draft"]
    assert sorted(int(w) for w in report["costs"]) == [0, 1, 2, 4] and min(report["costs"].values()) > 0
    continuous = report["continuous"]
    for kind in ("speculative", "target"):
        assert continuous[f"{kind}-eight"] == continuous[f"{kind}-buckets"] == continuous[f"{kind}-whole"], kind
    assert report["bucket_rows"] == {"speculative": [8, 16], "target": [8, 16]}
    assert all(sizes and set(sizes) == {8} for sizes in report["refills"].values()), report["refills"]
    explicit = report["explicit"]
    for kind in ("speculative", "target"):
        assert explicit[f"{kind}-explicit"] == explicit[f"{kind}-within"] == continuous[f"{kind}-whole"], kind
    not_split, no_data_axis = report["errors"]
    assert not_split is not None and "a batch of 3 requests does not split over the mesh's 8" in not_split
    assert no_data_axis is not None and "needs a 'data' axis" in no_data_axis


# ------------------------------------------------------------------------------------------
# Construction and argument checks: refused by name, before anything compiles


@pytest.mark.parametrize("policy, match", [("fixed:3", r"parse_policy\('fixed:3'\)"), (0.5, "got 0.5")])
def test_a_policy_must_be_a_policy_object(tiny, policy, match):
    target, drafter = tiny
    with pytest.raises(TypeError, match=match):
        SpeculativeDecoder(target, drafter, policy=policy)
    with pytest.raises(TypeError, match=match):
        SpeculativeDecoder(target, drafter, policy=FixedPolicy(3)).with_policy(policy)


@pytest.mark.parametrize("text, match", [
    ("fixed", r"policy fixed needs a whole number after the colon, e.g. fixed:3; got 'fixed'"),
    ("fixed:", "policy fixed needs a whole number"),
    ("fixed:2.5", "policy fixed needs a whole number"),
    ("fixed:1_0", "policy fixed needs a whole number"),  # int() would read 10
    ("threshold", r"policy threshold needs a number after the colon, e.g. threshold:0.5; got 'threshold'"),
    ("threshold: ", "policy threshold needs a number"),
])
def test_a_policy_text_without_its_number_is_named(text, match):
    with pytest.raises(ValueError, match=match):
        parse_policy(text)
    assert parse_policy("fixed:3") == FixedPolicy(3) and parse_policy("threshold:0.25") == ThresholdPolicy(0.25)


def test_the_default_policy_verifies_the_drafters_whole_block(tiny):
    target, drafter = tiny
    assert SpeculativeDecoder(target, drafter).policy == FixedPolicy(drafter.cfg.block_size)


def test_a_fixed_policy_verifies_a_whole_number_of_drafts_the_drafter_proposes(tiny):
    """K past γ is refused (not run as γ), as ``policy_for`` refuses it for the command line."""
    target, drafter = tiny
    with pytest.raises(ValueError, match="fixed policy k must be an int, got 2.5"):
        FixedPolicy(2.5)
    assert FixedPolicy(np.int64(3)) == FixedPolicy(3)
    with pytest.raises(ValueError, match=r"fixed:4 asks for 4 drafts a round, but the drafter proposes γ = 3: "
                                         r"use fixed:K with K <= 3"):
        SpeculativeDecoder(target, drafter, policy=FixedPolicy(4))
    with pytest.raises(ValueError, match="fixed:4 asks for 4 drafts"):
        SpeculativeDecoder(target, drafter, policy=FixedPolicy(3)).with_policy(FixedPolicy(4))


@pytest.mark.parametrize(
    "widths, match",
    [
        ((0,), r"verify_widths \[0\] are outside 1..4"),
        ((1, 2, 4, 8), r"verify_widths \[8\] are outside 1..4"),
        ((100,), r"verify_widths \[100\] are outside"),
        ((2.5,), "every entry of verify_widths must be an int, got 2.5"),
    ],
)
def test_verify_widths_lie_between_one_and_a_full_block(tiny, widths, match):
    target, drafter = tiny
    with pytest.raises(ValueError, match=match):
        SpeculativeDecoder(target, drafter, policy=FixedPolicy(3), verify_widths=widths)


def test_verify_widths_default_to_powers_of_two_and_always_fit_a_full_block(tiny):
    target, drafter = tiny  # γ = 3
    assert SpeculativeDecoder(target, drafter, policy=FixedPolicy(3)).verify_widths == (1, 2, 4)
    assert SpeculativeDecoder(target, drafter, policy=FixedPolicy(3), verify_widths=(1, 2)).verify_widths == (1, 2, 4)
    assert SpeculativeDecoder(target, drafter, policy=FixedPolicy(3), strict=True).verify_widths == (4,)


@pytest.fixture(scope="module")
def tiny97():
    """A tiny target with 97 token ids (room for more than 16 stop ids) and 512 positions."""
    target = tiny_target()
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, tap_layers=(0, 1), mask_token_id=5, block_size=3,
                                   markov_rank=4)
    return target, Drafter(cfg, rngs=nnx.Rngs(1))


def test_both_decoders_take_any_number_of_stop_ids(tiny97):
    target, drafter = tiny97
    prompts = [[3, 1, 4], [2, 7, 1, 8, 2]]
    generator = AutoregressiveGenerator(target)
    free = generator.generate(prompts, max_new_tokens=12, max_len=32)
    stop = free.tokens[0][3]
    seen = {t for tokens in free.tokens for t in tokens}
    stop_ids = [stop] + [t for t in range(97) if t not in seen][:20]
    assert len(stop_ids) > 16
    reference = generator.generate(prompts, max_new_tokens=12, max_len=32, stop_ids=stop_ids)
    assert reference.finish_reasons[0] == "stop" and reference.tokens[0] == free.tokens[0][: free.tokens[0].index(stop) + 1]
    result = SpeculativeDecoder(target, drafter, policy=FixedPolicy(3)).generate(
        prompts, max_new_tokens=12, max_len=32, stop_ids=stop_ids)
    assert result.tokens == reference.tokens and result.finish_reasons == reference.finish_reasons


@pytest.mark.parametrize(
    "stop_ids, error, match",
    [
        (2, TypeError, "stop_ids must be a collection of ints, got int 2"),
        ([2, 2**31], ValueError, r"stop_ids \[2147483648\] are outside the vocabulary \[0, 97\)"),
        ([-1], ValueError, r"stop_ids \[-1\] are outside the vocabulary"),
    ],
)
def test_both_decoders_refuse_stop_ids_that_are_not_token_ids(tiny97, stop_ids, error, match):
    target, drafter = tiny97
    for runner in (AutoregressiveGenerator(target), SpeculativeDecoder(target, drafter, policy=FixedPolicy(3))):
        with pytest.raises(error, match=match):
            runner.generate([[1, 2]], max_new_tokens=2, stop_ids=stop_ids)


def test_an_explicit_max_len_does_not_lift_the_models_position_limit(tiny97):
    """512 positions: 505 prompt tokens + 16 new ones (+ the verify slack) do not fit, however
    long the cache."""
    target, drafter = tiny97
    decoder = SpeculativeDecoder(target, drafter, policy=FixedPolicy(3))
    prompt = [[(i * 7) % 90 + 1 for i in range(505)]]
    for max_len in (None, 640):
        with pytest.raises(ValueError, match=r"exceeds the model's max_position_embeddings \(512\)"):
            decoder.generate(prompt, max_new_tokens=16, max_len=max_len)
