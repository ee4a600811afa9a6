"""Target-only generation on the real embedded SmolLM2 target (its first 4 layers for what does not
depend on depth: stopping, taps, sampling, compiling); argument checks on a tiny one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.config import SamplingConfig
from dspark_jax.decoding.autoregressive import AutoregressiveGenerator
from dspark_jax.diagnostics import count_compilations
from tests.prompts import mixed_prompts
from tests.tiny import tiny_target


@pytest.fixture(scope="module")
def generator(embedded_target):
    return AutoregressiveGenerator(embedded_target[0])


@pytest.fixture(scope="module")
def shallow_generator(shallow_target):
    return AutoregressiveGenerator(shallow_target[0])


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


def test_stop_ids_end_each_row_where_they_occur(shallow_generator, prompts):
    free = shallow_generator.generate(prompts, max_new_tokens=12, max_len=256)
    stop = free.tokens[1][4]  # row 1 stops at (the first occurrence of) its 5th token
    first = free.tokens[1].index(stop)
    stopped = shallow_generator.generate(prompts, max_new_tokens=12, stop_ids=[stop], max_len=256)
    assert stopped.tokens[1] == free.tokens[1][: first + 1]
    assert stopped.finish_reasons[1] == "stop"
    for row in (0, 2, 3):  # other rows continue unaffected (unless they also emit `stop`)
        expected = free.tokens[row]
        if stop in expected:
            expected = expected[: expected.index(stop) + 1]
        assert stopped.tokens[row] == expected


def test_taps_are_the_forward_over_prompt_and_answer(shallow_generator, prompts, shallow_target):
    """With tap layers, every position of prompt + answer gets the tapped layers' outputs as one
    forward over the finished sequence computes them, including the last token of a row that
    stopped early and of the rows that ran to max_new_tokens, and the answers do not change."""
    target = shallow_target[0]
    layers = (0, 2, target.cfg.num_layers - 1)
    free = shallow_generator.generate(prompts, max_new_tokens=10, max_len=256)
    stop = free.tokens[2][3]
    plain = shallow_generator.generate(prompts, max_new_tokens=10, stop_ids=[stop], max_len=256)
    tapping = AutoregressiveGenerator(target, tap_layers=layers)
    result = tapping.generate(prompts, max_new_tokens=10, stop_ids=[stop], max_len=256)
    assert result.tokens == plain.tokens and plain.taps is None
    assert result.finish_reasons[2] == "stop" and len(result.tokens[2]) < 10
    assert any(len(t) == 10 for t in result.tokens)
    sequences = [list(prompt) + answer for prompt, answer in zip(prompts, result.tokens)]
    # One jitted forward over the right-padded rows: causal attention keeps padding out of every
    # real position, and run eagerly the layers would dispatch op by op.
    width = max(map(len, sequences))
    padded = jnp.asarray([s + [0] * (width - len(s)) for s in sequences])
    forward = jax.jit(target.apply, static_argnames="tap_layers")
    whole = forward(target.params, padded, target.new_cache(len(sequences), width), tap_layers=layers)
    for row, sequence in enumerate(sequences):
        assert result.taps[row].shape == (len(sequence), len(layers) * target.cfg.hidden_size)
        # A decode step and a whole-sequence forward round their float32 products differently.
        np.testing.assert_allclose(result.taps[row], whole.taps[row, : len(sequence)], rtol=1e-3, atol=1e-3)
    # Prompts of other lengths compile nothing more: their taps are cut on the host.
    with count_compilations() as counter:
        tapping.generate([p[:-2] for p in prompts], max_new_tokens=3, max_len=256)
    assert counter.count == 0


def test_no_recompilation_after_warmup(shallow_generator, prompts):
    shallow_generator.warmup(len(prompts), max(len(p) for p in prompts), 256)
    with count_compilations() as counter:
        shallow_generator.generate(prompts, max_new_tokens=9, max_len=256, sampling=SamplingConfig(temperature=0.7))
        shallow_generator.generate(
            [p[:-2] for p in prompts],
            max_new_tokens=5,
            max_len=256,
            sampling=[SamplingConfig(), SamplingConfig(temperature=1.0, top_k=5), SamplingConfig(), SamplingConfig(top_p=0.5, temperature=0.9)],
            seeds=[1, 2, 3, 4],
            stop_ids=[2],
        )
    assert counter.count == 0


def test_compilation_counter_sees_new_shapes(shallow_generator, prompts):
    """The counter itself can fail: a new batch size compiles."""
    with count_compilations() as counter:
        shallow_generator.generate(prompts[:3], max_new_tokens=2, max_len=384)
    assert counter.count > 0


def test_sampling_is_reproducible_per_seed(shallow_generator, prompts):
    config = SamplingConfig(temperature=1.0, top_p=0.95)
    a = shallow_generator.generate(prompts[:2], max_new_tokens=12, sampling=config, seeds=[5, 6], max_len=256)
    b = shallow_generator.generate(prompts[:2], max_new_tokens=12, sampling=config, seeds=[5, 6], max_len=256)
    c = shallow_generator.generate(prompts[:2], max_new_tokens=12, sampling=config, seeds=[7, 8], max_len=256)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    # A request's samples do not depend on its batch neighbours.
    alone = shallow_generator.generate(prompts[1:2], max_new_tokens=12, sampling=config, seeds=[6], max_len=256)
    assert alone.tokens[0] == a.tokens[1]


def test_max_new_tokens_zero_returns_empty(shallow_generator, prompts):
    result = shallow_generator.generate(prompts, max_new_tokens=0)
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
def test_bad_input_is_a_clear_error(shallow_generator, prompts_, kwargs, match):
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        shallow_generator.generate(prompts_, **kwargs)


# ------------------------------------------------------------------------------------------
# Argument checks on a tiny target (no embedded model needed): each refusal names the argument.


@pytest.fixture(scope="module")
def tiny_generator():
    return AutoregressiveGenerator(tiny_target())  # 3 layers, vocabulary 97, 512 positions


@pytest.mark.parametrize(
    "taps, match",
    [
        ((3,), r"tap layer ids \[3\] are outside the target's decoder layers 0..2"),
        ((-1,), r"tap layer ids \[-1\] are outside"),
        ((1, 1), r"strictly ascending, got \[1, 1\]"),
        ((2, 0), r"strictly ascending, got \[2, 0\]"),
        ((0.5,), "every entry of tap_layers must be an int, got 0.5"),
    ],
)
def test_tap_layers_must_be_ascending_layers_of_the_target(tiny_generator, taps, match):
    """Drafters are trained on the taps concatenated in ascending layer order (the order the
    forward produces them), so any other order or a repeat is refused, not reordered."""
    with pytest.raises(ValueError, match=match):
        AutoregressiveGenerator(tiny_generator.target, tap_layers=taps)
    with pytest.raises(TypeError, match="tap_layers must be a collection of ints"):
        AutoregressiveGenerator(tiny_generator.target, tap_layers=1)


@pytest.mark.parametrize(
    "prompts_, error, match",
    [
        ([[1.9, 2.7]], ValueError, r"every entry of prompt 0 \(token ids\) must be an int, got 1.9"),
        ([[1, 2], [True, 2]], ValueError, r"prompt 1 \(token ids\) must be an int, got True"),
        ([[1, 2], "12"], TypeError, r"prompt 1 \(token ids\) must be a collection of ints, got str '12'"),
        (["hi"], TypeError, r"prompt 0 \(token ids\) must be a collection of ints, got str 'hi'"),
        ([1, 2, 3], TypeError, r"prompt 0 \(token ids\) must be a collection of ints, got int 1"),  # not in a list
    ],
)
def test_prompts_must_be_lists_of_integer_token_ids(tiny_generator, prompts_, error, match):
    with pytest.raises(error, match=match):
        tiny_generator.generate(prompts_, max_new_tokens=2)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(max_new_tokens=4.0), ValueError, "max_new_tokens must be an int, got 4.0"),
        (dict(max_new_tokens=True), ValueError, "max_new_tokens must be an int, got True"),
        (dict(max_len=128.0), ValueError, "max_len must be an int, got 128.0"),
        (dict(batch_size=1.0), ValueError, "batch_size must be an int, got 1.0"),
        (dict(seeds=0.5), ValueError, "seeds must be an int, got 0.5"),
        (dict(seeds=[0, 1.5]), ValueError, "every entry of seeds must be an int, got 1.5"),
        (dict(sampling={"temperature": 0.7}), TypeError, r"SamplingConfig\(\*\*\{'temperature': 0.7\}\)"),
        (dict(sampling=[SamplingConfig(), "greedy"]), TypeError, "sampling must be a SamplingConfig or a list"),
    ],
)
def test_arguments_of_the_wrong_type_are_named(tiny_generator, kwargs, error, match):
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(error, match=match):
        tiny_generator.generate([[1, 2], [3]], **kwargs)



def test_a_mesh_that_is_not_one_is_named(tiny_generator):
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh with a 'data' axis \(or None\), got list"):
        AutoregressiveGenerator(tiny_generator.target, mesh=jax.devices())

def test_numpy_integers_are_accepted_wherever_an_int_is(tiny_generator):
    config = dict(temperature=1.0, top_k=20)
    reference = tiny_generator.generate([[1, 2, 3], [4, 5]], max_new_tokens=3, seeds=0, max_len=32, batch_size=2,
                                        stop_ids=[96], sampling=SamplingConfig(**config))
    result = tiny_generator.generate(
        [np.asarray([1, 2, 3], np.int32), [np.int64(4), np.int64(5)]], max_new_tokens=np.int64(3), seeds=np.int64(0),
        max_len=np.int64(32), batch_size=np.int64(2), stop_ids=np.asarray([96]),
        sampling=SamplingConfig(temperature=1.0, top_k=np.int64(20)),
    )
    assert result.tokens == reference.tokens
    assert SamplingConfig(top_k=np.int64(20)) == SamplingConfig(top_k=20)
    assert (tiny_generator.generate(np.asarray([[1, 2, 3]]), max_new_tokens=3, max_len=32).tokens
            == tiny_generator.generate([[1, 2, 3]], max_new_tokens=3, max_len=32).tokens)


@pytest.mark.parametrize(
    "stop_ids, error, match",
    [
        (2, TypeError, "stop_ids must be a collection of ints, got int 2"),
        ([2, 2**31], ValueError, r"stop_ids \[2147483648\] are outside the vocabulary \[0, 97\)"),
        ([-1, 97], ValueError, r"stop_ids \[-1, 97\] are outside the vocabulary"),
        ([2.5], ValueError, "every entry of stop_ids must be an int, got 2.5"),
    ],
)
def test_stop_ids_must_be_token_ids(tiny_generator, stop_ids, error, match):
    with pytest.raises(error, match=match):
        tiny_generator.generate([[1, 2]], max_new_tokens=2, stop_ids=stop_ids)


def test_an_explicit_max_len_does_not_lift_the_models_position_limit(tiny_generator):
    """512 positions: 505 prompt tokens + 16 new ones do not fit, however long the cache."""
    prompt = [[(i * 7) % 90 + 1 for i in range(505)]]
    for max_len in (None, 640):
        with pytest.raises(ValueError, match=r"= 521 exceeds the model's max_position_embeddings \(512\)"):
            tiny_generator.generate(prompt, max_new_tokens=16, max_len=max_len)
