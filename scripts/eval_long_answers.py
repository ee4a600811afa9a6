#!/usr/bin/env python
"""τ along long answers: does a drafter keep its acceptance as the answer grows?

The shipped drafters trained on answers of at most 160 tokens (``seq_len`` 352 with the prompt).
This script decodes benchmark prompts greedily (B=1, ``fixed:γ``, stopping at EOS) for up to
``--max-new-tokens`` and reports, per drafter, τ (tokens committed per round) by where the round
starts in the answer, in buckets of ``--bucket`` tokens, with the number of rounds in each.
``--window W`` (repeatable) also runs every block drafter with its context limited to the last W
positions (``DrafterConfig.sliding_window``; the weights are the same), which tells attention over
contexts longer than training showed apart from what the later text itself does to acceptance.
``--mix M`` decodes held-out prompts of a training mix instead (data seed ``--data-seed``, with
every text a leg of ``--config`` trained on removed and checked against ``--benchmarks``, as
``eval_heldout.py`` does), grouped by the prompts' own domains: a window chosen on the benchmark
prompts is checked there before it ships.
τ does not depend on the machine's speed, so this needs no quiet machine.

    .venv/bin/python scripts/eval_long_answers.py --drafter smollm2_135m_dspark --window 256
    .venv/bin/python scripts/eval_long_answers.py --mix writing --window 256 --out /tmp/writing.json
    .venv/bin/python scripts/eval_long_answers.py --quick --out /tmp/long.json

Writes JSON (``--out``): per drafter, τ by bucket pooled and per domain, every prompt's committed
tokens per round by bucket, and for a windowed run the ratio to the whole-context run per bucket
with a 90% percentile-bootstrap interval over the prompts. The last line printed is the summary
``{"<drafter>": {"0-127": τ, ...}}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dspark_jax.cli import positive_int
from dspark_jax.config import write_json
from dspark_jax.eval.bench import (
    json_output,
    read_benchmark_prompts,
    set_quick_defaults,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DOMAINS = {"math": "gsm8k.jsonl", "code": "humaneval.jsonl", "chat": "mt-bench.jsonl"}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", action="append", default=None,
                    help="shipped drafter name or checkpoint directory; repeatable (default: smollm2_135m_dspark)")
    ap.add_argument("--window", type=int, action="append", default=[],
                    help="also run each block drafter with this sliding_window; repeatable")
    ap.add_argument("--benchmarks", default=str(REPO_ROOT.parent / "shared" / "benchmarks"))
    ap.add_argument("--mix", default=None,
                    help="decode held-out prompts of this training mix (a name in training/data.py MIXES) instead")
    ap.add_argument("--data-seed", type=int, default=1, help="seed of the --mix prompts (default 1, the held-out seed)")
    ap.add_argument("--config", default=str(REPO_ROOT / "configs" / "smollm2_135m_dspark.py"),
                    help="training config whose legs' prompts --mix leaves out")
    ap.add_argument("--prompts-per-domain", type=positive_int, default=None, help="default 10 (--quick: 1)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=None, help="default 512 (--quick: 64)")
    ap.add_argument("--bucket", type=positive_int, default=None,
                    help="answer tokens per bucket; default 128 (--quick: 32)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=json_output, default=str(REPO_ROOT / "docs" / "long_answers.json"))
    args = ap.parse_args(argv)
    args.drafter = args.drafter or ["smollm2_135m_dspark"]
    set_quick_defaults(args, prompts_per_domain=(1, 10), max_new_tokens=(64, 512), bucket=(32, 128))
    if any(w < 1 for w in args.window):
        ap.error("--window must be >= 1")
    if args.max_new_tokens < args.bucket:
        ap.error("need 1 <= --bucket <= --max-new-tokens")
    if args.mix is None and args.data_seed != 1:
        ap.error("--data-seed picks --mix prompts: pass --mix")
    return args


def benchmark_prompts(args, tokenizer) -> dict[str, list[list[int]]]:
    texts = read_benchmark_prompts(args.benchmarks, DOMAINS.values(), args.prompts_per_domain)
    return {domain: [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in group]
            for domain, group in zip(DOMAINS, texts)}


def mix_prompts(args, tokenizer) -> dict[str, list[list[int]]]:
    """Up to ``prompts_per_domain`` held-out prompts of each domain of ``args.mix`` that fit the
    training prompt cap, in the order the mix draws them."""
    import dataclasses

    from dspark_jax.training.data import MIXES
    from dspark_jax.training.train import heldout_prompts, load_config, render_prompts

    if args.mix not in MIXES:
        raise ValueError(f"--mix {args.mix!r} is not a training mix; known: {sorted(MIXES)}")
    config = load_config(args.config)
    if args.data_seed in {seed for leg in config.legs for seed, _ in leg.data_sources}:
        raise ValueError(f"--data-seed {args.data_seed} is a data seed of {config.name}: its prompts are training prompts")
    # heldout_prompts draws four times the count asked for: enough for every domain of a mix.
    # --benchmarks, not the config's path: the same overlap check wherever the checkout lies.
    wanted = dataclasses.replace(config, heldout_prompts=args.prompts_per_domain * len(MIXES[args.mix]),
                                 heldout_seed=args.data_seed, heldout_mix=args.mix, benchmarks_dir=args.benchmarks)
    by_domain: dict[str, list[list[int]]] = {domain: [] for domain in MIXES[args.mix]}
    for prompt in heldout_prompts(wanted):
        ids, _ = render_prompts(config, [prompt], tokenizer)
        if ids and len(by_domain[prompt.domain]) < args.prompts_per_domain:
            by_domain[prompt.domain].append(ids[0])
    return by_domain


def windowed_copy(directory: Path, window: int, scratch: Path) -> Path:
    """The drafter at ``directory`` with ``sliding_window = window``: same weights, edited config."""
    copy = scratch / f"{directory.name}_window{window}"
    copy.mkdir()
    for item in directory.iterdir():
        if item.name != "config.json":
            (copy / item.name).symlink_to(item.resolve())
    config = json.loads((directory / "config.json").read_text())
    config["drafter"]["sliding_window"] = window
    (copy / "config.json").write_text(json.dumps(config, indent=2))
    return copy


def committed_by_bucket(decoder, prompts, *, max_new_tokens: int, bucket: int, stop_ids: list[int]) -> list[list[list[int]]]:
    """Per prompt, per bucket of answer positions: the tokens committed by each round starting there."""
    buckets = max_new_tokens // bucket
    per_prompt = []
    for ids in prompts:
        out = decoder.generate([ids], max_new_tokens=max_new_tokens, stop_ids=stop_ids)
        committed = [[] for _ in range(buckets)]
        position = 1  # the prefill emitted the answer's first token
        for tokens in out.committed_per_round:
            committed[min(position // bucket, buckets - 1)].append(int(tokens[0]))
            position += int(tokens[0])
        per_prompt.append(committed)
    return per_prompt


def bucket_names(max_new_tokens: int, bucket: int) -> list[str]:
    """The answer positions of each bucket; the last one also holds the rounds past the last whole
    bucket (``committed_by_bucket``), so it ends at ``max_new_tokens - 1``."""
    count = max_new_tokens // bucket
    return [f"{i * bucket}-{(i + 1) * bucket - 1 if i < count - 1 else max_new_tokens - 1}" for i in range(count)]


def tau_by_bucket(per_prompt: list[list[list[int]]], names: list[str]) -> dict:
    """Per bucket: τ (tokens committed per round, pooled over the prompts) and the rounds."""
    from dspark_jax.eval.metrics import tau_of

    cells = {}
    for i, name in enumerate(names):
        rounds = [c for committed in per_prompt for c in committed[i]]
        cells[name] = {"tau": tau_of([rounds]) if rounds else None, "rounds": len(rounds)}
    return cells


def window_intervals(results: dict, base: str, label: str, names: list[str], *, level: float = 0.9) -> dict:
    """Per bucket: τ(label) / τ(base) pooled over every prompt, and its percentile-bootstrap
    interval over the prompts (the same prompts, and greedy answers, for both)."""
    from dspark_jax.eval.compare import ratio_interval

    def prompts_of(name):
        return [committed for domain in results[name]["committed"].values() for committed in domain]

    cells = {}
    for i, bucket in enumerate(names):
        taus = results[label]["pooled"][bucket]["tau"], results[base]["pooled"][bucket]["tau"]
        if None in taus:
            cells[bucket] = {"ratio": None, "interval": None}
            continue
        arrays = {name: [np.array(committed[i], int) for committed in prompts_of(name)] for name in (label, base)}
        cells[bucket] = {"ratio": taus[0] / taus[1], "interval": ratio_interval({"all": arrays}, label, base, level=level)}
    return cells


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from dspark_jax.checkpoints.drafter import load_drafter, read_drafter_config
    from dspark_jax.checkpoints.gguf import load_embedded_target
    from dspark_jax.decoding.speculative import FixedPolicy, SpeculativeDecoder
    from dspark_jax.drafters import resolve_drafter

    target, tokenizer = load_embedded_target()
    prompts = benchmark_prompts(args, tokenizer) if args.mix is None else mix_prompts(args, tokenizer)
    started = time.time()
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        runs = []
        for spec in args.drafter:
            directory = Path(resolve_drafter(spec)[1])
            runs.append((spec, None, directory))
            if read_drafter_config(directory)[0].kind != "eagle3":
                runs += [(f"{spec}@window{w}", spec, windowed_copy(directory, w, Path(scratch))) for w in args.window]
        names = bucket_names(args.max_new_tokens, args.bucket)
        for label, whole_context, directory in runs:
            drafter = load_drafter(directory, target=target)
            decoder = SpeculativeDecoder(target, drafter, policy=FixedPolicy(drafter.cfg.block_size))
            committed = {domain: committed_by_bucket(decoder, ids, max_new_tokens=args.max_new_tokens,
                                                   bucket=args.bucket, stop_ids=tokenizer.stop_ids)
                        for domain, ids in prompts.items()}
            results[label] = {
                "sliding_window": drafter.cfg.sliding_window,
                "domains": {domain: tau_by_bucket(c, names) for domain, c in committed.items()},
                "pooled": tau_by_bucket([p for c in committed.values() for p in c], names),
                "committed": committed,
            }
            if whole_context is not None:
                results[label]["vs_whole_context"] = window_intervals(results, whole_context, label, names)
            print(label, {k: round(v["tau"], 3) if v["tau"] else None for k, v in results[label]["pooled"].items()},
                  flush=True)
    report = {
        "settings": {"prompts_per_domain": args.prompts_per_domain, "max_new_tokens": args.max_new_tokens,
                     "bucket": args.bucket, "decoding": "greedy, B=1, fixed:γ, stop at EOS",
                     **({"benchmarks": DOMAINS} if args.mix is None else
                        {"mix": args.mix, "data_seed": args.data_seed, "config": args.config}),
                     "prompts": {domain: len(ids) for domain, ids in prompts.items()}},
        "wall_s": time.time() - started,
        "results": results,
    }
    write_json(args.out, report, indent=1)
    summary = {label: {k: None if v["tau"] is None else round(v["tau"], 3) for k, v in r["pooled"].items()}
               for label, r in results.items()}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
