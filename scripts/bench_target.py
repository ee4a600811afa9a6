#!/usr/bin/env python
"""Benchmark the target's cost curve on this machine: what DSpark's scheduler has to work with.

Measures, on the embedded SmolLM2-135M-Instruct target (fp32):

1. **Forward cost curve.** Wall time of one jitted cached forward over ``T`` new tokens that
   returns logits at *all* ``T`` positions (what verification needs), with the KV cache donated
   as in decoding, for every (B, context, T) of the grid. ``context`` tokens are already in the
   cache (only ``lengths_B`` is set; the contents do not matter for timing); the cache holds
   ``context + 32`` slots. The calls of one (B, context) group are interleaved round-robin over
   ``T`` so that a burst of load from other processes hits every ``T`` alike; min and median of
   the rounds are reported, and ratios ``T(t)/T(1)`` use the minima.
2. **AR decode throughput** at B=1 and B=8 with ``AutoregressiveGenerator`` on real chat prompts
   (no stop ids, so every row makes ``--new-tokens`` tokens); the best of ``--decode-repeats``
   runs, plus min / median of the individual step times.
3. **Profile** of the B=1 forward at T=1 and T=8: jitted sub-computations on the real weights,
   each run over all 30 layers in one program (the qkv / o / gate_up / down products, attention
   incl. RoPE and the cache write over the cache, the LM head), compared with the full forward;
   "rest" is the full forward minus the parts (embedding, norms, SwiGLU activation, residuals,
   dispatch).

Writes JSON (``--out``) and a PNG with the same stem; the last line printed is the one-line
summary ``{"t_ratio_8_1_b1": ..., "decode_tok_s_b1": ..., "decode_tok_s_b8": ...}``.

    .venv/bin/python scripts/bench_target.py                 # full run: 4-8 min on 2 cores
    .venv/bin/python scripts/bench_target.py --quick         # CI-sized subset: 1-1.5 min

Timings on a shared machine are noisy: the JSON records the load average before and after.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from tqdm import tqdm

from dspark_jax.cli import positive_int
from dspark_jax.config import SamplingConfig, write_json
from dspark_jax.eval.bench import (
    json_output_with_plot,
    machine_info,
    set_quick_defaults,
    stats_ms,
    timed,
)
from dspark_jax.models.layers import project

REPO_ROOT = Path(__file__).resolve().parents[1]

CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "A shop sells pencils at 3 for 25 cents. How much do 12 pencils cost?",
    "Give me three tips for staying focused while studying.",
    "Explain in two sentences why the sky is blue.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Write a haiku about autumn leaves.",
    "What are the main differences between a list and a tuple in Python?",
)
CACHE_SLACK = 32  # cache slots beyond the context: room for the T <= 16 new tokens
SAMPLED = SamplingConfig(temperature=0.7, top_k=20, top_p=0.8)


def fresh(lengths_B):
    """A new lengths buffer per call: the whole cache, lengths included, is donated."""
    return jnp.array(lengths_B, copy=True)


# --------------------------------------------------------------------------------------------
# 1. Forward cost curve
# --------------------------------------------------------------------------------------------


def make_forward(target):
    """Verification-shaped forward: logits at every new position, cache donated and returned."""

    def forward(params, tokens_BxT, cache):
        out = target.apply(params, tokens_BxT, cache)
        return out.logits, out.cache

    return jax.jit(forward, donate_argnums=(2,))


def bench_grid(target, batches, contexts, steps, repeats, warmup, bar) -> list[dict]:
    forward = make_forward(target)
    rows = []
    for context in contexts:
        for batch in batches:
            cache = target.new_cache(batch, context + CACHE_SLACK)
            lengths = jnp.full((batch,), context, jnp.int32)
            tokens = {t: jnp.zeros((batch, t), jnp.int32) for t in steps}

            def call(t, cache, tokens=tokens, lengths=lengths):
                elapsed, (_, cache) = timed(
                    forward, target.params, tokens[t], cache._replace(lengths_B=fresh(lengths))
                )
                return elapsed, cache

            compile_s = {}
            for t in steps:  # compile + warm up every T of this group
                bar.set_postfix_str(f"compile B={batch} ctx={context} T={t}")
                compile_s[t], cache = call(t, cache)
                for _ in range(warmup):
                    _, cache = call(t, cache)
                bar.update(1)
            times = {t: [] for t in steps}
            for r in range(repeats):  # round-robin over T: load bursts hit every T alike
                bar.set_postfix_str(f"B={batch} ctx={context} round {r + 1}/{repeats}")
                for t in steps:
                    elapsed, cache = call(t, cache)
                    times[t].append(elapsed)
                bar.update(1)
            for t in steps:
                rows.append(
                    {
                        "batch": batch,
                        "context": context,
                        "T": t,
                        "compile_s": compile_s[t],
                        **stats_ms(times[t]),
                        "times_ms": [round(x * 1e3, 3) for x in times[t]],
                    }
                )
            del cache
    # ratios against T=1 of the same (B, context)
    base = {(r["batch"], r["context"]): r for r in rows if r["T"] == 1}
    for r in rows:
        b = base.get((r["batch"], r["context"]))
        r["ratio_vs_t1_min"] = r["min_ms"] / b["min_ms"] if b else None
        r["ratio_vs_t1_median"] = r["median_ms"] / b["median_ms"] if b else None
    return rows


# --------------------------------------------------------------------------------------------
# 2. AR decode throughput
# --------------------------------------------------------------------------------------------


def bench_decode(target, tokenizer, batch, new_tokens, repeats, sampling=None) -> dict:
    from dspark_jax.decoding.autoregressive import AutoregressiveGenerator

    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}]
        )
        for i in range(batch)
    ]
    generator = AutoregressiveGenerator(target)
    lens = [len(p) for p in prompts]
    max_len = generator.cache_len_for(lens, new_tokens)
    warmup_s = generator.warmup(batch, max(lens), max_len)
    runs = []
    step_ms = []
    for _ in range(repeats):
        stamps: list[float] = []
        result = generator.generate(
            prompts,
            max_new_tokens=new_tokens,
            stop_ids=(),
            max_len=max_len,
            sampling=sampling,
            on_step=lambda _tokens, stamps=stamps: stamps.append(time.perf_counter()),
        )
        step_ms += [1e3 * (b - a) for a, b in itertools.pairwise(stamps)]  # one decode step each
        runs.append(
            {
                "decode_tok_s": result.decode_tokens_per_s,
                "decode_s": result.decode_s,
                "prefill_s": result.prefill_s,
                "steps": result.steps,
                "ms_per_step": 1e3 * result.decode_s / max(result.steps, 1),
            }
        )
    best = max(runs, key=lambda r: r["decode_tok_s"])
    return {
        "batch": batch,
        "new_tokens": new_tokens,
        "prompt_lens": lens,
        "cache_len": max_len,
        "warmup_s": warmup_s,
        "best": best,
        "runs": runs,
        "step_ms_min": min(step_ms) if step_ms else None,
        "step_ms_median": statistics.median(step_ms) if step_ms else None,
        "tok_s_at_min_step": batch * 1e3 / min(step_ms) if step_ms else None,
        "sample": tokenizer.decode(result.tokens[0])[:200],
    }


# --------------------------------------------------------------------------------------------
# 3. Profile: jitted sub-computations on the real weights, all 30 layers per program
# --------------------------------------------------------------------------------------------


def _chain_matmul():
    """All layers' products ``x @ W_l^T`` as one dependent chain (none can overlap or be dropped)."""

    def run(ws, x):
        d = x.shape[-1]
        for w in ws:
            y = project(x, w)
            if y.shape[-1] >= d:
                x = x + 1e-3 * y[..., :d]
            else:
                x = x.at[..., : y.shape[-1]].add(1e-3 * y)
        return x

    return jax.jit(run)


PROFILE_PARTS = ("qkv", "o", "gate_up", "down", "attention", "lm_head", "full_forward")
MATMUL_PARTS = ("qkv", "o", "gate_up", "down")


def profile_parts(target, batch, steps_list, context, repeats, warmup, bar) -> dict:
    from dspark_jax.models.layers import (
        apply_rope,
        cached_attention,
        rope_cos_sin,
        rope_inverse_frequencies,
        write_cache,
    )

    cfg = target.cfg
    module = target.module()
    layers = list(module.layers)
    weights = {
        "qkv": [layer.attn.qkv.weight[...] for layer in layers],
        "o": [layer.attn.o.weight[...] for layer in layers],
        "gate_up": [layer.mlp.gate_up.weight[...] for layer in layers],
        "down": [layer.mlp.down.weight[...] for layer in layers],
    }
    in_dim = {
        "qkv": cfg.hidden_size,
        "o": cfg.num_heads * cfg.head_dim,
        "gate_up": cfg.hidden_size,
        "down": cfg.intermediate_size,
    }
    embed = module.embed[...]
    norm_w = module.final_norm.weight[...]
    inv_freq = rope_inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    eps = cfg.rms_norm_eps

    def attention_all(q0, k_new, v_new, cache, positions):
        """RoPE + cache write + attention over the whole cache, for every layer."""
        cos, sin = rope_cos_sin(positions, inv_freq)
        q, keys, values = q0, [], []
        for layer in range(cfg.num_layers):
            qr, kr = apply_rope(q, cos, sin), apply_rope(k_new, cos, sin)
            ks = write_cache(cache.keys[layer], kr, positions)
            vs = write_cache(cache.values[layer], v_new, positions)
            q = q + 1e-3 * cached_attention(qr, ks, vs, positions)
            keys.append(ks)
            values.append(vs)
        return q, cache._replace(keys=tuple(keys), values=tuple(values))

    def lm_head(x, norm_w, embed):
        normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
        return project(norm_w * normed, embed)

    attention_jit = jax.jit(attention_all, donate_argnums=(3,))
    lm_head_jit = jax.jit(lm_head)
    matmul_jit = {name: _chain_matmul() for name in weights}
    forward = make_forward(target)
    key = jax.random.PRNGKey(0)
    results = {}
    for steps in steps_list:
        x = {name: jax.random.normal(key, (batch, steps, in_dim[name])) for name in weights}
        q0 = jax.random.normal(key, (batch, steps, cfg.num_heads, cfg.head_dim))
        kv0 = jax.random.normal(key, (batch, steps, cfg.num_kv_heads, cfg.head_dim))
        positions = context + jnp.broadcast_to(jnp.arange(steps, dtype=jnp.int32), (batch, steps))
        hidden = jax.random.normal(key, (batch, steps, cfg.hidden_size))
        tokens = jnp.zeros((batch, steps), jnp.int32)
        lengths = jnp.full((batch,), context, jnp.int32)
        caches = {
            "attention": target.new_cache(batch, context + CACHE_SLACK),
            "full_forward": target.new_cache(batch, context + CACHE_SLACK),
        }

        def call(
            part,
            x=x,
            q0=q0,
            kv0=kv0,
            positions=positions,
            hidden=hidden,
            tokens=tokens,
            lengths=lengths,
            caches=caches,
        ):
            if part in matmul_jit:
                return timed(matmul_jit[part], weights[part], x[part])[0]
            if part == "lm_head":
                return timed(lm_head_jit, hidden, norm_w, embed)[0]
            if part == "attention":
                elapsed, (_, caches[part]) = timed(
                    attention_jit, q0, kv0, kv0, caches[part], positions
                )
            else:
                elapsed, (_, caches[part]) = timed(
                    forward, target.params, tokens, caches[part]._replace(lengths_B=fresh(lengths))
                )
            return elapsed

        for part in PROFILE_PARTS:
            for _ in range(1 + warmup):
                call(part)
        bar.update(1)
        times = {p: [] for p in PROFILE_PARTS}
        for r in range(repeats):  # round-robin over the parts, like the grid
            bar.set_postfix_str(f"profile B={batch} T={steps} round {r + 1}/{repeats}")
            for part in PROFILE_PARTS:
                times[part].append(call(part))
            bar.update(1)
        table = {p: stats_ms(times[p]) for p in PROFILE_PARTS}
        full = table["full_forward"]["min_ms"]
        table["rest"] = {
            "min_ms": full - sum(v["min_ms"] for p, v in table.items() if p != "full_forward"),
            "note": "full_forward minus the parts: embedding, norms, SwiGLU activation, "
            "residuals, dispatch (and the noise of every term)",
        }
        table["matmuls_total"] = {"min_ms": sum(table[p]["min_ms"] for p in MATMUL_PARTS)}
        for value in table.values():
            value["share_of_full_min"] = value["min_ms"] / full
        results[f"T{steps}"] = table
    shapes = {name: list(ws[0].shape) for name, ws in weights.items()}
    shapes["lm_head"] = list(embed.shape)
    return {
        "batch": batch,
        "context": context,
        "cache_len": context + CACHE_SLACK,
        "weight_shapes_out_in": shapes,
        "layers": cfg.num_layers,
        "parts": results,
    }


# --------------------------------------------------------------------------------------------
# Plot and main
# --------------------------------------------------------------------------------------------


def plot(rows, path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ms, ax_ratio) = plt.subplots(1, 2, figsize=(12, 4.8))
    groups = sorted({(r["batch"], r["context"]) for r in rows})
    for batch, context in groups:
        pts = sorted(
            (r["T"], r["min_ms"], r["ratio_vs_t1_min"])
            for r in rows
            if r["batch"] == batch and r["context"] == context
        )
        ts = [p[0] for p in pts]
        style = "-" if context == min(c for _, c in groups) else "--"
        label = f"B={batch}, ctx={context}"
        (line,) = ax_ms.plot(ts, [p[1] for p in pts], style, marker="o", label=label)
        ax_ratio.plot(
            ts, [p[2] for p in pts], style, marker="o", color=line.get_color(), label=label
        )
    for ax in (ax_ms, ax_ratio):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("T (new tokens per forward)")
        ax.grid(True, which="both", alpha=0.3)
    ax_ms.set_yscale("log")
    ax_ms.set_ylabel("forward wall time, min of N [ms]")
    ax_ms.set_title("Target forward (all-T logits, donated cache)")
    ax_ratio.axhline(1.0, color="k", lw=0.8)
    ax_ratio.axhline(1.3, color="g", lw=0.8, ls=":", label="DSpark goal T(8)/T(1) = 1.3")
    ax_ratio.set_ylabel("T(t) / T(1)")
    ax_ratio.set_title("Cost ratio vs a single-token forward")
    ax_ratio.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=json_output_with_plot, default=str(REPO_ROOT / "docs" / "bench_target.json"),
        help="JSON output; the PNG goes next to it",
    )
    ap.add_argument(
        "--quick", action="store_true", help="CI-sized subset: B=1, T in {1,8}, ctx 256"
    )
    ap.add_argument("--batches", type=positive_int, nargs="+", default=None)
    ap.add_argument("--steps", type=positive_int, nargs="+", default=None, help="T values")
    ap.add_argument("--contexts", type=positive_int, nargs="+", default=None)
    ap.add_argument("--repeats", type=positive_int, default=None, help="timed rounds per grid cell")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls after compiling")
    ap.add_argument(
        "--new-tokens", type=positive_int, default=None, help="tokens per request in the decode test"
    )
    ap.add_argument("--decode-repeats", type=positive_int, default=None)
    ap.add_argument("--profile-repeats", type=positive_int, default=None)
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args(argv)
    set_quick_defaults(
        args, batches=([1], [1, 4, 8]), steps=([1, 8], [1, 2, 4, 8, 16]), contexts=([256], [256, 1024]),
        repeats=(5, 15), new_tokens=(32, 64), decode_repeats=(1, 3), profile_repeats=(3, 15),
    )
    args.steps = sorted({1, *args.steps})  # the ratios are against T = 1
    if max(args.steps) > CACHE_SLACK:
        ap.error(f"--steps: T must be <= {CACHE_SLACK}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    quick, batches, steps, contexts = args.quick, args.batches, args.steps, args.contexts
    repeats, new_tokens = args.repeats, args.new_tokens
    decode_repeats, profile_repeats = args.decode_repeats, args.profile_repeats
    png_path = args.out.with_suffix(".png")

    from dspark_jax.checkpoints.gguf import load_embedded_target

    load_avg_start = os.getloadavg()
    started = time.time()
    t0 = time.perf_counter()
    target, tokenizer = load_embedded_target()
    load_s = time.perf_counter() - t0
    print(
        f"loaded {target.cfg.architecture} target ({target.num_params / 1e6:.1f}M params) in {load_s:.1f}s",
        file=sys.stderr,
    )

    groups = len(batches) * len(contexts)
    total = (
        groups * (len(steps) + repeats) + 4 + (0 if args.no_profile else 2 * (1 + profile_repeats))
    )
    with tqdm(total=total, desc="bench_target", file=sys.stderr, dynamic_ncols=True) as bar:
        rows = bench_grid(target, batches, contexts, steps, repeats, args.warmup, bar)
        decode = {}
        for batch in (1, 8):
            bar.set_postfix_str(f"AR decode B={batch}")
            decode[f"b{batch}"] = bench_decode(target, tokenizer, batch, new_tokens, decode_repeats)
            bar.update(1)
            # The same decode sampled with top-k and top-p (the paper's regeneration settings).
            decode[f"b{batch}_sampled"] = bench_decode(target, tokenizer, batch, new_tokens, decode_repeats, SAMPLED)
            bar.update(1)
        profile = None
        if not args.no_profile:
            profile = profile_parts(
                target, 1, [1, 8], min(contexts), profile_repeats, args.warmup, bar
            )

    def row(b, c, t):
        return next(
            (r for r in rows if r["batch"] == b and r["context"] == c and r["T"] == t), None
        )

    ctx0 = 256 if 256 in contexts else min(contexts)
    r8 = row(1, ctx0, 8) or row(min(batches), ctx0, max(steps))
    summary = {
        "t_ratio_8_1_b1": round(r8["ratio_vs_t1_min"], 3) if r8 else None,
        "decode_tok_s_b1": round(decode["b1"]["best"]["decode_tok_s"], 2),
        "decode_tok_s_b8": round(decode["b8"]["best"]["decode_tok_s"], 2),
        "decode_tok_s_b1_sampled": round(decode["b1_sampled"]["best"]["decode_tok_s"], 2),
        "decode_tok_s_b8_sampled": round(decode["b8_sampled"]["best"]["decode_tok_s"], 2),
    }
    result = {
        "summary": summary,
        "summary_context": ctx0,
        "mode": "quick" if quick else "full",
        "started_unix": started,
        "wall_s": time.time() - started,
        "machine": machine_info(),
        "load_avg_start": load_avg_start,
        "load_avg_end": os.getloadavg(),
        "target": {
            "name": "SmolLM2-135M-Instruct (embedded GGUF, dequantized fp32)",
            "params": target.num_params,
            "config": {
                k: v for k, v in vars(target.cfg).items() if isinstance(v, (int, float, str, bool))
            },
        },
        "method": {
            "forward": "jax.jit(target.apply -> (logits[B,T,V], cache), donate_argnums=cache); "
            "cache max_len = context + 32, lengths_B = context; round-robin over T per "
            "(B, context); min and median of `repeats` rounds after compile + warmup",
            "repeats": repeats,
            "warmup": args.warmup,
            "cache_slack": CACHE_SLACK,
            "decode": "AutoregressiveGenerator.warmup then generate(max_new_tokens, stop_ids=()); best of runs; "
            f"greedy, and *_sampled at {SAMPLED}",
            "profile": "jitted sub-computations on real weights over all layers (dependent chains); "
            "rest = full - sum(parts)",
        },
        "forward": rows,
        "decode": decode,
        "profile": profile,
    }
    out_path = write_json(args.out, result, indent=1)
    mi = result["machine"]
    plot(
        rows,
        png_path,
        f"SmolLM2-135M fp32, jax {mi['jax']}, {mi['cpu_count']} CPUs ({mi['cpu_model']}), "
        f"min of {repeats}; load avg {load_avg_start[0]:.1f}->{result['load_avg_end'][0]:.1f}",
    )

    # human-readable tables (stderr), then the summary line last on stdout
    print(f"\nforward ms (min / median of {repeats}), logits at all T:", file=sys.stderr)
    for c in contexts:
        for b in batches:
            cells = "  ".join(
                f"T{t}: {row(b, c, t)['min_ms']:7.1f}/{row(b, c, t)['median_ms']:7.1f} "
                f"(x{row(b, c, t)['ratio_vs_t1_min']:.2f})"
                for t in steps
            )
            print(f"  ctx={c:5d} B={b}: {cells}", file=sys.stderr)
    for k, d in decode.items():
        print(
            f"AR decode {k}: {d['best']['decode_tok_s']:.1f} tok/s ({d['best']['ms_per_step']:.1f} ms/step mean; "
            f"per step min {d['step_ms_min']:.1f} / median {d['step_ms_median']:.1f} ms; cache {d['cache_len']})",
            file=sys.stderr,
        )
    if profile:
        for tkey, table in profile["parts"].items():
            parts = ", ".join(
                f"{p} {v['min_ms']:.1f}ms ({100 * v['share_of_full_min']:.0f}%)"
                for p, v in table.items()
            )
            print(f"profile B=1 {tkey}: {parts}", file=sys.stderr)
    print(f"wrote {out_path} and {png_path}", file=sys.stderr)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
