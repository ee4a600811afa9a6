#!/usr/bin/env python
"""Fixed batches, continuous batching and batch buckets, side by side, on one batch job.

``--per-set`` first turns from each of ``--sets`` (default GSM8K, HumanEval, MT-Bench;
interleaved, so answers of different lengths share every batch), chat-templated, answered
greedily by the embedded target (or ``--checkpoint``, in ``--dtype``) with
``AutoregressiveGenerator.generate(prompts, batch_size=B)`` (what ``dspark batch`` runs) in three modes: ``fixed`` (``--fixed-batches``),
``continuous`` (the default) and ``buckets`` (continuous, ``--batch-buckets``: each step at the
smallest of 1, 2, 4, ..., B rows holding the requests in flight). The modes alternate
``--rounds`` times on one generator: the first round of each compiles its shapes (continuous
batching has more: refill prefills of 1, 2, 4, ... rows and the row insert; buckets more again:
steps and resizes at every size), later rounds are warm.

Per run: wall seconds, decode steps, their mean rows, prefill and decode seconds, tokens/s. Per
job: the completion lengths (a fixed batch runs as long as its longest answer; that is what
continuous batching wins back; its tail, fewer requests than rows, is what buckets win back) and
whether each mode produced the fixed batches' tokens (greedy, target-only: they must, up to float
rounding across batch sizes with buckets).

Writes JSON (``--out``); the last line printed is ``{"speedup": {mode: its tokens/s over fixed's,
last round}, "steps": {mode: decode steps}, "identical": {mode: tokens equal to fixed's}}``.

    .venv/bin/python scripts/bench_batch.py                            # 8 a set, 256 tokens, B = 8
    .venv/bin/python scripts/bench_batch.py --sets gsm8k --per-set 32 --max-new-tokens 384
    .venv/bin/python scripts/bench_batch.py --quick                    # 2 a set, 24 tokens, B = 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dspark_jax.cli import add_checkpoint_argument, positive_int
from dspark_jax.config import write_json
from dspark_jax.eval.bench import (
    bench_target,
    json_output,
    read_benchmark_prompts,
    set_quick_defaults,
    target_label,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BENCHMARKS = REPO_ROOT.parent / "shared" / "benchmarks"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_checkpoint_argument(ap)
    ap.add_argument("--benchmarks", default=str(DEFAULT_BENCHMARKS))
    ap.add_argument("--sets", nargs="+", default=["gsm8k", "humaneval", "mt-bench"])
    ap.add_argument("--per-set", type=positive_int, default=None, help="prompts from each set (default 8; --quick: 2)")
    ap.add_argument("--batch-size", type=positive_int, default=None, help="default 8 (--quick: 2)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=None, help="default 256 (--quick: 24)")
    ap.add_argument("--rounds", type=positive_int, default=2, help="runs of each mode, alternating")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=json_output, default=str(REPO_ROOT / "docs" / "batch" / "bench_batch.json"))
    args = ap.parse_args(argv)
    set_quick_defaults(args, per_set=(2, 8), batch_size=(2, 8), max_new_tokens=(24, 256))
    return args


def prompt_texts(benchmarks, sets, per_set: int) -> list[str]:
    """The first ``per_set`` first turns of each set, interleaved (math, code, chat, math, ...)."""
    groups = read_benchmark_prompts(benchmarks, [f"{name}.jsonl" for name in sets], per_set)
    for name, texts in zip(sets, groups):
        if len(texts) < per_set:
            raise SystemExit(f"--benchmarks: {name}.jsonl has {len(texts)} prompts, fewer than --per-set {per_set}")
    return [text for group in zip(*groups) for text in group]


def main(argv=None) -> dict:
    args = parse_args(argv)
    from dspark_jax.decoding.autoregressive import AutoregressiveGenerator
    from dspark_jax.eval.metrics import mean_batch_rows

    texts = prompt_texts(args.benchmarks, args.sets, args.per_set)
    target, tokenizer = bench_target(args.checkpoint, args.dtype)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}]) for text in texts]
    generator = AutoregressiveGenerator(target)
    kwargs = dict(max_new_tokens=args.max_new_tokens, stop_ids=tokenizer.stop_ids, batch_size=args.batch_size,
                  max_len=generator.cache_len_for([len(p) for p in prompts], args.max_new_tokens))
    modes = {"fixed": dict(continuous=False), "continuous": dict(continuous=True),
             "buckets": dict(continuous=True, batch_buckets=True)}
    runs, tokens = [], {}
    for round_index in range(args.rounds):
        for mode, options in modes.items():
            start = time.perf_counter()
            result = generator.generate(prompts, **options, **kwargs)
            seconds = time.perf_counter() - start
            tokens[mode] = result.tokens
            runs.append({"mode": mode, "round": round_index, "seconds": round(seconds, 2), "steps": result.steps,
                         "mean_rows": round(mean_batch_rows(result), 3),
                         "prefill_s": round(result.prefill_s, 2), "decode_s": round(result.decode_s, 2),
                         "completion_tokens": result.num_generated,
                         "tokens_per_s": round(result.num_generated / seconds, 2)})
            print(json.dumps(runs[-1]), flush=True)
    last = {run["mode"]: run for run in runs if run["round"] == args.rounds - 1}
    lengths = [len(t) for t in tokens["continuous"]]
    report = {
        "settings": {"requests": len(prompts), "sets": args.sets, "per_set": args.per_set,
                     "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
                     "target": target_label(args.checkpoint, args.dtype), "dtype": args.dtype,
                     "sampling": "greedy", "drafter": None},
        "runs": runs,
        "completion_lengths": lengths,
        "at_limit": sum(n == args.max_new_tokens for n in lengths),
        "identical": {mode: tokens[mode] == tokens["fixed"] for mode in modes},
        "speedup": {mode: round(last[mode]["tokens_per_s"] / last["fixed"]["tokens_per_s"], 3) for mode in modes},
        "steps": {mode: last[mode]["steps"] for mode in modes},
    }
    write_json(args.out, report, indent=2)
    print(json.dumps({k: report[k] for k in ("speedup", "steps", "identical")}))
    return report


if __name__ == "__main__":
    main()
