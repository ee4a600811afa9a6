#!/usr/bin/env python
"""What building a target cache costs, two ways, on the same prompts in one process.

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

    .venv/bin/python scripts/bench_cache.py                    # 5 batches of 16 prompts: ~6 min
    .venv/bin/python scripts/bench_cache.py --quick            # one timed batch: ~2 min
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "smollm2_135m_dspark.py"),
                        help="training config whose prompts and cache settings to use")
    parser.add_argument("--batches", type=int, default=5, help="timed batches (after one untimed)")
    parser.add_argument("--quick", action="store_true", help="one timed batch")
    parser.add_argument("--out", default=str(REPO / "docs" / "bench_cache.json"))
    args = parser.parse_args(argv)
    if args.batches < 1:
        parser.error("--batches must be >= 1")
    if args.quick:
        args.batches = 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from dspark_jax.decoding.autoregressive import AutoregressiveGenerator, bucket
    from dspark_jax.eval.bench import machine_info
    from dspark_jax.training.target_cache import TargetCacheWriter, teacher_forced
    from dspark_jax.training.train import load_config, load_target, render_prompts, training_prompts

    config = load_config(Path(args.config))
    spec = config.cache
    if not spec.store_features:
        raise SystemExit(f"{args.config}: its cache stores token ids only (store_features=False); nothing to compare")
    target, tokenizer = load_target(config)
    size = spec.batch_size
    ids, _ = render_prompts(config, training_prompts(config)[: 2 * size * (args.batches + 1)], tokenizer)
    if len(ids) < size * (args.batches + 1):
        raise SystemExit(f"the config gives {len(ids)} prompts, fewer than {size * (args.batches + 1)}")
    ids = sorted(ids[: size * (args.batches + 1)], key=len)  # the writer answers in prompt-length order
    batches = [ids[i * size : (i + 1) * size] for i in range(args.batches + 1)]

    writer = TargetCacheWriter(target, spec, tempfile.mkdtemp(), stop_ids=[tokenizer.eos_token_id])
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
    prompts = size * args.batches
    result = {
        "config": str(args.config),
        "batch_size": size,
        "timed_batches": args.batches,
        "prompts": prompts,
        "response_tokens": int(np.sum(tokens)),
        "seconds_per_batch": seconds,
        "seconds_per_prompt": {name: t / prompts for name, t in total.items()},
        "speedup": total["second_forward"] / total["answer_forwards"],
        # Largest gap between the two ways' stored features and hidden states, over the RMS of the
        # sequence's values (one bf16 step is 2^-8 of a value), and the largest absolute lse gap.
        "max_gap": gaps,
        # Elements of each that differ by more than one bf16 step (and float32 noise), of all.
        "beyond_one_bf16_step": {name: [beyond[name], elements[name]] for name in beyond},
        "machine": machine_info(),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"seconds_per_prompt": result["seconds_per_prompt"], "speedup": round(result["speedup"], 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
