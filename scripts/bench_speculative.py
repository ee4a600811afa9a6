#!/usr/bin/env python
"""Benchmark speculative decoding against target-only decoding on math, code and chat prompts.

On the embedded SmolLM2-135M-Instruct target (or ``--checkpoint``; float32 unless ``--dtype
bfloat16``), one request at a time (B=1):

- prompts: the first ``--prompts-per-domain`` lines of GSM8K (math), HumanEval (code) and
  MT-Bench (chat) from ``--benchmarks DIR`` (``gsm8k.jsonl``, ``humaneval.jsonl``,
  ``mt-bench.jsonl``; one ``{"turns": [...]}`` per line, the first turn, in the chat template);
- every decoder is compiled for every prompt-length bucket and warmed up before timing; each
  prompt then runs target-only and right after it through every drafter (``--repeats`` times,
  the fastest decode counts), so all decoders see the same prompts and the same load;
- per drafter and domain: speedup = speculative / target-only decode tokens per second, pooled
  over the prompts (for greedy outputs, which are identical, the ratio of decode times;
  compilation and prefill excluded; ``speedup_with_prefill`` next to it), τ (tokens committed
  per round), per-position conditional acceptance, acceptance rate, verify-width histogram,
  draft / verify / host time split, tokens/s, and for greedy decoding whether every prompt's
  output equals target-only output token for token (``differing_prompts`` otherwise);
- macro numbers are unweighted means over the three domains; ``tau_ratio`` is
  τ(dspark) / τ(dflash) (macro) and ``tau_ratio_eagle3`` τ(dspark) / τ(eagle3) when drafters of
  both kinds ran; ``accepted_ratio`` / ``accepted_ratio_eagle3`` are the same ratios of accepted
  drafts per round (τ − 1), which the bonus token does not dilute; each with a 90% bootstrap
  interval over the prompts (``tau_ratio_interval``).

Writes JSON (``--out``) and a PNG of per-position acceptance with the same stem; the last line
printed is the summary ``{"identical": ..., "speedup": {"math": ..., "code": ..., "chat": ...},
"tau": {"<drafter>": {...}, ...}}`` (speedup of the first drafter; ``identical`` is null when
sampling; the ratios and their ``_interval`` are added when they exist).

    .venv/bin/python scripts/bench_speculative.py                       # shipped DSpark drafter
    .venv/bin/python scripts/bench_speculative.py --compare-baselines   # DSpark, DFlash, EAGLE-3
    .venv/bin/python scripts/bench_speculative.py --quick --drafter /path/to/drafter_dir
    .venv/bin/python scripts/bench_speculative.py --dtype bfloat16      # on a GPU or TPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from dspark_jax.cli import add_checkpoint_argument, positive_int
from dspark_jax.config import write_json
from dspark_jax.eval.bench import (
    json_output_with_plot,
    read_benchmark_prompts,
    set_quick_defaults,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BENCHMARKS = REPO_ROOT.parent / "shared" / "benchmarks"
INTERVAL_LEVEL = 0.9  # of the bootstrap intervals around the τ ratios


def parse_args(argv):
    from dspark_jax.drafters import SHIPPED

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--benchmarks", default=str(DEFAULT_BENCHMARKS),
                    help="directory with gsm8k.jsonl, humaneval.jsonl, mt-bench.jsonl (default: ../shared/benchmarks)")
    ap.add_argument("--drafter", action="append", default=None,
                    help=f"shipped drafter name ({', '.join(SHIPPED)}) or checkpoint directory; repeatable "
                    "(default: smollm2_135m_dspark)")
    add_checkpoint_argument(ap)
    ap.add_argument("--compare-baselines", action="store_true",
                    help="also run the three shipped drafters (DSpark, DFlash, EAGLE-3)")
    ap.add_argument("--policy", action="append", default=None,
                    help="fixed:K, threshold:X, scheduler (profiled at start, B=1), scheduler:PROFILE.json, or "
                    "scheduler-ahead[:PROFILE.json] (each round's width planned from the last); "
                    "repeatable: every drafter runs with every policy, side by side (drafters without a "
                    "confidence head run fixed:γ instead); default: the decoder's (fixed:7)")
    ap.add_argument("--prompts-per-domain", type=positive_int, default=None, help="default 10 (--quick: 2)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=None, help="default 128 (--quick: 32)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the identity check needs it)")
    ap.add_argument("--top-k", type=int, default=0, help="with --temperature > 0; 0 = off")
    ap.add_argument("--top-p", type=float, default=1.0, help="with --temperature > 0; 1 = off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=positive_int, default=1,
                    help="sampled paths per prompt (with --temperature > 0): every prompt is decoded with this "
                    "many seeds, the summaries pool them and the intervals resample prompts with all their paths")
    ap.add_argument("--repeats", type=positive_int, default=1, help="runs per prompt and decoder; the fastest counts")
    ap.add_argument("--quick", action="store_true", help="2 prompts per domain, 32 new tokens")
    ap.add_argument("--out", type=json_output_with_plot, default=str(REPO_ROOT / "docs" / "bench_speculative.json"),
                    help="JSON output; the PNG goes next to it")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    set_quick_defaults(args, prompts_per_domain=(2, 10), max_new_tokens=(32, 128))
    if args.seeds > 1 and args.temperature == 0:
        ap.error("--seeds > 1 needs --temperature > 0: greedy decoding takes one path whatever the seed")
    specs = list(args.drafter or [])
    if args.compare_baselines:
        specs += [name for name in SHIPPED if name not in specs]
    args.drafter = specs or [SHIPPED[0]]
    return args


def domain_texts(directory, per_domain: int) -> dict:
    """``{domain: (file, first turns)}`` of the math, code and chat sets."""
    from dspark_jax.eval.compare import DOMAIN_FILES

    texts = read_benchmark_prompts(directory, DOMAIN_FILES.values(), per_domain)
    return {domain: (filename, t) for (domain, filename), t in zip(DOMAIN_FILES.items(), texts)}


def load_domains(texts: dict, tokenizer) -> dict:
    """``domain_texts`` with each prompt in the chat template."""
    return {domain: {"file": filename, "texts": t,
                     "ids": [tokenizer.apply_chat_template([{"role": "user", "content": x}]) for x in t]}
            for domain, (filename, t) in texts.items()}


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = list(next(iter(results.values()))["domains"])
    fig, axes = plt.subplots(1, len(domains), figsize=(4.2 * len(domains), 3.8), sharey=True)
    for ax, domain in zip(axes, domains):
        for name, result in results.items():
            values = [float("nan") if v is None else v for v in result["domains"][domain]["per_position_acceptance"]]
            tau = result["domains"][domain]["tau"]
            label = f"{name} (τ {tau:.2f})" if tau is not None else name
            ax.plot(range(1, len(values) + 1), values, marker="o", label=label)
        gamma = max(len(r["domains"][domain]["per_position_acceptance"]) for r in results.values())
        ax.set_xticks(range(1, gamma + 1))
        ax.set_xlim(0.5, gamma + 0.5)
        ax.set_title(domain)
        ax.set_xlabel("draft position k")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("P(accept k | 1..k-1 accepted)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm

    from dspark_jax.checkpoints.drafter import read_drafter_config
    from dspark_jax.cli import check_drafter_arg, load_drafter_arg, parse_policy_arg, policy_text
    from dspark_jax.config import SamplingConfig
    from dspark_jax.drafters import resolve_drafter
    from dspark_jax.eval.bench import bench_target, machine_info, target_label, weights_digest
    from dspark_jax.eval.compare import (
        Comparison,
        decoding_cache_len,
        json_clean,
        macro,
        make_decoder,
        summarize,
        tau_ratio_interval,
    )
    from dspark_jax.scheduler.prefix import SchedulerPolicy

    try:
        sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    except ValueError as error:
        raise SystemExit(f"--temperature/--top-k/--top-p: {error}") from None
    policies = [(text, parse_policy_arg(text)) for text in args.policy or [None]]
    for spec in args.drafter:  # fail before the target loads
        check_drafter_arg(spec)
    texts = domain_texts(args.benchmarks, args.prompts_per_domain)

    load_avg_start = os.getloadavg()
    started = time.time()
    t0 = time.perf_counter()
    target, tokenizer = bench_target(args.checkpoint, args.dtype)
    print(f"loaded target ({target.num_params / 1e6:.1f}M params) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    domains = load_domains(texts, tokenizer)
    lens = [len(ids) for d in domains.values() for ids in d["ids"]]

    decoders, drafters = {}, {}
    # Scheduler decoders on the same weights share the first one's profiled cost table: profiles
    # of identical weights differ by up to 10% run to run, which would blur an A/B of calibrations.
    profiles = {}
    for spec in args.drafter:
        chosen_here = []
        _, source = resolve_drafter(spec)
        weights = weights_digest(source)
        for text, policy in policies:
            name, drafter, chosen, note = load_drafter_arg(spec, target, policy, fallback=True, sampling=sampling)
            if chosen in chosen_here:  # e.g. a baseline's fixed:γ stand-in for every confidence policy
                continue
            chosen_here.append(chosen)
            base = name if len(policies) == 1 else f"{name}@{text}"
            name, n = base, 2
            while name in decoders:
                name, n = f"{base}#{n}", n + 1
            if isinstance(chosen, SchedulerPolicy) and chosen.costs is None and weights in profiles:
                chosen = dataclasses.replace(chosen, costs=profiles[weights])
            decoders[name] = make_decoder(target, drafter, chosen, profile_sampling=sampling,
                                          profile_max_len=decoding_cache_len(target, drafter, lens, args.max_new_tokens))
            if isinstance(decoders[name].policy, SchedulerPolicy):
                profiles.setdefault(weights, decoders[name].policy.costs)
            drafters[name] = {
                "spec": spec,
                "path": str(source),
                "kind": drafter.cfg.kind,
                "block_size": drafter.cfg.block_size,
                "backbone_layers": drafter.cfg.backbone.num_layers,
                "tap_layers": list(drafter.cfg.tap_layers),
                "markov_head": drafter.cfg.markov_head,
                "confidence_head": drafter.cfg.confidence_head,
                "draft_vocab_size": drafter.cfg.draft_vocab_size,
                "policy": policy_text(decoders[name].policy),
                "policy_note": note,
                "metadata": read_drafter_config(source)[1],
            }
            if note:
                print(f"note: {name}: {note}", file=sys.stderr)

    comparison = Comparison(target, decoders, max_new_tokens=args.max_new_tokens,
                            stop_ids=tokenizer.stop_ids, sampling=sampling)
    total = args.seeds * sum(len(d["ids"]) for d in domains.values())
    with tqdm(total=total + 1, desc="bench_speculative", file=sys.stderr, dynamic_ncols=True) as bar:
        bar.set_postfix_str(f"compile + warm-up ({len(decoders) + 1} decoders)")
        compile_s = comparison.prepare(lens)
        bar.update(1)
        runs = {}
        for domain, data in domains.items():
            bar.set_postfix_str(domain)
            # Path p of prompt i draws with seed `seed + p·prompts + i`: path 0 is a --seeds 1 run.
            runs[domain] = [run for path in range(args.seeds) for run in comparison.run(
                data["ids"], repeats=args.repeats, seed=args.seed + path * len(data["ids"]),
                progress=lambda _i: bar.update(1))]

    results = {}
    for name, decoder in decoders.items():
        gamma = decoder.cfg.block_size
        per_domain = {
            domain: summarize(runs[domain], name, gamma, greedy=sampling.greedy,
                              labels=[f"{domain}:{data['file']}:{i}" + (f":path{p}" if args.seeds > 1 else "")
                                      for p in range(args.seeds) for i in range(len(data["ids"]))])
            for domain, data in domains.items()
        }
        results[name] = {
            "domains": per_domain,
            "macro": {key: macro(per_domain, key) for key in
                      ("speedup", "speedup_with_prefill", "tau", "acceptance_rate")},
            "identical": all(d["identical"] for d in per_domain.values()) if sampling.greedy else None,
        }

    first = next(iter(results))
    kinds = {}
    for name, info in drafters.items():
        kinds.setdefault(info["kind"], name)

    # τ(DSpark) over each baseline's τ, and the same for accepted drafts per round (τ − 1), which
    # the bonus token does not dilute; each with a bootstrap interval over the prompts.
    ratios, intervals = {}, {}
    for kind in ("dflash", "eagle3"):
        if "dspark" not in kinds or kind not in kinds:
            continue
        suffix = "" if kind == "dflash" else f"_{kind}"
        mine, theirs = (results[kinds[k]]["macro"]["tau"] for k in ("dspark", kind))
        for key, drafts_only in (("tau_ratio", False), ("accepted_ratio", True)):
            offset = 1.0 if drafts_only else 0.0
            ratios[key + suffix] = (mine - offset) / (theirs - offset) if theirs > offset else float("nan")
            intervals[key + suffix] = tau_ratio_interval(runs, kinds["dspark"], kinds[kind], level=INTERVAL_LEVEL,
                                                         drafts_only=drafts_only, paths=args.seeds)
    summary = {
        "identical": all(r["identical"] for r in results.values()) if sampling.greedy else None,
        "speedup": {d: round(v["speedup"], 3) for d, v in results[first]["domains"].items()},
        "tau": {name: {d: round(v["tau"], 3) if v["tau"] == v["tau"] else None for d, v in r["domains"].items()}
                for name, r in results.items()},
    }
    for key, ratio in ratios.items():
        summary[key] = round(ratio, 3)
        summary[f"{key}_interval"] = [round(x, 3) for x in intervals[key]]

    result = {
        "summary": summary,
        "mode": "quick" if args.quick else "full",
        "started_unix": started,
        "wall_s": time.time() - started,
        "machine": machine_info(),
        "load_avg_start": load_avg_start,
        "load_avg_end": os.getloadavg(),
        "settings": {
            "benchmarks": str(Path(args.benchmarks).resolve()),
            "files": {d: v["file"] for d, v in domains.items()},
            "prompts_per_domain": args.prompts_per_domain,
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "top_k": args.top_k,
            "top_p": args.top_p,
            "seed": args.seed,
            "seeds": args.seeds,
            "repeats": args.repeats,
            "batch": 1,
            "policy_requested": args.policy,
            "stop_ids": tokenizer.stop_ids,
            "prompt": "first turn, user message in the chat template",
            "cache_len": {"target_only": comparison.max_len_ar, "speculative": comparison.max_len_spec},
        },
        "target": {"name": args.checkpoint or "SmolLM2-135M-Instruct (embedded GGUF, dequantized)",
                   "dtype": args.dtype, "params": target.num_params},
        "drafters": drafters,
        "compile_s": compile_s,
        "compiles_while_timing": comparison.compiles_while_timing,
        "speedup": {name: {d: v["speedup"] for d, v in r["domains"].items()} | {"macro": r["macro"]["speedup"]}
                    for name, r in results.items()},
        **{key: ratios.get(key) for key in ("tau_ratio", "tau_ratio_eagle3", "accepted_ratio", "accepted_ratio_eagle3")},
        "tau_ratio_interval": {"level": INTERVAL_LEVEL, **intervals},
        "results": results,
        "method": {
            "speedup": "speculative / target-only decode throughput (tokens / seconds, each summed over the "
            "domain's prompts; for identical greedy outputs the ratio of decode seconds; sampled outputs differ "
            "in length) (same prompts, same process, B=1; compile + warm-up before timing; prefill excluded, "
            "speedup_with_prefill includes it); each prompt runs target-only then every drafter, "
            "best of `repeats`",
            "tau": "mean over request-rounds of tokens committed: accepted drafts + 1, or the drafts through a "
            "stop token among them (spec 6.4 step 4)",
            "per_position_acceptance": "position k: rounds that accepted >= k / rounds that offered >= k "
            "and accepted >= k-1",
            "acceptance_rate": "accepted drafts / offered (verified) drafts",
            "time_split": "host-timed at the loop's existing syncs: draft = until the verify lengths reach "
            "the host, verify = until the verdict does, host = the rest of decode_s",
            "macro": "unweighted mean over domains",
            "accepted_ratio": "the ratio of tau - 1 (accepted drafts per round, but for a stop among them): the "
            "drafters alone, without the target token almost every round commits",
            "tau_ratio_interval": "percentile bootstrap over prompts (resampled within each domain, the same "
            "prompts for both drafters) of every ratio: how much it depends on which prompts were drawn",
        },
    }
    out_path = write_json(args.out, json_clean(result), indent=1)
    png_path = out_path.with_suffix(".png")
    if not args.no_plot:
        mi = result["machine"]
        plot(json_clean(results), png_path,
             f"per-position acceptance, {target_label(args.checkpoint, args.dtype)}, B=1, {args.max_new_tokens} new tokens, "
             f"{args.prompts_per_domain} prompts/domain; jax {mi['jax']} {mi['backend']}")

    for name, r in results.items():
        print(f"\n{name} ({drafters[name]['kind']}, γ={decoders[name].cfg.block_size}, "
              f"policy {drafters[name]['policy']}):", file=sys.stderr)
        for domain, d in r["domains"].items():
            rate, split = d["tokens_per_s"], d["time_split"]
            print(f"  {domain:5s} speedup x{d['speedup']:.2f}  τ {d['tau']:.2f}  accept {d['acceptance_rate']:.2f}  "
                  f"tok/s {rate['target_only']:.1f} -> {rate['speculative']:.1f}  "
                  f"draft/verify/host {split['draft_s']:.2f}/{split['verify_s']:.2f}/{split['host_s']:.2f} s  "
                  f"identical {d['identical']}", file=sys.stderr)
            for diff in d["differing_prompts"] or ():
                print(f"        differs: {diff}", file=sys.stderr)
    if comparison.compiles_while_timing:
        print(f"warning: {comparison.compiles_while_timing} compilations while timing", file=sys.stderr)
    print(f"wrote {out_path}" + ("" if args.no_plot else f" and {png_path}"), file=sys.stderr)
    print(json.dumps(json_clean(summary)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
