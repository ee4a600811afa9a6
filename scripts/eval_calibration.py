#!/usr/bin/env python
"""How well calibrations of a drafter's confidence head hold on prompts they were not fitted on.

Decodes ``--prompts`` generated prompts (``--data-seed``, default 1001: not the 1000 that
``dspark calibrate`` fits on, and no shipped drafter trained on it) verifying every draft, as
``dspark calibrate`` does, and scores the raw confidences ``σ(z)`` and, of each ``--calibration``
file, the entry the scheduler would serve this sampling with, by the ECE and the log loss of the survival
``Π_{i≤k} σ(z_i / T_i + b_i)`` per draft position. Writes JSON (``--out``).

    .venv/bin/python scripts/eval_calibration.py --calibration dspark_jax/drafters/smollm2_135m_dspark/calibration.json \\
        --calibration old/calibration.json --temperature 1 --out docs/scheduler/calibration_heldout_t1.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from dspark_jax.checkpoints.drafter import read_drafter_config
from dspark_jax.cli import _encode, check_drafter_arg, load_drafter_arg, load_target, positive_int
from dspark_jax.config import SamplingConfig, write_json
from dspark_jax.decoding.speculative import FixedPolicy, SpeculativeDecoder
from dspark_jax.drafters import resolve_drafter
from dspark_jax.eval.bench import json_output, machine_info
from dspark_jax.scheduler.prefix import calibration_for
from dspark_jax.training.calibrate import (
    calibrated,
    collect_rounds,
    ece,
    heldout_prompt_texts,
    log_loss,
    prefix_labels,
    read_calibrations,
)


def score(survival_NxG: np.ndarray, labels_NxG: np.ndarray) -> dict:
    gamma = labels_NxG.shape[1]
    per_ece = [ece(survival_NxG[:, k], labels_NxG[:, k]) for k in range(gamma)]
    per_loss = log_loss(survival_NxG.T, labels_NxG.T).tolist()
    return {"ece": per_ece, "log_loss": per_loss, "mean_ece": float(np.mean(per_ece)),
            "mean_log_loss": float(np.mean(per_loss))}


def parse_args(argv):
    """The flags, with everything that can be checked before the target loads checked: the
    sampling setting and that the drafter has a confidence head to score."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default="smollm2_135m_dspark")
    ap.add_argument("--calibration", action="append", default=[], help="calibration.json to score; repeatable")
    ap.add_argument("--prompts", type=positive_int, default=48)
    ap.add_argument("--data-seed", type=int, default=1001)
    ap.add_argument("--exclude-config", action="append", default=[], metavar="CONFIG",
                    help="a training config (configs/NAME.py) whose prompts are left out; repeatable")
    ap.add_argument("--max-new-tokens", type=positive_int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=json_output, required=True)
    args = ap.parse_args(argv)
    try:
        args.sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    except ValueError as error:
        ap.error(f"--temperature/--top-k/--top-p: {error}")
    check_drafter_arg(args.drafter)
    try:
        drafter_cfg = read_drafter_config(resolve_drafter(args.drafter)[1])[0]
    except (OSError, ValueError) as error:
        ap.error(f"--drafter {args.drafter!r}: {error}")
    if not drafter_cfg.confidence_head:
        ap.error(f"--drafter {args.drafter!r}: a {drafter_cfg.kind} drafter has no confidence head to calibrate")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    sampling = args.sampling
    calibrations = {}
    for path in args.calibration:
        fits = read_calibrations(Path(path).parent) if Path(path).name == "calibration.json" else ()
        calibration = calibration_for(fits, sampling)
        if calibration is None:
            raise SystemExit(f"--calibration {path}: not a calibration.json with an entry for {sampling.describe()}")
        calibrations[path] = calibration

    started = time.time()
    target, tokenizer = load_target(None)
    name, drafter, _, _ = load_drafter_arg(args.drafter, target)
    texts = heldout_prompt_texts(args.prompts, seed=args.data_seed, exclude_configs=args.exclude_config)
    prompts = [_encode(tokenizer, text, chat=True) for text in texts]
    decoder = SpeculativeDecoder(target, drafter, policy=FixedPolicy(drafter.cfg.block_size))
    logits, accepted = collect_rounds(decoder, prompts, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                      stop_ids=tokenizer.stop_ids, seed=args.seed)
    labels = prefix_labels(accepted, logits.shape[1])
    gamma = logits.shape[1]
    scores = {"raw": score(calibrated(logits, [1.0] * gamma, [0.0] * gamma), labels)}
    for path, calibration in calibrations.items():
        scores[path] = {**dataclasses.asdict(calibration),
                        **score(calibrated(logits, calibration.temperatures, calibration.biases), labels)}
    result = {
        "drafter": name,
        "mode": sampling.describe(),
        "settings": {"prompts": args.prompts, "data_seed": args.data_seed, "excluded_configs": args.exclude_config,
                     "max_new_tokens": args.max_new_tokens,
                     "sampling": dataclasses.asdict(sampling), "seed": args.seed},
        "rounds": int(len(accepted)),
        "observed_survival": labels.mean(0).tolist(),
        "scores": scores,
        "wall_s": time.time() - started,
        "machine": machine_info(),
        "load_avg_end": os.getloadavg(),
    }
    write_json(args.out, result, indent=1)
    for key, s in scores.items():
        print(f"{key}: ECE {' '.join(f'{v:.3f}' for v in s['ece'])} (mean {s['mean_ece']:.4f}); "
              f"log loss mean {s['mean_log_loss']:.4f}", file=sys.stderr)
    print(json.dumps({k: round(s["mean_ece"], 4) for k, s in scores.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
