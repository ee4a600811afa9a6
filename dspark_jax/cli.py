"""``dspark`` command line: ``demo``, ``generate``, ``batch``, ``bench``, ``profile``, ``calibrate``, ``convert``, ``train``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from dspark_jax.checkpoints import load_target  # a module global: tests replace it

DEMO_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "A shop sells pencils at 3 for 25 cents. How much do 12 pencils cost?",
    "Give me three tips for staying focused while studying.",
)


def _encode(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt)


def parse_policy_arg(text: str | None):
    """``--policy`` as a policy object (None: the decoder's default); bad text exits with one line."""
    from dspark_jax.decoding.speculative import parse_policy

    if text is None:
        return None
    try:
        return parse_policy(text)
    except ValueError as error:
        raise SystemExit(f"--policy {text!r}: {error}") from None


def check_drafter_arg(spec: str) -> None:
    """Fail fast (before the target loads) on a drafter name or path that cannot exist."""
    from dspark_jax.drafters import resolve_drafter

    try:
        resolve_drafter(spec)
    except (OSError, ValueError) as error:
        raise SystemExit(f"--drafter {spec!r}: {error}") from None


def load_drafter_arg(spec: str, target, policy=None, *, fallback: bool = False, sampling=None):
    """``(name, drafter, policy, note)`` for ``--drafter`` (a shipped name or a directory).

    Anything wrong (unknown name, not trained/shipped yet, not a checkpoint, does not fit the
    target) exits with one line. A threshold or scheduler policy on a drafter without a
    confidence head is an error, or with ``fallback`` runs ``fixed:γ`` and says so in ``note``.
    A scheduler policy gets the drafter's calibrations (noted when none serves ``sampling``: one
    setting, or a batch job's requests' list).
    """
    from dspark_jax.drafters import resolve_drafter
    from dspark_jax.eval.compare import load_drafter_spec, policy_for

    try:
        name, drafter = load_drafter_spec(spec, target, dtype=target.dtype)  # the target's dtype
        chosen, note = policy_for(drafter.cfg, policy, directory=resolve_drafter(spec)[1], sampling=sampling)
    except (OSError, ValueError) as error:
        raise SystemExit(f"--drafter {spec!r}: {error}") from None
    if note and not drafter.cfg.confidence_head and not fallback:
        raise SystemExit(f"--policy {policy_text(policy)} needs a drafter with a confidence head; "
                         f"{name} ({drafter.cfg.kind}) has none: use fixed:K")
    return name, drafter, chosen, note


def _width_name(width: int) -> str:
    from dspark_jax.scheduler.prefix import PLAIN

    return "plain" if width == PLAIN else f"W{width}"


def policy_text(policy) -> str:
    from dspark_jax.decoding.speculative import FixedPolicy, ThresholdPolicy
    from dspark_jax.scheduler.prefix import SchedulerPolicy

    if isinstance(policy, FixedPolicy):
        return f"fixed:{policy.k}"
    if isinstance(policy, ThresholdPolicy):
        return f"threshold:{policy.threshold:g}"
    if isinstance(policy, SchedulerPolicy):
        costs = "; ".join(f"B={b}: " + ", ".join(f"{_width_name(w)} {s * 1e3:.1f}" for w, s in table) + " ms"
                          for b, table in policy.costs or ())
        fits = ", ".join("any" if c.sampling is None else c.sampling.describe() for c in policy.calibrations)
        calibrated = f"calibrated for {fits}" if fits else "uncalibrated"
        name = "scheduler-ahead" if policy.plan_ahead else "scheduler"
        return f"{name} ({calibrated}; round cost {costs or 'not profiled'})"
    return repr(policy)


def _describe(name, drafter, decoder) -> str:
    return f"{name} ({drafter.cfg.kind}, γ={drafter.cfg.block_size}), policy {policy_text(decoder.policy)}"


def _spec_stats(result) -> str:
    """τ, rounds, draft/verify split and the verify-width histogram of a speculative result."""
    tau = "n/a" if result.rounds == 0 else f"{result.tau:.2f}"
    widths = ", ".join(f"{w}: {c}" for w, c in sorted(result.width_histogram.items()))
    return (f"τ {tau} over {result.rounds} rounds (draft {result.draft_s * 1e3:.0f} ms, "
            f"verify {result.verify_s * 1e3:.0f} ms); verify widths {{{widths}}}")


def _decode_tok_s(result) -> float:
    produced = sum(max(len(t) - 1, 0) for t in result.tokens)
    return produced / result.decode_s if result.decode_s > 0 else float("nan")


def cmd_generate(args) -> int:
    from dspark_jax.decoding.autoregressive import AutoregressiveGenerator

    if args.prompt == "-":
        args.prompt = sys.stdin.read()
    if not args.prompt:
        raise SystemExit("--prompt is empty")
    if args.policy is not None and args.drafter is None:
        raise SystemExit("--policy needs --drafter")
    policy = parse_policy_arg(args.policy)
    sampling = sampling_from_args(args)
    if args.drafter is not None:
        check_drafter_arg(args.drafter)
    target, tokenizer = load_target(args.checkpoint, args.dtype)
    ids = _encode(tokenizer, args.prompt, args.chat)
    stops = tokenizer.stop_ids
    if args.drafter is not None:
        from dspark_jax.eval.compare import decoding_cache_len, make_decoder

        name, drafter, policy, note = load_drafter_arg(args.drafter, target, policy, sampling=sampling)
        if note:
            print(f"note: {note}", file=sys.stderr)
        runner = make_decoder(target, drafter, policy, profile_sampling=sampling,
                              profile_max_len=decoding_cache_len(target, drafter, [len(ids)], args.max_new_tokens))
    else:
        runner = AutoregressiveGenerator(target)
    max_len = runner.cache_len_for([len(ids)], args.max_new_tokens)
    compile_s = runner.warmup(1, len(ids), max_len)
    text_of = tokenizer.stream_decoder()

    def show(_, tokens):  # each round's committed tokens, as they come
        sys.stdout.write(text_of(tokens))
        sys.stdout.flush()

    result = runner.generate(
        [ids], max_new_tokens=args.max_new_tokens, sampling=sampling, seeds=[args.seed],
        stop_ids=stops, max_len=max_len, on_tokens=show,
    )
    print()
    speculative = "" if args.drafter is None else f"; {_spec_stats(result)}; drafter {_describe(name, drafter, runner)}"
    print(
        f"[{len(result.tokens[0])} tokens, finish={result.finish_reasons[0]}; prompt {len(ids)} tokens; "
        f"prefill {result.prefill_s * 1e3:.0f} ms; decode {_decode_tok_s(result):.1f} tokens/s"
        f"{speculative}; compile {compile_s:.1f} s]",
        file=sys.stderr,
    )
    return 0


def cmd_batch(args) -> int:
    """Every request of a JSONL file, batched with continuous batching (split over the devices with
    --data-parallel), completions appended to a JSONL file in input order as they finish; a rerun
    resumes a killed job. Several processes (``--distributed`` ...) each answer their share of the
    requests on their own devices, and process 0 then writes the output from their parts."""
    join_processes(args)
    import jax
    import numpy as np

    from dspark_jax import multihost
    from dspark_jax.decoding import batch_job
    from dspark_jax.decoding.autoregressive import AutoregressiveGenerator
    from dspark_jax.decoding.slots import refill_sizes
    from dspark_jax.scheduler.prefix import SchedulerPolicy

    if args.policy is not None and args.drafter is None:
        raise SystemExit("--policy needs --drafter")
    mesh = None
    if args.data_parallel:
        devices = jax.local_devices()  # with several processes, each splits its own share
        if args.batch_size % len(devices):
            raise SystemExit(f"--data-parallel splits each batch over {len(devices)} devices: "
                             f"--batch-size {args.batch_size} is not a multiple of {len(devices)}")
        mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    # The batch sizes the job's steps run at (and the scheduler must be profiled at).
    sizes = refill_sizes(args.batch_size, 1 if mesh is None else mesh.size) if args.batch_buckets else [args.batch_size]
    policy = parse_policy_arg(args.policy)
    sampling = sampling_from_args(args)
    if args.drafter is not None:
        check_drafter_arg(args.drafter)
    # Every process checks that the output is this job's before any work starts.
    job = batch_job.BatchJob(args.input, args.output, {
        "checkpoint": args.checkpoint, "drafter": args.drafter, "policy": args.policy, "chat": args.chat,
        "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
        "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, "continuous": not args.fixed_batches,
        # Recorded only when not the default, so that jobs started before the options existed still resume.
        **({"batch_buckets": True} if args.batch_buckets else {}),
        **({"dtype": args.dtype} if args.dtype != "float32" else {})})
    process, processes = jax.process_index(), jax.process_count()
    own_job = job if processes == 1 else job.part(process, processes)
    # A second copy of a running job is refused here, before it loads the model or profiles.
    with own_job.hold():
        target, tokenizer = load_target(args.checkpoint, args.dtype)
        requests = batch_job.read_requests(args.input, tokenizer, chat=args.chat, sampling=sampling, seed=args.seed)
        own_requests = multihost.share(requests)
        if not own_requests:
            raise ValueError(f"{len(requests)} requests cannot keep {processes} processes busy: run fewer processes")
        stops = tokenizer.stop_ids
        longest = max(r.limit(args.max_new_tokens) for r in own_requests)  # new tokens the cache is sized for
        costs = None
        if args.drafter is not None:
            from dspark_jax.eval.compare import decoding_cache_len, make_decoder

            name, drafter, policy, note = load_drafter_arg(args.drafter, target, policy,
                                                            sampling=[r.sampling for r in requests])
            if note:
                print(f"note: {note}", file=sys.stderr)
            if isinstance(policy, SchedulerPolicy) and own_job.scheduler_costs:  # a resumed job schedules as it started
                policy = policy.with_tables(own_job.scheduler_costs)
            runner = make_decoder(
                target, drafter, policy, profile_batches=sizes, profile_sampling=sampling, mesh=mesh,
                profile_max_len=decoding_cache_len(target, drafter, [len(r.ids) for r in own_requests], longest))
            if isinstance(runner.policy, SchedulerPolicy):
                costs = {b: dict(table) for b, table in runner.policy.costs}
                missing = [size for size in sizes if size not in costs]
                if missing:
                    listed = " ".join(map(str, missing))
                    raise SystemExit(f"--policy {args.policy}: the cost table has no batch size {listed} "
                                     f"(profiled: {sorted(costs)}); profile it with dspark profile --batch {listed}")
            described = _describe(name, drafter, runner)
        else:
            runner = AutoregressiveGenerator(target, mesh=mesh)
            described = "none (target-only decoding)"
        devices = "" if mesh is None else f", split over {mesh.size} devices"
        batching = "fixed batches" if args.fixed_batches else "continuous batching"
        rows = f"{args.batch_size} rows" if not args.batch_buckets else f"up to {args.batch_size} rows (batch buckets)"
        share = "" if processes == 1 else f" (process {process} of {processes}: {len(own_requests)} of them)"
        print(f"{len(requests)} requests from {args.input}{share}, {batching} of {rows}{devices}; "
              f"drafter {described}; up to {longest} new tokens", file=sys.stderr)
        summary = own_job.run(own_requests, runner=runner, decode=tokenizer.decode, max_new_tokens=args.max_new_tokens,
                              stop_ids=stops, scheduler_costs=costs, progress=not args.no_progress and multihost.is_lead())
    resumed = f" ({summary['resumed']} already done)" if summary["resumed"] else ""
    tau = "" if summary["tau"] is None else f", τ {summary['tau']:.2f}"
    rows = "" if summary["mean_batch_rows"] is None else f", {summary['mean_batch_rows']:.2f} rows a step"
    print(f"wrote {summary['requests']} completions to {own_job.output}{resumed}: {summary['completion_tokens']} new "
          f"tokens in {summary['seconds']:.1f} s (compiling included), {summary['tokens_per_s']:.1f} tokens/s{tau}{rows}",
          file=sys.stderr)
    if processes > 1:
        multihost.barrier(f"batch job parts {job.output}")
        if multihost.is_lead():
            job.merge(requests, processes)
            print(f"wrote {len(requests)} completions to {job.output}, from the {processes} processes' parts",
                  file=sys.stderr)
        multihost.barrier(f"batch job merged {job.output}")
    return 0


def _fmt_values(values) -> str:
    return "[" + ", ".join("-" if v is None or v != v else f"{v:.2f}" for v in values) + "]"


def _yes_no(identical) -> str:
    return "n/a (sampled)" if identical is None else ("yes" if identical else "NO")


def cmd_bench(args) -> int:
    from dspark_jax.drafters import DEFAULT
    from dspark_jax.eval.compare import (
        Comparison,
        decoding_cache_len,
        make_decoder,
        read_prompts_jsonl,
        summarize,
    )

    policy = parse_policy_arg(args.policy)
    sampling = sampling_from_args(args)
    if args.prompts_file:
        try:
            texts = read_prompts_jsonl(args.prompts_file, args.prompts)
        except (OSError, ValueError) as error:
            raise SystemExit(f"--prompts-file: {error}") from None
    else:
        texts = list(DEMO_PROMPTS[: args.prompts])
    check_drafter_arg(args.drafter or DEFAULT)
    target, tokenizer = load_target(args.checkpoint, args.dtype)
    name, drafter, policy, note = load_drafter_arg(args.drafter or DEFAULT, target, policy, sampling=sampling)
    if note:
        print(f"note: {note}")
    prompts = [_encode(tokenizer, text, chat=True) for text in texts]
    decoder = make_decoder(target, drafter, policy, profile_sampling=sampling, profile_max_len=decoding_cache_len(
        target, drafter, [len(p) for p in prompts], args.max_new_tokens))
    print(f"target-only vs speculative decoding, drafter {_describe(name, drafter, decoder)}; "
          f"{len(prompts)} prompts one at a time (B=1), up to {args.max_new_tokens} new tokens, {sampling.describe()}")
    comparison = Comparison(target, {name: decoder}, max_new_tokens=args.max_new_tokens,
                            stop_ids=tokenizer.stop_ids, sampling=sampling)
    compile_s = comparison.prepare([len(p) for p in prompts])
    print(f"compiled + warmed up before timing: target-only {compile_s['target_only']:.1f} s, "
          f"speculative {compile_s[name]:.1f} s")
    runs = comparison.run(prompts, repeats=args.repeats, seed=args.seed)
    for index, run in enumerate(runs):
        base, spec = run.baseline, run.speculative[name]
        same = base.tokens[0] == spec.tokens[0]
        print(f"  [{index}] {len(spec.tokens[0])} tokens: target-only {_decode_tok_s(base):.1f} tok/s, "
              f"speculative {_decode_tok_s(spec):.1f} tok/s, τ {spec.tau:.2f}, "
              f"identical {_yes_no(same if sampling.greedy else None)}")
    summary = summarize(runs, name, drafter.cfg.block_size, greedy=sampling.greedy)
    split = summary["time_split"]
    rate = summary["tokens_per_s"]
    print(f"speedup x{summary['speedup']:.2f} (decode throughput; x{summary['speedup_with_prefill']:.2f} with prefill): "
          f"{rate['target_only']:.1f} -> {rate['speculative']:.1f} tokens/s")
    print(f"τ {summary['tau']:.2f}; acceptance rate {summary['acceptance_rate']:.2f}; "
          f"per-position acceptance {_fmt_values(summary['per_position_acceptance'])}")
    widths = ", ".join(f"{w}: {c}" for w, c in summary["width_histogram"].items())
    print(f"verify widths {{{widths}}}; decode time split: draft {split['draft_s']:.2f} s "
          f"({100 * split['draft_share']:.0f}%), verify {split['verify_s']:.2f} s "
          f"({100 * split['verify_share']:.0f}%), host {split['host_s']:.2f} s")
    differing = [d["prompt"] for d in summary["differing_prompts"] or ()]
    print(f"greedy outputs identical: {_yes_no(summary['identical'])}"
          + (f" (prompts {differing} differ)" if differing else ""))
    if comparison.compiles_while_timing:
        print(f"warning: {comparison.compiles_while_timing} compilations happened while timing")
    return 0


def cmd_demo(args) -> int:
    from dspark_jax.decoding.autoregressive import AutoregressiveGenerator
    from dspark_jax.drafters import DEFAULT, is_shipped

    start = time.perf_counter()
    target, tokenizer = load_target(None)
    print(f"embedded target: SmolLM2-135M-Instruct, {target.num_params / 1e6:.1f}M parameters, "
          f"loaded in {time.perf_counter() - start:.1f} s")
    generator = AutoregressiveGenerator(target)
    prompts = [_encode(tokenizer, p, chat=True) for p in DEMO_PROMPTS]
    stops = tokenizer.stop_ids
    max_len = generator.cache_len_for([len(p) for p in prompts], args.max_new_tokens)

    shipped = is_shipped(DEFAULT)
    if shipped:
        _demo_side_by_side(args, target, tokenizer, prompts)
    else:
        print(f"\n== target-only greedy decoding, one request at a time (B=1), {args.max_new_tokens} new tokens max")
        generator.warmup(1, max(len(p) for p in prompts), max_len)
        for text, ids in zip(DEMO_PROMPTS, prompts):
            r = generator.generate([ids], max_new_tokens=args.max_new_tokens, stop_ids=stops, max_len=max_len)
            print(f"\n> {text}\n{tokenizer.decode(r.tokens[0]).strip()}")
            print(f"  [{len(r.tokens[0])} tokens, prefill {r.prefill_s * 1e3:.0f} ms, "
                  f"{r.decode_tokens_per_s:.1f} tokens/s]")

    print(f"\n== the same {len(prompts)} prompts as one batch (B={len(prompts)})")
    generator.warmup(len(prompts), max(len(p) for p in prompts), max_len)
    r = generator.generate(prompts, max_new_tokens=args.max_new_tokens, stop_ids=stops, max_len=max_len)
    total = r.num_generated
    print(f"  {total} tokens in {r.prefill_s + r.decode_s:.2f} s: "
          f"{total / (r.prefill_s + r.decode_s):.1f} tokens/s overall, {r.steps} decode steps")
    if not shipped:
        print(f"\n(No DSpark side by side: the shipped drafter {DEFAULT} is not trained/shipped yet.)")
    return 0


def _demo_side_by_side(args, target, tokenizer, prompts) -> None:
    """Target-only vs the shipped DSpark drafter, greedy, B=1: the text once, both timings."""
    from dspark_jax.drafters import DEFAULT
    from dspark_jax.eval.compare import Comparison, decoding_cache_len, make_decoder

    name, drafter, policy, note = load_drafter_arg(DEFAULT, target, parse_policy_arg(args.policy))
    if note:
        print(f"note: {note}")
    decoder = make_decoder(target, drafter, policy, profile_max_len=decoding_cache_len(
        target, drafter, [len(p) for p in prompts], args.max_new_tokens))
    print(f"\n== target-only vs DSpark ({_describe(name, drafter, decoder)}), greedy, one request at "
          f"a time (B=1), {args.max_new_tokens} new tokens max")
    comparison = Comparison(target, {name: decoder}, max_new_tokens=args.max_new_tokens,
                            stop_ids=tokenizer.stop_ids)
    comparison.prepare([len(p) for p in prompts])
    base_s = spec_s = 0.0
    for text, run in zip(DEMO_PROMPTS, comparison.run(prompts)):
        base, spec = run.baseline, run.speculative[name]
        base_s, spec_s = base_s + base.decode_s, spec_s + spec.decode_s
        print(f"\n> {text}\n{tokenizer.decode(base.tokens[0]).strip()}")
        if spec.tokens[0] != base.tokens[0]:  # greedy: must not happen; show it if it does
            print(f"  (DSpark's output differs:)\n{tokenizer.decode(spec.tokens[0]).strip()}")
        speedup = base.decode_s / spec.decode_s if spec.decode_s > 0 else float("nan")
        print(f"  [{len(base.tokens[0])} tokens; target-only {_decode_tok_s(base):.1f} tokens/s; "
              f"DSpark {_decode_tok_s(spec):.1f} tokens/s, τ {spec.tau:.2f}; speedup x{speedup:.2f}]")
    if spec_s > 0:
        print(f"\n  overall decode speedup x{base_s / spec_s:.2f}")


def cmd_convert(args) -> int:
    from dspark_jax.checkpoints.gguf import embedded_gguf_path, load_gguf
    from dspark_jax.checkpoints.hf import save_hf_checkpoint

    if args.drafter:
        from dspark_jax.checkpoints.drafter import convert_drafter

        try:
            out = convert_drafter(args.drafter, args.out, storage_dtype=args.dtype)
        except (OSError, ValueError) as error:
            raise SystemExit(f"--drafter {args.drafter!r}: {error}") from None
        print(f"wrote dspark-jax drafter to {out} (use it as --drafter {out})")
        return 0
    source = Path(args.gguf) if args.gguf else embedded_gguf_path()
    target, tokenizer = load_gguf(source, args.dtype, cache=False)  # the user asked for one copy, not two
    out = save_hf_checkpoint(target.module(), args.out)
    tokenizer.save(out)
    print(f"wrote HF checkpoint to {out}")
    return 0


def cmd_profile(args) -> int:
    """Time a round at every verify width for each batch size: the scheduler's cost table."""
    from dspark_jax.decoding.speculative import FixedPolicy, SpeculativeDecoder
    from dspark_jax.eval.bench import machine_info
    from dspark_jax.scheduler.profile import cost_table_path, profile_round_costs, save_cost_tables

    sampling = sampling_from_args(args)
    check_drafter_arg(args.drafter)
    cost_table_path(args.out)  # before minutes of profiling, not after
    target, _ = load_target(args.checkpoint, args.dtype)
    name, drafter, _, _ = load_drafter_arg(args.drafter, target)
    decoder = SpeculativeDecoder(target, drafter, policy=FixedPolicy(drafter.cfg.block_size),
                                 verify_widths=args.widths)
    tables = {}
    for batch in args.batch:
        tables[batch] = profile_round_costs(decoder, batch, max_len=args.max_len, repeats=args.repeats,
                                            sampling=sampling)
        print(f"B={batch}: " + ", ".join(f"{_width_name(w)} {s * 1e3:.1f} ms" for w, s in tables[batch].items()))
    path = save_cost_tables(args.out, tables, drafter=name, max_len=args.max_len, repeats=args.repeats,
                            sampling=sampling.describe(), dtype=args.dtype,
                            statistic="median seconds of a draft + verify round", machine=machine_info())
    print(f"wrote {path}; use it with --policy scheduler:{path}")
    return 0


def cmd_calibrate(args) -> int:
    """Fit the confidence head's calibration on held-out prompts and store it next to the drafter's weights."""
    from dspark_jax.checkpoints.drafter import drafter_weights_id
    from dspark_jax.decoding.speculative import FixedPolicy, SpeculativeDecoder
    from dspark_jax.drafters import resolve_drafter
    from dspark_jax.training import calibrate

    sampling = sampling_from_args(args)
    check_drafter_arg(args.drafter)
    directory = Path(args.out_dir) if args.out_dir else resolve_drafter(args.drafter)[1]
    if args.out_dir:
        directory.mkdir(parents=True, exist_ok=True)
    try:  # before minutes of decoding, not after
        calibrate.check_calibration_dir(directory)
    except ValueError as error:
        raise ValueError(f"the calibration goes to {directory}, but {error}"
                         + ("" if args.out_dir else "; choose another place with --out-dir")) from None
    target, tokenizer = load_target(args.checkpoint, args.dtype)
    name, drafter, _, _ = load_drafter_arg(args.drafter, target)
    if not drafter.cfg.confidence_head:
        raise SystemExit(f"--drafter {args.drafter!r}: a {drafter.cfg.kind} drafter has no confidence head to calibrate")
    try:
        texts = calibrate.heldout_prompt_texts(args.prompts, seed=args.data_seed, exclude_configs=args.exclude_config)
    except ValueError as error:
        raise SystemExit(f"--exclude-config: {error}") from None
    prompts = [_encode(tokenizer, text, chat=True) for text in texts]
    decoder = SpeculativeDecoder(target, drafter, policy=FixedPolicy(drafter.cfg.block_size))
    logits, accepted = calibrate.collect_rounds(
        decoder, prompts, max_new_tokens=args.max_new_tokens, sampling=sampling,
        stop_ids=tokenizer.stop_ids, seed=args.seed)
    fitted = calibrate.fit_calibration(logits, accepted, args.method)
    path = calibrate.save_calibration(directory, fitted, sampling, drafter=name, prompts=args.prompts,
                                      weights_id=drafter_weights_id(resolve_drafter(args.drafter)[1]),
                                      data_seed=args.data_seed, max_new_tokens=args.max_new_tokens,
                                      excluded_configs=[Path(path).name for path in args.exclude_config])
    print(f"{sampling.describe()} ({args.method}): {fitted['rounds']} rounds; temperatures {_fmt_values(fitted['temperatures'])}; "
          f"biases {_fmt_values(fitted['biases'])}")
    print(f"ECE of the survival per position: {_fmt_values(fitted['ece_before'])} -> {_fmt_values(fitted['ece_after'])}")
    print(f"log loss per position: {_fmt_values(fitted['log_loss_before'])} -> {_fmt_values(fitted['log_loss_after'])}")
    if fitted["at_grid_edge"]:
        print(f"note: positions {fitted['at_grid_edge']} fitted at an end of the search grid (temperatures "
              f"{calibrate.GRID[0]}-{calibrate.GRID[-1]}, biases {calibrate.BIAS_GRID[0]}-{calibrate.BIAS_GRID[-1]}): "
              f"their best values may lie beyond it; more --prompts give those positions more rounds", file=sys.stderr)
    print(f"wrote {path}")
    return 0


def join_processes(args) -> None:
    """Join the run's other processes when the command was given ``add_process_arguments``'
    flags; first, before anything runs on a device."""
    from dspark_jax import multihost

    manual = (args.coordinator, args.num_processes, args.process_id)
    if args.distributed or any(v is not None for v in manual):
        multihost.initialize(*manual)


def cmd_train(args) -> int:
    from dspark_jax import multihost

    join_processes(args)
    from dspark_jax.training.train import LOG_FILE, load_config, run, run_budgeted

    if args.out_dir is not None and len(args.config) > 1:
        raise SystemExit("dspark train: --out-dir names one run's directory; give one --config with it")
    if args.budget_s is not None and args.steps is not None:
        raise SystemExit("dspark train: --budget-s chooses the steps; do not give --steps with it")
    overrides = {k: v for k, v in (("out_dir", args.out_dir), ("steps", args.steps),
                                   ("data_parallel", args.data_parallel)) if v is not None}
    configs = [dataclasses.replace(load_config(path), **overrides) for path in args.config]
    if args.budget_s is not None:
        outs = run_budgeted(configs, args.budget_s, data_fraction=args.data_fraction)
    else:
        outs = [run(config) for config in configs]
    for config, out in zip(configs, outs):
        if multihost.is_lead():
            print(f"drafter written to {out}; per-step log in {Path(config.out_dir) / LOG_FILE}")
    return 0


def positive_int(text: str) -> int:
    """argparse type for counts and sizes: an int >= 1, or a one-line usage error."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_process_arguments(parser, shared: str) -> None:
    """The flags that make a command one of several processes (``join_processes``)."""
    hosts = parser.add_argument_group(
        "several processes (a multi-host TPU slice or GPU cluster, or one machine): run the same command in "
        f"every process, with {shared} on storage all of them see")
    hosts.add_argument("--distributed", action="store_true",
                       help="join the other processes; JAX finds them on a Cloud TPU slice, under SLURM, Open MPI "
                            "or Kubernetes")
    hosts.add_argument("--coordinator", default=None,
                       help="elsewhere: host:port of process 0, the same in every process (with --num-processes "
                            "and --process-id)")
    hosts.add_argument("--num-processes", type=positive_int, default=None)
    hosts.add_argument("--process-id", type=int, default=None, help="this process's index, 0 .. --num-processes - 1")


DRAFTER_HELP = "a shipped drafter name (smollm2_135m_dspark, _dflash, _eagle3) or a drafter checkpoint directory"
POLICY_HELP = ("verify lengths: fixed:K (K drafts per round), threshold:X (confidence >= X), scheduler (Algorithm 1 "
               "over a cost table profiled at start), scheduler:PROFILE.json (from dspark profile), or "
               "scheduler-ahead[:PROFILE.json] (the paper's production variant: each round's width planned from the "
               "last); default: the decoder's (fixed:7)")


def add_sampling_arguments(parser, temperature_help: str, *, seed_help: str | None | bool) -> None:
    """--temperature, --top-k, --top-p (read back by ``sampling_from_args``) and, unless
    ``seed_help`` is False, --seed."""
    parser.add_argument("--temperature", type=float, default=0.0, help=temperature_help)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    if seed_help is not False:
        parser.add_argument("--seed", type=int, default=0, help=seed_help)


def sampling_from_args(args):
    from dspark_jax.config import SamplingConfig

    return SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def add_checkpoint_argument(parser) -> None:
    parser.add_argument("--checkpoint", default=None, help="the target: a GGUF file or HF directory (default: embedded SmolLM2)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32",
                        help="the weights' dtype, the target's and the drafter's (default float32): bfloat16 halves "
                             "their memory on a GPU or TPU; a CPU without bf16 arithmetic runs it several times slower")


def add_model_arguments(parser) -> None:
    """The target and, for speculative decoding, the drafter and its policy."""
    add_checkpoint_argument(parser)
    parser.add_argument("--drafter", default=None, help=DRAFTER_HELP + " (default: target-only decoding)")
    parser.add_argument("--policy", default=None, help=POLICY_HELP)


def build_parser() -> argparse.ArgumentParser:
    from dspark_jax.training.calibrate import METHODS as CALIBRATION_METHODS  # numpy only: cheap

    parser = argparse.ArgumentParser(prog="dspark", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run a few real prompts on the embedded target")
    demo.add_argument("--max-new-tokens", type=positive_int, default=48)
    # The scheduler (profiled on this machine, STS-calibrated, with plain rounds) beat the best
    # hand-picked threshold (0.4) on every domain measured, with nothing tuned (docs/BENCHMARKS.md).
    demo.add_argument("--policy", default="scheduler", help=POLICY_HELP.split("; default")[0] + "; default scheduler")
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", help="generate text from one prompt, printed as it is generated")
    gen.add_argument("--prompt", required=True, help="the prompt text; - reads it from standard input")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-new-tokens", type=positive_int, default=64)
    add_sampling_arguments(gen, "0 = greedy", seed_help=None)
    add_model_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    batch = sub.add_parser("batch", help="generate for every request of a JSONL file, continuously batched; resumes if killed")
    batch.add_argument("--input", required=True,
                       help='JSONL, one request per line: {"prompt": str} or {"messages": [...]} or {"turns": [...]}, '
                            'optionally "id", "temperature", "top_k", "top_p", "seed", "metadata" (README)')
    batch.add_argument("--output", required=True,
                       help="JSONL of completions in input order, appended as they finish; rerunning the same command resumes it")
    batch.add_argument("--batch-size", type=positive_int, default=8)
    batch.add_argument("--fixed-batches", action="store_true",
                       help="run the file in fixed batches, each after the last has finished, instead of refilling "
                            "a finished request's row at once (continuous batching): slower, but a resumed job "
                            "redraws nothing, even sampled requests under a threshold or scheduler policy")
    batch.add_argument("--batch-buckets", action="store_true",
                       help="run each step at the smallest of 1, 2, 4, ..., --batch-size rows holding the requests "
                            "in flight, so that the job's tail does not pay for idle rows; each size compiles its own "
                            "programs")
    batch.add_argument("--data-parallel", action="store_true",
                       help="split every batch over all of this host's devices (the batch size a multiple of their count)")
    batch.add_argument("--chat", action="store_true", help='put "prompt" texts through the chat template too')
    batch.add_argument("--max-new-tokens", type=positive_int, default=256,
                       help='default 256; a request\'s own "max_new_tokens" wins')
    add_sampling_arguments(batch, "0 = greedy; a request's own value wins",
                           seed_help="request i samples with seed + i unless it gives its own")
    add_model_arguments(batch)
    batch.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_process_arguments(batch, "the output")
    batch.set_defaults(func=cmd_batch)

    bench = sub.add_parser("bench", help="target-only vs speculative decoding on the same prompts (B=1)")
    add_checkpoint_argument(bench)
    bench.add_argument("--drafter", default=None, help=DRAFTER_HELP + " (default: smollm2_135m_dspark)")
    bench.add_argument("--policy", default=None, help=POLICY_HELP)
    bench.add_argument("--prompts", type=positive_int, default=None, help="how many prompts (default: all)")
    bench.add_argument("--prompts-file", default=None,
                       help='jsonl, one {"turns": [...]} per line, first turn used (default: the demo prompts)')
    bench.add_argument("--max-new-tokens", type=positive_int, default=64)
    add_sampling_arguments(bench, "0 = greedy (outputs must then be identical)", seed_help=None)
    bench.add_argument("--repeats", type=positive_int, default=1, help="runs per prompt and decoder; the fastest counts")
    bench.set_defaults(func=cmd_bench)

    conv = sub.add_parser("convert", help="write a GGUF model as an HF checkpoint directory, or a drafter DeepSpec, "
                          "z-lab, speculators, SpecForge or the EAGLE authors saved as a dspark-jax one")
    source = conv.add_mutually_exclusive_group()
    source.add_argument("--gguf", default=None, help="GGUF file (default: the embedded SmolLM2)")
    source.add_argument("--drafter", "--deepspec", dest="drafter", default=None,
                        help="a drafter checkpoint DeepSpec (Qwen3DSparkModel, Qwen3Eagle3Model), z-lab (DFlash), "
                             "speculators (DSpark, DFlash, EAGLE-3), SpecForge or the EAGLE authors "
                             "(LlamaForCausalLMEagle3) saved; DeepSpec's is written without its copies of the "
                             "target's embedding and LM head")
    conv.add_argument("--out", required=True)
    conv.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32",
                      help="the written weights' dtype (default float32; bfloat16 halves the checkpoint)")
    conv.set_defaults(func=cmd_convert)

    prof = sub.add_parser("profile", help="time a speculative round at each verify width: the scheduler's cost table")
    add_checkpoint_argument(prof)
    prof.add_argument("--drafter", default="smollm2_135m_dspark", help=DRAFTER_HELP)
    prof.add_argument("--batch", type=positive_int, nargs="+", default=[1], help="batch sizes to profile (default 1)")
    prof.add_argument("--widths", type=positive_int, nargs="+", default=None,
                      help="verify width buckets, each at most γ + 1 (default: the powers of two below γ + 1, "
                           "1 2 4 for γ = 7; the full-block width γ + 1 is always added)")
    prof.add_argument("--max-len", type=positive_int, default=256, help="cache length to time with (default 256)")
    prof.add_argument("--repeats", type=positive_int, default=10, help="timed rounds per width; the median counts")
    add_sampling_arguments(prof, "decode the timed rounds with this sampling (default greedy): sampled rounds cost "
                                 "more", seed_help=False)
    prof.add_argument("--out", required=True, help="JSON cost table to write")
    prof.set_defaults(func=cmd_profile)

    cal = sub.add_parser("calibrate", help="fit the confidence head's calibration on held-out prompts")
    add_checkpoint_argument(cal)
    cal.add_argument("--drafter", default="smollm2_135m_dspark", help=DRAFTER_HELP)
    cal.add_argument("--prompts", type=positive_int, default=192,
                     help="held-out prompts to decode (default 192: a fit on 48 did not hold on other prompts, "
                          "docs/BENCHMARKS.md; about 9 minutes on 2 CPU cores)")
    cal.add_argument("--data-seed", type=int, default=1000,
                     help="seed of the generated prompt mix (default 1000, a seed no shipped drafter trained on; "
                          "the generators reuse templates, so --exclude-config the drafter's training config)")
    cal.add_argument("--exclude-config", action="append", default=[], metavar="CONFIG",
                     help="a training config (configs/NAME.py) whose prompts are left out; repeatable")
    cal.add_argument("--max-new-tokens", type=positive_int, default=96)
    add_sampling_arguments(cal, "0 = calibrate for greedy decoding", seed_help=None)
    cal.add_argument("--method", choices=CALIBRATION_METHODS, default=CALIBRATION_METHODS[0],
                     help="platt: a temperature and a bias per position, by log loss (default); "
                          "sts: the paper's sequential temperature scaling, temperatures by ECE")
    cal.add_argument("--out-dir", default=None, help="where calibration.json goes (default: the drafter's directory)")
    cal.set_defaults(func=cmd_calibrate)

    train = sub.add_parser("train", help="build the target cache and train a drafter (resumes if interrupted)")
    train.add_argument("--config", required=True, action="append",
                       help="a config file defining CONFIG = TrainConfig(...), e.g. configs/tiny_test.py; repeat it "
                            "to train several drafters, one after another")
    train.add_argument("--out-dir", default=None, help="override the config's out_dir (one --config only)")
    train.add_argument("--steps", type=int, default=None, help="override the config's step count")
    train.add_argument("--data-parallel", type=positive_int, default=None,
                       help="train on the first N devices (override the config's data_parallel; default: all)")
    train.add_argument("--budget-s", type=float, default=None,
                       help="train every --config on one data set within this many seconds of wall time, with "
                            "equal steps: the cache is built for --data-fraction of it, a batch and each step are "
                            "timed, and the drafters train together for the steps the rest affords (replaces the "
                            "configs' steps)")
    train.add_argument("--data-fraction", type=float, default=0.3,
                       help="with --budget-s: the share of the budget the target cache may take (default 0.3)")
    add_process_arguments(train, "the run directories")
    train.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    from dspark_jax.user_cache import enable_compilation_cache

    args = build_parser().parse_args(argv)
    enable_compilation_cache()  # a second run loads its programs instead of compiling them again
    try:
        return args.func(args)
    except (ValueError, OSError) as error:  # bad input or a path the system refuses: one line, not a traceback
        print(f"dspark {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
