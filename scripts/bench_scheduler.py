#!/usr/bin/env python
"""Batched decoding: verify-length policies against target-only throughput as the batch grows.

What the hardware-aware scheduler is for: a verify forward's cost grows with the batch × width
it runs at (steeply on a CPU), so a policy that is right at B=1 is wrong at B=8. On the embedded
SmolLM2-135M-Instruct target (or ``--checkpoint``, in ``--dtype``) with a shipped drafter, greedy:

- prompts: math (GSM8K), code (HumanEval) and chat (MT-Bench) first turns from ``--benchmarks``,
  interleaved, so every batch mixes domains; ``--batches-per-size`` batches of B for each B;
- every decoder is warmed up at every (B, prompt bucket) first; the scheduler's cost table is
  profiled for every B on its own decoder before anything is timed;
- per batch: target-only, then each policy, on the same prompts (best of ``--repeats``);
- per (B, policy): decode throughput (generated tokens / decode seconds, pooled over batches),
  the ratio to target-only's at the same B, τ, the verify-width histogram, the mean verify
  length, how many rounds skipped the draft (``plain_rounds``), and whether greedy outputs equal
  target-only's token for token.

Writes JSON (``--out``) and a PNG of throughput against B next to it; the last line printed is
``{"speedup": {"<policy>": {"<B>": ratio}}, "identical": ...}``.

    .venv/bin/python scripts/bench_scheduler.py                   # B in 1 4 8, four policies
    .venv/bin/python scripts/bench_scheduler.py --quick           # B in 1 4, 12 new tokens
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from dspark_jax.cli import add_checkpoint_argument, positive_int
from dspark_jax.config import write_json
from dspark_jax.eval.bench import (
    interleaved_texts,
    json_output_with_plot,
    policy_bench,
    set_quick_defaults,
    target_label,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BENCHMARKS = REPO_ROOT.parent / "shared" / "benchmarks"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--benchmarks", default=str(DEFAULT_BENCHMARKS))
    ap.add_argument("--drafter", default="smollm2_135m_dspark")
    add_checkpoint_argument(ap)
    ap.add_argument("--policy", action="append", default=None,
                    help="repeatable (default: fixed:7, threshold:0.4, scheduler, scheduler-ahead)")
    ap.add_argument("--batches", type=positive_int, nargs="+", default=None,
                    help="batch sizes (default 1 4 8; --quick: 1 4)")
    ap.add_argument("--batches-per-size", type=positive_int, default=None, help="batches timed per B (default 2; --quick: 1)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=None, help="default 64 (--quick: 12)")
    ap.add_argument("--repeats", type=positive_int, default=1)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=json_output_with_plot,
                    default=str(REPO_ROOT / "docs" / "scheduler" / "bench_scheduler_batch.json"),
                    help="JSON output; the PNG goes next to it")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    args.policy = args.policy or ["fixed:7", "threshold:0.4", "scheduler", "scheduler-ahead"]
    set_quick_defaults(args, batches=([1, 4], [1, 4, 8]), batches_per_size=(1, 2), max_new_tokens=(12, 64))
    return args


def results_table(totals: dict) -> dict:
    """Per decoder and B (as a string): decode tokens/s and, for the policies, the ratio to
    target-only's, τ and the verify widths, from the pooled ``totals``; NaN where there was
    nothing to time (every answer one token long: no decode step)."""
    import numpy as np

    from dspark_jax.eval.compare import _ratio
    from dspark_jax.eval.metrics import tau_of

    results = {}
    for name, per_batch in totals.items():
        results[name] = {}
        for b, e in per_batch.items():
            rate = _ratio(e["tokens"], e["decode_s"])
            row = {"tokens": e["tokens"], "decode_s": e["decode_s"], "tokens_per_s": rate}
            if name != "target_only":
                base = totals["target_only"][b]
                lengths = np.concatenate(e["lengths"]) if e["lengths"] else np.zeros(0)
                widths, counts = np.unique(np.asarray(e["widths"], int), return_counts=True)
                row |= {
                    "speedup": _ratio(rate, _ratio(base["tokens"], base["decode_s"])),
                    "tau": tau_of(e["committed"]),
                    "mean_verify_length": float(lengths.mean()) if lengths.size else float("nan"),
                    "width_histogram": {str(int(w)): int(c) for w, c in zip(widths, counts)},
                    "rounds": len(e["widths"]),
                    "plain_rounds": e["plain_rounds"],
                    "identical": e["identical"],
                }
            results[name][str(b)] = row
    return results


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for name, per_batch in results.items():
        batches = sorted(int(b) for b in per_batch)
        ax.plot(batches, [per_batch[str(b)]["tokens_per_s"] for b in batches], marker="o", label=name)
    ax.set_xlabel("batch size B")
    ax.set_ylabel("decode tokens/s")
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    from dspark_jax.cli import check_drafter_arg, parse_policy_arg, policy_text
    from dspark_jax.decoding.autoregressive import AutoregressiveGenerator, prompt_width
    from dspark_jax.diagnostics import count_compilations
    from dspark_jax.eval.bench import machine_info
    from dspark_jax.eval.compare import json_clean
    from dspark_jax.scheduler.profile import policy_summary

    policies = {text: parse_policy_arg(text) for text in args.policy}
    check_drafter_arg(args.drafter)
    texts = interleaved_texts(args.benchmarks, max(args.batches) * args.batches_per_size)
    started, load_start = time.time(), os.getloadavg()
    # One cache length for every decoder, target-only too (eval.bench.policy_decoders).
    target, tokenizer, prompts, max_len, decoders = policy_bench(
        texts, args.drafter, policies, batches=args.batches, max_new_tokens=args.max_new_tokens,
        checkpoint=args.checkpoint, dtype=args.dtype)
    stops = tokenizer.stop_ids
    baseline = AutoregressiveGenerator(target)

    t0 = time.perf_counter()
    for b in args.batches:
        groups = [prompts[i * b:(i + 1) * b] for i in range(args.batches_per_size)]
        # One prompt length per bucket (a group's longest): what warmup() compiles for it, then an
        # untimed run, since generate() compiles per prompt shape what warmup() does not.
        for length in sorted({prompt_width(n, max_len): n for n in (max(len(p) for p in g) for g in groups)}.values()):
            for generator in (baseline, *decoders.values()):
                generator.warmup(b, length, max_len)
                generator.generate([[1] * length] * b, max_new_tokens=min(args.max_new_tokens, 4), stop_ids=stops,
                                   max_len=max_len)
    compile_s = time.perf_counter() - t0
    print(f"compiled and warmed up in {compile_s:.0f} s", file=sys.stderr)

    def best(generator, batch):
        runs = [generator.generate(batch, max_new_tokens=args.max_new_tokens, stop_ids=stops, max_len=max_len)
                for _ in range(args.repeats)]
        return min(runs, key=lambda r: r.decode_s)

    def produced(result):
        return sum(max(len(t) - 1, 0) for t in result.tokens)

    totals = {name: {b: {"tokens": 0, "decode_s": 0.0, "committed": [], "lengths": [], "widths": [],
                         "plain_rounds": 0, "identical": True} for b in args.batches} for name in ["target_only", *decoders]}
    with count_compilations() as compiled:  # every XLA compilation while timing: none expected
        for b in args.batches:
            for i in range(args.batches_per_size):
                batch = prompts[i * b:(i + 1) * b]
                base = best(baseline, batch)
                totals["target_only"][b]["tokens"] += produced(base)
                totals["target_only"][b]["decode_s"] += base.decode_s
                for name, decoder in decoders.items():
                    spec = best(decoder, batch)
                    entry = totals[name][b]
                    entry["tokens"] += produced(spec)
                    entry["decode_s"] += spec.decode_s
                    entry["committed"] += spec.committed_per_round
                    entry["lengths"] += spec.verify_lengths
                    entry["widths"] += spec.verify_widths
                    entry["plain_rounds"] += spec.plain_rounds
                    entry["identical"] &= spec.tokens == base.tokens
                print(f"B={b} batch {i + 1}/{args.batches_per_size} done", file=sys.stderr)

    if compiled.count:
        print(f"warning: {compiled.count} compilations while timing: the times include them", file=sys.stderr)
    results = results_table(totals)
    summary = {
        "speedup": {n: {b: round(r["speedup"], 3) for b, r in per.items()} for n, per in results.items() if n != "target_only"},
        "identical": all(r["identical"] for n, per in results.items() if n != "target_only" for r in per.values()),
    }
    body = {
        "summary": summary,
        "mode": "quick" if args.quick else "full",
        "started_unix": started,
        "wall_s": time.time() - started,
        "machine": machine_info(),
        "load_avg_start": load_start,
        "settings": {"target": target_label(args.checkpoint, args.dtype), "dtype": args.dtype, "drafter": args.drafter,
                     "batches": args.batches, "batches_per_size": args.batches_per_size,
                     "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "greedy": True,
                     "prompts": "math/code/chat first turns interleaved", "cache_len": max_len},
        "policies": {n: policy_text(d.policy) for n, d in decoders.items()},
        "scheduler_tables": {n: policy_summary(d.policy) for n, d in decoders.items() if hasattr(d.policy, "costs")},
        "compile_s": compile_s,
        "compiles_while_timing": compiled.count,
        "results": results,
        "method": {"speedup": "decode tokens/s of the policy / target-only's at the same B (tokens and decode "
                   "seconds pooled over the batches; best of repeats per batch)",
                   "identical": "greedy outputs equal target-only's token for token in every batch"},
    }
    write_json(args.out, json_clean(body), indent=1)
    if not args.no_plot:
        plot(json_clean(results), args.out.with_suffix(".png"),
             f"{target_label(args.checkpoint, args.dtype)} + {args.drafter}, greedy, {args.max_new_tokens} new tokens, "
             "mixed prompts")
    for name, per in results.items():
        cells = "  ".join(f"B={b}: {r['tokens_per_s']:.1f} tok/s" + (f" x{r['speedup']:.2f} τ {r['tau']:.2f}"
                                                                  if "speedup" in r else "") for b, r in per.items())
        print(f"{name:14s} {cells}", file=sys.stderr)
    print(json.dumps(json_clean(summary)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
