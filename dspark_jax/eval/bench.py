"""Shared pieces of the benchmark scripts (``scripts/bench_*.py``): timing and machine info."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics
import time
from pathlib import Path

import jax


def machine_info() -> dict:
    import flax

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
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - start, out
