"""Batch non-invariance of the embedded target, and what it does to greedy exactness.

Three measurements behind docs/EXACTNESS.md, on the 24 vendored benchmark prompts
(tests/fixtures/exactness_prompts.jsonl, chat-templated):

* ``delta``: per prompt, 8 greedy positions computed by single-token decode (T=1) and inside one
  T=8 forward from the same cache; max |Δlogit|, argmax agreement, and the same comparison for
  strict mode (both as [B, 8] forwards).
* ``divergence``: default-mode speculative greedy (random drafter, FixedPolicy(ℓ)) against
  target-only greedy, ℓ ∈ {0, 1, 3, 7}, B ∈ {1, 4}, 64 new tokens; every divergence with the
  top-2 logit gap at that position (near-tie evidence).
* ``timing``: decode tok/s at B=1 of the target-only generator, default vs strict
  (step_width 8), runs interleaved.

    .venv/bin/python scripts/exactness_report.py --part delta --part divergence --out /tmp/x.json
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

from dspark_jax.checkpoints.gguf import load_embedded_target
from dspark_jax.cli import positive_int
from dspark_jax.config import write_json
from dspark_jax.decoding.autoregressive import AutoregressiveGenerator
from dspark_jax.decoding.speculative import FixedPolicy, SpeculativeDecoder
from dspark_jax.eval.bench import json_output

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the report measures what the tests check, with the tests' helpers
from tests.prompts import random_drafter  # noqa: E402

PROMPTS = ROOT / "tests" / "fixtures" / "exactness_prompts.jsonl"
GAMMA, WIDTH = 7, 8
DIVERGENCE_BATCHES = (1, 4)  # the batch sizes measure_divergence has prompt groups for


def load_prompts(tokenizer) -> tuple[list[list[int]], list[str]]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}]) for r in rows]
    return ids, [r["source"] for r in rows]


def measure_delta(target, prompts) -> dict:
    """Logits of 8 greedy positions: T=1 steps vs one T=8 forward (default), and strict."""
    prefill = jax.jit(lambda p, t, c, n: target.apply(p, t, c, n_new_B=n, logits_at_B=n - 1))
    step1 = jax.jit(lambda p, t, c: target.apply(p, t, c, logits_at_B=jnp.zeros((t.shape[0],), jnp.int32)))
    wide = jax.jit(lambda p, t, c, n: target.apply(p, t, c, n_new_B=n))
    result = {"default_max_abs": 0.0, "strict_max_abs": 0.0, "argmax_flips": 0, "positions": 0}
    per_prompt = []
    for prompt in prompts:
        tokens = np.zeros((1, 256), np.int32)
        tokens[0, : len(prompt)] = prompt
        lens = jnp.asarray([len(prompt)], jnp.int32)
        out = prefill(target.params, jnp.asarray(tokens), target.new_cache(1, 512), lens)
        cache0, first = out.cache, int(jnp.argmax(out.logits[0]))
        seqs = {}
        for mode in ("default", "strict"):
            seq, logits, cache = [first], [], cache0
            for _ in range(WIDTH):
                if mode == "default":
                    o = step1(target.params, jnp.asarray([[seq[-1]]], jnp.int32), cache)
                    logits.append(np.asarray(o.logits[0]))
                else:
                    padded = np.zeros((1, WIDTH), np.int32)
                    padded[0, 0] = seq[-1]
                    o = wide(target.params, jnp.asarray(padded), cache, jnp.ones((1,), jnp.int32))
                    logits.append(np.asarray(o.logits[0, 0]))
                cache = o.cache
                seq.append(int(np.argmax(logits[-1])))
            seqs[mode] = (seq, np.stack(logits))
        row = {}
        for mode, (seq, single) in seqs.items():
            o = wide(target.params, jnp.asarray([seq[:WIDTH]], jnp.int32), cache0, jnp.full((1,), WIDTH, jnp.int32))
            verify = np.asarray(o.logits[0])
            delta = float(np.abs(verify - single).max())
            row[mode] = delta
            result[f"{mode}_max_abs"] = max(result[f"{mode}_max_abs"], delta)
            if mode == "default":
                result["argmax_flips"] += int((verify.argmax(-1) != single.argmax(-1)).sum())
                result["positions"] += WIDTH
        per_prompt.append(row)
    result["per_prompt"] = per_prompt
    return result


def top2_gap(target, prompt: list[int], generated: list[int], index: int) -> dict:
    """The target's top-2 logits for generated token ``index`` (one prefill-style forward)."""
    context = prompt + generated[:index]
    size = 1 << max(4, (len(context) - 1).bit_length())
    tokens = np.zeros((1, size), np.int32)
    tokens[0, : len(context)] = context
    lens = jnp.asarray([len(context)], jnp.int32)
    out = target.apply(target.params, jnp.asarray(tokens), target.new_cache(1, size), n_new_B=lens, logits_at_B=lens - 1)
    logits = np.asarray(out.logits[0])
    top = np.argsort(logits)[-2:][::-1]
    return {"top2_ids": [int(t) for t in top], "top2_gap": float(logits[top[0]] - logits[top[1]])}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def measure_divergence(target, prompts, sources, new_tokens: int, ells, batches) -> dict:
    drafter = random_drafter(target.cfg, block_size=GAMMA)
    decoders = {k: SpeculativeDecoder(target, drafter, policy=FixedPolicy(k)) for k in ells}
    ar = AutoregressiveGenerator(target)
    groups = {1: [[i] for i in range(len(prompts))]}
    # B=4: mixed sources and lengths per batch (prompt i with i+6, i+12, i+18).
    step = len(prompts) // 4
    groups[4] = [[i + j * step for j in range(4)] for i in range(step)]
    report = {"new_tokens": new_tokens, "ells": list(ells), "runs": 0, "diverged": [], "seconds": {}}
    for batch in batches:
        start = time.perf_counter()
        for group in groups[batch]:
            batch_prompts = [prompts[i] for i in group]
            reference = ar.generate(batch_prompts, max_new_tokens=new_tokens).tokens
            for k in ells:
                got = decoders[k].generate(batch_prompts, max_new_tokens=new_tokens).tokens
                for row, index in enumerate(group):
                    report["runs"] += 1
                    where = first_divergence(got[row], reference[row])
                    if where is not None:
                        entry = {"prompt": index, "source": sources[index], "B": batch, "ell": k, "at": where,
                                 "target_only": reference[row][where], "speculative": got[row][where]}
                        entry.update(top2_gap(target, batch_prompts[row], reference[row], where))
                        report["diverged"].append(entry)
                        print("divergence", entry, flush=True)
        report["seconds"][f"B{batch}"] = round(time.perf_counter() - start, 1)
        print(f"B={batch} done in {report['seconds'][f'B{batch}']} s", flush=True)
    return report


def measure_margins(target, prompts, new_tokens: int) -> dict:
    """Top-2 logit gaps along the target-only greedy trajectories: how close to a tie they come
    (a flip needs a gap below the T=1 vs T=8 |Δlogit|)."""
    reference = AutoregressiveGenerator(target).generate(prompts, max_new_tokens=new_tokens).tokens
    gaps = []
    for prompt, generated in zip(prompts, reference):
        context = prompt + generated[:-1]
        size = 1 << max(4, (len(context) - 1).bit_length())
        tokens = np.zeros((1, size), np.int32)
        tokens[0, : len(context)] = context
        out = jax.jit(target.apply)(target.params, jnp.asarray(tokens), target.new_cache(1, size))
        logits = np.asarray(out.logits[0, len(prompt) - 1 : len(context)])
        top2 = np.sort(logits, axis=-1)[:, -2:]
        gaps.append(top2[:, 1] - top2[:, 0])
    gaps = np.concatenate(gaps)
    return {
        "positions": int(gaps.size), "min_gap": float(gaps.min()),
        "smallest_5": [float(g) for g in np.sort(gaps)[:5]],
        "below_1e-3": int((gaps < 1e-3).sum()), "below_1e-2": int((gaps < 1e-2).sum()),
    }


def measure_timing(target, prompts, rounds: int = 2, new_tokens: int = 48) -> dict:
    gens = {"default": AutoregressiveGenerator(target), "strict": AutoregressiveGenerator(target, step_width=WIDTH)}
    batch = [prompts[10]]  # a short chat prompt
    for gen in gens.values():
        gen.generate(batch, max_new_tokens=4)  # compile
    rates = {name: [] for name in gens}
    for _ in range(rounds):
        for name, gen in gens.items():
            rates[name].append(round(gen.generate(batch, max_new_tokens=new_tokens).decode_tokens_per_s, 2))
    return {"decode_tok_s_b1": rates, "new_tokens": new_tokens}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", action="append", choices=["delta", "divergence", "margins", "timing"])
    parser.add_argument("--new-tokens", type=positive_int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", choices=DIVERGENCE_BATCHES, default=list(DIVERGENCE_BATCHES))
    parser.add_argument("--ells", type=int, nargs="+", choices=range(GAMMA + 1), default=[0, 1, 3, GAMMA],
                        metavar="ELL", help=f"drafts verified per round, 0 to {GAMMA}")
    parser.add_argument("--out", type=json_output)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    parts = args.part or ["delta", "divergence", "margins", "timing"]
    target, tokenizer = load_embedded_target()
    prompts, sources = load_prompts(tokenizer)
    summary = {"load_avg": list(np.round(np.asarray(__import__("os").getloadavg()), 2))}
    if "delta" in parts:
        summary["delta"] = measure_delta(target, prompts)
        print(json.dumps({k: v for k, v in summary["delta"].items() if k != "per_prompt"}), flush=True)
    if "divergence" in parts:
        summary["divergence"] = measure_divergence(target, prompts, sources, args.new_tokens, args.ells, args.batches)
    if "margins" in parts:
        summary["margins"] = measure_margins(target, prompts, args.new_tokens)
        print(json.dumps(summary["margins"]), flush=True)
    if "timing" in parts:
        summary["timing"] = measure_timing(target, prompts)
        print(json.dumps(summary["timing"]), flush=True)
    if args.out:
        write_json(args.out, summary, indent=1)
    short = {k: v for k, v in summary.items() if k != "delta"}
    if "divergence" in short:
        short["divergence"] = {k: v for k, v in short["divergence"].items()}
    print(json.dumps(short))


if __name__ == "__main__":
    main()
