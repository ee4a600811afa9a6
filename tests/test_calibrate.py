"""Calibrating the confidence head: both methods recover a known miscalibration and lower the ECE;
only a bias removes an offset, and the fit holds on held-out rounds."""

import json
from pathlib import Path

import numpy as np
import pytest

from dspark_jax.config import SamplingConfig
from dspark_jax.scheduler.prefix import Calibration
from dspark_jax.training.calibrate import (
    calibrated,
    ece,
    fit_calibration,
    log_loss,
    prefix_labels,
    read_calibrations,
    save_calibration,
)


def test_ece_of_perfect_and_of_overconfident_predictions():
    rng = np.random.default_rng(0)
    p = rng.uniform(size=200000)
    assert ece(p, rng.uniform(size=p.size) < p) < 0.01
    assert ece(np.full(1000, 0.9), np.zeros(1000, bool)) == pytest.approx(0.9)
    assert log_loss(np.full(4, 0.5), np.array([0, 1, 0, 1])) == pytest.approx(np.log(2))


def test_prefix_labels():
    np.testing.assert_array_equal(prefix_labels(np.array([0, 2, 3]), 3), [[0, 0, 0], [1, 1, 0], [1, 1, 1]])


def _rounds(rng, n, true_temperatures, true_biases=None):
    """Rounds whose confidence logits are off by a known per-position temperature (and bias): the
    true conditional survival is σ(z_k / T_k + b_k); accepted = the first failure."""
    gamma = len(true_temperatures)
    biases = np.zeros(gamma) if true_biases is None else np.asarray(true_biases)
    z = rng.normal(1.0, 2.0, (n, gamma))
    survives = rng.uniform(size=(n, gamma)) < 1 / (1 + np.exp(-(z / np.asarray(true_temperatures) + biases)))
    accepted = np.cumprod(survives, axis=1).sum(1)
    return z, accepted


def _held_out_ece(rng, truth, biases, fitted):
    z, accepted = _rounds(rng, 60000, truth, biases)
    survival, labels = calibrated(z, fitted["temperatures"], fitted["biases"]), prefix_labels(accepted, len(truth))
    return max(ece(survival[:, k], labels[:, k]) for k in range(len(truth)))


@pytest.mark.parametrize("method", ["platt", "sts"])
def test_both_methods_recover_temperatures_and_lower_the_ece(method):
    rng = np.random.default_rng(1)
    truth = [2.0, 0.5, 1.0, 3.0]
    fitted = fit_calibration(*_rounds(rng, 60000, truth), method)
    assert fitted["method"] == method
    np.testing.assert_allclose(fitted["temperatures"], truth, rtol=0.15)
    np.testing.assert_allclose(fitted["biases"], 0.0, atol=0.1 if method == "platt" else 0.0)
    assert all(after < before for after, before in zip(fitted["ece_after"][:2], fitted["ece_before"][:2]))
    assert max(fitted["ece_after"]) < 0.01
    assert _held_out_ece(rng, truth, None, fitted) < 0.015  # rounds from the same process stay calibrated


def test_only_a_bias_removes_an_offset():
    """A head over-confident by an offset (as the shipped one is on answers sampled at T = 1): a
    temperature cannot fix it, Platt scaling recovers the bias, and its log loss is lower."""
    rng = np.random.default_rng(3)
    truth, biases = [1.0, 1.5, 0.8], [-1.0, -0.5, 0.7]
    z, accepted = _rounds(rng, 60000, truth, biases)
    platt, sts = fit_calibration(z, accepted, "platt"), fit_calibration(z, accepted, "sts")
    np.testing.assert_allclose(platt["temperatures"], truth, rtol=0.15)
    np.testing.assert_allclose(platt["biases"], biases, atol=0.15)
    assert _held_out_ece(rng, truth, biases, platt) < 0.015 < _held_out_ece(rng, truth, biases, sts)
    assert sum(platt["log_loss_after"]) < sum(sts["log_loss_after"])
    assert all(after < before for after, before in zip(platt["log_loss_after"], platt["log_loss_before"]))


def test_a_fit_at_the_end_of_its_grid_is_marked():
    """A best bias beyond the bias grid is clamped to its end; the fit says which positions."""
    rng = np.random.default_rng(4)
    z, accepted = _rounds(rng, 20000, [1.0, 1.0], [0.0, 2.0])
    assert fit_calibration(z, accepted)["at_grid_edge"] == []
    narrow = fit_calibration(z, accepted, bias_grid=np.linspace(-1.0, 1.0, 81))
    assert narrow["at_grid_edge"] == [2] and narrow["biases"][1] == 1.0
    assert fit_calibration(z, accepted, grid=np.geomspace(2.0, 4.0, 31))["at_grid_edge"] == [1, 2]


def test_calibration_file_round_trip_and_errors(tmp_path):
    fitted = fit_calibration(*_rounds(np.random.default_rng(2), 2000, [1.0, 1.0]))
    greedy, t1, t07 = SamplingConfig(), SamplingConfig(temperature=1.0), SamplingConfig(0.7, top_k=20, top_p=0.8)
    save_calibration(tmp_path, fitted, greedy, drafter="x")
    fit = (tuple(fitted["temperatures"]), tuple(fitted["biases"]))
    assert read_calibrations(tmp_path) == (Calibration(*fit, greedy),)
    # One fit per sampling setting: a second setting is added, the same setting replaced.
    save_calibration(tmp_path, fitted, t1)
    save_calibration(tmp_path, {**fitted, "biases": [0.5, 0.5]}, t07)
    save_calibration(tmp_path, {**fitted, "biases": [0.25, 0.25]}, t07)
    assert read_calibrations(tmp_path) == (Calibration(*fit, greedy), Calibration(*fit, t1),
                                           Calibration(fit[0], (0.25, 0.25), t07))
    body = json.loads((tmp_path / "calibration.json").read_text())
    assert set(body) == {"greedy", "sampled"} and len(body["sampled"]) == 2 and body["greedy"]["drafter"] == "x"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["calibration.json"]  # no partial file left
    with pytest.raises(ValueError, match="nowhere is not a directory"):
        save_calibration(tmp_path / "nowhere", fitted, greedy)
    assert read_calibrations(tmp_path / "nowhere") == ()
    # Files from before: one sampled entry (a dict), entries without biases (the paper's STS) or
    # without the sampling they were fitted on (greedy's is greedy; a sampled one serves any).
    (tmp_path / "calibration.json").write_text(json.dumps({
        "greedy": {"temperatures": [1.0, 2.0]},
        "sampled": {"temperatures": [3.0, 1.0], "biases": [0.1, 0.2]}}))
    assert read_calibrations(tmp_path) == (Calibration((1.0, 2.0), (0.0, 0.0), greedy), Calibration((3.0, 1.0), (0.1, 0.2)))
    for body, message in [
        ({"greedy": {"temperatures": [1.0, -2.0]}}, "positive numbers"),
        ({"greedy": {"temperatures": [1.0], "biases": [0, 1]}}, "list of 1 finite numbers"),
        ({"sampled": [{"temperatures": [1.0], "sampling": {"temperature": 1.0, "top_q": 3}}]}, "not a sampling setting"),
        ({"sampled": [{"temperatures": [1.0], "sampling": {"temperature": 0.0}}]}, "fitted on greedy decoding"),
        ([1, 2], "not a calibration file"),
    ]:
        (tmp_path / "calibration.json").write_text(json.dumps(body))
        with pytest.raises(ValueError, match=message):
            read_calibrations(tmp_path)
    # A fit replaces the one for the same setting however that one's sampling was written.
    (tmp_path / "calibration.json").write_text(json.dumps({"sampled": [
        {"temperatures": [1.0, 1.0], "sampling": {"temperature": 1.0}},
        {"temperatures": [1.0, 1.0], "sampling": {"temperature": 0.7, "top_k": 20, "top_p": 0.8}}]}))
    save_calibration(tmp_path, {**fitted, "biases": [0.5, 0.5]}, t1)
    assert read_calibrations(tmp_path) == (Calibration((1.0, 1.0), (0.0, 0.0), t07), Calibration(fit[0], (0.5, 0.5), t1))
    (tmp_path / "calibration.json").write_text(json.dumps({"sampled": [
        {"temperatures": [1.0], "sampling": {"temperature": 1.0}},
        {"temperatures": [2.0], "sampling": {"temperature": 1.0, "top_k": 0}}]}))
    with pytest.raises(ValueError, match=r"calibration.json holds two fits for T=1: keep one"):
        read_calibrations(tmp_path)
    (tmp_path / "calibration.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match="calibration.json is not a calibration file"):
        read_calibrations(tmp_path)
    with pytest.raises(ValueError, match="no rounds"):
        fit_calibration(np.zeros((0, 3)), np.zeros(0))
    with pytest.raises(ValueError, match="calibration method"):
        fit_calibration(np.zeros((1, 3)), np.zeros(1), "isotonic")



def test_collecting_rounds_needs_a_round_that_drafted():
    from flax import nnx

    from dspark_jax.config import DrafterConfig
    from dspark_jax.decoding.speculative import FixedPolicy, SpeculativeDecoder
    from dspark_jax.drafter.model import Drafter
    from dspark_jax.training.calibrate import collect_rounds
    from tests.tiny import sharp_tiny_target

    target = sharp_tiny_target()
    cfg = DrafterConfig.for_target(target.cfg, num_layers=1, tap_layers=(0, 2), mask_token_id=5, block_size=3,
                                   markov_rank=4)
    decoder = SpeculativeDecoder(target, Drafter(cfg, rngs=nnx.Rngs(1)), policy=FixedPolicy(3))
    prompts = [[3, 1, 4], [2, 7]]
    logits, accepted = collect_rounds(decoder, prompts, max_new_tokens=8, sampling=SamplingConfig(), progress=False)
    assert logits.shape[1] == 3 and len(logits) == len(accepted) > 0
    with pytest.raises(ValueError, match="no round drafted in 2 prompts of at most 1 new tokens"):
        collect_rounds(decoder, prompts, max_new_tokens=1, sampling=SamplingConfig(), progress=False)

def test_heldout_prompts_leave_out_what_a_config_trained_on():
    from dspark_jax.training.calibrate import heldout_prompt_texts
    from dspark_jax.training.data import normalise_text
    from dspark_jax.training.train import load_config, training_prompts

    config = Path(__file__).parents[1] / "configs" / "tiny_test.py"
    trained = {normalise_text(p.text) for p in training_prompts(load_config(config))}
    plain = heldout_prompt_texts(64, seed=0)
    assert len(plain) == 64 and {normalise_text(t) for t in plain} <= trained  # the config's own seed: its prompts
    fresh = heldout_prompt_texts(8, seed=1000, exclude_configs=[config])
    assert len(fresh) == 8 and not {normalise_text(t) for t in fresh} & trained
    assert fresh == heldout_prompt_texts(8, seed=1000, exclude_configs=[config])  # reproducible
    with pytest.raises(ValueError, match="only 0 of 64 generated prompts are untrained by .*tiny_test.py"):
        heldout_prompt_texts(16, seed=0, exclude_configs=[config])


def test_a_fit_belongs_to_the_weights_it_was_made_on(tmp_path):
    """A drafter trained or saved again with other weights in the same directory makes its
    calibration.json stale: read, it is refused by name; the next fit drops it. The same weights
    saved again keep their id, and the fit stays theirs."""
    from dspark_jax.checkpoints.drafter import build_drafter, drafter_weights_id, save_drafter
    from tests.test_drafter_checkpoints import configs

    cfg = configs()["dflash"]
    save_drafter(build_drafter(cfg, seed=1), tmp_path)
    fitted = fit_calibration(*_rounds(np.random.default_rng(3), 2000, [1.0, 1.0, 1.0]))
    greedy, t1 = SamplingConfig(), SamplingConfig(temperature=1.0)
    for sampling in (greedy, t1):
        save_calibration(tmp_path, fitted, sampling, weights_id=drafter_weights_id(tmp_path))
    both = read_calibrations(tmp_path)
    assert len(both) == 2
    save_drafter(build_drafter(cfg, seed=1), tmp_path, metadata={"saved": "again"})
    assert read_calibrations(tmp_path) == both
    save_drafter(build_drafter(cfg, seed=2), tmp_path)  # retrained
    with pytest.raises(ValueError, match=r"calibration.json: a greedy fit was made on other weights .* run dspark "
                                         "calibrate again"):
        read_calibrations(tmp_path)
    assert read_calibrations(tmp_path, stale_ok=True) == ()
    save_calibration(tmp_path, {**fitted, "biases": [0.5] * 3}, t1, weights_id=drafter_weights_id(tmp_path))
    assert [(c.sampling, c.biases) for c in read_calibrations(tmp_path)] == [(t1, (0.5,) * 3)]
