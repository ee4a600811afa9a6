"""Sequential temperature scaling: the fit recovers a known miscalibration and lowers the ECE."""

import json

import numpy as np
import pytest

from dspark_jax.training.calibrate import (
    ece,
    fit_sts,
    prefix_labels,
    read_temperatures,
    save_calibration,
)


def test_ece_of_perfect_and_of_overconfident_predictions():
    rng = np.random.default_rng(0)
    p = rng.uniform(size=200000)
    assert ece(p, rng.uniform(size=p.size) < p) < 0.01
    assert ece(np.full(1000, 0.9), np.zeros(1000, bool)) == pytest.approx(0.9)


def test_prefix_labels():
    np.testing.assert_array_equal(prefix_labels(np.array([0, 2, 3]), 3), [[0, 0, 0], [1, 1, 0], [1, 1, 1]])


def _rounds(rng, n, true_temperatures):
    """Rounds whose confidence logits are off by a known per-position temperature: the true
    conditional survival is σ(z_k / T_k); accepted = the first failure."""
    gamma = len(true_temperatures)
    z = rng.normal(1.0, 2.0, (n, gamma))
    survives = rng.uniform(size=(n, gamma)) < 1 / (1 + np.exp(-z / np.asarray(true_temperatures)))
    accepted = np.cumprod(survives, axis=1).sum(1)
    return z, accepted


def test_fit_recovers_the_temperatures_and_lowers_the_ece():
    rng = np.random.default_rng(1)
    truth = [2.0, 0.5, 1.0, 3.0]
    z, accepted = _rounds(rng, 60000, truth)
    fitted = fit_sts(z, accepted)
    np.testing.assert_allclose(fitted["temperatures"], truth, rtol=0.15)
    assert all(after < before for after, before in zip(fitted["ece_after"][:2], fitted["ece_before"][:2]))
    assert max(fitted["ece_after"]) < 0.01
    # Held-out rounds from the same process: the fitted temperatures stay calibrated.
    z2, accepted2 = _rounds(rng, 60000, truth)
    survival = np.cumprod(1 / (1 + np.exp(-z2 / np.asarray(fitted["temperatures"]))), axis=1)
    labels = prefix_labels(accepted2, len(truth))
    assert max(ece(survival[:, k], labels[:, k]) for k in range(len(truth))) < 0.015


def test_calibration_file_round_trip_and_errors(tmp_path):
    fitted = fit_sts(*_rounds(np.random.default_rng(2), 2000, [1.0, 1.0]))
    save_calibration(tmp_path, "greedy", fitted, drafter="x")
    assert read_temperatures(tmp_path, "greedy") == fitted["temperatures"]
    assert read_temperatures(tmp_path, "sampled") is None
    save_calibration(tmp_path, "sampled", fitted)
    assert set(json.loads((tmp_path / "calibration.json").read_text())) == {"greedy", "sampled"}
    assert read_temperatures(tmp_path / "nowhere", "greedy") is None
    with pytest.raises(ValueError, match="calibration mode"):
        save_calibration(tmp_path, "warm", fitted)
    (tmp_path / "calibration.json").write_text(json.dumps({"greedy": {"temperatures": [1.0, -2.0]}}))
    with pytest.raises(ValueError, match="positive numbers"):
        read_temperatures(tmp_path, "greedy")
    with pytest.raises(ValueError, match="no rounds"):
        fit_sts(np.zeros((0, 3)), np.zeros(0))
