"""Calibrating the confidence head for the scheduler, one draft position after another.

The scheduler ranks drafts by ``a_k = Π_{i≤k} σ(z_i / T_i + b_i)``, the predicted chance that
drafts ``1..k`` all survive, and weighs them against measured costs, so ``a_k`` must be a
probability, not just a score. The head is trained towards ``1 − TV(p_d, p_t)``, the acceptance
rate of *sampled* verification; greedy verification accepts on argmax agreement, which is a
different rate, and sampled acceptance moves with the temperature and the top-k/top-p filters.
So a drafter keeps one calibration for greedy decoding and one per sampling setting it was fitted
on, and the scheduler serves each request by the one nearest its own sampling
(``scheduler.prefix.calibration_index``).

Procedure: decode held-out prompts with every draft verified (``fixed:γ``), record per round the
confidence logits ``z_1..z_γ`` and how many drafts were accepted; the label of position ``k`` is
``y_k = [accepted ≥ k]``. For ``k = 1..γ`` in turn, with ``(T_i, b_i)`` of the earlier positions
fixed, a grid search picks position ``k``'s parameters for the survival ``Π_{i≤k} σ(z_i/T_i + b_i)``
against ``y_k``. Two methods (``METHODS``):

- ``sts``, the paper's sequential temperature scaling: ``b_k = 0``, ``T_k`` minimises the ECE.
  A temperature only rescales the logit, so it cannot remove an offset: a head trained on answers
  sampled unlike the ones it is calibrated on (at T = 1, say) stays over-confident.
- ``platt`` (the default), sequential Platt scaling: ``T_k`` and ``b_k`` minimise the log loss.
  The bias removes the offset. The criterion is a proper scoring rule because the ECE, given a
  free bias, is minimised by flattening the predictions towards the base rate, which throws away
  the ranking the scheduler acts on. On held-out rounds of the shipped drafter it lowers both the
  ECE and the log loss of ``sts`` (``docs/BENCHMARKS.md``).

The result lives next to the drafter's weights as ``calibration.json`` (``{"greedy": {...},
"sampled": [{...}, ...]}``, each entry with the sampling it was fitted on, the method,
temperatures and biases, the ECE and log loss before and after per position, and the rounds it
was fitted on).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dspark_jax.config import write_json

CALIBRATION_FILE = "calibration.json"
WEIGHTS_ID = "weights_id"  # the drafter weights a fit was made on (checkpoints.drafter)
MODES = ("greedy", "sampled")
METHODS = ("platt", "sts")
ECE_BINS = 20  # DeepSpec's reporting bins (spec §3.4)
GRID = np.geomspace(0.25, 8.0, 301)  # temperatures
BIAS_GRID = np.linspace(-4.0, 4.0, 321)


def mode_of(greedy: bool) -> str:
    """The calibration entry for greedy or sampled decoding."""
    return "greedy" if greedy else "sampled"


def prefix_labels(accepted_N: np.ndarray, gamma: int) -> np.ndarray:
    """``[N, γ]`` booleans: drafts ``1..k`` all survived (``accepted ≥ k``)."""
    return np.asarray(accepted_N)[:, None] >= np.arange(1, gamma + 1)[None, :]


def ece(predicted_N: np.ndarray, label_N: np.ndarray, bins: int = ECE_BINS) -> float:
    """Expected calibration error over equal-width bins of the prediction."""
    predicted, label = np.asarray(predicted_N, np.float64), np.asarray(label_N, np.float64)
    which = np.minimum((predicted * bins).astype(int), bins - 1)
    count = np.bincount(which, minlength=bins)
    gap = np.abs(np.bincount(which, predicted, bins) - np.bincount(which, label, bins))
    return float(gap.sum() / max(len(predicted), 1)) if count.sum() else float("nan")


def log_loss(predicted_N: np.ndarray, label_N: np.ndarray) -> np.ndarray:
    """Mean binary log loss over the last axis (predictions clipped away from 0 and 1)."""
    p = np.clip(np.asarray(predicted_N, np.float64), 1e-7, 1 - 1e-7)
    y = np.asarray(label_N, np.float64)
    return -(y * np.log(p) + (1 - y) * np.log1p(-p)).mean(-1)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def calibrated(logits_NxG: np.ndarray, temperatures: Sequence[float], biases: Sequence[float]) -> np.ndarray:
    """The survival ``Π_{i≤k} σ(z_i / T_i + b_i)``, ``[N, γ]`` (numpy twin of ``scheduler.prefix.survival``)."""
    z = np.asarray(logits_NxG, np.float64)
    return np.cumprod(_sigmoid(z / np.asarray(temperatures) + np.asarray(biases)), axis=1)


def _best_ece(survival, z, label, grid):
    candidates = survival[None, :] * _sigmoid(z[None, :] / grid[:, None])  # [grid, N]
    errors = [ece(c, label) for c in candidates]
    best = int(np.argmin(errors))
    return float(grid[best]), 0.0


def _best_log_loss(survival, z, label, grid, bias_grid):
    """Coarse (every 10th temperature, every 10th bias) then fine around the coarse optimum: the
    loss is smooth in both, and the full grid would cost 30× as much."""
    def search(t_idx, b_idx):
        b = bias_grid[b_idx]
        losses = np.stack([log_loss(survival * _sigmoid(z[None, :] / t + b[:, None]), label)
                           for t in grid[t_idx]])  # [temperatures, biases]
        i, j = np.unravel_index(int(np.argmin(losses)), losses.shape)
        return int(t_idx[i]), int(b_idx[j])

    i, j = search(np.arange(0, len(grid), 10), np.arange(0, len(bias_grid), 10))
    i, j = search(np.arange(max(i - 10, 0), min(i + 11, len(grid))),
                  np.arange(max(j - 10, 0), min(j + 11, len(bias_grid))))
    return float(grid[i]), float(bias_grid[j])


def fit_calibration(logits_NxG: np.ndarray, accepted_N: np.ndarray, method: str = "platt",
                    grid: Sequence[float] = GRID, bias_grid: Sequence[float] = BIAS_GRID) -> dict:
    """Per-position temperatures and biases, fitted left to right (module docstring); the ECE
    and log loss of the survival before (raw ``σ(z)``) and after, per position, on the rounds it
    was fitted on (``scripts/eval_calibration.py`` scores held-out ones); and ``at_grid_edge``,
    the positions (1-based) whose temperature or bias is an end of its search grid, where the
    best value may lie beyond it (too few rounds there, or a head that barely ranks them)."""
    if method not in METHODS:
        raise ValueError(f"calibration method must be one of {METHODS}, got {method!r}")
    z = np.asarray(logits_NxG, np.float64)
    n, gamma = z.shape
    if n == 0:
        raise ValueError("no rounds to calibrate on")
    labels = prefix_labels(accepted_N, gamma)
    grid, bias_grid = np.asarray(grid, np.float64), np.asarray(bias_grid, np.float64)
    temperatures, biases = [], []
    survival = np.ones(n)
    for k in range(gamma):
        if method == "sts":
            t, b = _best_ece(survival, z[:, k], labels[:, k], grid)
        else:
            t, b = _best_log_loss(survival, z[:, k], labels[:, k], grid, bias_grid)
        temperatures.append(t)
        biases.append(b)
        survival = survival * _sigmoid(z[:, k] / t + b)
    raw, fitted = calibrated(z, [1.0] * gamma, [0.0] * gamma), calibrated(z, temperatures, biases)
    return {
        "method": method,
        "temperatures": temperatures,
        "biases": biases,
        "ece_before": [ece(raw[:, k], labels[:, k]) for k in range(gamma)],
        "ece_after": [ece(fitted[:, k], labels[:, k]) for k in range(gamma)],
        "log_loss_before": log_loss(raw.T, labels.T).tolist(),
        "log_loss_after": log_loss(fitted.T, labels.T).tolist(),
        "observed_survival": labels.mean(0).tolist(),
        "rounds": int(n),
        "at_grid_edge": [k + 1 for k in range(gamma) if temperatures[k] in (grid[0], grid[-1])
                         or (method == "platt" and biases[k] in (bias_grid[0], bias_grid[-1]))],
    }


def heldout_prompt_texts(count: int, *, seed: int, exclude_configs: Sequence = ()) -> list[str]:
    """``count`` prompts of the generated training mix (``training.data.MIX``) for ``seed``,
    leaving out every prompt a training config in ``exclude_configs`` (paths) trained on: the
    generators reuse templates, so another seed alone can repeat training prompts."""
    from dspark_jax.training.data import MIX, build_prompts

    if not exclude_configs:
        return [p.text for p in build_prompts(count, seed=seed, mix=MIX)]
    from dspark_jax.training.train import load_config, prompts_not_trained_on

    fresh = prompts_not_trained_on([load_config(path) for path in exclude_configs], 4 * count, seed=seed, mix=MIX)
    if len(fresh) < count:
        raise ValueError(f"only {len(fresh)} of {4 * count} generated prompts are untrained by "
                         f"{', '.join(map(str, exclude_configs))}; ask for fewer prompts or another data seed")
    return [p.text for p in fresh[:count]]


def collect_rounds(decoder, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, sampling, stop_ids=(),
                   batch_size: int = 8, seed: int = 0, progress: bool = True):
    """``(logits [N, γ], accepted [N])`` over every request-round of ``prompts`` through
    ``decoder`` (which must verify every draft: ``FixedPolicy(γ)``, or the labels are censored)."""
    from tqdm import tqdm

    from dspark_jax.decoding.speculative import FixedPolicy

    gamma = decoder.cfg.block_size
    if decoder.policy != FixedPolicy(gamma):
        raise ValueError(f"calibration rounds must verify every draft (policy fixed:{gamma}), not {decoder.policy}")
    if not decoder.cfg.confidence_head:
        raise ValueError(f"a {decoder.cfg.kind} drafter has no confidence head to calibrate")
    logits, accepted = [], []
    batches = range(0, len(prompts), batch_size)
    for start in tqdm(batches, desc="calibration rounds", disable=not progress):
        chunk = list(prompts[start:start + batch_size])
        result = decoder.generate(chunk, max_new_tokens=max_new_tokens, sampling=sampling,
                                  seeds=list(range(seed + start, seed + start + len(chunk))), stop_ids=stop_ids)
        logits.extend(result.confidence_per_round)
        accepted.extend(result.accepted_per_round)
    if not logits:  # every request ended before a round drafted
        raise ValueError(f"no round drafted in {len(prompts)} prompts of at most {max_new_tokens} new tokens: "
                         "nothing to calibrate on; give more prompts or more new tokens")
    return np.concatenate(logits), np.concatenate(accepted)


def _entries(body: dict, mode: str) -> list:
    """``mode``'s entries in a calibration file: ``greedy`` holds one, ``sampled`` a list (one per
    sampling setting; files from before that hold one)."""
    entry = body.get(mode)
    if entry is None:
        return []
    return list(entry) if mode == "sampled" and isinstance(entry, list) else [entry]


def save_calibration(directory, fitted: dict, sampling, **info) -> Path:
    """Write ``fitted`` (fitted on decoding with ``sampling``, a ``SamplingConfig``) into
    ``directory/calibration.json``, replacing an earlier fit for the same sampling and keeping
    the fits for other samplings. ``info`` is recorded with the fit; its ``weights_id`` (the
    drafter's, ``checkpoints.drafter.drafter_weights_id``) also drops the fits made for other
    weights."""
    import dataclasses

    from dspark_jax.config import SamplingConfig

    path = check_calibration_dir(directory)
    body = json.loads(path.read_text()) if path.is_file() else {}
    mode = mode_of(sampling.greedy)
    entry = {**fitted, **info, "sampling": dataclasses.asdict(sampling)}

    def kept(e):  # a fit for other weights of the drafter is stale; one for this sampling is replaced
        stale = None not in (e.get(WEIGHTS_ID), info.get(WEIGHTS_ID)) and e[WEIGHTS_ID] != info[WEIGHTS_ID]
        # As a setting, not a dict: {"temperature": 1.0} is T = 1 without top-k or top-p too.
        same = e.get("sampling") is not None and SamplingConfig(**e["sampling"]) == sampling
        return not (stale or same)

    greedy = [entry] if mode == "greedy" else [e for e in _entries(body, "greedy") if kept(e)]
    sampled = [e for e in _entries(body, "sampled") if kept(e)] + ([entry] if mode == "sampled" else [])
    body = {key: value for key, value in body.items() if key not in MODES}
    if greedy:
        body["greedy"] = greedy[0]
    if sampled:
        body["sampled"] = sampled
    return write_json(path, body, indent=1)  # whole or not at all: half a file would stop the drafter loading


def check_calibration_dir(directory) -> Path:
    """The calibration file of ``directory``, checked before the decoding that fits it (minutes):
    the directory must exist and be writable, and a file already there must read as a calibration,
    since the fit is merged into it."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"{directory} is not writable")
    read_calibrations(directory, stale_ok=True)  # the new fit replaces the stale ones
    return directory / CALIBRATION_FILE


def read_calibrations(directory, *, stale_ok: bool = False) -> tuple:
    """Every calibration (``scheduler.prefix.Calibration``) of the drafter in ``directory``, each
    with the sampling it was fitted on; ``()`` when it has none. Entries written before biases
    existed read with zero biases; a sampled one without its sampling serves any decoding that
    has no fit of its own (``scheduler.prefix.calibration_index``). A fit made on other weights
    than the drafter's in ``directory`` now holds (trained or saved again since; both record
    their weights id) is refused, or left out with ``stale_ok``."""
    from dspark_jax.checkpoints.drafter import drafter_weights_id
    from dspark_jax.config import SamplingConfig
    from dspark_jax.scheduler.prefix import Calibration

    path = Path(directory) / CALIBRATION_FILE
    weights_id = drafter_weights_id(directory)
    if not path.is_file():
        return ()
    try:
        body = json.loads(path.read_text())
        entries = [(mode, entry) for mode in MODES for entry in _entries(body, mode)]
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, TypeError) as error:
        raise ValueError(f"{path} is not a calibration file ({error})") from None
    calibrations = []
    for mode, entry in entries:
        fitted_on = entry.get(WEIGHTS_ID) if isinstance(entry, dict) else None
        if None not in (fitted_on, weights_id) and fitted_on != weights_id:
            if stale_ok:
                continue
            raise ValueError(f"{path}: a {mode} fit was made on other weights (id {fitted_on}) than the drafter's in "
                             f"{directory} (id {weights_id}), which was trained or saved again since: run dspark "
                             f"calibrate again, or delete {path}")
        temperatures = entry.get("temperatures") if isinstance(entry, dict) else None
        if not isinstance(temperatures, list) or not all(isinstance(t, (int, float)) and t > 0 for t in temperatures):
            raise ValueError(f"{path}: '{mode}.temperatures' must be a list of positive numbers")
        biases = entry.get("biases", [0.0] * len(temperatures))
        if (not isinstance(biases, list) or len(biases) != len(temperatures)
                or not all(isinstance(b, (int, float)) and np.isfinite(b) for b in biases)):
            raise ValueError(f"{path}: '{mode}.biases' must be a list of {len(temperatures)} finite numbers")
        try:
            if entry.get("sampling") is not None:
                sampling = SamplingConfig(**entry["sampling"])
            else:  # the greedy entry is greedy's whatever it says; a sampled one without it, anyone's
                sampling = SamplingConfig() if mode == "greedy" else None
        except (TypeError, ValueError) as error:
            raise ValueError(f"{path}: '{mode}.sampling' is not a sampling setting ({error})") from None
        if sampling is not None and mode_of(sampling.greedy) != mode:
            raise ValueError(f"{path}: a '{mode}' entry fitted on {mode_of(sampling.greedy)} decoding")
        if any(c.sampling == sampling for c in calibrations):
            raise ValueError(f"{path} holds two fits for {'any sampling' if sampling is None else sampling.describe()}: "
                             "keep one")
        calibrations.append(Calibration(temperatures, biases, sampling))
    return tuple(calibrations)
