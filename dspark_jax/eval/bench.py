"""Shared pieces of the benchmark scripts (``scripts/*.py``): their ``--out`` file, benchmark
prompts, timing and machine info."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import statistics
import time
from pathlib import Path

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
