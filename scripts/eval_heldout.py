#!/usr/bin/env python
"""Analytic τ of trained drafters on held-out answers vs on their training sequences.

A run with ``heldout_prompts`` logs held-out τ while it trains; this script scores finished
drafters after the fact, every leg side by side. It draws fresh prompts of a mix
(``train.heldout_prompts`` with ``--data-seed`` and ``--mix``: minus any text a leg trained on, checked
against the benchmark sets), has the target answer them into a small target cache (resumable,
like the training cache), and scores every drafter of the given configs (each leg, when a config
has ``init_from`` legs) with its training objective on:

- ``heldout``: the fresh answers;
- ``train``: as many training sequences, drawn at random from those every leg trained on
  (``--heldout-only`` skips it; legs that trained on different caches, e.g. a leg on fresh
  seeds, share none).

Both use the same anchor sampling as training. Writes JSON (``--out``); prints one line per
drafter, then ``{"<leg>": {"heldout": τ, "train": τ}, ...}`` last. τ here is the analytic
estimate of the training log (spec §5), not a decoding τ.

    .venv/bin/python scripts/eval_heldout.py    # the three SmolLM2 configs, 48 held-out prompts
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_CONFIGS = [str(REPO_ROOT / "configs" / f"smollm2_135m_{k}.py") for k in ("dspark", "dflash", "eagle3")]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", default=None,
                    help="training config (repeatable; default: the three SmolLM2 configs); all must share one data set")
    ap.add_argument("--num-prompts", type=int, default=None, help="held-out prompts (default 48; --quick: 8)")
    ap.add_argument("--data-seed", type=int, default=1, help="prompt seed of the held-out set (training uses the config's)")
    ap.add_argument("--mix", default="paper", help="prompt mix of the held-out set, a name in training/data.py MIXES (default paper)")
    ap.add_argument("--cache-dir", default=None,
                    help="where the held-out target cache is built or resumed (default runs/heldout_cache_seed{S}_n{N})")
    ap.add_argument("--last-legs", type=int, default=None, help="score only each config's last N legs (default: all)")
    ap.add_argument("--heldout-only", action="store_true",
                    help="skip the training-sequence score (needed when the legs trained on different caches)")
    ap.add_argument("--quick", action="store_true", help="8 held-out prompts")
    ap.add_argument("--out", default=str(REPO_ROOT / "docs" / "heldout_tau.json"))
    args = ap.parse_args(argv)
    if args.num_prompts is None:
        args.num_prompts = 8 if args.quick else 48
    if args.num_prompts < 1:
        ap.error("--num-prompts must be >= 1")
    if args.last_legs is not None and args.last_legs < 1:
        ap.error("--last-legs must be >= 1")
    if args.cache_dir is None:
        mix = "" if args.mix == "paper" else f"_{args.mix}"
        args.cache_dir = f"runs/heldout_cache_seed{args.data_seed}_n{args.num_prompts}{mix}"
    return args


def drafter_legs(config, last: int | None = None):
    """(name, exported drafter dir, config) of ``config``'s legs (the ``last`` ones), first leg first."""
    legs = config.legs if last is None else config.legs[-last:]
    return [(leg.name, Path(leg.out_dir) / "drafter", leg) for leg in legs]


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import numpy as np

    from dspark_jax.checkpoints.drafter import load_drafter
    from dspark_jax.training.train import (
        build_heldout_cache,
        load_config,
        load_target,
        load_training_set,
        mean_metrics,
        objective,
        training_names,
    )

    configs = [load_config(path) for path in (args.config or SMOLLM2_CONFIGS)]
    first = configs[0]
    for config in configs[1:]:
        data = ("num_prompts", "data_seed", "data_mix", "cache", "cache_shards", "cache_dir")
        if any(getattr(config, f) != getattr(first, f) for f in data):
            raise ValueError(f"{config.name} was trained on other data than {first.name}: evaluate them separately")
    target, tokenizer = load_target(first)
    heldout_config = dataclasses.replace(first, heldout_prompts=args.num_prompts, heldout_seed=args.data_seed,
                                         heldout_mix=args.mix, heldout_cache_dir=args.cache_dir)
    heldout = build_heldout_cache(heldout_config, target, tokenizer)
    names = [s.name for s in heldout]
    scored = [leg for config in configs for _, _, leg in drafter_legs(config, args.last_legs)]
    training = None
    if not args.heldout_only:
        caches = sorted({str(leg.cache_path) for leg in scored})
        if len(caches) > 1:
            raise ValueError(f"the legs scored trained on different target caches ({caches}): pass --heldout-only, "
                             "or --last-legs to score only legs of one cache")
        # Training sequences every scored leg trained on (legs on one cache only add prompts).
        shared = min((training_names(leg, tokenizer) for leg in scored), key=len)
        training = load_training_set(scored[-1], shared)
        rows = np.random.default_rng(0).choice(len(training), len(heldout), replace=False)
        training = [training[i] for i in rows]
    embed, head = jax.jit(target.embedding_and_head)(target.params)

    results = {}
    for config in configs:
        for name, directory, leg in drafter_legs(config, args.last_legs):
            if not directory.exists():
                print(f"{name}: no exported drafter at {directory}, skipped", file=sys.stderr)
                continue
            drafter = load_drafter(directory, target=target.cfg)
            # One compiled scorer per drafter, for both sets (their batches have one shape).
            score = jax.jit(lambda batch, drafter=drafter, leg=leg: objective(drafter, leg, batch, embed, head)[1])
            results[name] = {"drafter": str(directory), "heldout": mean_metrics(score, leg, heldout)}
            if training is not None:
                results[name]["train"] = mean_metrics(score, leg, training)
            r = results[name]
            line = f"{name:28s} τ held-out {r['heldout']['tau']:.3f}"
            if training is not None:
                line += f"  train {r['train']['tau']:.3f}  gap {r['train']['tau'] - r['heldout']['tau']:.3f}"
            print(line)
    out = {
        "heldout": {"prompts": len(heldout), "data_seed": args.data_seed, "mix": args.mix, "cache": str(args.cache_dir),
                    "domains": {d: sum(n.startswith(d) for n in names) for d in sorted({n.split("-")[0] for n in names})}},
        "results": results,
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    print(json.dumps({name: {k: r[k]["tau"] for k in ("heldout", "train") if k in r} for name, r in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
