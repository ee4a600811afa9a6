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

Both use the same anchor sampling as training; ``heldout_domains`` splits the held-out score by
the prompts' domain. ``--temperature`` (with ``--top-p``/``--top-k``) samples the held-out
answers otherwise than the training cache did: the analytic τ on answers sampled at a decoding
temperature tracks the τ of decoding at it (``docs/TRAINING.md``). ``--benchmarks DIR`` scores on
the target's answers to GSM8K / HumanEval / MT-Bench prompts instead of a mix (evaluation only,
from ``--benchmark-skip`` on, past the prompts the speculative benchmark decodes).

Writes JSON (``--out``); prints one line per drafter, then ``{"<leg>": {"heldout": τ, "train": τ},
...}`` last. τ here is the analytic estimate of the training log (spec §5), not a decoding τ;
``tau_greedy`` beside it is the teacher-forced τ of greedy drafting and verification (the draft's
argmax must be the answer's token), which on greedy answers (``--temperature 0``) is what
greedy decoding measures, up to where its rounds start.

    .venv/bin/python scripts/eval_heldout.py    # the three SmolLM2 configs, 48 held-out prompts
    .venv/bin/python scripts/eval_heldout.py --heldout-only --last-legs 2 --benchmarks ../shared/benchmarks --temperature 1
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

from dspark_jax.cli import positive_int
from dspark_jax.config import write_json
from dspark_jax.eval.bench import json_output

REPO_ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_CONFIGS = [str(REPO_ROOT / "configs" / f"smollm2_135m_{k}.py") for k in ("dspark", "dflash", "eagle3")]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", default=None,
                    help="training config (repeatable; default: the three SmolLM2 configs); all must share one data set")
    ap.add_argument("--num-prompts", type=positive_int, default=None,
                    help=f"held-out prompts, at least {SCORE_BATCH} (default 48; --quick: 8, or 9 with --benchmarks)")
    ap.add_argument("--data-seed", type=int, default=None, help="prompt seed of the held-out set (default 1; training uses the config's)")
    ap.add_argument("--mix", default=None, help="prompt mix of the held-out set, a name in training/data.py MIXES (default paper)")
    ap.add_argument("--benchmarks", default=None, metavar="DIR",
                    help="score on the target's answers to benchmark prompts instead of a mix: num-prompts / 3 from each "
                    "of DIR's gsm8k.jsonl, humaneval.jsonl and mt-bench.jsonl (evaluation only; nothing trains on them)")
    ap.add_argument("--benchmark-skip", type=int, default=10,
                    help="with --benchmarks: start at this line of each file (default 10, past the prompts that "
                    "bench_speculative.py decodes by default)")
    ap.add_argument("--temperature", type=float, default=None,
                    help="sample the held-out answers at this temperature (0 = greedy; default: the first config's "
                    "cache settings, top-k/top-p included); with it, top-k and top-p are off unless given")
    ap.add_argument("--top-p", type=float, default=None, help="with --temperature (default 1 = off)")
    ap.add_argument("--top-k", type=int, default=None, help="with --temperature (default 0 = off)")
    ap.add_argument("--replay", type=int, default=None, metavar="TOKENS",
                    help="with --temperature 0: also replay greedy decoding of TOKENS new tokens per answer from the "
                    "cache (dspark_jax/eval/replay.py): the τ and per-position acceptance bench_speculative.py "
                    "measures, per domain, without running the target")
    ap.add_argument("--cache-dir", default=None,
                    help="where the held-out target cache is built or resumed (default runs/heldout_cache_seed{S}_n{N}, "
                    "then _{mix} for a mix other than paper, then _t{T}_p{P}_k{K} with --temperature, then, for a "
                    "mix, _{digest of its prompts}, which leave out the configs' training texts; "
                    "runs/heldout_cache_benchmarks_skip{K}_n{N}[_t..] with --benchmarks)")
    ap.add_argument("--last-legs", type=positive_int, default=None, help="score only each config's last N legs (default: all)")
    ap.add_argument("--heldout-only", action="store_true",
                    help="skip the training-sequence score (needed when the legs trained on different caches)")
    ap.add_argument("--quick", action="store_true", help="8 held-out prompts")
    ap.add_argument("--out", type=json_output, default=str(REPO_ROOT / "docs" / "heldout_tau.json"))
    args = ap.parse_args(argv)
    if args.num_prompts is None:
        args.num_prompts = (9 if args.benchmarks else 8) if args.quick else 48
    if args.num_prompts < SCORE_BATCH:
        ap.error(f"--num-prompts must be >= {SCORE_BATCH}: held-out answers are scored in whole batches of {SCORE_BATCH}")
    if args.benchmarks is not None:
        if args.mix is not None or args.data_seed is not None:
            ap.error("--benchmarks scores benchmark prompts: --mix and --data-seed do not apply")
        if args.num_prompts % 3 or args.benchmark_skip < 0:
            ap.error("--benchmarks needs --num-prompts divisible by 3 (one third per domain) and --benchmark-skip >= 0")
    args.mix = "paper" if args.mix is None else args.mix
    args.data_seed = 1 if args.data_seed is None else args.data_seed
    if args.temperature is None and (args.top_p is not None or args.top_k is not None):
        ap.error("--top-p and --top-k go with --temperature")
    if args.temperature is not None:
        from dspark_jax.config import SamplingConfig

        args.top_p = 1.0 if args.top_p is None else args.top_p
        args.top_k = 0 if args.top_k is None else args.top_k
        try:
            SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        except ValueError as error:
            ap.error(f"--temperature/--top-k/--top-p: {error}")
    if args.replay is not None and (args.temperature != 0 or args.replay < 2):
        ap.error("--replay needs --temperature 0 (greedy answers are the path greedy decoding takes) and TOKENS >= 2")
    return args


def heldout_cache_dir(args, prompts) -> str:
    """``--cache-dir``, or a name that says which answers the cache holds.

    A mix's held-out prompts leave out every text the configs' legs trained on, so configs with a
    leg on new seeds can draw other prompts under the same seed and count: a mix's name ends in a
    digest of its prompts, and such configs get a cache of their own instead of one built for
    others. The digest covers every candidate prompt (the first ``--num-prompts`` that fit are
    answered), so it may change when the answered ones do not, never the other way round.
    Benchmark prompts are fixed by the files, the skip and the count.
    """
    if args.cache_dir is not None:
        return args.cache_dir
    sampling = "" if args.temperature is None else f"_t{args.temperature:g}_p{args.top_p:g}_k{args.top_k}"
    if args.benchmarks is not None:
        return f"runs/heldout_cache_benchmarks_skip{args.benchmark_skip}_n{args.num_prompts}{sampling}"
    mix = "" if args.mix == "paper" else f"_{args.mix}"
    digest = hashlib.sha256("\n".join(f"{p.id}\t{p.text}" for p in prompts).encode()).hexdigest()[:8]
    return f"runs/heldout_cache_seed{args.data_seed}_n{args.num_prompts}{mix}{sampling}_{digest}"


# Sequences scored per batch: what the CPU legs trained with. Only whole batches are scored, so
# a run's own (an accelerator config's 64) would leave most of a held-out set out.
SCORE_BATCH = 8


def drafter_legs(config, last: int | None = None):
    """(name, exported drafter dir, config) of ``config``'s legs (the ``last`` ones), first leg
    first; the configs score ``SCORE_BATCH`` sequences a batch at most."""
    legs = config.legs if last is None else config.legs[-last:]
    return [(leg.name, Path(leg.out_dir) / "drafter", dataclasses.replace(leg, batch_size=min(leg.batch_size, SCORE_BATCH)))
            for leg in legs]


def benchmark_prompts(directory, per_domain: int, skip: int) -> list:
    """``per_domain`` first turns from each domain's benchmark file, from line ``skip`` on, with
    ids ``{domain}-{line:06d}``."""
    from dspark_jax.eval.compare import DOMAIN_FILES, read_prompts_jsonl
    from dspark_jax.training.data import TrainingPrompt

    prompts = []
    for domain, file in DOMAIN_FILES.items():
        texts = read_prompts_jsonl(Path(directory) / file, limit=skip + per_domain)[skip:]
        if len(texts) < per_domain:
            raise ValueError(f"{file} has {len(texts) + skip} prompts; --benchmark-skip {skip} leaves fewer than {per_domain}")
        prompts += [TrainingPrompt(f"{domain}-{skip + i:06d}", domain, text) for i, text in enumerate(texts)]
    return prompts


def domain_of(prompt_id: str) -> str:
    """A prompt id's domain: ``math-000012`` -> ``math`` (training and benchmark ids alike)."""
    return prompt_id.split("-")[0]


def by_domain(items: dict) -> dict:
    """``{name: value}`` grouped as ``{domain: {name: value}}``, domains sorted."""
    groups = {}
    for name, value in items.items():
        groups.setdefault(domain_of(name), {})[name] = value
    return dict(sorted(groups.items()))


def domain_metrics(score, config, sequences) -> dict:
    """``mean_metrics`` per domain that fills at least one batch."""
    from dspark_jax.training.train import mean_metrics

    subsets = by_domain({seq.name: seq for seq in sequences})
    return {d: mean_metrics(score, config, list(s.values())) for d, s in subsets.items() if len(s) >= config.batch_size}


def replay_by_domain(chains, sequences, *, gamma: int, max_new_tokens: int, stop_ids):
    """Greedy decoding replayed along every answer (one pass, one compile), summarised per domain:
    (the benchmark's summary per domain and its macro τ, ``{domain: {name: tokens committed per
    round}}`` for the ratio intervals)."""
    from dspark_jax.eval.replay import replay_sequences, replay_summary

    rounds = by_domain(replay_sequences(chains, sequences, max_new_tokens=max_new_tokens, stop_ids=stop_ids))
    domains = {d: replay_summary(r, gamma) for d, r in rounds.items()}
    committed = {d: {name: r.committed for name, r in by_name.items()} for d, by_name in rounds.items()}
    return {"tau": sum(r["tau"] for r in domains.values()) / len(domains), "domains": domains}, committed


def replay_ratios(results: dict, kinds: dict, committed: dict) -> dict:
    """τ(DSpark) / τ(DFlash) and / τ(EAGLE-3) of the replayed decoding, each with the benchmark's
    90% bootstrap interval over prompts, between the last scored drafter of each kind."""
    from dspark_jax.eval.compare import ratio_interval

    last = {kind: name for name, kind in kinds.items()}
    ratios = {}
    for other, key in (("dflash", "tau_ratio"), ("eagle3", "tau_ratio_eagle3")):
        if "dspark" not in last or other not in last:
            continue
        mine, theirs = last["dspark"], last[other]
        by_domain = {d: {mine: list(committed[mine][d].values()), theirs: list(committed[theirs][d].values())}
                     for d in committed[mine]}
        ratios[key] = results[mine]["replay"]["tau"] / results[theirs]["replay"]["tau"]
        ratios[f"{key}_interval"] = ratio_interval(by_domain, mine, theirs)
    return ratios


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import numpy as np

    from dspark_jax.checkpoints.drafter import load_drafter
    from dspark_jax.eval.compare import json_clean
    from dspark_jax.eval.replay import jit_with_drafter
    from dspark_jax.training.losses import greedy_chains
    from dspark_jax.training.train import (
        batch_completer,
        build_heldout_cache,
        heldout_prompts,
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
    # Held-out answers keep their features (a few MB), which the replay reads, even for drafters
    # trained from a cache of token ids; training sequences of such a cache get them computed.
    answers = dataclasses.replace(first.cache, store_features=True)
    if args.temperature is not None:
        answers = dataclasses.replace(answers, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    heldout_config = dataclasses.replace(first, batch_size=min(first.batch_size, SCORE_BATCH),
                                         heldout_prompts=args.num_prompts, heldout_seed=args.data_seed,
                                         heldout_mix=args.mix, cache=answers)
    prompts = (heldout_prompts(heldout_config) if args.benchmarks is None
               else benchmark_prompts(args.benchmarks, args.num_prompts // 3, args.benchmark_skip))
    args.cache_dir = heldout_cache_dir(args, prompts)
    heldout_config = dataclasses.replace(heldout_config, heldout_cache_dir=args.cache_dir)
    heldout = build_heldout_cache(heldout_config, target, tokenizer, prompts=prompts)
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
    complete = batch_completer(target, first.cache.tap_layers)

    results, kinds, replayed = {}, {}, {}
    for config in configs:
        for name, directory, leg in drafter_legs(config, args.last_legs):
            if not directory.exists():
                print(f"{name}: no exported drafter at {directory}, skipped", file=sys.stderr)
                continue
            drafter = load_drafter(directory, target=target)
            # One compiled scorer per drafter and kind of batch (with features, or token ids).
            scorer = jit_with_drafter(lambda drafter, target_params, embed, head, batch, leg=leg: objective(
                drafter, leg, complete(target_params, batch), embed, head)[1], drafter, target.params, embed, head)

            results[name] = {"drafter": str(directory), "heldout": mean_metrics(scorer, leg, heldout),
                             "heldout_domains": domain_metrics(scorer, leg, heldout)}
            if training is not None:
                results[name]["train"] = mean_metrics(scorer, leg, training)
            r = results[name]
            by_domain = " ".join(f"{d} {m['tau']:.3f}" for d, m in r["heldout_domains"].items())
            line = f"{name:28s} τ held-out {r['heldout']['tau']:.3f} ({by_domain}) greedy {r['heldout']['tau_greedy']:.3f}"
            if training is not None:
                line += f"  train {r['train']['tau']:.3f}  gap {r['train']['tau'] - r['heldout']['tau']:.3f}"
            if args.replay is not None:
                chains = jit_with_drafter(greedy_chains, drafter, embed, head)
                r["replay"], replayed[name] = replay_by_domain(
                    chains, heldout, gamma=drafter.cfg.block_size, max_new_tokens=args.replay,
                    stop_ids=tokenizer.stop_ids)
                kinds[name] = drafter.cfg.kind
                line += f"  replayed greedy decoding τ {r['replay']['tau']:.3f}"
            print(line)
    out = {
        "heldout": {"prompts": len(heldout), "cache": str(args.cache_dir),
                    **({"data_seed": args.data_seed, "mix": args.mix} if args.benchmarks is None else
                       {"benchmarks": str(args.benchmarks), "skip": args.benchmark_skip}),
                    "answers": {"temperature": answers.temperature, "top_p": answers.top_p, "top_k": answers.top_k},
                    "domains": dict(sorted(collections.Counter(domain_of(n) for n in names).items()))},
        "results": results,
    }
    if replayed:
        out["replay"] = {"max_new_tokens": args.replay, **replay_ratios(results, kinds, replayed)}
        print("replayed greedy decoding: " + json.dumps(out["replay"]))
    write_json(args.out, json_clean(out), indent=1)  # NaN (a slot never reached) -> null
    print(f"wrote {args.out}")
    print(json.dumps({name: {k: r[k]["tau"] for k in ("heldout", "train") if k in r} for name, r in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
