"""Target-only generation on the real embedded SmolLM2 target."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.config import SamplingConfig
from dspark_jax.decoding.autoregressive import AutoregressiveGenerator
from dspark_jax.diagnostics import count_compilations
from tests.prompts import mixed_prompts


@pytest.fixture(scope="module")
def generator(embedded_target):
    return AutoregressiveGenerator(embedded_target[0])


@pytest.fixture(scope="module")
def prompts(embedded_target):
    tokenizer = embedded_target[1]
    return mixed_prompts(tokenizer)


def test_batched_mixed_lengths_equal_one_at_a_time(generator, prompts):
    assert len({len(p) for p in prompts}) == len(prompts), "want mixed prompt lengths"
    batched = generator.generate(prompts, max_new_tokens=24, max_len=256)
    for row, prompt in enumerate(prompts):
        alone = generator.generate([prompt], max_new_tokens=24, max_len=256)
        assert alone.tokens[0] == batched.tokens[row], f"row {row} differs between B=4 and B=1"
    assert all(len(t) == 24 for t in batched.tokens)
    assert batched.finish_reasons == ["length"] * 4


def test_greedy_answer_is_sensible(generator, prompts, embedded_target):
    result = generator.generate(prompts[:1], max_new_tokens=16, stop_ids=[embedded_target[1].eos_token_id])
    text = embedded_target[1].decode(result.tokens[0])
    assert "Paris" in text
    assert result.finish_reasons == ["stop"] and result.tokens[0][-1] == embedded_target[1].eos_token_id


def test_stop_ids_end_each_row_where_they_occur(generator, prompts):
    free = generator.generate(prompts, max_new_tokens=12, max_len=256)
    stop = free.tokens[1][4]  # row 1 stops at (the first occurrence of) its 5th token
    first = free.tokens[1].index(stop)
    stopped = generator.generate(prompts, max_new_tokens=12, stop_ids=[stop], max_len=256)
    assert stopped.tokens[1] == free.tokens[1][: first + 1]
    assert stopped.finish_reasons[1] == "stop"
    for row in (0, 2, 3):  # other rows continue unaffected (unless they also emit `stop`)
        expected = free.tokens[row]
        if stop in expected:
            expected = expected[: expected.index(stop) + 1]
        assert stopped.tokens[row] == expected


def test_taps_are_the_forward_over_prompt_and_answer(generator, prompts, embedded_target):
    """With tap layers, every position of prompt + answer gets the tapped layers' outputs as one
    forward over the finished sequence computes them, including the last token of a row that
    stopped early and of the rows that ran to max_new_tokens, and the answers do not change."""
    target = embedded_target[0]
    layers = (2, 17, target.cfg.num_layers - 1)
    free = generator.generate(prompts, max_new_tokens=10, max_len=256)
    stop = free.tokens[2][3]
    plain = generator.generate(prompts, max_new_tokens=10, stop_ids=[stop], max_len=256)
    tapping = AutoregressiveGenerator(target, tap_layers=layers)
    result = tapping.generate(prompts, max_new_tokens=10, stop_ids=[stop], max_len=256)
    assert result.tokens == plain.tokens and plain.taps is None
    assert result.finish_reasons[2] == "stop" and len(result.tokens[2]) < 10
    assert any(len(t) == 10 for t in result.tokens)
    sequences = [list(prompt) + answer for prompt, answer in zip(prompts, result.tokens)]
    # One jitted forward over the right-padded rows: causal attention keeps padding out of every
    # real position, and run eagerly the 30 layers would dispatch op by op (a minute on 2 cores).
    width = max(map(len, sequences))
    padded = jnp.asarray([s + [0] * (width - len(s)) for s in sequences])
    forward = jax.jit(target.apply, static_argnames="tap_layers")
    whole = forward(target.params, padded, target.new_cache(len(sequences), width), tap_layers=layers)
    for row, sequence in enumerate(sequences):
        assert result.taps[row].shape == (len(sequence), len(layers) * target.cfg.hidden_size)
        # A decode step and a whole-sequence forward round their float32 products differently.
        np.testing.assert_allclose(result.taps[row], whole.taps[row, : len(sequence)], rtol=1e-3, atol=1e-3)


def test_no_recompilation_after_warmup(generator, prompts):
    generator.warmup(len(prompts), max(len(p) for p in prompts), 256)
    with count_compilations() as counter:
        generator.generate(prompts, max_new_tokens=9, max_len=256, sampling=SamplingConfig(temperature=0.7))
        generator.generate(
            [p[:-2] for p in prompts],
            max_new_tokens=5,
            max_len=256,
            sampling=[SamplingConfig(), SamplingConfig(temperature=1.0, top_k=5), SamplingConfig(), SamplingConfig(top_p=0.5, temperature=0.9)],
            seeds=[1, 2, 3, 4],
            stop_ids=[2],
        )
    assert counter.count == 0


def test_compilation_counter_sees_new_shapes(generator, prompts):
    """The counter itself can fail: a new batch size compiles."""
    with count_compilations() as counter:
        generator.generate(prompts[:3], max_new_tokens=2, max_len=384)
    assert counter.count > 0


def test_sampling_is_reproducible_per_seed(generator, prompts):
    config = SamplingConfig(temperature=1.0, top_p=0.95)
    a = generator.generate(prompts[:2], max_new_tokens=12, sampling=config, seeds=[5, 6], max_len=256)
    b = generator.generate(prompts[:2], max_new_tokens=12, sampling=config, seeds=[5, 6], max_len=256)
    c = generator.generate(prompts[:2], max_new_tokens=12, sampling=config, seeds=[7, 8], max_len=256)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    # A request's samples do not depend on its batch neighbours.
    alone = generator.generate(prompts[1:2], max_new_tokens=12, sampling=config, seeds=[6], max_len=256)
    assert alone.tokens[0] == a.tokens[1]


def test_max_new_tokens_zero_returns_empty(generator, prompts):
    result = generator.generate(prompts, max_new_tokens=0)
    assert result.tokens == [[]] * len(prompts) and result.finish_reasons == ["length"] * len(prompts)


@pytest.mark.parametrize(
    "prompts_, kwargs, match",
    [
        ([], {}, "no prompts"),
        ([[1, 2], []], {}, "prompt 1 is empty"),
        ([[1, 49152]], {}, "outside"),
        ([[1, 2]], dict(max_new_tokens=-1), "max_new_tokens"),
        ([[1] * 300], dict(max_len=256), "does not fit the cache"),
        ([[1] * 8000], dict(max_new_tokens=500), "max_position_embeddings"),
        ([[1], [2]], dict(seeds=[1]), "seeds"),
        ([[1], [2]], dict(sampling=[SamplingConfig()]), "sampling configs"),
    ],
)
def test_bad_input_is_a_clear_error(generator, prompts_, kwargs, match):
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        generator.generate(prompts_, **kwargs)
