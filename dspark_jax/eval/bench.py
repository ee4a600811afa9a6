"""Shared pieces of the benchmark scripts (``scripts/*.py``): their ``--out`` file, benchmark
prompts, timing and machine info."""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from dspark_jax.config import output_file

# jax is imported where it is used: the scripts read their flags with this module, before any work.


def json_output(text: str) -> Path:
    """argparse type of a script's ``--out``: the JSON file, checked when the flags are read
    (``config.output_file``) rather than when it is written at the end of a run."""
    try:
        return output_file(text, "the JSON file")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def json_output_with_plot(text: str) -> Path:
    """``json_output`` for a script that also draws a PNG beside the JSON (the same stem): an
    ``--out`` ending in .png would be both files, and the plot would overwrite the JSON."""
    path = json_output(text)
    if path.suffix.lower() == ".png":
        raise argparse.ArgumentTypeError(f"{path} names the JSON file; the PNG is written beside it with the same stem "
                                         f"(give e.g. {path.with_suffix('.json')})")
    return path


def set_quick_defaults(args, **defaults: tuple) -> None:
    """Each flag of ``defaults`` left unset (None) takes its ``(quick, full)`` default by
    ``args.quick``: a default that depends on --quick cannot be argparse's, and ``args.x or
    default`` would turn an explicit 0 into the default."""
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)


def read_benchmark_prompts(directory, filenames, limit: int) -> list[list[str]]:
    """The first ``limit`` first turns of each of ``filenames`` in ``--benchmarks directory``,
    read before the target loads; a missing directory or file or a malformed line ends the
    script with one line that names the file."""
    from dspark_jax.eval.compare import read_prompts_jsonl

    directory = Path(directory)
    if not directory.is_dir():
        raise SystemExit(f"--benchmarks {directory}: not a directory")
    try:
        return [read_prompts_jsonl(directory / name, limit) for name in filenames]
    except (OSError, ValueError) as error:
        raise SystemExit(f"--benchmarks: {error}") from None


def interleaved_texts(directory, count: int) -> list[str]:
    """``count`` first turns of the math, code and chat sets in ``--benchmarks directory``,
    interleaved (math, code, chat, math, ...), so that every batch mixes domains."""
    from dspark_jax.eval.compare import DOMAIN_FILES

    per_domain = -(-count // len(DOMAIN_FILES))
    lists = read_benchmark_prompts(directory, DOMAIN_FILES.values(), per_domain)
    texts = [t for group in zip(*lists) for t in group][:count]
    if len(texts) < count:
        raise SystemExit(f"--benchmarks {directory}: {count} prompts needed, {len(texts)} found")
    return texts


def weights_digest(directory) -> str:
    """SHA-256 of a drafter checkpoint's safetensors files (one, or a DeepSpec checkpoint's shards),
    not of its calibration: two directories of the same weights share a digest."""
    from dspark_jax.checkpoints.hf import safetensors_files

    digest = hashlib.sha256()
    for path in sorted(set(safetensors_files(Path(directory)).values())):
        with open(path, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def policy_decoders(target, drafter_spec: str, policies: dict, *, batches: Sequence[int], max_len: int,
                    sampling=None) -> dict:
    """One speculative decoder for ``--drafter drafter_spec`` per ``--policy`` (``policies``: text
    -> ``cli.parse_policy_arg(text)``, parsed before the target loads), by text.

    A policy the drafter cannot run is a one-line exit (``cli.load_drafter_arg``); a scheduler
    without a cost table is profiled here at every B of ``batches`` on ``max_len`` slots (the
    cache decoding uses), decoding with ``sampling`` (default greedy), once, so that schedulers
    compared side by side weigh the same costs; it takes the drafter's calibration for ``sampling``.
    Every decoder must reserve γ + 1 slots for its widest verify, so that one cache length
    serves them all (and target-only too: a step attends over the whole cache, so a shorter one
    would make its steps cheaper than the rounds')."""
    import dataclasses
    import sys

    from dspark_jax.cli import load_drafter_arg
    from dspark_jax.eval.compare import make_decoder
    from dspark_jax.scheduler.prefix import SchedulerPolicy

    decoders, costs = {}, None
    for text, policy in policies.items():
        _, drafter, chosen, note = load_drafter_arg(drafter_spec, target, policy, sampling=sampling)
        if note:
            print(f"note: {text}: {note}", file=sys.stderr)
        if isinstance(chosen, SchedulerPolicy) and chosen.costs is None and costs is not None:
            chosen = dataclasses.replace(chosen, costs=costs)
        decoders[text] = make_decoder(target, drafter, chosen, profile_batches=batches, profile_max_len=max_len,
                                      profile_sampling=sampling)
        if isinstance(decoders[text].policy, SchedulerPolicy):
            costs = costs or decoders[text].policy.costs
        if decoders[text].slack != drafter.cfg.block_size + 1:
            raise SystemExit(f"--policy {text}: verifies up to {decoders[text].slack} tokens a row, "
                             f"not γ + 1 = {drafter.cfg.block_size + 1}")
    return decoders


class PolicyBench(NamedTuple):
    target: Any
    tokenizer: Any
    prompts: list[list[int]]  # chat-templated token ids
    max_len: int  # the cache length every decoder runs with
    decoders: dict  # --policy text -> SpeculativeDecoder


def bench_target(checkpoint: str | None, dtype: str = "float32"):
    """``(target, tokenizer)`` for a script's ``--checkpoint`` / ``--dtype``
    (``cli.add_checkpoint_argument``; None is the embedded target); a checkpoint that does not
    load ends the script with one line that names it."""
    from dspark_jax import checkpoints

    try:
        return checkpoints.load_target(checkpoint, dtype)
    except (OSError, ValueError) as error:
        raise SystemExit(f"--checkpoint {checkpoint!r}: {error}") from None


def target_label(checkpoint: str | None, dtype: str = "float32") -> str:
    """How a benchmark's JSON and plot name its target: the checkpoint's file or directory name
    (the embedded SmolLM2 for None), and its dtype where it is not float32."""
    name = Path(checkpoint).name if checkpoint else "SmolLM2-135M-Instruct"
    return name if dtype == "float32" else f"{name} ({dtype})"


def policy_bench(texts: Sequence[str], drafter_spec: str, policies: dict, *, batches: Sequence[int],
                 max_new_tokens: int, sampling=None, checkpoint: str | None = None,
                 dtype: str = "float32") -> PolicyBench:
    """The target (``bench_target``), ``texts`` as chat-templated prompts, the one cache length for
    them (longest prompt + ``max_new_tokens`` + the drafter's γ + 1) and ``policy_decoders`` on it
    (for ``sampling``, default greedy)."""
    from dspark_jax.checkpoints.drafter import read_drafter_config
    from dspark_jax.decoding.autoregressive import cache_len
    from dspark_jax.drafters import resolve_drafter

    target, tokenizer = bench_target(checkpoint, dtype)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    slack = read_drafter_config(resolve_drafter(drafter_spec)[1], target)[0].block_size + 1
    max_len = cache_len([len(p) for p in prompts], max_new_tokens, target.cfg.max_position_embeddings, slack)
    return PolicyBench(target, tokenizer, prompts, max_len,
                       policy_decoders(target, drafter_spec, policies, batches=batches, max_len=max_len,
                                       sampling=sampling))


def machine_info() -> dict:
    import flax
    import jax

    cpu_model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "flax": flax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu_model,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "load_avg": os.getloadavg(),
    }


def stats_ms(times_s: list[float]) -> dict:
    ms = [t * 1e3 for t in times_s]
    return {"min_ms": min(ms), "median_ms": statistics.median(ms), "n": len(ms)}


def timed(fn, *args):
    """``(seconds, result)`` of one call, waiting for the device."""
    import jax

    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - start, out
