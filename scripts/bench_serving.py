#!/usr/bin/env python
"""Serving under load: requests arriving over time, target-only against speculative policies.

Where DSpark's scheduler is meant to pay (paper §6.7; vLLM's adaptive verification is measured
the same way, sweeping load): a fixed verify length that suits one request wastes the verify
forward once many share it. On the embedded SmolLM2-135M-Instruct target (or ``--checkpoint``,
in ``--dtype``) with a shipped drafter, greedy unless ``--temperature`` (with ``--top-k``, ``--top-p``) says otherwise:

- requests: ``--requests`` math (GSM8K), code (HumanEval) and chat (MT-Bench) first turns,
  interleaved, arriving as a Poisson process at each of ``--rates`` requests per second
  (``inf``: all at the start, a closed batch); every decoder gets the same arrival times
  (``--seed``);
- at most B decode together, for each B of ``--batch-sizes`` (continuous batching: a request
  takes a row as one frees up, ``engine.load.serve``); each B > 1 also with batch buckets
  ("B=4 buckets": each step runs at the smallest of 1, 2, 4 rows that holds the requests in
  flight; ``--no-buckets`` skips these runs);
- decoders: target-only and each ``--policy`` (default ``fixed:7`` and ``scheduler``, whose cost
  table is profiled at every batch size the runs take, on the cache serving uses); every program
  is compiled before timing (``engine.load.warm_up``) and compilations while timing are counted;
  runs alternate between decoders, and between static rows and buckets, at each (B, rate), so a
  burst of load from other processes hits all alike;
- per run: throughput (tokens/s over the run), per-user speed (the median request's 1 / TPOT),
  latency, time to first token and TPOT (mean, p50, p90, p99), τ and verify widths; greedy
  outputs compared with target-only's (sampled ones are not: each decoder draws its own
  random numbers, request i from seed ``--sampling-seed`` + i); per (policy, B, rate) the
  throughput and p90-latency ratios to target-only's; the Pareto front of (throughput, per-user
  speed) over every run. A sampled scheduler is profiled with that sampling and served by the
  drafter's calibration for it.

Writes JSON (``--out``) and a PNG beside it: per-user speed against throughput (one line per
decoder and B across the rates, the front ringed) and p90 latency against the arrival rate. The
last line printed is ``{"throughput_ratio": {"<policy>": {"B=<b>": {"<rate>": x}}},
"pareto_front": [...], "identical": ...}``.

    .venv/bin/python scripts/bench_serving.py                  # 16 requests, B 1 4, 4 rates
    .venv/bin/python scripts/bench_serving.py --rates 0.5 inf --batch-sizes 8 --requests 32
    .venv/bin/python scripts/bench_serving.py --temperature 1 --batch-sizes 1 8
    .venv/bin/python scripts/bench_serving.py --quick          # 4 requests, B 2, 12 new tokens
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

from dspark_jax.cli import (
    add_checkpoint_argument,
    add_sampling_arguments,
    positive_int,
    sampling_from_args,
)
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
TARGET_ONLY = "target-only"


def arrival_rate(text: str) -> float:
    """argparse type for ``--rates``: requests per second > 0, or ``inf`` (all at the start)."""
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an arrival rate: requests per second > 0, or inf")
    return rate


def rate_name(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--benchmarks", default=str(DEFAULT_BENCHMARKS))
    ap.add_argument("--drafter", default="smollm2_135m_dspark")
    add_checkpoint_argument(ap)
    ap.add_argument("--policy", action="append", default=None, help="repeatable (default: fixed:7, scheduler)")
    ap.add_argument("--requests", type=positive_int, default=None, help="default 16 (--quick: 4)")
    ap.add_argument("--rates", type=arrival_rate, nargs="+", default=None,
                    help="arrival rates, requests/s; inf: all at the start (default 0.25 0.5 1 inf; --quick: 2 inf)")
    ap.add_argument("--batch-sizes", type=positive_int, nargs="+", default=None,
                    help="rows decoding at once (default 1 4; --quick: 2)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=None, help="default 64 (--quick: 12)")
    ap.add_argument("--no-buckets", action="store_true", help="skip the runs with batch buckets")
    ap.add_argument("--seed", type=int, default=0, help="arrival times")
    add_sampling_arguments(ap, "0 = greedy (outputs then compared with target-only's)", seed_help=False)
    ap.add_argument("--sampling-seed", type=int, default=0, help="request i samples from seed SAMPLING_SEED + i")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=json_output_with_plot, default=str(REPO_ROOT / "docs" / "serving" / "bench_serving.json"),
                    help="JSON output; the PNG goes next to it")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    try:
        args.sampling = sampling_from_args(args)
    except ValueError as error:
        ap.error(f"--temperature/--top-k/--top-p: {error}")
    args.policy = args.policy or ["fixed:7", "scheduler"]
    if TARGET_ONLY in args.policy:
        ap.error(f"--policy {TARGET_ONLY}: target-only decoding always runs, as the baseline")
    set_quick_defaults(args, requests=(4, 16), rates=([2.0, math.inf], [0.25, 0.5, 1.0, math.inf]),
                       batch_sizes=([2], [1, 4]), max_new_tokens=(12, 64))
    return args


def compare_runs(summaries: dict) -> dict:
    """Per policy, B and rate: throughput and p90-latency ratios to target-only's (the same B and
    rate), and the runs on the Pareto front of (throughput, per-user speed)."""
    from dspark_jax.engine.load import pareto_front
    from dspark_jax.eval.compare import _ratio

    ratios = {}
    for name, per_b in summaries.items():
        if name == TARGET_ONLY:
            continue
        ratios[name] = {b: {rate: {"throughput": _ratio(s["throughput"], summaries[TARGET_ONLY][b][rate]["throughput"]),
                                   "latency_p90": _ratio(s["latency_s"]["p90"],
                                                         summaries[TARGET_ONLY][b][rate]["latency_s"]["p90"])}
                            for rate, s in per_rate.items()} for b, per_rate in per_b.items()}
    labels = [(name, b, rate) for name, per_b in summaries.items() for b, per_rate in per_b.items() for rate in per_rate]
    points = [(summaries[n][b][r]["throughput"], summaries[n][b][r]["per_user_tokens_per_s"]) for n, b, r in labels]
    front = [f"{n} {b} rate {r}" for n, b, r in (labels[i] for i in pareto_front(points))]
    return {"ratios": ratios, "pareto_front": front}


def plot(summaries: dict, front: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (trade, latency) = plt.subplots(1, 2, figsize=(11, 4))
    colors = dict(zip(summaries, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    markers = "osD^v<>"
    for name, per_b in summaries.items():
        for j, (b, per_rate) in enumerate(per_b.items()):
            rates = list(per_rate)
            style = dict(color=colors[name], marker=markers[j % len(markers)], label=f"{name} {b}")
            trade.plot([per_rate[r]["throughput"] for r in rates], [per_rate[r]["per_user_tokens_per_s"] for r in rates],
                       **style)
            for r in rates:
                if f"{name} {b} rate {r}" in front:
                    trade.scatter(per_rate[r]["throughput"], per_rate[r]["per_user_tokens_per_s"], s=160,
                                  facecolors="none", edgecolors="black", linewidths=1.2)
            latency.plot(range(len(rates)), [per_rate[r]["latency_s"]["p90"] for r in rates], **style)
            latency.set_xticks(range(len(rates)), [r if r != "inf" else "all at\nonce" for r in rates])
    trade.set(xlabel="throughput, tokens/s", ylabel="per-user speed, tokens/s (median 1 / TPOT)",
              title="trade-off over arrival rates (ringed: Pareto front)")
    latency.set(xlabel="arrival rate, requests/s", ylabel="p90 latency, s", ylim=(0, None), title="latency under load")
    for ax in (trade, latency):
        ax.grid(True, alpha=0.3)
    latency.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    from dspark_jax.cli import check_drafter_arg, parse_policy_arg, policy_text
    from dspark_jax.decoding.autoregressive import AutoregressiveGenerator
    from dspark_jax.decoding.slots import refill_sizes
    from dspark_jax.diagnostics import count_compilations
    from dspark_jax.engine.load import poisson_arrivals, serve, warm_up
    from dspark_jax.eval.bench import machine_info
    from dspark_jax.eval.compare import json_clean
    from dspark_jax.scheduler.profile import policy_summary

    policies = {text: parse_policy_arg(text) for text in args.policy}
    check_drafter_arg(args.drafter)
    texts = interleaved_texts(args.benchmarks, args.requests)
    started, load_start = time.time(), os.getloadavg()
    # Each B as is, and (B > 1) with batch buckets: (label, B, batch_buckets).
    batchings = [(f"B={b}{' buckets' if buckets else ''}", b, buckets) for b in args.batch_sizes
                 for buckets in (False, True) if not buckets or (b > 1 and not args.no_buckets)]
    profile_batches = sorted({size for _, b, buckets in batchings for size in (refill_sizes(b) if buckets else [b])})
    # One cache length for every decoder, target-only too (eval.bench.policy_decoders).
    target, tokenizer, prompts, max_len, speculative = policy_bench(
        texts, args.drafter, policies, batches=profile_batches, max_new_tokens=args.max_new_tokens,
        sampling=args.sampling, checkpoint=args.checkpoint, dtype=args.dtype)
    decoders = {TARGET_ONLY: AutoregressiveGenerator(target), **speculative}
    # What every generate call of a run takes besides its batching.
    decoding = dict(stop_ids=tokenizer.stop_ids, max_len=max_len, sampling=args.sampling,
                    seeds=[args.sampling_seed + i for i in range(len(prompts))])

    compile_s = sum(warm_up(decoder, prompts, batch_size=b, batch_buckets=buckets, **decoding)
                    for _, b, buckets in batchings for decoder in decoders.values())
    print(f"compiled and warmed up in {compile_s:.0f} s", file=sys.stderr)

    arrivals = {rate_name(rate): poisson_arrivals(len(prompts), rate, seed=args.seed) for rate in args.rates}
    summaries = {name: {label: {} for label, _, _ in batchings} for name in decoders}
    greedy = args.sampling.greedy
    identical = {name: True for name in decoders if name != TARGET_ONLY} if greedy else None
    with count_compilations() as compiled:
        for b, (rate, times) in itertools.product(args.batch_sizes, arrivals.items()):
            for label, buckets in [(label, buckets) for label, size, buckets in batchings if size == b]:
                base = None
                for name, decoder in decoders.items():
                    run = serve(decoder, prompts, times, max_new_tokens=args.max_new_tokens, batch_size=b,
                                batch_buckets=buckets, **decoding)
                    summaries[name][label][rate] = s = run.summary()
                    if base is None:
                        base = run.result.tokens
                    elif greedy:
                        identical[name] &= run.result.tokens == base
                    print(f"{label} rate {rate}: {name:12s} {s['throughput']:6.1f} tok/s, per user "
                          f"{s['per_user_tokens_per_s']:5.1f} tok/s, latency p90 {s['latency_s']['p90']:6.2f} s"
                          + (f", tau {s['tau']:.2f}" if "tau" in s else ""), file=sys.stderr, flush=True)
    if compiled.count:
        print(f"warning: {compiled.count} compilations while timing: the times include them", file=sys.stderr)

    compared = compare_runs(summaries)
    summary = {
        "throughput_ratio": {n: {b: {r: round(x["throughput"], 3) for r, x in per_rate.items()}
                                 for b, per_rate in per_b.items()} for n, per_b in compared["ratios"].items()},
        "pareto_front": compared["pareto_front"],
        "identical": all(identical.values()) if greedy else None,
    }
    body = {
        "summary": summary,
        "mode": "quick" if args.quick else "full",
        "started_unix": started,
        "wall_s": time.time() - started,
        "machine": machine_info(),
        "load_avg_start": load_start,
        "settings": {"target": target_label(args.checkpoint, args.dtype), "dtype": args.dtype, "drafter": args.drafter,
                     "requests": len(prompts), "rates": list(arrivals),
                     "batch_sizes": args.batch_sizes, "batch_buckets": not args.no_buckets,
                     "max_new_tokens": args.max_new_tokens, "seed": args.seed,
                     "sampling": args.sampling.describe(), "sampling_seeds": f"{args.sampling_seed} + request index",
                     "prompts": "math/code/chat first turns interleaved", "cache_len": max_len},
        "arrivals_s": {rate: times.tolist() for rate, times in arrivals.items()},
        "policies": {n: policy_text(d.policy) for n, d in speculative.items()},
        "scheduler_tables": {n: policy_summary(d.policy) for n, d in speculative.items() if hasattr(d.policy, "costs")},
        "compile_s": compile_s,
        "compiles_while_timing": compiled.count,
        "runs": summaries,
        "ratios_to_target_only": compared["ratios"],
        "identical_per_policy": identical,
        "method": {"throughput": "tokens generated / seconds from the first arrival to the last token",
                   "per_user_tokens_per_s": "1 / the median request's time per output token after its first",
                   "latency_s": "arrival to last token; ttft_s: arrival to first token (queueing + prefill)",
                   "pareto_front": "runs no other run matches or beats on both throughput and per-user speed",
                   "identical": "greedy outputs equal target-only's token for token in every run (null: sampled)"},
    }
    write_json(args.out, json_clean(body), indent=1)
    if not args.no_plot:
        plot(json_clean(summaries), compared["pareto_front"], args.out.with_suffix(".png"),
             f"{target_label(args.checkpoint, args.dtype)} + {args.drafter}, {args.sampling.describe()}, {len(prompts)} requests of up to "
             f"{args.max_new_tokens} tokens, "
             f"Poisson arrivals")
    print(json.dumps(json_clean(summary)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
