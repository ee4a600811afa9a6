"""Continuous batching: more requests than rows, a finished request's row refilled with the next."""

import dataclasses
import time

import numpy as np
import pytest
from flax import nnx

from dspark_jax.config import DrafterConfig, SamplingConfig
from dspark_jax.decoding.autoregressive import AutoregressiveGenerator
from dspark_jax.decoding.slots import IDLE, Slots, row_axes
from dspark_jax.decoding.speculative import FixedPolicy, SpeculativeDecoder, ThresholdPolicy
from dspark_jax.diagnostics import count_compilations
from dspark_jax.drafter.model import Drafter
from dspark_jax.scheduler.prefix import PLAIN, SchedulerPolicy
from dspark_jax.training.target_cache import CacheSpec, TargetCacheWriter
from tests.refills import counting_refills
from tests.stored_arrays import assert_same_stored_arrays
from tests.tiny import sharp_tiny_target

STOP = 2


@pytest.fixture(scope="module")
def tiny():
    target = sharp_tiny_target()
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, tap_layers=(0, 2), mask_token_id=5, block_size=3,
                                   markov_rank=4, confidence_head=True)
    rng = np.random.default_rng(0)
    # Lengths 2..11; on this target some requests stop at their first or second token, the rest run
    # to max_new_tokens: rows free up at different steps.
    prompts = [rng.integers(1, 12, size=n).tolist() for n in rng.integers(2, 12, size=13)]
    sampling = [SamplingConfig(temperature=1.0, top_k=6), SamplingConfig()] * 6 + [SamplingConfig(temperature=3.0)]
    return target, Drafter(cfg, rngs=nnx.Rngs(1)), prompts, sampling


def test_slots_fill_idle_rows_in_request_order():
    slots = Slots(7, rows=4, devices=1)
    assert slots.sizes == [1, 2, 4]
    first = slots.refill()
    assert first.whole and first.size == 4 and list(first.rows) == [0, 1, 2, 3] and first.requests == [0, 1, 2, 3]
    assert slots.refill() is None  # no idle row
    slots.release(2)
    slots.release(0)
    second = slots.refill()
    assert not second.whole and list(second.rows) == [0, 2] and second.requests == [4, 5] and second.size == 2
    slots.release(1)
    slots.release(3)
    last = slots.refill()  # one request waits for two idle rows: a refill of one
    assert list(last.rows) == [1] and last.requests == [6] and last.size == 1
    assert list(slots.request_of) == [4, 6, 5, IDLE] and slots.refill() is None
    held = Slots(3, rows=2, devices=1)
    held.refill()
    held.release(0)
    held.release(1)
    joined = held.refill(held=[0])  # a held row is not refilled yet
    assert list(joined.rows) == [1] and joined.requests == [2] and not joined.whole

    fixed = Slots(5, rows=2, devices=1, continuous=False)
    assert fixed.refill().requests == [0, 1]
    fixed.release(0)
    assert fixed.refill() is None  # fixed batches: wait for the whole batch
    fixed.release(1)
    assert fixed.refill(held=[1]) is None  # a held row counts as busy
    assert fixed.refill().requests == [2, 3]
    # On a mesh a refill is a multiple of the data-parallel devices.
    assert Slots(3, rows=16, devices=4).sizes == [4, 8, 16]
    assert Slots(3, rows=8, devices=8).sizes == [8]


class FakeClock:
    """A clock that moves only when slept on."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_slots_take_requests_in_order_of_arrival_once_arrived():
    clock = FakeClock()
    slots = Slots(4, rows=2, arrivals=[0.0, 5.0, 1.0, 1.0], clock=clock, sleep=clock.sleep)
    first = slots.refill()  # only request 0 has arrived: the batch is prefilled around it
    assert first.whole and first.size == 2 and list(first.rows) == [0] and first.requests == [0]
    assert slots.refill() is None and slots.arrived() == 0
    clock.now += 1.0
    assert slots.arrived() == 2  # requests 2 and 3 (t = 1) are ahead of request 1 (t = 5)
    joined = slots.refill()
    assert not joined.whole and list(joined.rows) == [1] and joined.requests == [2] and joined.size == 1
    slots.release(0)
    assert slots.refill().requests == [3]
    slots.release(0)
    slots.release(1)
    assert slots.refill() is None  # request 1 is still to come
    assert slots.wait_for_arrival() and clock.now == 105.0  # slept until it arrived
    assert slots.refill().requests == [1]
    slots.release(0)
    assert not slots.wait_for_arrival() and clock.now == 105.0  # nothing waits: the run is over
    for arrivals, message in [([0.0], "one time per request, so 4"), ([0, 1, -1, 2], "request 2 has -1"),
                              ([0, float("nan"), 1, 2], "request 1 has nan"), (["soon"] * 4, "numbers of seconds")]:
        with pytest.raises(ValueError, match=message):
            Slots(4, rows=2, arrivals=arrivals)


def test_bucketed_slots_run_at_the_smallest_size_holding_the_rows_in_flight():
    """With ``buckets`` the batch grows when requests join (the busy rows kept first, in order),
    shrinks once the busy rows fit a smaller size, and keeps a held row (owed a tap) with its
    place in ``keep``; without, it never resizes."""
    clock = FakeClock()
    slots = Slots(6, rows=4, arrivals=[0, 1, 1, 2, 2, 2], clock=clock, sleep=clock.sleep, buckets=True)
    assert slots.live == 0
    first = slots.refill()  # one request: a batch of one row
    assert first.whole and first.size == 1 and slots.live == 1 and first.keep is None
    clock.now += 1.0
    grown = slots.refill()  # two join the one in flight: four rows, the busy one first
    assert not grown.whole and list(grown.keep) == [0, 0, 0, 0] and slots.live == 4
    assert list(grown.rows) == [1, 2] and grown.size == 2 and list(slots.request_of) == [0, 1, 2, IDLE]
    assert slots.shrink() is None  # three in flight need four rows
    slots.release(0)
    assert list(slots.shrink()) == [1, 2] and list(slots.request_of) == [1, 2]
    slots.release(0)
    assert list(slots.shrink()) == [1] and list(slots.request_of) == [2] and slots.shrink() is None
    clock.now += 1.0
    joined = slots.refill()  # three join one: four rows, a refill prefilled as four
    assert list(joined.keep) == [0, 0, 0, 0] and list(joined.rows) == [1, 2, 3] and joined.size == 4
    slots.release(2)
    slots.release(3)
    assert slots.shrink(held=[2]) is None  # the held row counts as busy: three rows need four
    slots.release(0)
    keep = slots.shrink(held=[2])  # row 1 in flight and held row 2: two rows, the held one at 1
    assert list(keep) == [1, 2] and list(slots.request_of) == [3, IDLE]
    slots.release(0)
    assert slots.shrink() is None and slots.refill() is None  # nothing busy, nothing waiting: left as is
    fixed = Slots(3, rows=4, buckets=True, continuous=False)
    assert fixed.refill().size == 4 and fixed.live == 4  # three requests: the size holding them
    plain = Slots(3, rows=4)
    assert plain.refill().size == 4 and plain.live == 4
    plain.release(0)
    plain.release(1)
    assert plain.shrink() is None
    assert Slots(1, rows=16, devices=4, buckets=True).refill().size == 4  # a multiple of the devices


def test_the_batch_axis_of_every_state_leaf_is_found():
    import jax.numpy as jnp

    def make(batch):  # a layers-first cache leaf, a batch-first one, a per-row vector
        return {"stacked": jnp.zeros((3, batch, 5)), "rows": jnp.zeros((batch, 7)), "lengths": jnp.zeros((batch,))}

    assert row_axes(make) == {"stacked": 1, "rows": 0, "lengths": 0}
    with pytest.raises(ValueError, match="cannot tell the batch axis"):
        row_axes(lambda batch: jnp.zeros((batch, batch)))


@pytest.mark.parametrize("make", [
    lambda target, drafter: AutoregressiveGenerator(target),
    lambda target, drafter: SpeculativeDecoder(target, drafter, policy=FixedPolicy(3)),
], ids=["target-only", "speculative"])
def test_continuous_batching_generates_what_one_batch_does(tiny, make):
    """13 requests, greedy and sampled, through 4 rows: every request's tokens are those it gets
    when all 13 run as one batch (its own PRNG stream and step counter), in either batching mode;
    refilling rows at once takes fewer steps than fixed batches. Streamed (``on_tokens``), each
    request's pieces join to its tokens, stop token included, nothing past max_new_tokens."""
    target, drafter, prompts, sampling = tiny
    runner = make(target, drafter)
    kwargs = dict(max_new_tokens=16, sampling=sampling, seeds=7, stop_ids=[STOP], max_len=48)
    one_batch = runner.generate(prompts, **kwargs)
    assert {"stop", "length"} == set(one_batch.finish_reasons)
    finished = []
    inserts = counting_refills(runner)
    streamed = [[] for _ in prompts]
    continuous = runner.generate(prompts, batch_size=4, on_finish=lambda *f: finished.append(f),
                                 on_tokens=lambda i, tokens: streamed[i].append(tokens), **kwargs)
    assert continuous.tokens == one_batch.tokens and continuous.finish_reasons == one_batch.finish_reasons
    assert [sum(pieces, []) for pieces in streamed] == continuous.tokens and all(map(all, streamed))
    assert max(map(len, streamed)) > 1, "every request came out at once: nothing was streamed"
    assert sorted(i for i, _, _ in finished) == list(range(13))  # each request reported once, when done
    assert all(tokens == one_batch.tokens[i] and reason == one_batch.finish_reasons[i] for i, tokens, reason in finished)
    assert inserts and set(inserts) <= {1, 2, 4}, "rows were refilled while others decoded"
    fixed = runner.generate(prompts, batch_size=4, continuous=False, **kwargs)
    assert fixed.tokens == one_batch.tokens
    steps = "steps" if isinstance(runner, AutoregressiveGenerator) else "rounds"
    assert getattr(continuous, steps) < getattr(fixed, steps)


# Cheap plain rounds: this random drafter's drafts rarely pay, so the scheduler mostly skips them.
PLAIN_SCHEDULER = SchedulerPolicy.from_tables({b: {PLAIN: 0.5, 1: 1.0, 2: 1.02, 4: 1.05} for b in (1, 2, 4)})


@pytest.mark.parametrize("policy, buckets", [(ThresholdPolicy(0.5), False), (FixedPolicy(0), False),
                                             (PLAIN_SCHEDULER, True)],
                         ids=["threshold", "plain-rounds", "scheduler-buckets"])
def test_continuous_greedy_speculative_decoding_is_the_targets_greedy_decoding(tiny, policy, buckets):
    """Under a policy whose lengths weigh the rows in flight (threshold) or that runs plain rounds
    (fixed:0 and the scheduler reuse the last block), refills keep greedy output equal to
    target-only decoding; so do resizes (``batch_buckets``: the round after one drafts), requests
    arriving in three waves among them, each wave refilling an empty batch at another size, and
    nothing compiles after ``warmup(buckets=True)``. A scheduler without a cost table for every size the batch may take is refused at the start."""
    target, drafter, prompts, _ = tiny
    limits = [16 - i for i in range(len(prompts))]  # the last requests finish one by one
    kwargs = dict(max_new_tokens=limits, stop_ids=[STOP], max_len=48)
    reference = AutoregressiveGenerator(target).generate(prompts, **kwargs)
    decoder = SpeculativeDecoder(target, drafter, policy=policy)
    inserts = counting_refills(decoder)
    arrivals = None
    if buckets:  # compiled first, so that each wave finishes before the next arrives
        for length in (2, 11):
            decoder.warmup(4, length, 48, refills=True, buckets=True)
        arrivals = [0.0] * 8 + [0.3] * 4 + [0.6]
    with count_compilations() as compiled:
        result = decoder.generate(prompts, batch_size=4, batch_buckets=buckets, arrivals=arrivals, **kwargs)
    assert result.tokens == reference.tokens and inserts
    assert (min(result.rows_per_round) < 4) == buckets
    if buckets:
        assert compiled.count == 0
    if isinstance(policy, SchedulerPolicy):
        assert 0 < result.plain_rounds < result.rounds
        only_4 = decoder.with_policy(SchedulerPolicy.from_tables({4: dict(dict(policy.costs)[4])}))
        with pytest.raises(ValueError, match="no batch size 1, 2 "):
            only_4.generate(prompts, batch_size=4, batch_buckets=True, **kwargs)


@pytest.mark.parametrize("make", [
    lambda target, drafter: AutoregressiveGenerator(target),
    lambda target, drafter: SpeculativeDecoder(target, drafter, policy=FixedPolicy(3)),
], ids=["target-only", "speculative"])
def test_a_prompt_padded_past_its_cache_is_prefilled_within_it(tiny, make):
    """A 260-token prompt pads to a 512-column prefill bucket, but 6 new tokens give it a cache of
    384 slots: the prefill is cut to the cache (it was refused, "512 tokens do not fit a KV cache of
    384 positions"), in the first batch, in a refill and in warm-up, and the tokens are those of a
    cache wide enough for the whole bucket."""
    target, drafter, prompts, _ = tiny
    long = (np.arange(260) % 11 + 1).tolist()
    # prompts[9] stops at its first token: its row takes long[:-3] while the first long one decodes.
    requests = [long, prompts[9], long[:-3], prompts[0]]
    runner = make(target, drafter)
    kwargs = dict(max_new_tokens=6, stop_ids=[STOP])
    max_len = runner.cache_len_for([len(r) for r in requests], 6)
    assert max_len == 384
    runner.warmup(2, len(long), max_len)
    inserts = counting_refills(runner)
    result = runner.generate(requests, batch_size=2, **kwargs)
    assert inserts, "no request joined a batch in flight"
    wide = [runner.generate([r], max_len=512, **kwargs).tokens[0] for r in requests]
    assert result.tokens == wide


@pytest.mark.parametrize("make", [
    lambda target, drafter: AutoregressiveGenerator(target),
    lambda target, drafter: SpeculativeDecoder(target, drafter, policy=FixedPolicy(3)),
], ids=["target-only", "speculative"])
def test_arrivals_count_from_the_call(tiny, make, monkeypatch):
    """``arrivals`` are seconds after ``generate`` is called: the time it spends checking the
    requests (made 0.2 s here) is queueing they wait through, so a serving run timed from the
    call (``engine.load.serve``) does not overstate their latency by it."""
    import sys

    target, drafter, prompts, _ = tiny
    runner = make(target, drafter)
    module = sys.modules[type(runner).__module__]
    checks, origins = module.prepare_requests, []

    def slow_checks(*args):
        time.sleep(0.2)
        return checks(*args)

    class RecordedSlots(Slots):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            origins.append(self.start)

    monkeypatch.setattr(module, "prepare_requests", slow_checks)
    monkeypatch.setattr(module, "Slots", RecordedSlots)
    called = time.perf_counter()
    runner.generate(prompts[:2], max_new_tokens=2, stop_ids=[STOP], arrivals=[0.0, 0.05])
    assert len(origins) == 1 and origins[0] - called < 0.1, origins[0] - called


@pytest.mark.parametrize("buckets", [False, True], ids=["rows", "buckets"])
@pytest.mark.parametrize("make", [
    lambda target, drafter: AutoregressiveGenerator(target),
    lambda target, drafter: SpeculativeDecoder(target, drafter, policy=FixedPolicy(3)),
], ids=["target-only", "speculative"])
def test_requests_decode_from_their_arrival_on(tiny, make, buckets):
    """Online serving (``arrivals``): no request gets a token before it arrives, they join in order
    of arrival (request 0 comes last), a batch with nothing in flight waits for the next arrival
    instead of ending, and each request's tokens are those it gets when all arrive at once. A
    warm-up with ``refills`` compiled every program serving takes. With ``batch_buckets`` the
    batch runs at 4 rows while the first wave decodes and at 1 for request 0 alone."""
    target, drafter, prompts, sampling = tiny
    runner = make(target, drafter)
    kwargs = dict(max_new_tokens=16, sampling=sampling, seeds=7, stop_ids=[STOP], max_len=48)
    at_once = runner.generate(prompts, **kwargs)  # one batch of 13: no refill
    for length in (2, 11):  # the two prompt widths these prompts pad to (16 and 32 columns)
        runner.warmup(4, length, 48, refills=True, buckets=buckets)
    # Eight at the start, four at 0.3 s, request 0 at 0.6 s: 4 rows of this target finish each wave
    # in milliseconds, so the batch runs dry twice.
    arrivals = [0.6] + [0.0] * 8 + [0.3] * 4
    first = {}
    start = time.perf_counter()
    with count_compilations() as compiled:
        served = runner.generate(prompts, arrivals=arrivals, batch_size=4, batch_buckets=buckets,
                                 on_tokens=lambda i, tokens: first.setdefault(i, time.perf_counter() - start), **kwargs)
    assert compiled.count == 0
    assert served.tokens == at_once.tokens and served.finish_reasons == at_once.finish_reasons
    assert all(first[i] >= arrivals[i] for i in range(len(prompts))), (first, arrivals)
    assert first[0] > max(first[i] for i in range(1, len(prompts)))
    rows = getattr(served, "rows_per_step" if isinstance(runner, AutoregressiveGenerator) else "rows_per_round")
    assert (rows[0], rows[-1]) == ((4, 1) if buckets else (4, 4)) and set(rows) <= {1, 2, 4}
    with pytest.raises(ValueError, match="one time per request, so 13"):
        runner.generate(prompts, arrivals=[0.0], batch_size=4, **kwargs)


@pytest.mark.parametrize("make", [
    lambda target, drafter: AutoregressiveGenerator(target),
    lambda target, drafter: SpeculativeDecoder(target, drafter, policy=FixedPolicy(3)),
], ids=["target-only", "speculative"])
def test_each_request_stops_at_its_own_max_new_tokens(tiny, make):
    """``max_new_tokens`` per request: each request's tokens are the first of those it gets with
    the largest limit, cut at its own ("length"), or ending at its stop token within it ("stop")."""
    target, drafter, prompts, sampling = tiny
    runner = make(target, drafter)
    kwargs = dict(sampling=sampling, seeds=7, stop_ids=[STOP], max_len=48, batch_size=4)
    longest = runner.generate(prompts, max_new_tokens=16, **kwargs)
    limits = [1 + i % 5 * 3 for i in range(len(prompts))]  # 1, 4, 7, 10, 13, 1, ...
    limited = runner.generate(prompts, max_new_tokens=limits, **kwargs)
    for tokens, reason, full, full_reason, limit in zip(limited.tokens, limited.finish_reasons, longest.tokens,
                                                        longest.finish_reasons, limits):
        assert tokens == full[:limit]
        assert reason == ("stop" if full_reason == "stop" and len(full) <= limit else "length")
    assert {"stop", "length"} == set(limited.finish_reasons) and min(map(len, limited.tokens)) == 1
    for bad, message in [(limits[:3], "got 3 max_new_tokens for 13 prompts"),
                         ([0] + limits[1:], "per request must be >= 1"), ([1.5] * 13, "must be an int")]:
        with pytest.raises(ValueError, match=message):
            runner.generate(prompts, max_new_tokens=bad, **kwargs)


def test_bad_batch_sizes_are_refused(tiny):
    target, drafter, prompts, _ = tiny
    with pytest.raises(ValueError, match="at least one row"):
        AutoregressiveGenerator(target).generate(prompts, max_new_tokens=4, batch_size=0)


@pytest.mark.parametrize("continuous, buckets", [(True, False), (False, False), (True, True)],
                         ids=["continuous", "fixed", "buckets"])
def test_taps_under_refills_are_those_of_one_batch(tiny, continuous, buckets):
    """With tap layers (what the target cache stores), every request gets its taps at every
    position of prompt + answer, as in one batch, although rows are refilled: the last token of a
    finished request is tapped by the step after it, before its row takes the next request. With
    ``batch_buckets`` such a row keeps its tap when the batch shrinks around it (the last
    requests finish one by one: their limits fall)."""
    target, _, prompts, sampling = tiny
    generator = AutoregressiveGenerator(target, tap_layers=(0, 2))
    limits = [16 - i for i in range(len(prompts))]
    kwargs = dict(max_new_tokens=limits, sampling=sampling, seeds=7, stop_ids=[STOP], max_len=48)
    one_batch = generator.generate(prompts, **kwargs)
    assert min(map(len, one_batch.tokens)) == 1, "a request stops at its first token"
    inserts = counting_refills(generator)
    refilled = generator.generate(prompts, batch_size=4, continuous=continuous, batch_buckets=buckets, **kwargs)
    assert refilled.tokens == one_batch.tokens and bool(inserts) == continuous
    assert (min(refilled.rows_per_step) < 4) == buckets
    for prompt, tokens, taps, expected in zip(prompts, refilled.tokens, refilled.taps, one_batch.taps):
        assert taps.shape == (len(prompt) + len(tokens), 2 * target.cfg.hidden_size)
        # A refill's prefill pads its prompts to another width than the one batch's: attention then
        # sums over another number of masked keys, which moves float32 rounding (≈ 2e-6 here); a
        # tap from the wrong position or request would be off by O(1).
        np.testing.assert_allclose(taps, expected, rtol=0, atol=1e-5)


def test_the_cache_writer_answers_a_shard_through_refills(tiny, tmp_path):
    """The target cache writer answers a shard's 13 prompts 4 rows at a time: in fixed batches
    and by continuous batching (``CacheSpec.continuous``) each prompt gets the answer and stored
    arrays it gets when the shard is one batch (the arrays to the rounding of another prefill
    width, then bf16 storage)."""
    target, _, prompts, _ = tiny
    spec = CacheSpec(tap_layers=(0,), max_new_tokens=16, max_prompt_tokens=16, temperature=1.0, top_k=6,
                     top_p=1.0, shard_size=13, batch_size=13, min_response_tokens=1)

    def respond(**changes):
        writer = TargetCacheWriter(target, dataclasses.replace(spec, **changes), tmp_path, stop_ids=[STOP])
        inserts = counting_refills(writer.generator)
        return writer.respond(prompts, 0), inserts

    (answers, arrays), _ = respond()
    assert min(map(len, answers)) == 1 and max(map(len, answers)) == 16
    _, head = target.embedding_and_head(target.params)
    for continuous in (True, False):
        (refilled, refilled_arrays), inserts = respond(batch_size=4, continuous=continuous)
        assert refilled == answers and bool(inserts) == continuous
        for prompt, answer, got, want in zip(prompts, answers, refilled_arrays, arrays):
            assert len(got[0]) == len(prompt) + len(answer)
            assert_same_stored_arrays(got, want, head)
