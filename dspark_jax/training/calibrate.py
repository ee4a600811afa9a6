"""Sequential temperature scaling (STS, spec §3.5): calibrating the confidence head for the scheduler.

The scheduler ranks drafts by ``a_k = Π_{i≤k} σ(z_i / T_i)``, the predicted chance that drafts
``1..k`` all survive, and weighs them against measured costs, so ``a_k`` must be a probability, not
just a score. The head is trained towards ``1 − TV(p_d, p_t)``, the acceptance rate of *sampled*
verification; greedy verification accepts on argmax agreement, which is a different rate, so
each decoding mode gets its own temperatures (``MODES``).

Procedure: decode held-out prompts with every draft verified (``fixed:γ``), record per round the
confidence logits ``z_1..z_γ`` and how many drafts were accepted; the label of position ``k`` is
``y_k = [accepted ≥ k]``. For ``k = 1..γ`` in turn, ``T_k`` is the grid value minimising the ECE
of ``Π_{i≤k} σ(z_i / T_i)`` against ``y_k`` with ``T_1..T_{k−1}`` already fixed.

The result lives next to the drafter's weights as ``calibration.json`` (``{"greedy": {...},
"sampled": {...}}``, each with the temperatures, the ECE before and after per position, the
rounds it was fitted on and the sampling used).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

CALIBRATION_FILE = "calibration.json"
MODES = ("greedy", "sampled")
ECE_BINS = 20  # DeepSpec's reporting bins (spec §3.4)
GRID = np.geomspace(0.25, 8.0, 301)


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


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def fit_sts(logits_NxG: np.ndarray, accepted_N: np.ndarray, grid: Sequence[float] = GRID) -> dict:
    """Per-position temperatures by sequential grid search; ECE of the survival before and after."""
    z = np.asarray(logits_NxG, np.float64)
    n, gamma = z.shape
    if n == 0:
        raise ValueError("no rounds to calibrate on")
    labels = prefix_labels(accepted_N, gamma)
    grid = np.asarray(grid, np.float64)
    temperatures, before, after = [], [], []
    raw = np.cumprod(_sigmoid(z), axis=1)
    survival = np.ones(n)
    for k in range(gamma):
        candidates = survival[None, :] * _sigmoid(z[None, :, k] / grid[:, None])  # [grid, N]
        errors = [ece(c, labels[:, k]) for c in candidates]
        best = int(np.argmin(errors))
        temperatures.append(float(grid[best]))
        survival = candidates[best]
        before.append(ece(raw[:, k], labels[:, k]))
        after.append(errors[best])
    return {
        "temperatures": temperatures,
        "ece_before": before,
        "ece_after": after,
        "observed_survival": labels.mean(0).tolist(),
        "rounds": int(n),
    }


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
    return np.concatenate(logits), np.concatenate(accepted)


def save_calibration(directory, mode: str, fitted: dict, **info) -> Path:
    """Write (or update) ``mode``'s entry of ``directory/calibration.json``."""
    if mode not in MODES:
        raise ValueError(f"calibration mode must be one of {MODES}, got {mode!r}")
    path = Path(directory) / CALIBRATION_FILE
    body = json.loads(path.read_text()) if path.is_file() else {}
    body[mode] = {**fitted, **info}
    path.write_text(json.dumps(body, indent=1) + "\n")
    return path


def read_temperatures(directory, mode: str) -> list[float] | None:
    """``mode``'s STS temperatures for the drafter in ``directory``; ``None`` when it has none."""
    path = Path(directory) / CALIBRATION_FILE
    if not path.is_file():
        return None
    try:
        entry = json.loads(path.read_text()).get(mode)
    except (json.JSONDecodeError, AttributeError) as error:
        raise ValueError(f"{path} is not a calibration file ({error})") from None
    if entry is None:
        return None
    temperatures = entry.get("temperatures") if isinstance(entry, dict) else None
    if not isinstance(temperatures, list) or not all(isinstance(t, (int, float)) and t > 0 for t in temperatures):
        raise ValueError(f"{path}: '{mode}.temperatures' must be a list of positive numbers")
    return [float(t) for t in temperatures]
