#!/usr/bin/env python
"""Benchmark a DSpark drafter for the embedded SmolLM2-135M target on this machine.

For every (γ, B, vocabulary) cell it times, jitted and interleaved round-robin so load bursts hit
all variants alike (min and median of the rounds):

* ``dspark``: one full proposal — backbone over ``[anchor, MASK x (γ−1)]`` against a context
  cache of ``--context`` rows, LM head, the Markov head's γ sequential sampling steps
  (``lax.scan``) and the confidence head;
* ``parallel``: the same drafter with no sequential head (DFlash: the γ slots are sampled
  independently) — the difference is the sequential head's cost;
* ``gated``: the same drafter with the gated Markov head (spec §2.2) — the difference to
  ``dspark`` is what the gate costs;
* ``backbone``: the backbone + LM head alone, no sampling.

Vocabularies: the full 49,152-token head and a reduced ``--reduced-vocab`` head. Writes JSON
(``--out``) and prints the one-line summary ``{"draft_ms_b1_g7": …, "seq_head_share_b1_g7": …}``
(full vocabulary, greedy) last.

    .venv/bin/python scripts/bench_drafter.py            # full grid, a few minutes on 2 cores
    .venv/bin/python scripts/bench_drafter.py --quick    # γ=7, B=1 only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from dspark_jax.cli import positive_int
from dspark_jax.config import DrafterConfig, SamplingConfig, write_json
from dspark_jax.drafter.backbone import ContextCache
from dspark_jax.drafter.model import Drafter
from dspark_jax.eval.bench import (
    json_output,
    machine_info,
    set_quick_defaults,
    stats_ms,
    timed,
)
from dspark_jax.sampling import SamplingParams, request_keys

REPO_ROOT = Path(__file__).resolve().parents[1]
TAP_LAYERS = (1, 8, 15, 22, 28)  # spread over SmolLM2's 30 layers, never the last (spec §1.2)


def build(target, gamma, vocab, markov, layers, rank):
    cfg = DrafterConfig.for_target(
        target.cfg,
        num_layers=layers,
        tap_layers=TAP_LAYERS,
        mask_token_id=0,
        block_size=gamma,
        markov_head=markov,
        markov_rank=rank,
        confidence_head=markov != "none",
        confidence_with_markov=markov != "none",
        draft_vocab_size=vocab,
    )
    ids = None if vocab is None else np.arange(vocab)
    return Drafter(cfg, rngs=nnx.Rngs(0), draft_vocab_ids=ids)


def make_calls(drafter, embed, batch, context, sampling):
    """Jitted proposal and backbone-only calls over a filled context cache."""
    cfg = drafter.cfg
    graphdef, state = nnx.split(drafter)
    cache = drafter.backbone.extend_context(
        ContextCache.create(cfg, batch, context + 32),
        jax.random.normal(jax.random.PRNGKey(0), (batch, context, cfg.context_size)),
        jnp.full((batch,), context, jnp.int32),
    )
    params = SamplingParams.broadcast(sampling, batch)
    keys = jax.vmap(lambda k: jax.random.split(k, cfg.block_size))(request_keys(range(batch)))
    anchor = jnp.arange(batch, dtype=jnp.int32) + 100

    @jax.jit
    def propose(state, embed, cache, anchor, keys):
        block, confidence = nnx.merge(graphdef, state).propose(embed, embed, cache, anchor, params, keys)
        return block.tokens_BxG, block.q_BxGxV, confidence

    @jax.jit
    def backbone(state, embed, cache, anchor):
        model = nnx.merge(graphdef, state)
        return model.base_logits(model.backbone.forward_block(embed, cache, anchor), embed)

    return {
        "dspark": lambda: propose(state, embed, cache, anchor, keys),
        "backbone": lambda: backbone(state, embed, cache, anchor),
    }


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=json_output, default=str(REPO_ROOT / "docs" / "bench_drafter.json"))
    ap.add_argument("--quick", action="store_true", help="γ=7, B=1 only, fewer repeats")
    ap.add_argument("--layers", type=positive_int, default=1, help="draft layers (1 fits this CPU)")
    ap.add_argument("--rank", type=positive_int, default=256, help="Markov rank r")
    ap.add_argument("--context", type=positive_int, default=256, help="context rows in the drafter cache")
    ap.add_argument("--reduced-vocab", type=positive_int, default=8192)
    ap.add_argument("--repeats", type=positive_int, default=None, help="timed rounds per cell (default 15; --quick: 5)")
    args = ap.parse_args(argv)
    set_quick_defaults(args, repeats=(5, 15))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    gammas = [7] if args.quick else [3, 5, 7]
    batches = [1] if args.quick else [1, 8]
    repeats = args.repeats

    from dspark_jax.checkpoints.gguf import load_embedded_target

    started = time.time()
    target, _ = load_embedded_target()
    embed = target.module().embed[...]
    rows = []
    cells = [(g, b, v) for g in gammas for b in batches for v in (None, args.reduced_vocab)]
    with tqdm(cells, desc="bench_drafter", file=sys.stderr) as bar:
        for gamma, batch, vocab in bar:
            bar.set_postfix_str(f"γ={gamma} B={batch} vocab={vocab or 'full'}")
            dspark = build(target, gamma, vocab, "vanilla", args.layers, args.rank)
            calls = make_calls(dspark, embed, batch, args.context, SamplingConfig())
            for markov in ("none", "gated"):
                variant = build(target, gamma, vocab, markov, args.layers, args.rank)
                calls["parallel" if markov == "none" else markov] = make_calls(
                    variant, embed, batch, args.context, SamplingConfig())["dspark"]
            calls["dspark_t1"] = make_calls(dspark, embed, batch, args.context, SamplingConfig(temperature=1.0))["dspark"]
            times = {name: [] for name in calls}
            for fn in calls.values():  # compile + warm up
                timed(fn)
                timed(fn)
            for _ in range(repeats):
                for name, fn in calls.items():
                    times[name].append(timed(fn)[0])
            stats = {name: stats_ms(t) for name, t in times.items()}
            dspark_ms, parallel_ms = stats["dspark"]["min_ms"], stats["parallel"]["min_ms"]
            rows.append({
                "gamma": gamma,
                "batch": batch,
                "vocab": vocab or target.cfg.vocab_size,
                "drafter_params": dspark.num_params,
                **{f"{name}_ms": s for name, s in stats.items()},
                "seq_head_ms": dspark_ms - parallel_ms,
                "seq_head_share": (dspark_ms - parallel_ms) / dspark_ms,
                "gate_ms": stats["gated"]["min_ms"] - dspark_ms,
            })

    def cell(gamma, batch, vocab):
        return next(r for r in rows if (r["gamma"], r["batch"], r["vocab"]) == (gamma, batch, vocab))

    full = cell(7, 1, target.cfg.vocab_size)
    reduced = cell(7, 1, args.reduced_vocab)
    summary = {
        "draft_ms_b1_g7": round(full["dspark_ms"]["min_ms"], 2),
        "seq_head_share_b1_g7": round(full["seq_head_share"], 3),
        "draft_ms_b1_g7_reduced_vocab": round(reduced["dspark_ms"]["min_ms"], 2),
        "gate_ms_b1_g7_reduced_vocab": round(reduced["gate_ms"], 2),
    }
    result = {
        "summary": summary,
        "mode": "quick" if args.quick else "full",
        "wall_s": time.time() - started,
        "machine": machine_info(),
        "drafter": {
            "layers": args.layers,
            "markov_rank": args.rank,
            "tap_layers": TAP_LAYERS,
            "context_rows": args.context,
            "weights": "random (timing only)",
        },
        "method": "jitted calls interleaved round-robin; min/median of repeats after 2 warm-up "
        "calls; seq_head = dspark - parallel (same drafter without the Markov head); gate = gated - dspark",
        "rows": rows,
        "args": vars(args) | {"out": str(args.out)},
    }
    write_json(args.out, result, indent=2, default=float)
    for r in rows:
        print(
            f"γ={r['gamma']} B={r['batch']} vocab={r['vocab']:>6}: dspark {r['dspark_ms']['min_ms']:.2f} ms "
            f"(T=1 {r['dspark_t1_ms']['min_ms']:.2f}), parallel {r['parallel_ms']['min_ms']:.2f}, "
            f"backbone {r['backbone_ms']['min_ms']:.2f}, seq head share {r['seq_head_share']:.1%}, "
            f"gated {r['gated_ms']['min_ms']:.2f}",
            file=sys.stderr,
        )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
