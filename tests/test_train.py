"""The training pipeline: target cache, anchors, exact resume, data parallelism, `dspark train`."""

import dataclasses
import json
import re
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from dspark_jax.checkpoints.drafter import build_drafter, load_drafter
from dspark_jax.cli import main as cli_main
from dspark_jax.config import DrafterConfig
from dspark_jax.training import target_cache
from dspark_jax.training import train as train_module
from dspark_jax.training.target_cache import (
    CacheSpec,
    TargetCacheWriter,
    load_target_cache,
    teacher_forced,
)
from dspark_jax.training.train import (
    BUDGET_FILE,
    LOG_FILE,
    SHARED_FIELDS,
    BatchSource,
    NonFiniteLoss,
    Trainer,
    batch_completer,
    build_cache,
    draft_vocab,
    drafter_config,
    load_config,
    load_training_set,
    next_leg,
    objective,
    run,
    run_budgeted,
    same_legs,
    sample_anchors,
    schedule,
    train,
    train_together,
    training_names,
)
from tests.multidevice import run_on_eight_devices, run_processes
from tests.stored_arrays import assert_same_stored_arrays, assert_within_one_bf16_step
from tests.tiny import tiny_target

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny_test.py"


def losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (Path(run_dir) / LOG_FILE).read_text().splitlines()]


class SkewedClock:
    """Stands in for the ``time`` module of the module under test: its monotonic clock runs ``skew``
    seconds ahead of the real one, so a test makes a deadline pass exactly where it wants, however
    loaded the machine is (real seconds would make the test depend on the machine's speed)."""

    def __init__(self):
        self.skew = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.skew

    def __getattr__(self, name):
        return getattr(time, name)


@pytest.fixture(scope="module")
def tiny_run(built_once_per_run):
    """`dspark train --config configs/tiny_test.py`, run once for the test run (the tests only
    read its directory)."""

    def train_tiny(out):
        assert cli_main(["train", "--config", str(TINY), "--out-dir", str(out)]) == 0

    return built_once_per_run("tiny_run", train_tiny)


@pytest.fixture(scope="module")
def tiny_parts(tiny_run, embedded_target):
    config = dataclasses.replace(load_config(TINY), out_dir=str(tiny_run))
    target = embedded_target[0].truncated(config.target_layers)
    return config, target, load_target_cache(config.cache_path)


# --- anchors ---------------------------------------------------------------------------------


def test_anchor_candidates_follow_the_response_rule():
    mask = np.array([0, 0, 1, 1, 1, 0, 1, 1])
    anchors, keep = sample_anchors(mask, 8, np.random.default_rng(0))
    # i is a candidate iff tokens i and i+1 are both response tokens: 2, 3 and 6.
    assert anchors[keep].tolist() == [2, 3, 6] and keep.sum() == 3
    assert (anchors[~keep] == 0).all()


def test_anchor_sampling_is_uniform_without_replacement_and_sorted():
    mask = np.ones(200, np.uint8)
    rng = np.random.default_rng(1)
    hits = np.zeros(199)
    for _ in range(400):
        anchors, keep = sample_anchors(mask, 16, rng)
        assert keep.all() and (np.diff(anchors) > 0).all()
        hits[anchors] += 1
    # 400·16/199 ≈ 32 expected hits per candidate; a biased sampler would leave gaps.
    assert hits.min() > 10 and hits.max() < 60


# --- the pipeline on the tiny config ------------------------------------------------------------


def test_tiny_training_loss_falls_and_exports_a_loadable_drafter(tiny_run, embedded_target):
    curve = losses(tiny_run)
    assert len(curve) == load_config(TINY).steps
    assert np.mean(curve[-8:]) < 0.6 * np.mean(curve[:4]), curve
    assert any((tiny_run / "checkpoints").iterdir())
    records = [json.loads(line) for line in (tiny_run / LOG_FILE).read_text().splitlines()]
    for key in ("ce", "tv", "conf", "accept_rate", "tau_probabilistic", "grad_norm", "lr"):
        assert key in records[-1], key
    assert records[-1]["tau_probabilistic"] > records[0]["tau_probabilistic"]
    # Held-out τ every heldout_every steps and at the end, on answers to prompts it never saw.
    config = load_config(TINY)
    scored = [r["step"] for r in records if "heldout_tau" in r]
    assert scored == list(range(config.heldout_every - 1, config.steps, config.heldout_every)), scored
    heldout = [r["heldout_tau"] for r in records if "heldout_tau" in r]
    assert all(1.0 <= t <= 1 + config.drafter["block_size"] for t in heldout), heldout
    assert heldout[-1] > heldout[0], heldout
    target = embedded_target[0].truncated(2)
    drafter = load_drafter(tiny_run / "drafter", target=target)
    assert drafter.cfg.block_size == 4
    # It records the 2-layer target it was trained for, and refuses the whole embedded target.
    assert json.loads((tiny_run / "drafter" / "config.json").read_text())["target"]["num_layers"] == 2
    with pytest.raises(ValueError, match="trained for a target of 2 decoder layers, and this target has 30"):
        load_drafter(tiny_run / "drafter", target=embedded_target[0])


def test_cache_holds_the_targets_own_features_and_normaliser(tiny_parts):
    config, target, sequences = tiny_parts
    seq = sequences[0]
    assert seq.loss_mask.sum() >= config.cache.min_response_tokens
    tokens = jax.numpy.asarray(seq.input_ids[None])
    out = target.apply(target.params, tokens, target.new_cache(1, len(seq.input_ids)),
                       tap_layers=config.cache.tap_layers)
    np.testing.assert_allclose(np.asarray(seq.features, np.float32), out.taps[0], rtol=2e-2, atol=2e-2)
    # lse is the normaliser of the logits recomputed from the *stored* (bf16) hidden state, so
    # in-vocabulary probabilities from that hidden state sum to at most 1 at train time.
    _, head = target.embedding_and_head(target.params)
    stored_logits = np.asarray(seq.hidden, np.float32) @ np.asarray(head).T
    np.testing.assert_allclose(seq.lse, jax.nn.logsumexp(stored_logits, axis=-1), rtol=1e-5)
    # ... and that hidden state is the target's own up to bf16 rounding: each logit is within
    # the bound that rounding every hidden element by at most 2^-8 relative allows.
    hidden = np.asarray(seq.hidden, np.float32)
    bound = (np.abs(hidden) @ np.abs(np.asarray(head)).T) * 2.0**-8
    assert (np.abs(stored_logits - np.asarray(out.logits[0])) <= bound + 1e-4).all()
    # The response is the target's greedy continuation (tiny_test samples at T=0).
    response_start = int(np.argmax(seq.loss_mask))
    np.testing.assert_array_equal(
        np.argmax(out.logits[0, response_start - 1 : -1], axis=-1)[:8], seq.input_ids[response_start:][:8]
    )


def test_cache_from_the_answers_own_forwards_equals_one_forward_over_each_sequence(tiny_parts):
    """The writer keeps what the forwards that generated each answer computed; one forward over
    the finished sequence (``teacher_forced``, what training computes for a cache of token ids)
    gives the same features and hidden state to one bf16 rounding step, and an lse that differs
    by no more than the logits of the two hidden states can (lse is 1-Lipschitz in the max norm)."""
    config, target, sequences = tiny_parts
    run = jax.jit(teacher_forced(target, config.cache.tap_layers))
    _, head = target.embedding_and_head(target.params)
    for seq in sequences[:4]:
        n = len(seq.input_ids)
        features, hidden, lse = jax.device_get(run(target.params, seq.input_ids[None], np.asarray([n], np.int32)))
        assert_same_stored_arrays((seq.features, seq.hidden, seq.lse), (features[0], hidden[0], lse[0]), head)


@pytest.fixture
def six_prompts(tiny_parts, embedded_target):
    """``(prompts, names, spec, writer)``: six short chat prompts, three shards of two, and
    ``writer(path, spec=spec)`` for the tiny target."""
    _, target, _ = tiny_parts
    tokenizer = embedded_target[1]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Count to {i}."}]) for i in range(6)]
    names = [f"p{i}" for i in range(6)]
    spec = CacheSpec(tap_layers=(0,), max_new_tokens=12, max_prompt_tokens=64, temperature=0.0,
                     shard_size=2, batch_size=2, min_response_tokens=1)

    def writer(path, spec=spec):
        return TargetCacheWriter(target, spec, path, stop_ids=[tokenizer.eos_token_id])

    return prompts, names, spec, writer


def test_cache_resumes_after_a_kill_without_loss_or_duplication(tmp_path, six_prompts, monkeypatch):
    prompts, names, spec, writer = six_prompts
    writer(tmp_path / "whole").build(prompts, names, progress=False)
    original = TargetCacheWriter._write_shard

    def dies_at_shard_1(self, shard, *args):
        if shard == 1:
            raise KeyboardInterrupt("killed")
        return original(self, shard, *args)

    monkeypatch.setattr(TargetCacheWriter, "_write_shard", dies_at_shard_1)
    with pytest.raises(KeyboardInterrupt):
        writer(tmp_path / "killed").build(prompts, names, progress=False)
    with pytest.raises(ValueError, match="incomplete"):
        load_target_cache(tmp_path / "killed")
    monkeypatch.setattr(TargetCacheWriter, "_write_shard", original)
    writer(tmp_path / "killed").build(prompts, names, progress=False)
    whole, resumed = load_target_cache(tmp_path / "whole"), load_target_cache(tmp_path / "killed")
    assert [s.name for s in resumed] == [s.name for s in whole] == names
    for a, b in zip(whole, resumed):
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.features, b.features)
        np.testing.assert_array_equal(a.lse, b.lse)
    # A different spec on the same directory is refused, naming what changed.
    other = dataclasses.replace(spec, max_new_tokens=13)
    with pytest.raises(ValueError, match="spec"):
        writer(tmp_path / "whole", other).build(prompts, names, progress=False)
    assert target_cache.shard_done(tmp_path / "whole", 2)


def test_cache_grows_in_place_when_prompts_are_appended(tmp_path, tiny_parts, six_prompts, monkeypatch):
    """Appending prompts keeps the finished shards (not regenerated) and adds the new ones, which
    equal a cache built from scratch; the shorter list stays readable; other prompts are refused."""
    prompts, names, spec, writer = six_prompts

    def build(path, n):
        return writer(path).build(prompts[:n], names[:n], progress=False)

    assert build(tmp_path / "whole", 6) == 3
    assert build(tmp_path / "grown", 4) == 2
    first_shard = (tmp_path / "grown" / "shard-00000.safetensors").stat().st_mtime_ns
    written = []
    original = TargetCacheWriter._write_shard
    monkeypatch.setattr(TargetCacheWriter, "_write_shard",
                        lambda self, shard, *a: (written.append(shard), original(self, shard, *a)))
    build(tmp_path / "grown", 6)
    assert written == [2]
    assert (tmp_path / "grown" / "shard-00000.safetensors").stat().st_mtime_ns == first_shard
    whole, grown = load_target_cache(tmp_path / "whole"), load_target_cache(tmp_path / "grown")
    assert [s.name for s in grown] == names
    for a, b in zip(whole, grown):
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.features, b.features)
    # The shorter list it grew from (an earlier training leg) is still served: its own shards.
    assert build(tmp_path / "grown", 4) == 2
    assert [s.name for s in load_target_cache(tmp_path / "grown", 2)] == names[:4]
    with pytest.raises(ValueError, match="neither extend"):
        writer(tmp_path / "grown").build(prompts[1:] + prompts[:2], names[1:] + names[:2], progress=False)
    # A partial last shard is written again with the prompts that complete it.
    build(tmp_path / "partial", 3)
    written.clear()
    build(tmp_path / "partial", 6)
    assert written == [1, 2]
    partial = load_target_cache(tmp_path / "partial")
    assert [s.name for s in partial] == names
    for a, b in zip(whole, partial):
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
    # A run on the 3-prompt list reads its 3 answers, not the one appended to its last shard.
    # (A run needs answers of 2 tokens at least, one anchor; reading the cache does not look.)
    config = dataclasses.replace(tiny_parts[0], cache=dataclasses.replace(spec, min_response_tokens=2),
                                 cache_dir=str(tmp_path / "partial"))
    assert [s.name for s in load_training_set(config, names[:3])] == names[:3]
    # Were that shared shard lost, the short list must not rewrite it without the appended prompt.
    for suffix in (".json", ".safetensors"):
        (tmp_path / "partial" / f"shard-00001{suffix}").unlink()
    with pytest.raises(ValueError, match="resume the build with that list first"):
        build(tmp_path / "partial", 3)


def test_a_cache_of_token_ids_stops_at_a_deadline_and_resumes(tmp_path, six_prompts, monkeypatch):
    """``store_features=False`` keeps the answers' ids and masks alone (the ids equal a full
    cache's); a deadline stops the build between shards, and the next build resumes it."""
    prompts, names, spec, writer = six_prompts
    writer(tmp_path / "full").build(prompts, names, progress=False)
    ids_only = dataclasses.replace(spec, store_features=False)
    clock = SkewedClock()
    monkeypatch.setattr(target_cache, "time", clock)
    original = TargetCacheWriter._write_shard

    def outlasts_the_deadline(self, shard, *args):  # shard 0 starts in time and ends after it
        original(self, shard, *args)
        clock.skew = 1e6

    monkeypatch.setattr(TargetCacheWriter, "_write_shard", outlasts_the_deadline)
    deadline = time.monotonic() + 600.0
    assert writer(tmp_path / "ids", ids_only).build(prompts, names, progress=False, deadline=deadline) == 3
    assert target_cache.complete_shards(tmp_path / "ids", 3) == 1
    assert [s.name for s in load_target_cache(tmp_path / "ids", 1)] == names[:2]
    monkeypatch.undo()
    writer(tmp_path / "ids", ids_only).build(prompts, names, progress=False)
    full, ids = load_target_cache(tmp_path / "full"), load_target_cache(tmp_path / "ids")
    assert [s.name for s in ids] == names
    for a, b in zip(full, ids):
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
        assert b.features is None and b.hidden is None and b.lse is None
    stored = safetensors.numpy.load_file(str(tmp_path / "ids" / "shard-00000.safetensors"))
    assert sorted(stored) == ["input_ids", "loss_mask", "offsets"]


def test_training_on_token_ids_computes_the_features_the_cache_holds(tiny_parts):
    """From a cache of token ids, the step gets the cached batch's features (the cache kept the
    answers' own forwards, the step runs one forward over the batch: equal up to one bf16
    rounding step), so the loss and the acceptance estimate are the cached batch's."""
    config, target, sequences = tiny_parts
    online = dataclasses.replace(config, cache=dataclasses.replace(config.cache, store_features=False))
    ids_only = [dataclasses.replace(s, features=None, hidden=None, lse=None) for s in sequences]
    cached = BatchSource(sequences, config).batch(3)
    bare = BatchSource(ids_only, online).batch(3)
    assert bare.features_BxSxF is None and bare.target_lse_BxS is None
    for name in ("input_ids_BxS", "loss_mask_BxS", "anchors_BxA", "keep_BxA", "lengths_B"):
        np.testing.assert_array_equal(getattr(cached, name), getattr(bare, name))
    filled = jax.jit(batch_completer(target, config.cache.tap_layers))(target.params, bare)
    real = np.arange(config.seq_len)[None, :] < cached.lengths_B[:, None]
    for name in ("features_BxSxF", "target_hidden_BxSxD"):
        want = np.asarray(getattr(cached, name), np.float32)[real]
        assert_within_one_bf16_step(np.asarray(getattr(filled, name), np.float32)[real], want, name)
    drafter = build_drafter(drafter_config(config, target.cfg), seed=0,
                            draft_vocab_ids=draft_vocab(config, sequences, target.cfg.vocab_size))
    embed, head = target.embedding_and_head(target.params)
    drafter.init_draft_head(head)
    loss, metrics = objective(drafter, config, cached, embed, head)
    loss_online, metrics_online = objective(drafter, online, filled, embed, head)
    np.testing.assert_allclose(float(loss_online), float(loss), rtol=1e-5)
    np.testing.assert_allclose(metrics_online["tau_probabilistic"], metrics["tau_probabilistic"], rtol=1e-5)


def test_trainers_on_one_mesh_share_one_batch_completion(tmp_path, tiny_parts, embedded_target):
    """Drafters trained together from token ids hold the frozen target's weights and its compiled
    completer once, not once per drafter; a drafter tapping other layers cannot share them."""
    config, _, sequences = tiny_parts
    target = embedded_target[0].truncated(3)  # room for another tapped layer below the last
    online = dataclasses.replace(config, out_dir=str(tmp_path / "first"),
                                 cache=dataclasses.replace(config.cache, store_features=False))
    ids_only = [dataclasses.replace(s, features=None, hidden=None, lse=None) for s in sequences]
    first = Trainer(online, target, ids_only)
    second = Trainer(dataclasses.replace(online, out_dir=str(tmp_path / "second"), seed=1), target, ids_only,
                     completion_from=first)
    assert first.complete is not None and second.complete is first.complete
    assert second.target_params is first.target_params
    cached = dataclasses.replace(config, out_dir=str(tmp_path / "cached"))
    assert Trainer(cached, target, sequences, completion_from=first).complete is None  # features cached: nothing to complete
    other_taps = dataclasses.replace(online, out_dir=str(tmp_path / "other"),
                                     cache=dataclasses.replace(online.cache, tap_layers=(1,)))
    with pytest.raises(ValueError, match="cannot share .* batch completion"):
        Trainer(other_taps, target, ids_only, completion_from=first)


def _budget_configs(tmp_path, kinds=("dspark", "dflash", "eagle3")):
    """tiny_test's DSpark drafter and its baselines on 16 prompts, in a cache of token ids."""
    config = load_config(TINY)
    base = dataclasses.replace(
        config, name="tiny_dspark", out_dir=str(tmp_path / "dspark"), cache_dir=str(tmp_path / "cache"),
        num_prompts=16, heldout_prompts=0, batch_size=4, checkpoint_every=2,
        cache=dataclasses.replace(config.cache, shard_size=8, batch_size=8, store_features=False))
    drafters = {"dflash": dict(kind="dflash", mask_token_id=0, block_size=4, draft_vocab_size=512),
                "eagle3": dict(kind="eagle3", mask_token_id=0, block_size=4, draft_vocab_size=512)}
    return [base] + [same_legs(base, drafters[k], ("dspark", k)) for k in kinds[1:]]


def test_budgeted_training_gives_every_drafter_the_same_steps_and_resumes(tmp_path, monkeypatch):
    configs = _budget_configs(tmp_path)
    # A step "takes" 30 s a drafter and a batch 10 s, so the budget left after the cache affords a
    # few rounds of 100 s. The real steps take a small part of that, so the deadline, which
    # test_budgeted_training_stops_at_its_deadline_... covers, does not cut this run short.
    monkeypatch.setattr(Trainer, "step_seconds", lambda self, batch, repeats=3: 30.0)
    monkeypatch.setattr(Trainer, "batch_seconds", lambda self, repeats=3: 10.0)
    exported = run_budgeted(configs, 600.0, data_fraction=0.5, margin=0.0, progress=False)
    plans = [json.loads((Path(c.out_dir) / BUDGET_FILE).read_text()) for c in configs]
    assert all(plan == plans[0] for plan in plans) and plans[0]["drafters"] == [c.name for c in configs]
    steps = plans[0]["steps"]
    assert 1 <= steps <= 600 // 100, plans[0]
    assert steps == int((600.0 - plans[0]["planned_after_s"]) / 100.0)
    assert plans[0]["cache_shards"] == target_cache.complete_shards(configs[0].cache_path, 2) >= 1
    for config, out in zip(configs, exported):
        assert len(losses(config.out_dir)) == steps
        meta = json.loads((out / "config.json").read_text())["metadata"]
        assert meta["steps"] == steps and meta["budget"] == plans[0] and meta["sequences"] == plans[0]["sequences"]
    assert "features" not in safetensors.numpy.load_file(str(configs[0].cache_path / "shard-00000.safetensors"))
    # Trained together (one batch a step for all), each drafter trained as it would alone.
    alone = dataclasses.replace(configs[1], out_dir=str(tmp_path / "alone"), steps=steps,
                                cache_shards=plans[0]["cache_shards"])
    run(alone, progress=False)
    assert losses(alone.out_dir) == losses(configs[1].out_dir)
    # A rerun finds the plans and resumes: nothing is planned or trained again.
    monkeypatch.setattr(Trainer, "step_seconds", lambda *a, **k: pytest.fail("planned again"))
    before = [losses(c.out_dir) for c in configs]
    run_budgeted(configs, 600.0, data_fraction=0.5, progress=False)
    assert [losses(c.out_dir) for c in configs] == before


def test_budgeted_training_stops_at_its_deadline_and_exports_what_it_trained(tmp_path, monkeypatch):
    """Steps slower than timed: the run stops at the budget's end, checkpoints, and exports the
    drafters with the steps they got, instead of running on until a hard stop kills it."""
    configs = _budget_configs(tmp_path, kinds=("dspark", "dflash"))
    monkeypatch.setattr(Trainer, "step_seconds", lambda self, batch, repeats=3: 1e-4)
    monkeypatch.setattr(Trainer, "batch_seconds", lambda self, repeats=3: 1e-4)
    # Planned at 0.2 ms a round, the budget "affords" millions of steps; the training's clock
    # then passes the deadline once both drafters have taken two steps.
    clock = SkewedClock()
    monkeypatch.setattr(train_module, "time", clock)
    step = Trainer.step
    steps_done = []

    def step_then_run_late(self, *args, **kwargs):
        metrics = step(self, *args, **kwargs)
        steps_done.append(self)
        if len(steps_done) == 2 * len(configs):
            clock.skew = 1e6
        elif len(steps_done) > 2 * len(configs):
            pytest.fail("a step started past the deadline")
        return metrics

    monkeypatch.setattr(Trainer, "step", step_then_run_late)
    exported = run_budgeted(configs, 600.0, data_fraction=0.5, margin=0.0, progress=False)
    plan = json.loads((Path(configs[0].out_dir) / BUDGET_FILE).read_text())
    done = len(losses(configs[0].out_dir))
    assert done == 2 < plan["steps"], (done, plan["steps"])
    for config, out in zip(configs, exported):
        assert len(losses(config.out_dir)) == done
        assert json.loads((out / "config.json").read_text())["metadata"]["steps"] == done
        saved = [int(p.name) for p in (Path(config.out_dir) / "checkpoints").iterdir() if p.name.isdigit()]
        assert max(saved) == done  # checkpointed where it stopped, so a rerun resumes there


def test_budgeted_training_refuses_drafters_on_other_data_or_a_bad_budget(tmp_path):
    spark, flash = _budget_configs(tmp_path, kinds=("dspark", "dflash"))
    with pytest.raises(ValueError, match="num_prompts"):
        run_budgeted([spark, dataclasses.replace(flash, num_prompts=8)], 60.0, progress=False)
    with pytest.raises(ValueError, match="distinct names"):
        run_budgeted([spark, dataclasses.replace(flash, name=spark.name)], 60.0, progress=False)
    with pytest.raises(ValueError, match="data_fraction"):
        run_budgeted([spark], 60.0, data_fraction=1.0, progress=False)


# --- refusals: one line, before the target cache is built ------------------------------------


@pytest.mark.parametrize("change, message", [
    (dict(learning_rate="3e-3"), "TrainConfig.learning_rate must be a finite number > 0, got '3e-3'"),
    (dict(learning_rate=-1e-3), "TrainConfig.learning_rate must be a finite number > 0, got -0.001"),
    (dict(learning_rate=float("nan")), "TrainConfig.learning_rate must be a finite number > 0, got nan"),
    (dict(clip_norm=0.0), "TrainConfig.clip_norm must be a finite number > 0, got 0.0"),
    (dict(clip_norm=-1.0), "TrainConfig.clip_norm must be a finite number > 0, got -1.0"),
    (dict(warmup_fraction=2.0), "TrainConfig.warmup_fraction must be a finite number in [0, 1), got 2.0"),
    (dict(steps=4.5), "TrainConfig.steps must be an int, got 4.5"),
    (dict(batch_size=True), "TrainConfig.batch_size must be an int, got True"),
    (dict(cache_shards=0), "TrainConfig.cache_shards must be >= 1, got 0"),
    (dict(seed=-1), "TrainConfig.seed must be >= 0, got -1"),
    # A str is not its digits: "12" was seeds ("1", "2"), and heldout_seed=1 passed as no data seed.
    (dict(data_seed="12"), "TrainConfig.data_seed must be an int or a tuple of distinct ints, got '12'"),
    (dict(data_seed=(0, 1.5)), "every entry of TrainConfig.data_seed must be an int, got 1.5"),
    # An answer of one token has no anchor: a cache of them trained on a loss of 0 and exported.
    (dict(cache=CacheSpec(tap_layers=(0,), max_prompt_tokens=192, min_response_tokens=1)),
     "TrainConfig.cache.min_response_tokens must be >= 2"),
])
def test_a_train_config_refuses_values_it_cannot_train_with(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        dataclasses.replace(load_config(TINY), **change)


def test_a_train_config_takes_numpy_numbers_as_python_ones():
    config = dataclasses.replace(load_config(TINY), steps=np.int64(5), learning_rate=np.float32(0.5), data_seed=[0, 2])
    assert type(config.steps) is int and type(config.learning_rate) is float and config.data_seeds == (0, 2)


@pytest.mark.parametrize("text, said", [
    ("CONFIG = (\n", "SyntaxError: '(' was never closed"),
    (TINY.read_text().replace("learning_rate=", "learning_rat="), "TypeError: "),
    ("CONFIG = TrainConfg()\n", "NameError: name 'TrainConfg' is not defined"),
    (TINY.read_text().replace("batch_size=4", "batch_size=0"), "TrainConfig.batch_size must be >= 1, got 0"),
])
def test_a_config_file_that_fails_is_a_one_line_error_naming_it(tmp_path, capsys, text, said):
    path = tmp_path / "bad.py"
    path.write_text(text)
    assert cli_main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dspark train: error: {path}: {said}") and err.count("\n") == 1, err


def test_a_run_refuses_a_bad_drafter_or_out_dir_before_building_the_cache(tmp_path, monkeypatch, embedded_target):
    """Each of these failed only after the target cache was built (a TypeError traceback for the
    unknown key); ``run`` and ``run_budgeted`` now build the drafter's config first."""
    target, tokenizer = embedded_target
    monkeypatch.setattr(train_module, "load_target", lambda config: (target.truncated(config.target_layers), tokenizer))
    monkeypatch.setattr(train_module, "build_cache", lambda *a, **k: pytest.fail("the target cache was built"))
    tiny = dataclasses.replace(load_config(TINY), out_dir=str(tmp_path / "run"))
    (tmp_path / "a_file").write_text("")
    for change, message in ((dict(drafter={**tiny.drafter, "blok_size": 4}), "unknown keys ['blok_size']"),
                            (dict(drafter={**tiny.drafter, "block_size": 0}), "TrainConfig.drafter: block_size (γ) must be >= 1"),
                            (dict(drafter={**tiny.drafter, "block_size": 4.0}), "TrainConfig.drafter: block_size must be an int"),
                            (dict(drafter={**tiny.drafter, "kind": "dspak"}), "got 'dspak'"),
                            (dict(drafter={**tiny.drafter, "draft_vocab_size": 10**6}), "draft_vocab_size must be in"),
                            (dict(cache=dataclasses.replace(tiny.cache, tap_layers=())), "at least one tapped"),
                            (dict(out_dir=str(tmp_path / "a_file")), "a_file is a file, not a directory"),
                            (dict(out_dir=str(tmp_path / "a_file" / "run")), "a_file, a file, not a directory")):
        config = dataclasses.replace(tiny, **change)
        with pytest.raises(ValueError, match=re.escape(message)):
            run(config, progress=False)
        with pytest.raises(ValueError, match=re.escape(message)):
            run_budgeted([config], 60.0, progress=False)
    assert not (tmp_path / "run").exists()


def test_a_trainer_without_sequences_says_why():
    """Every answer dropped as too short: an IndexError on ``sequences[0]`` before."""
    with pytest.raises(ValueError, match=re.escape("holds no answer to train on: every answer was shorter than "
                                                   "min_response_tokens (8)")):
        Trainer(load_config(TINY), None, [])


def test_prompts_left_out_for_their_length_are_counted_by_domain(embedded_target, capsys):
    """Prompts over max_prompt_tokens are left out, not evenly across domains: said, per domain."""
    tokenizer = embedded_target[1]
    tiny = load_config(TINY)
    capped = dataclasses.replace(tiny, cache=dataclasses.replace(tiny.cache, max_prompt_tokens=64))
    names = training_names(capped, tokenizer)
    said = re.search(r"tiny_test leaves out (\d+) of its 64 training prompts, longer than max_prompt_tokens "
                     r"\(64\): (.*)\n", capsys.readouterr().err)
    assert said and int(said[1]) == 64 - len(names) > 0
    per_domain = re.findall(r"(\w+) (\d+) of (\d+)", said[2])
    assert sum(int(n) for _, n, _ in per_domain) == int(said[1]) and len(per_domain) > 1
    with pytest.raises(ValueError, match=re.escape("none of the 64 training prompts fits max_prompt_tokens (1 ")):
        training_names(dataclasses.replace(tiny, cache=dataclasses.replace(tiny.cache, max_prompt_tokens=1)), tokenizer)


def test_a_non_finite_loss_stops_the_run_before_it_is_saved(tmp_path, tiny_parts):
    """A damaged cache (here NaN features) gave a NaN loss every step, saved and exported: the first
    such step now stops the run, named, before it is checkpointed; the last checkpoint stays."""
    config, target, sequences = tiny_parts
    config = dataclasses.replace(config, out_dir=str(tmp_path / "run"), steps=4, checkpoint_every=2)
    assert train(config, target, sequences, stop_after=2, progress=False) is None
    damaged = [dataclasses.replace(s, features=np.full_like(s.features, np.nan)) for s in sequences]
    with pytest.raises(NonFiniteLoss, match=r"step 2 has loss nan .* its last checkpoint \(step 2\) .* is kept"):
        train(config, target, damaged, progress=False)
    saved = [int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()]
    assert max(saved) == 2 and not (tmp_path / "run" / "drafter").exists()


def test_timing_a_step_compiles_it_without_moving_the_run(tmp_path, tiny_parts):
    config, target, sequences = tiny_parts
    config = dataclasses.replace(config, out_dir=str(tmp_path / "timed"), steps=2)
    trainer = Trainer(config, target, sequences)
    before = jax.tree.map(np.asarray, trainer.params)
    assert 0 < trainer.batch_seconds(repeats=2) < 60
    batch = trainer.device_batch(trainer.source.batch(0))
    assert 0 < trainer.step_seconds(batch, repeats=2) < 60
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, trainer.params))
    train_together([trainer], progress=False)
    straight = dataclasses.replace(config, out_dir=str(tmp_path / "straight"))
    train(straight, target, sequences, progress=False)
    assert losses(tmp_path / "timed") == losses(tmp_path / "straight")


def test_more_data_seeds_append_distinct_prompts_and_heldout_avoids_them(tiny_parts):
    from dspark_jax.training.train import heldout_prompts, training_prompts

    config = dataclasses.replace(tiny_parts[0], num_prompts=40)
    one = training_prompts(config)
    two = training_prompts(dataclasses.replace(config, data_seed=(0, 5)))
    assert two[: len(one)] == one and len(one) == 40
    assert 40 < len(two) <= 80
    assert len({p.id for p in two}) == len(two) and all(p.id.endswith("@s5") for p in two[40:])
    assert len({p.text for p in two}) == len(two)
    with pytest.raises(ValueError, match="distinct"):
        dataclasses.replace(config, data_seed=(0, 0))
    # The held-out prompts avoid every seed's training prompts; a data seed cannot be held out.
    held = heldout_prompts(dataclasses.replace(config, data_seed=(0, 5), heldout_prompts=30, heldout_seed=1))
    assert len(held) >= 30 and not {p.text for p in held} & {p.text for p in two}
    with pytest.raises(ValueError, match="heldout_seed 5 is a data seed"):
        dataclasses.replace(config, data_seed=(0, 5), heldout_prompts=30, heldout_seed=5)
    # A seed of another mix appends that mix's prompts and leaves the earlier ones as they were.
    formats = training_prompts(dataclasses.replace(config, data_seed=(0, 5), data_mix=("paper", "formats")))
    assert formats[: len(one)] == one and formats[len(one):] != two[len(one):]
    assert {p.domain for p in formats[len(one):]} >= {"stub", "task"}
    with pytest.raises(ValueError, match="2 mixes for 1 data seeds"):
        dataclasses.replace(config, data_mix=("paper", "formats"))
    with pytest.raises(ValueError, match=r"unknown mix \['recipes'\]"):
        dataclasses.replace(config, data_mix="recipes")
    held = heldout_prompts(dataclasses.replace(config, heldout_prompts=30, heldout_mix="formats"))
    assert {p.domain for p in held} >= {"stub", "task"} and not {p.text for p in held} & {p.text for p in one}
    # A leg on fresh seeds is scored against the legs before it: its held-out prompts avoid
    # their training prompts too, not only its own.
    first = dataclasses.replace(config, num_prompts=400, heldout_prompts=60)
    fresh = next_leg(first, "fresh", data_seed=(6,))
    assert fresh.legs == (first, fresh)
    seen_first = {p.text for p in training_prompts(first)}
    alone = heldout_prompts(dataclasses.replace(fresh, init_from=None))
    assert {p.text for p in alone} & seen_first, "no overlap to avoid: the check below would prove nothing"
    held = heldout_prompts(fresh)
    assert not {p.text for p in held} & (seen_first | {p.text for p in training_prompts(fresh)})


def test_kill_and_resume_reproduces_the_loss_curve(tmp_path, tiny_parts):
    config, target, sequences = tiny_parts
    config = dataclasses.replace(config, out_dir=str(tmp_path / "resumed"), steps=12, checkpoint_every=4)
    assert train(config, target, sequences, stop_after=6, progress=False) is None
    assert len(losses(tmp_path / "resumed")) == 6
    # The run died at step 6, after the step-4 checkpoint: steps 4 and 5 are redone.
    train(config, target, sequences, progress=False)
    uninterrupted = dataclasses.replace(config, out_dir=str(tmp_path / "straight"))
    train(uninterrupted, target, sequences, progress=False)
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")



def test_a_run_trains_for_a_target_checkpoint_it_is_given(tmp_path, tiny_run, embedded_target):
    """``target_checkpoint``: the tiny run's own target (the embedded one's first two layers),
    written as an HF directory, is the same target (its caches are reused, not rebuilt) and
    trains the same steps; a target whose tokenizer has no EOS is refused by name."""
    import shutil

    from dspark_jax.checkpoints.hf import save_hf_checkpoint

    config = load_config(TINY)
    directory = save_hf_checkpoint(embedded_target[0].truncated(config.target_layers).module(), tmp_path / "target")
    embedded_target[1].save(directory)
    caches = {}
    for name in ("cache", "heldout_cache"):  # copies: the shared run is only read
        caches[name] = shutil.copytree(Path(tiny_run) / name, tmp_path / name)
    given = dataclasses.replace(config, target_checkpoint=str(directory), target_layers=None,
                                out_dir=str(tmp_path / "run"), cache_dir=str(caches["cache"]),
                                heldout_cache_dir=str(caches["heldout_cache"]))

    def cache_files():
        return {path: path.stat().st_mtime_ns for cache in caches.values() for path in cache.rglob("*")}

    before = cache_files()
    assert run(given, stop_after=3, progress=False) is None
    assert cache_files() == before  # nothing answered again
    assert losses(given.out_dir) == losses(tiny_run)[:3]
    tokens = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**tokens, "eos_token": None}))
    (directory / "special_tokens_map.json").unlink(missing_ok=True)
    with pytest.raises(ValueError, match="names no EOS token"):
        run(dataclasses.replace(given, out_dir=str(tmp_path / "no_eos")), progress=False)


def test_a_run_trains_on_a_prompts_file_of_your_own(tmp_path):
    """``prompts_file`` replaces the generated mix: the cache answers the file's prompts, named by
    their lines, and lines appended later grow it."""
    path = tmp_path / "mine.jsonl"
    texts = ["Name three rivers in Africa.", "What is 7 times 8?", "Write a haiku about rain.", "Define entropy."]
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    config = dataclasses.replace(load_config(TINY), prompts_file=str(path), out_dir=str(tmp_path / "run"),
                                 heldout_prompts=0)
    assert run(config, stop_after=2, progress=False) is None
    assert len(losses(config.out_dir)) == 2 and np.isfinite(losses(config.out_dir)).all()
    assert [s.name for s in load_target_cache(config.cache_path)] == [f"line-00000{i}" for i in range(1, 5)]
    assert json.loads((tmp_path / "run" / "run.json").read_text())["prompts_file"] == str(path)
    with path.open("a") as f:
        f.write(json.dumps({"text": "Explain recursion to a child.", "id": "recursion"}) + "\n")
    target, tokenizer = train_module.load_target(config)
    names = build_cache(config, target, tokenizer, progress=False)
    assert names[-1] == "recursion" and [s.name for s in load_training_set(config, names)] == names
    path.write_text(path.read_text().replace('"id": "recursion"', '"id": "renamed"'))  # same prompts, new ids
    with pytest.raises(ValueError, match=r"answered these prompts under other ids \(1 ids it does not know, "
                                         r"e.g. \['renamed'\]\)"):
        load_training_set(config, build_cache(config, target, tokenizer, progress=False))

def test_a_run_resumes_only_with_the_settings_it_was_started_with(tmp_path, tiny_parts, capsys):
    """Rerun with another learning rate, a killed run would go on as a hybrid of two runs, and with
    another drafter it would fail deep in orbax: both are refused, naming what changed, before
    anything is written. Where things go and what is logged may change, and more steps train on,
    saying so."""
    config, target, sequences = tiny_parts
    config = dataclasses.replace(config, out_dir=str(tmp_path / "run"), steps=6, checkpoint_every=2)
    assert train(config, target, sequences, stop_after=4, progress=False) is None
    for change, said in ((dict(learning_rate=1e-2), "learning_rate: 0.003 then, 0.01 now"),
                         (dict(drafter={**config.drafter, "markov_rank": 8}), "drafter.markov_rank: 16 then, 8 now")):
        with pytest.raises(ValueError, match=re.escape(f"was started with other settings ({said})")):
            train(dataclasses.replace(config, **change), target, sequences, progress=False)
    assert len(losses(config.out_dir)) == 4
    capsys.readouterr()
    train(dataclasses.replace(config, name="renamed", checkpoint_every=3, heldout_every=2, steps=7), target,
          sequences, progress=False)
    assert len(losses(config.out_dir)) == 7
    assert "renamed resumes at step 4 of 7, not of the 6 it started with" in capsys.readouterr().err
    # Before its first checkpoint a run has nothing to resume, so its settings may still change.
    fresh = dataclasses.replace(config, out_dir=str(tmp_path / "fresh"), steps=3)
    Trainer(fresh, target, sequences)
    train(dataclasses.replace(fresh, learning_rate=1e-2), target, sequences, progress=False)
    assert json.loads((tmp_path / "fresh" / "run.json").read_text())["learning_rate"] == 1e-2


def test_batches_are_a_function_of_the_step(tiny_parts):
    config, _, sequences = tiny_parts
    a, b = BatchSource(sequences, config), BatchSource(sequences, config)
    for step in (0, 7, 3):
        for x, y in zip(a.batch(step), b.batch(step)):
            np.testing.assert_array_equal(x, y)
    epoch = [a.rows(s) for s in range(a.steps_per_epoch)]
    assert sorted(np.concatenate(epoch).tolist()) == sorted(set(np.concatenate(epoch).tolist()))


def test_init_from_an_exported_drafter_starts_where_it_left_off(tmp_path, tiny_run, tiny_parts):
    config, target, sequences = tiny_parts
    first = losses(tiny_run)
    # Same seed, so without the warm start this run would repeat the first run's step-0 loss.
    leg = dataclasses.replace(config, out_dir=str(tmp_path / "leg"), steps=3, init_from=tiny_run / "drafter")  # a Path
    train(leg, target, sequences, progress=False)
    second = losses(tmp_path / "leg")
    assert second[0] < 0.7 * first[0] and second[0] < 1.3 * np.mean(first[-8:]), (first, second)


def test_init_from_refuses_a_drafter_that_is_not_the_configs(tmp_path, tiny_run, tiny_parts):
    config, target, sequences = tiny_parts
    other = dataclasses.replace(config, out_dir=str(tmp_path / "other"), init_from=str(tiny_run / "drafter"),
                                drafter={**config.drafter, "markov_rank": 8})
    with pytest.raises(ValueError, match="markov_rank"):
        train(other, target, sequences, progress=False)
    missing = dataclasses.replace(config, out_dir=str(tmp_path / "missing"), init_from=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="no exported drafter"):
        train(missing, target, sequences, progress=False)


def test_init_from_a_shallower_drafter_appends_identity_layers(tmp_path, tiny_run, tiny_parts):
    config, target, sequences = tiny_parts
    same = dataclasses.replace(config, out_dir=str(tmp_path / "same"), steps=2, init_from=tiny_run / "drafter")
    deeper = dataclasses.replace(same, out_dir=str(tmp_path / "deeper"), drafter={**config.drafter, "num_layers": 2})
    train(same, target, sequences, progress=False)
    grown = train(deeper, target, sequences, progress=False)
    assert grown.cfg.backbone.num_layers == 2
    # Step 0 scores the warm-started drafter before any update: the new layer adds nothing.
    # Step 1 comes after an update that moved the new layer.
    a, b = losses(tmp_path / "same"), losses(tmp_path / "deeper")
    np.testing.assert_allclose(b[0], a[0], rtol=1e-6)
    assert b[1] != a[1]


def test_init_from_a_narrower_vanilla_markov_head_widens_and_gates_it(tmp_path, tiny_run, tiny_parts):
    config, target, sequences = tiny_parts
    same = dataclasses.replace(config, out_dir=str(tmp_path / "same"), steps=2, init_from=tiny_run / "drafter")
    wider = dataclasses.replace(same, out_dir=str(tmp_path / "wider"),
                                drafter={**config.drafter, "markov_rank": 2 * config.drafter["markov_rank"],
                                         "markov_head": "gated"})
    train(same, target, sequences, progress=False)
    grown = train(wider, target, sequences, progress=False)
    assert grown.cfg.markov_rank == 2 * config.drafter["markov_rank"] and grown.cfg.markov_head == "gated"
    # Step 0 scores the warm-started drafter before any update: the new columns add nothing, and
    # the gate starts at ½ everywhere against a doubled W2.
    a, b = losses(tmp_path / "same"), losses(tmp_path / "wider")
    np.testing.assert_allclose(b[0], a[0], rtol=1e-6)
    assert b[1] != a[1]


def test_a_block_drafter_baseline_follows_each_legs_depth(tiny_parts):
    config, _, _ = tiny_parts
    second = next_leg(config, "tiny_second", drafter={**config.drafter, "num_layers": 2})
    assert second.init_from is config and second.out_dir == "runs/tiny_second" and second.steps == config.steps
    flash = same_legs(second, dict(kind="dflash", mask_token_id=0, block_size=4), ("tiny", "flash"))
    assert flash.name == "flash_second" and flash.drafter["num_layers"] == 2
    assert flash.init_from.drafter["num_layers"] == 1 and flash.init_from.drafter["kind"] == "dflash"
    eagle = same_legs(second, dict(kind="eagle3", mask_token_id=0, block_size=4), ("tiny", "eagle"))
    assert "num_layers" not in eagle.drafter and "num_layers" not in eagle.init_from.drafter
    with pytest.raises(ValueError, match="takes num_layers from each leg"):
        same_legs(second, dict(kind="dflash", num_layers=1, mask_token_id=0, block_size=4), ("tiny", "flash"))
    # The shipped DFlash baseline has the shipped DSpark drafter's depth in every leg.
    dspark, dflash = (load_config(REPO / "configs" / f"smollm2_135m_{k}.py") for k in ("dspark", "dflash"))
    assert len(dspark.legs) == len(dflash.legs) == 10
    for spark_leg, flash_leg in zip(dspark.legs, dflash.legs):
        assert flash_leg.drafter["num_layers"] == spark_leg.drafter.get("num_layers", 1), spark_leg.name


@pytest.mark.parametrize("steps, warmup", [(100, 4), (10, 1)])
def test_the_learning_rate_schedule_is_deepspecs(tiny_parts, steps, warmup):
    """Warm-up step t at (t + 1)/W of the peak (the peak itself at W − 1), then a cosine from the
    peak at W to 0 (``deepspec/utils/optim.py``)."""
    config = dataclasses.replace(tiny_parts[0], steps=steps, learning_rate=2e-3)
    t = np.arange(steps)
    cosine = 0.5 * (1 + np.cos(np.pi * (t - warmup) / (steps - warmup)))
    expected = 2e-3 * np.where(t < warmup, (t + 1) / warmup, cosine)
    np.testing.assert_allclose([float(schedule(config)(i)) for i in t], expected, rtol=1e-5, atol=2e-9)  # float32


def test_a_baseline_follows_each_legs_qk_norm(tiny_parts):
    config, target, _ = tiny_parts
    normed = dataclasses.replace(config, drafter={**config.drafter, "qk_norm": True})
    for kind in ("dflash", "eagle3"):
        baseline = same_legs(next_leg(normed, "tiny_second"), dict(kind=kind, mask_token_id=0, block_size=4),
                             ("tiny", "base"))
        assert [leg.drafter["qk_norm"] for leg in baseline.legs] == [True, True]
        assert drafter_config(baseline, target.cfg).backbone.qk_norm is True
        with pytest.raises(ValueError, match="takes qk_norm"):
            same_legs(normed, dict(kind=kind, mask_token_id=0, block_size=4, qk_norm=False), ("tiny", "base"))
    # Left unset, a drafter has QK-norm where its target has (this one has none).
    assert not target.cfg.qk_norm and not drafter_config(config, target.cfg).backbone.qk_norm


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_the_shipped_configs_describe_the_shipped_drafters(kind, embedded_target):
    """A shipped config's last leg builds the drafter in the package (its qk_norm included), so
    the next leg started from it is not refused by ``warm_start``."""
    config = load_config(REPO / "configs" / f"smollm2_135m_{kind}.py")
    shipped = json.loads((REPO / "dspark_jax" / "drafters" / f"smollm2_135m_{kind}" / "config.json").read_text())
    cfg = drafter_config(config, embedded_target[0].cfg)
    assert cfg.to_dict() == DrafterConfig.from_dict(shipped["drafter"]).to_dict()


def test_a_drafter_started_from_target_layers_copies_them_and_trains(tmp_path, tiny_parts):
    """``target_init_layers``: the drafter's layer is the target's, its context rows start as the
    last tap under that layer's input norm, its final norm is the target's; every parameter is its
    own buffer (the step donates them), so it trains."""
    config, target, sequences = tiny_parts
    config = dataclasses.replace(config, out_dir=str(tmp_path / "copied"), steps=2, heldout_prompts=0,
                                 target_init_layers=(1,))
    with pytest.raises(ValueError, match="has no QK-norm: set the drafter's qk_norm=False"):
        Trainer(dataclasses.replace(config, drafter={**config.drafter, "qk_norm": True}), target, sequences)
    trainer = Trainer(config, target, sequences)
    drafter = nnx.merge(trainer.graphdef, trainer.params, trainer.rest)
    layer, source = drafter.backbone.layers[0], target.module().layers[1]
    np.testing.assert_array_equal(np.concatenate([layer.q.weight[...], layer.kv.weight[...]]), source.attn.qkv.weight[...])
    for mine, theirs in ((layer.o, source.attn.o), (layer.mlp.gate_up, source.mlp.gate_up), (layer.mlp.down, source.mlp.down),
                         (layer.input_norm, source.input_norm), (layer.post_attn_norm, source.post_attn_norm),
                         (drafter.backbone.final_norm, target.module().final_norm)):
        np.testing.assert_array_equal(mine.weight[...], theirs.weight[...])
    d = target.cfg.hidden_size
    features = jax.random.normal(jax.random.key(0), (5, drafter.cfg.context_size))
    np.testing.assert_allclose(drafter.backbone.project_context(features), source.input_norm(features[:, -d:]), rtol=1e-5)
    train_together([trainer], progress=False)
    assert len(losses(config.out_dir)) == 2 and np.isfinite(losses(config.out_dir)).all()


def test_target_init_layers_are_checked_and_pass_to_block_baselines_only(tiny_parts):
    config, target, sequences = tiny_parts
    copied = dataclasses.replace(config, target_init_layers=(1,))
    with pytest.raises(ValueError, match="set one of them"):
        dataclasses.replace(copied, init_from="runs/elsewhere")
    with pytest.raises(ValueError, match="EAGLE-3"):
        dataclasses.replace(copied, drafter=dict(kind="eagle3", mask_token_id=0, block_size=4))
    with pytest.raises(ValueError, match="one per drafter layer"):
        dataclasses.replace(config, target_init_layers=(0, 1))
    with pytest.raises(ValueError, match="outside the target's layers"):
        Trainer(dataclasses.replace(config, target_init_layers=(target.cfg.num_layers,)), target, sequences)
    assert next_leg(copied, "tiny_second").target_init_layers is None  # a later leg starts from a drafter
    flash = same_legs(copied, dict(kind="dflash", mask_token_id=0, block_size=4), ("tiny", "flash"))
    eagle = same_legs(copied, dict(kind="eagle3", mask_token_id=0, block_size=4), ("tiny", "eagle"))
    assert flash.target_init_layers == (1,) and eagle.target_init_layers is None


def test_the_accelerator_configs_can_train_under_one_budget():
    """The three accelerator configs pass run_budgeted's checks: the same data and batches, a
    cache of token ids, the shipped drafters' shapes, no earlier leg to train first."""
    spark, flash, eagle = (load_config(REPO / "configs" / f"smollm2_135m_accel_{k}.py") for k in ("dspark", "dflash", "eagle3"))
    for config in (flash, eagle):
        assert [f for f in SHARED_FIELDS if getattr(config, f) != getattr(spark, f)] == [], config.name
    assert not spark.cache.store_features and spark.init_from is None
    shipped = load_config(REPO / "configs" / "smollm2_135m_dspark.py")
    assert spark.drafter == shipped.drafter and flash.drafter["num_layers"] == shipped.drafter["num_layers"]
    assert [c.kind for c in (spark, flash, eagle)] == ["dspark", "dflash", "eagle3"]
    assert all(c.target_init_layers is None for c in (spark, flash, eagle))  # docs/TRAINING.md says why
    assert len({c.out_dir for c in (spark, flash, eagle)}) == 3


def test_init_from_a_config_trains_that_leg_first(tmp_path, tiny_parts):
    config, _, _ = tiny_parts
    first = dataclasses.replace(config, out_dir=str(tmp_path / "first"), cache_dir=str(config.cache_path), steps=2)
    second = dataclasses.replace(first, out_dir=str(tmp_path / "second"), init_from=first, seed=7)
    exported = run(second, progress=False)
    assert len(losses(tmp_path / "first")) == 2 and len(losses(tmp_path / "second")) == 2
    meta = json.loads((exported / "config.json").read_text())["metadata"]
    assert meta["init_from"] == str(tmp_path / "first" / "drafter")


def test_eight_device_data_parallel_equals_one_device(tiny_parts):
    """The same steps on a 1-device and an 8-device mesh (simulated CPU devices, fresh process),
    from a cache with features and from one of token ids alone; and the batch stays split by
    rows: neither the target's forward over token ids nor the step gathers rows across devices."""
    config, _, _ = tiny_parts
    script = textwrap.dedent(f"""
        import dataclasses, json, sys
        import jax
        import numpy as np
        assert len(jax.devices()) == 8, jax.devices()
        from tests.multidevice import collectives
        from dspark_jax.checkpoints.gguf import load_embedded_target
        from dspark_jax.training.target_cache import load_target_cache
        from dspark_jax.training.train import LOG_FILE, Trainer, load_config, train
        config = load_config({str(TINY)!r})
        config = dataclasses.replace(config, cache_dir={str(config.cache_path)!r}, steps=3, batch_size=8)
        target = load_embedded_target()[0].truncated(config.target_layers)
        cached = load_target_cache(config.cache_path)
        # From token ids alone the target computes the features in the step, sharded by rows too.
        online = dataclasses.replace(config, cache=dataclasses.replace(config.cache, store_features=False))
        ids_only = [dataclasses.replace(s, features=None, hidden=None, lse=None) for s in cached]
        curves = {{}}
        for name, base, sequences in (("cached", config, cached), ("online", online, ids_only)):
            for devices in (1, 8):
                run = dataclasses.replace(base, out_dir=sys.argv[1] + f"/{{name}}{{devices}}", data_parallel=devices)
                train(run, target, sequences, progress=False)
                curves[f"{{name}}{{devices}}"] = [json.loads(l)["loss"] for l in open(run.out_dir + "/" + LOG_FILE)]
        trainer = Trainer(dataclasses.replace(online, out_dir=sys.argv[1] + "/hlo", data_parallel=8), target, ids_only)
        rows = jax.device_put(trainer.source.batch(0), trainer.by_row)
        batch = trainer.complete(trainer.target_params, rows)
        programs = {{"complete": trainer.complete.lower(trainer.target_params, rows),
                    "step": trainer.step_fn.lower(trainer.params, trainer.opt_state, trainer.rest, batch,
                                                  trainer.embed, trainer.head, np.float32(1e-3))}}
        gathers = {{name: sum(" all-gather" in line for line in collectives(lowered))
                   for name, lowered in programs.items()}}
        print(json.dumps({{"curves": curves, "all_gathers": gathers}}))
    """)
    report = run_on_eight_devices(script, str(Path(config.out_dir).parent / "dp"))
    # Each device works on its own rows: gathering them everywhere would repeat the target's
    # forward (and its [S, V] logsumexp) for the whole batch on every device.
    assert report["all_gathers"] == {"complete": 0, "step": 0}, report["all_gathers"]
    curves = {k: np.asarray(v) for k, v in report["curves"].items()}
    assert len(curves["cached1"]) == 3
    # Same math, different reduction order across devices: float32 rounding only.
    np.testing.assert_allclose(curves["cached8"], curves["cached1"], rtol=1e-5)
    np.testing.assert_allclose(curves["online8"], curves["online1"], rtol=1e-5)
    # Before any update, token ids give the cache's loss (test_training_on_token_ids_...); after
    # it, features a bf16 step apart here and there make the two runs drift apart slowly.
    np.testing.assert_allclose(curves["online1"][0], curves["cached1"][0], rtol=1e-5)


@pytest.mark.slow  # about 90 s; in CI: two processes in a budgeted run (below), 8 devices in one process (above)
def test_two_processes_split_the_cache_and_train_as_one_device_does(tmp_path, tiny_parts):
    """`dspark train` run by two processes joined as one multi-host run (2 simulated CPU devices
    each). Each answers its own shard of the target cache, which then holds the 1-process cache's
    answers. They train as one 4-device mesh: 2 steps, then a rerun resumed to 4 from the
    checkpoint, with one log and one exported drafter, and the loss curve is that of 4 steps
    without a stop on one device, to float32 rounding."""
    config, target, reference = tiny_parts
    out = tmp_path / "hosts"
    args = ["-m", "dspark_jax.cli", "train", "--config", str(TINY), "--out-dir", str(out)]
    printed = run_processes([*args, "--steps", "2"])
    assert ["drafter written to" in out for out, _ in printed] == [True, False]  # the lead reports
    assert len(losses(out)) == 2
    run_processes([*args, "--steps", "4"])

    shards = sorted((out / "cache").glob("shard-*.json"))
    assert [json.loads(path.read_text())["process"] for path in shards] == [0, 1]
    cached = load_target_cache(out / "cache")
    assert [s.name for s in cached] == [s.name for s in reference]
    _, head = target.embedding_and_head(target.params)
    for got, want in zip(cached, reference):
        np.testing.assert_array_equal(got.input_ids, want.input_ids)
        # Two devices per process, one in the reference: rows' float32 sums round differently.
        assert_same_stored_arrays((got.features, got.hidden, got.lse), (want.features, want.hidden, want.lse), head)

    one = dataclasses.replace(config, out_dir=str(tmp_path / "one"), cache_dir=str(out / "cache"), data_parallel=1,
                              steps=4)
    train(one, target, cached, progress=False)  # without held-out tau, which the losses do not depend on
    assert len(losses(out)) == 4
    np.testing.assert_allclose(losses(out), losses(one.out_dir), rtol=1e-5)
    records = [json.loads(line) for line in (out / LOG_FILE).read_text().splitlines()]
    assert "heldout_tau" in records[-1]
    exported = load_drafter(out / "drafter", target=target)
    assert exported.cfg.block_size == config.drafter["block_size"]
    assert json.loads((out / "drafter" / "config.json").read_text())["metadata"]["steps"] == 4


def test_two_processes_follow_the_lead_process_budget_and_deadline(tmp_path, tiny_parts):
    """A budgeted run by two processes whose own timings and clocks disagree: the other process
    times a step 30 times faster than the lead and its clock passes the deadline after the first
    step. Steps run on every process's devices, so a process that planned or stopped on its own
    would leave the other waiting for it; both follow the lead's plan and clock to the end."""
    config, _, _ = tiny_parts
    script = textwrap.dedent(f"""
        import dataclasses, json, sys, time
        from dspark_jax import multihost
        flags = dict(zip(sys.argv[2::2], sys.argv[3::2]))
        multihost.initialize(flags["--coordinator"], int(flags["--num-processes"]), int(flags["--process-id"]))
        import jax
        from dspark_jax.training import train as train_module
        from dspark_jax.training.train import Trainer, load_config, run_budgeted
        lead = multihost.is_lead()
        Trainer.step_seconds = lambda self, batch, repeats=3: 30.0 if lead else 1.0
        Trainer.batch_seconds = lambda self, repeats=3: 10.0
        steps_taken = []
        step = Trainer.step
        def counted(self, *args, **kwargs):
            steps_taken.append(1)
            return step(self, *args, **kwargs)
        Trainer.step = counted
        class Clock:
            def monotonic(self):
                return time.monotonic() + (0 if lead or not steps_taken else 1e6)
            def __getattr__(self, name):
                return getattr(time, name)
        train_module.time = Clock()
        config = dataclasses.replace(load_config({str(TINY)!r}), name="tiny_budget", out_dir=sys.argv[1],
                                     cache_dir={str(config.cache_path)!r}, heldout_prompts=0)
        run_budgeted([config], 600.0, data_fraction=0.5, margin=0.0, progress=False)
        print(json.dumps({{"steps_taken": len(steps_taken)}}))
    """)
    out = tmp_path / "budget"
    reports = [json.loads(text.strip().splitlines()[-1]) for text, _ in run_processes(["-c", script, str(out)])]
    plan = json.loads((out / BUDGET_FILE).read_text())
    assert plan["step_seconds"] == {"tiny_budget": 30.0}  # the lead's timing
    assert plan["steps"] == int((600.0 - plan["planned_after_s"]) / 40.0) > 1
    assert [r["steps_taken"] for r in reports] == [plan["steps"]] * 2
    assert len(losses(out)) == plan["steps"]


def test_eight_device_cache_equals_one_device_and_each_device_answers_its_own_rows(tmp_path):
    """The target cache written on an 8-device mesh (simulated CPU devices, fresh process; a shard
    of 12 prompts through 8 rows, refilled as answers finish) holds the 1-device cache's answers,
    and its arrays to float rounding; the compiled prefill, decode step and stored-array pass have
    no collective at all (sampling included: ``lax.top_k`` on a row-split batch would gather every
    row's logits everywhere); a batch that cannot split is refused by name."""
    script = textwrap.dedent("""
        import json, sys
        import jax, jax.numpy as jnp
        import numpy as np
        from jax.sharding import Mesh
        assert len(jax.devices()) == 8, jax.devices()
        from tests.multidevice import collectives, value_errors
        from tests.refills import counting_refills
        from dspark_jax.sampling import SamplingParams, request_keys
        from dspark_jax.training.target_cache import CacheSpec, TargetCacheWriter, load_target_cache
        from tests.tiny import tiny_target
        # A vocabulary above TOP_CANDIDATES, so top-k/top-p take their partial-sort path.
        target = tiny_target(vocab_size=300)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(1, 300, size=n).tolist() for n in rng.integers(3, 24, size=12)]
        names = [f"p{i}" for i in range(12)]
        spec = CacheSpec(tap_layers=(0, 1), max_new_tokens=16, max_prompt_tokens=32, temperature=0.7,
                         top_p=0.8, top_k=20, shard_size=12, batch_size=8, min_response_tokens=1,
                         continuous=True)
        mesh = Mesh(np.asarray(jax.devices()), ("data",))
        # Stop ids the answers use, so that answers end at different steps and rows are refilled.
        writers = {name: TargetCacheWriter(target, spec, sys.argv[1] + "/" + name, stop_ids=[2, 36, 138], mesh=m)
                   for name, m in (("one", None), ("eight", mesh))}
        inserts = counting_refills(writers["eight"].generator)
        caches = {}
        for name, writer in writers.items():
            writer.build(prompts, names, progress=False)
            caches[name] = [{k: np.asarray(getattr(s, k), np.float32).tolist() for k in ("input_ids", "features", "hidden", "lse")}
                            for s in load_target_cache(writer.dir)]
        g = writers["eight"].generator
        cache = g.new_cache(8, writers["eight"].max_len)
        params, keys, tokens, lens = g.on_rows((SamplingParams.broadcast(spec.sampling, 8), request_keys(range(8)),
                                                jnp.zeros((8, 32), jnp.int32), jnp.ones((8,), jnp.int32)))
        taps = g.on_rows(jnp.zeros((writers["eight"].store_rows, 3 * target.cfg.hidden_size)))
        programs = {"prefill": g._prefill.lower(g.params, cache, tokens, lens, keys, params),
                    "decode": g._decode_step.lower(g.params, cache, tokens[:, 0], lens > 0, lens, keys, params),
                    "stored": writers["eight"].stored_arrays.lower(g.params, taps)}
        counts = {k: len(collectives(p)) for k, p in programs.items()}
        from dspark_jax.training import train
        tiny = train.load_config("configs/tiny_test.py")
        train.load_target = None  # a run whose batches cannot split is refused before loading anything
        errors = value_errors(lambda: TargetCacheWriter(target, dataclasses_replace(spec, batch_size=6), sys.argv[1] + "/x",
                                                        stop_ids=[2], mesh=mesh),
                              lambda: g.generate(prompts[:3], max_new_tokens=4),
                              lambda: train.run(dataclasses_replace(tiny, batch_size=4, out_dir=sys.argv[1] + "/run")),
                              lambda: train.run_budgeted([dataclasses_replace(tiny, batch_size=4, out_dir=sys.argv[1] + "/b")], 60))
        print(json.dumps({"caches": caches, "collectives": counts, "errors": errors, "inserts": inserts}))
    """).replace("dataclasses_replace", "__import__('dataclasses').replace")
    report = run_on_eight_devices(script, str(tmp_path))
    assert report["collectives"] == {"prefill": 0, "decode": 0, "stored": 0}, report["collectives"]
    assert report["inserts"] and set(report["inserts"]) == {8}, "refills of one row per device"
    one, eight = report["caches"]["one"], report["caches"]["eight"]
    assert len(one) == len(eight) == 12
    small = tiny_target(vocab_size=300)  # the subprocess's target: seeded, so the same weights
    _, head = small.embedding_and_head(small.params)
    for a, b in zip(one, eight):
        # Per-request seeds: a request's answer does not depend on how its batch is split.
        assert a["input_ids"] == b["input_ids"]
        # Each device multiplies its own rows: float32 sums round differently, then bf16 storage.
        stored = ("features", "hidden", "lse")
        assert_same_stored_arrays([b[k] for k in stored], [a[k] for k in stored], head)
    not_divisible, not_split, run_not_divisible, budget_not_divisible = report["errors"]
    assert not_divisible is not None and "batch_size 6 is not divisible by the mesh's 8" in not_divisible
    assert not_split is not None and "a batch of 3 requests does not split" in not_split
    for message in (run_not_divisible, budget_not_divisible):
        assert message is not None and message.startswith("batch_size 4 is not divisible by the 8 data-parallel "
                                                          "devices: train on a number of devices that divides it")
    assert not (tmp_path / "run").exists() and not (tmp_path / "b").exists()


def test_a_damaged_cache_shard_is_named_with_the_remedy(tmp_path, six_prompts):
    """Truncated tensors, garbled metadata and names that no longer match the offsets stop the
    read with the shard named (before, a traceback without a path, or training on sequences
    shifted by one name)."""
    prompts, names, _, writer = six_prompts
    writer(tmp_path / "cache").build(prompts, names, progress=False)
    assert len(load_target_cache(tmp_path / "cache")) == 6
    stem = tmp_path / "cache" / "shard-00001"
    tensors, meta = stem.with_suffix(".safetensors"), stem.with_suffix(".json")
    good_tensors, good_meta = tensors.read_bytes(), json.loads(meta.read_text())

    def damaged(message):
        with pytest.raises(ValueError, match=message):
            load_target_cache(tmp_path / "cache")
        tensors.write_bytes(good_tensors)
        meta.write_text(json.dumps(good_meta))

    tensors.write_bytes(good_tensors[: len(good_tensors) // 2])
    damaged(rf"{stem}.safetensors is damaged .*; delete {stem}\.\* and rerun to rebuild the shard")
    meta.write_text(json.dumps(good_meta)[:-3])
    damaged(rf"{stem}.json is not valid JSON")
    for edit in ({"prompt_names": good_meta["prompt_names"][:1], "dropped": [{"name": "p3", "response_tokens": 1}]},
                 {"prompt_names": good_meta["prompt_names"] + ["p9"]}):
        meta.write_text(json.dumps({**good_meta, **edit}))
        damaged(rf"{stem} is damaged: .*(offsets do not delimit|one response_tokens each)")
    arrays = safetensors.numpy.load_file(str(tensors))
    safetensors.numpy.save_file({**arrays, "lse": arrays["lse"][:-1]}, str(tensors))
    damaged(rf"{stem} is damaged: its offsets do not delimit its prompts' tokens")


def test_cache_specs_take_exact_ints_and_no_final_layer_tap(tiny_parts):
    _, target, _ = tiny_parts
    for bad, message in (({"tap_layers": (0.9,)}, "every entry of CacheSpec.tap_layers must be an int, got 0.9"),
                         ({"tap_layers": (0,), "shard_size": 2.5}, "CacheSpec.shard_size must be an int, got 2.5"),
                         ({"tap_layers": (0,), "seed": "1"}, "CacheSpec.seed must be an int, got '1'")):
        with pytest.raises(ValueError, match=re.escape(message)):
            CacheSpec(**bad)
    final = target.cfg.num_layers - 1
    with pytest.raises(ValueError, match=f"tap layer {final} is the target's final layer"):
        TargetCacheWriter(target, CacheSpec(tap_layers=(final,)), "unused", stop_ids=[0])
