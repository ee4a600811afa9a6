#!/usr/bin/env python
"""A whole generation as one jitted program (``speculative_generate``) against the host loop it
equals (``SpeculativeDecoder(strict=True)``), at each batch size.

The host loop returns to Python every round (the verify lengths pick the width, the verdict is
read back); the one program runs the rounds in a ``lax.while_loop`` on the device. Both decode
the same prompts (math, code and chat interleaved from ``--benchmarks``), greedy, ``fixed:γ``
at width γ + 1, in batches of B; each is compiled first, then both are timed interleaved
``--repeats`` times (min per batch), prefill included. The JSON holds tokens/s for each, their
ratio, τ, and whether every request's tokens were equal (they must be).

    .venv/bin/python scripts/bench_one_program.py            # B = 1 and 4, 8 prompts, 64 tokens: ~4 min
    .venv/bin/python scripts/bench_one_program.py --quick    # B = 1, 2 prompts, 16 tokens
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

from dspark_jax.cli import add_checkpoint_argument, positive_int
from dspark_jax.config import write_json
from dspark_jax.eval.bench import (
    interleaved_texts,
    json_output,
    machine_info,
    set_quick_defaults,
    target_label,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BENCHMARKS = REPO_ROOT.parent / "shared" / "benchmarks"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--benchmarks", default=str(DEFAULT_BENCHMARKS))
    ap.add_argument("--drafter", default="smollm2_135m_dspark")
    add_checkpoint_argument(ap)
    ap.add_argument("--batches", type=positive_int, nargs="+", default=None, help="batch sizes (default 1 4; --quick: 1)")
    ap.add_argument("--prompts", type=positive_int, default=None,
                    help="a multiple of every batch size (default 8; --quick: 2)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=None, help="default 64 (--quick: 16)")
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=json_output, default=str(REPO_ROOT / "docs" / "bench_one_program.json"))
    args = ap.parse_args(argv)
    set_quick_defaults(args, batches=([1], [1, 4]), prompts=(2, 8), max_new_tokens=(16, 64))
    uneven = [b for b in args.batches if args.prompts % b]
    if uneven:
        ap.error(f"--prompts {args.prompts} is not a multiple of batch size {uneven[0]}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    texts = interleaved_texts(args.benchmarks, args.prompts)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dspark_jax.decoding.autoregressive import cache_len, prepare_requests, prompt_width
    from dspark_jax.decoding.speculative import (
        FixedPolicy,
        SpeculativeDecoder,
        speculative_generate,
        stop_id_array,
    )
    from dspark_jax.eval.bench import bench_target, timed
    from dspark_jax.eval.compare import load_drafter_spec

    target, tokenizer = bench_target(args.checkpoint, args.dtype)
    try:
        name, drafter = load_drafter_spec(args.drafter, target, dtype=target.dtype)
    except (OSError, ValueError) as error:
        raise SystemExit(f"--drafter {args.drafter!r}: {error}") from None
    gamma, stops, new = drafter.cfg.block_size, tokenizer.stop_ids, args.max_new_tokens
    policy = FixedPolicy(gamma)
    host = SpeculativeDecoder(target, drafter, policy=policy, strict=True)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    max_len = cache_len([len(p) for p in prompts], new, target.cfg.max_position_embeddings, gamma + 1)
    graph, drafter_state = nnx.split(drafter)

    @jax.jit
    def one_program(params, drafter_state, tokens, lens, keys, sampling, stop_ids, limits):
        return speculative_generate(target, nnx.merge(graph, drafter_state), policy, params, tokens, lens, keys,
                                    sampling, stop_ids, limits, max_new_tokens=new, max_len=max_len,
                                    verify_widths=host.verify_widths)

    per_batch, same = {}, True
    for b in args.batches:
        totals = {"host_s": 0.0, "one_program_s": 0.0, "tokens": 0, "committed": 0, "rounds": 0}
        for start in range(0, len(prompts), b):
            group = prompts[start:start + b]
            requests = prepare_requests(group, target.cfg.vocab_size, new, None, 0, stops)
            requests.check_fits(max_len, gamma + 1)
            inputs = (target.params, drafter_state, requests.padded_BxP[:, :prompt_width(max(requests.lens), max_len)],
                      jnp.asarray(requests.lens), requests.keys_B, requests.params, stop_id_array(stops),
                      jnp.full((b,), new))

            run_host = functools.partial(host.generate, group, max_new_tokens=new, stop_ids=stops, max_len=max_len)
            reference, out = run_host(), jax.block_until_ready(one_program(*inputs))  # compiled here, not timed
            host_times, program_times = [], []
            for _ in range(args.repeats):
                host_times.append(timed(run_host)[0])
                seconds, out = timed(one_program, *inputs)
                program_times.append(seconds)
            counts = np.asarray(out.num_tokens_B)
            same &= [row[:n].tolist() for row, n in zip(np.asarray(out.tokens_BxN), counts)] == reference.tokens
            totals["host_s"] += min(host_times)
            totals["one_program_s"] += min(program_times)
            totals["tokens"] += int(counts.sum())
            totals["committed"] += int(out.committed_B.sum())
            totals["rounds"] += int(out.rounds_B.sum())
        per_batch[str(b)] = {
            "tokens": totals["tokens"], "host_s": round(totals["host_s"], 4),
            "one_program_s": round(totals["one_program_s"], 4),
            "host_tokens_per_s": round(totals["tokens"] / totals["host_s"], 2),
            "one_program_tokens_per_s": round(totals["tokens"] / totals["one_program_s"], 2),
            "one_program_over_host": round(totals["host_s"] / totals["one_program_s"], 3),
            "tau": round(totals["committed"] / max(totals["rounds"], 1), 3),
        }
        print(f"B={b}: {per_batch[str(b)]}", file=sys.stderr)
    report = {
        "target": target_label(args.checkpoint, args.dtype), "drafter": name, "policy": f"fixed:{gamma}",
        "prompts": args.prompts, "max_new_tokens": new, "repeats": args.repeats, "max_len": max_len,
        "per_batch": per_batch, "same_tokens": same, "machine": machine_info(),
    }
    write_json(args.out, report, indent=2)
    print(json.dumps({"one_program_over_host": {b: r["one_program_over_host"] for b, r in per_batch.items()},
                      "same_tokens": same}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
