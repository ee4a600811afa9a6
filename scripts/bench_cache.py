#!/usr/bin/env python
"""What building a target cache costs, compared two ways on the same prompts in one process.

``--compare forwards`` (default): where the stored arrays come from.

* ``answer_forwards`` (what ``TargetCacheWriter`` does): the forwards that generate each answer
  (prefill, then a decode step per token) also return the tapped layers' outputs, and
  ``stored_arrays`` turns them into the stored features, hidden state and lse.
* ``second_forward`` (what the writer did before): generate the answers, then run one more
  forward over each finished batch of sequences (``teacher_forced``), padded to a common width
  (``bucket`` of the longest, at least 64, as the old writer did; here the batch is the
  generation batch, already sorted by prompt length, so the padding is at most what the old
  writer paid).

Both answer the same batches with the same seeds, alternating which goes first, after one
untimed batch that compiles both. The JSON holds seconds per batch and per prompt for each, their
ratio, the response tokens, and how far the two ways' stored arrays are apart (they agree to one
bf16 rounding step: a decode step and a whole-sequence forward round differently).

``--compare batching``: how a shard's prompts share the ``batch_size`` rows.

* ``continuous`` (``CacheSpec(continuous=True)``): a finished answer's row takes the next prompt.
* ``fixed`` (the default): fixed batches in order of prompt length, each row waiting for its
  batch's longest answer.

Both answer whole shards (``shard_size`` prompts) with the same seeds, alternating which goes
first, after one untimed shard. The JSON holds seconds, decode steps and response tokens per shard
for each, their ratio, and how many answers differ (none should: per-prompt seeds; only a float
rounding flip between prefill shapes could change a sampled token).

    .venv/bin/python scripts/bench_cache.py                       # 5 batches of 16 prompts: ~6 min
    .venv/bin/python scripts/bench_cache.py --quick               # one timed batch: ~2 min
    .venv/bin/python scripts/bench_cache.py --compare batching    # 1 + 2 shards of 64, each way: ~45 min
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.cli import positive_int
from dspark_jax.config import write_json
from dspark_jax.eval.bench import json_output

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "smollm2_135m_dspark.py"),
                        help="training config whose prompts and cache settings to use")
    parser.add_argument("--compare", choices=("forwards", "batching"), default="forwards",
                        help="where the stored arrays come from, or how prompts share the rows")
    parser.add_argument("--batches", type=positive_int,
                        help="timed batches (forwards, default 5) or shards (batching, default 2), after one untimed")
    parser.add_argument("--quick", action="store_true", help="one timed batch or shard")
    parser.add_argument("--out", type=json_output,
                        help="JSON path (default docs/bench_cache.json, or bench_cache_batching.json)")
    args = parser.parse_args(argv)
    if args.batches is None:
        args.batches = 1 if args.quick else 5 if args.compare == "forwards" else 2
    if args.out is None:
        args.out = REPO / "docs" / ("bench_cache.json" if args.compare == "forwards" else "bench_cache_batching.json")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from dspark_jax.eval.bench import machine_info
    from dspark_jax.training.target_cache import TargetCacheWriter
    from dspark_jax.training.train import load_config, load_target, render_prompts, training_prompts

    config = load_config(Path(args.config))
    spec = config.cache
    if not spec.store_features and args.compare == "forwards":
        raise SystemExit(f"{args.config}: its cache stores token ids only (store_features=False); nothing to compare")
    target, tokenizer = load_target(config)

    def prompts(count: int) -> list[list[int]]:
        """The config's first ``count`` training prompts, tokenized (over-long ones dropped)."""
        ids, _ = render_prompts(config, training_prompts(config)[: 2 * count], tokenizer)
        if len(ids) < count:
            raise SystemExit(f"the config gives {len(ids)} prompts, fewer than {count}")
        return ids[:count]

    writer = TargetCacheWriter(target, spec, tempfile.mkdtemp(), stop_ids=tokenizer.stop_ids)
    compare = compare_forwards if args.compare == "forwards" else compare_batching
    result = {"config": str(args.config), **compare(args, writer, prompts), "machine": machine_info()}
    write_json(args.out, result, indent=2)
    print(json.dumps({"seconds_per_prompt": result["seconds_per_prompt"], "speedup": round(result["speedup"], 3)}))
    return 0


def compare_forwards(args, writer, prompts) -> dict:
    from dspark_jax.decoding.autoregressive import AutoregressiveGenerator, bucket
    from dspark_jax.training.target_cache import teacher_forced

    target, spec = writer.target, writer.spec
    size = spec.batch_size
    ids = sorted(prompts(size * (args.batches + 1)), key=len)  # the writer answers in prompt-length order
    batches = [ids[i * size : (i + 1) * size] for i in range(args.batches + 1)]

    plain = AutoregressiveGenerator(target)
    second = jax.jit(teacher_forced(target, spec.tap_layers))

    def second_forward(batch, first):
        result = plain.generate(batch, max_new_tokens=spec.max_new_tokens, sampling=spec.sampling,
                                seeds=[spec.seed * 1_000_003 + first + i for i in range(len(batch))],
                                stop_ids=writer.stop_ids, max_len=writer.max_len)
        sequences = [list(p) + r for p, r in zip(batch, result.tokens)]
        lens = np.asarray([len(s) for s in sequences], np.int32)
        tokens = np.zeros((len(batch), bucket(int(lens.max()), 64)), np.int32)
        for row, seq in enumerate(sequences):
            tokens[row, : len(seq)] = seq
        features, hidden, lse = jax.device_get(second(target.params, jnp.asarray(tokens), jnp.asarray(lens)))
        return result.tokens, [(features[r, :n], hidden[r, :n], lse[r, :n]) for r, n in enumerate(lens)]

    ways = {"answer_forwards": writer.respond, "second_forward": second_forward}
    seconds = {name: [] for name in ways}
    tokens, gaps = [], {"features": 0.0, "hidden": 0.0, "lse": 0.0}
    beyond, elements = {"features": 0, "hidden": 0}, {"features": 0, "hidden": 0}
    for index, batch in enumerate(batches):
        first = index * size
        order = list(ways) if index % 2 == 0 else list(reversed(ways))
        outputs = {}
        for name in order:
            start = time.perf_counter()
            outputs[name] = ways[name](batch, first)
            if index > 0:
                seconds[name].append(time.perf_counter() - start)
            print(f"batch {index} {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
        (answers, stored), (answers_2, stored_2) = outputs["answer_forwards"], outputs["second_forward"]
        if answers != answers_2:
            raise SystemExit(f"batch {index}: the two ways generated different answers")
        if index > 0:
            tokens.append(sum(len(a) for a in answers))
        for one, other in zip(stored, stored_2):
            for name, a, b in zip(gaps, one, other):
                a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
                scale = 1.0 if name == "lse" else float(np.sqrt(np.mean(b**2)))
                gaps[name] = max(gaps[name], float(np.max(np.abs(a - b))) / scale)
                if name != "lse":  # one bf16 step is at most 2^-7 of a value; float32 noise near 0
                    beyond[name] += int(np.sum(np.abs(a - b) > 2.0**-7 * np.maximum(np.abs(a), np.abs(b)) + 1e-4 * scale))
                    elements[name] += a.size

    total = {name: float(np.sum(s)) for name, s in seconds.items()}
    count = size * args.batches
    return {
        "batch_size": size,
        "timed_batches": args.batches,
        "prompts": count,
        "response_tokens": int(np.sum(tokens)),
        "seconds_per_batch": seconds,
        "seconds_per_prompt": {name: t / count for name, t in total.items()},
        "speedup": total["second_forward"] / total["answer_forwards"],
        # Largest gap between the two ways' stored features and hidden states, over the RMS of the
        # sequence's values (one bf16 step is 2^-8 of a value), and the largest absolute lse gap.
        "max_gap": gaps,
        # Elements of each that differ by more than one bf16 step (and float32 noise), of all.
        "beyond_one_bf16_step": {name: [beyond[name], elements[name]] for name in beyond},
    }


def compare_batching(args, writer, prompts) -> dict:
    """Continuous against fixed batches over whole shards, alternating which goes first."""
    spec = writer.spec
    size = spec.shard_size
    ids = prompts(size * (args.batches + 1))
    shards = [ids[i * size : (i + 1) * size] for i in range(args.batches + 1)]
    generate, steps = writer.generator.generate, []

    def counting_steps(*a, **kw):  # respond() keeps only the tokens; the steps are the result's
        result = generate(*a, **kw)
        steps.append(result.steps)
        return result

    writer.generator.generate = counting_steps
    ways = {"continuous": dataclasses.replace(spec, continuous=True), "fixed": dataclasses.replace(spec, continuous=False)}
    seconds, decode_steps = {name: [] for name in ways}, {name: [] for name in ways}
    tokens, differing = [], 0
    for index, shard in enumerate(shards):
        order = list(ways) if index % 2 == 0 else list(reversed(ways))
        answers = {}
        for name in order:
            start = time.perf_counter()
            writer.spec = ways[name]  # respond() batches as its spec says; one writer compiles once for both
            answers[name], _ = writer.respond(shard, index * size)
            elapsed = time.perf_counter() - start
            if index > 0:
                seconds[name].append(elapsed)
                decode_steps[name].append(steps[-1])
            print(f"shard {index} {name}: {elapsed:.1f} s, {steps[-1]} steps", file=sys.stderr)
        differing += sum(a != b for a, b in zip(answers["continuous"], answers["fixed"]))
        if index > 0:
            tokens.append(sum(len(a) for a in answers["continuous"]))

    total = {name: float(np.sum(s)) for name, s in seconds.items()}
    count = size * args.batches
    return {
        "shard_size": size,
        "batch_size": spec.batch_size,
        "timed_shards": args.batches,
        "prompts": count,
        "response_tokens": int(np.sum(tokens)),
        "seconds_per_shard": seconds,
        "decode_steps_per_shard": decode_steps,
        "seconds_per_prompt": {name: t / count for name, t in total.items()},
        "speedup": total["fixed"] / total["continuous"],
        # Answers (of every shard, the untimed one too) that differ between the two ways.
        "differing_answers": differing,
    }


if __name__ == "__main__":
    sys.exit(main())
