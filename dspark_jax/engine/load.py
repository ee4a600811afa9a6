"""Serving under load: requests that arrive over time, and the throughput and latency they get.

A decoder serves requests by continuous batching (``decoding.slots``): at most ``batch_size``
rows decode together, and a request takes a free row once it has arrived
(``generate(arrivals=...)``). ``poisson_arrivals`` draws the arrival times of an open workload
(a Poisson process: exponential gaps at a mean rate), ``warm_up`` compiles what serving it takes,
``serve`` runs one decoder on it and times each request from its arrival, and ``pareto_front``
keeps the runs of a sweep (arrival rates × batch sizes × policies) that no other run beats on
both aggregate throughput and per-user speed: the trade-off DSpark's scheduler is meant to move
(paper §6.7; vLLM's adaptive-verification benchmarks sweep concurrency the same way).

Times are wall-clock seconds from the start of ``serve``, measured on the host as the decoder
commits tokens (``on_tokens`` / ``on_finish``), so they include prefill, queueing for a row and
every round the request shares with others.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dspark_jax.config import as_int
from dspark_jax.decoding.autoregressive import prompt_width
from dspark_jax.eval.metrics import mean_batch_rows


def poisson_arrivals(count: int, rate_per_s: float, seed: int = 0) -> np.ndarray:
    """Arrival times (seconds) of ``count`` requests at a mean ``rate_per_s``: exponential gaps,
    shifted so the first arrives at 0 (a run does not start by waiting). ``math.inf``: all at 0
    (a closed batch, every request queued at the start). The same seed gives the same times."""
    if as_int(count, "count", "an int >= 1") < 1:
        raise ValueError(f"count must be an int >= 1, got {count!r}")
    if isinstance(rate_per_s, bool) or not (isinstance(rate_per_s, numbers.Real) and rate_per_s > 0):
        raise ValueError(f"rate_per_s must be a number of requests per second > 0 (math.inf: all at once), "
                         f"got {rate_per_s!r}")
    if math.isinf(rate_per_s):
        return np.zeros(count)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, count)
    return np.cumsum(gaps) - gaps[0]


@dataclasses.dataclass(frozen=True)
class ServingRun:
    """One decoder serving one workload: per request (in request order) its arrival, first token
    and finish times and its token count; the run's wall time; the decoder's own result."""

    arrival_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    num_tokens: np.ndarray
    wall_s: float
    result: Any  # GenerationResult or SpeculativeResult: tokens, and for speculative decoding τ and widths

    @property
    def ttft_s(self) -> np.ndarray:
        """Time to first token: queueing for a row + prefill."""
        return self.first_token_s - self.arrival_s

    @property
    def latency_s(self) -> np.ndarray:
        """Arrival to last token."""
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> np.ndarray:
        """Time per output token after the first (NaN for a one-token answer)."""
        later = self.num_tokens - 1
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(later > 0, (self.finish_s - self.first_token_s) / np.maximum(later, 1), np.nan)

    @property
    def throughput(self) -> float:
        """Tokens generated per second of the run: every request's, over the wall time."""
        return float(self.num_tokens.sum() / self.wall_s)

    @property
    def per_user_tokens_per_s(self) -> float:
        """The median request's decoding speed, 1 / TPOT: what one user sees once tokens flow."""
        tpot = self.tpot_s[np.isfinite(self.tpot_s)]
        return float(1.0 / np.median(tpot)) if tpot.size else float("nan")

    def summary(self) -> dict:
        """The numbers a sweep compares, JSON-ready (seconds and tokens/s)."""

        def spread(values: np.ndarray) -> dict:
            values = values[np.isfinite(values)]
            if not values.size:
                return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
            return {"mean": float(values.mean()), **{f"p{q}": float(np.percentile(values, q)) for q in (50, 90, 99)}}

        out = {
            "requests": int(self.num_tokens.size),
            "tokens": int(self.num_tokens.sum()),
            "wall_s": self.wall_s,
            "throughput": self.throughput,
            "per_user_tokens_per_s": self.per_user_tokens_per_s,
            "latency_s": spread(self.latency_s),
            "ttft_s": spread(self.ttft_s),
            "tpot_s": spread(self.tpot_s),
        }
        rows = mean_batch_rows(self.result)
        if rows is not None:
            out["mean_batch_rows"] = rows
        if hasattr(self.result, "tau"):
            out |= {"tau": self.result.tau, "width_histogram": dict(self.result.width_histogram)}
        return out


def warm_up(decoder, prompts: Sequence[Sequence[int]], *, batch_size: int, max_len: int, **generate_kwargs) -> float:
    """Compile what serving ``prompts`` on ``batch_size`` rows with a ``max_len`` cache takes, so
    that no request waits on a compilation: every refill size at every prompt width among
    ``prompts`` (``warmup(refills=True)``; with ``batch_buckets=True`` at every batch size, and the
    resizes), then a one-token run of them all (what depends on the number of requests: their
    sampling parameters and PRNG keys). Returns seconds spent."""
    start = time.perf_counter()
    buckets = generate_kwargs.get("batch_buckets", False)
    for length in sorted({prompt_width(len(p), max_len): len(p) for p in prompts}.values()):  # one per width
        decoder.warmup(batch_size, length, max_len, refills=True, buckets=buckets)
    decoder.generate(prompts, max_new_tokens=1, max_len=max_len, batch_size=batch_size, **generate_kwargs)
    return time.perf_counter() - start


def serve(decoder, prompts: Sequence[Sequence[int]], arrivals: Sequence[float], *, max_new_tokens: int | Sequence[int],
          batch_size: int, clock=time.perf_counter, **generate_kwargs) -> ServingRun:
    """``decoder.generate`` on requests arriving at ``arrivals`` (seconds from now), at most
    ``batch_size`` decoding at once; every request timed. ``generate_kwargs`` (sampling, seeds,
    stop_ids, max_len, batch_buckets) go to ``generate``; time a warm decoder (``warm_up``, with
    the same ``batch_buckets``)."""
    if np.min(max_new_tokens) < 1:
        raise ValueError(f"serving times each request's tokens: max_new_tokens must be >= 1, got {max_new_tokens}")
    count = len(prompts)
    first, finish = np.full(count, np.nan), np.full(count, np.nan)

    def on_tokens(index, tokens):
        if np.isnan(first[index]):
            first[index] = clock() - start

    def on_finish(index, tokens, reason):
        finish[index] = clock() - start

    start = clock()
    result = decoder.generate(prompts, max_new_tokens=max_new_tokens, batch_size=batch_size, arrivals=arrivals,
                              on_tokens=on_tokens, on_finish=on_finish, **generate_kwargs)
    wall = clock() - start
    return ServingRun(np.asarray(arrivals, np.float64), first, finish,
                      np.array([len(t) for t in result.tokens]), wall, result)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points (x, y), both larger-is-better, that no other point matches or beats
    on both with one strictly better; in order of x. NaN points are never on the front."""
    finite = [i for i, (x, y) in enumerate(points) if math.isfinite(x) and math.isfinite(y)]
    front = [i for i in finite
             if not any(points[j][0] >= points[i][0] and points[j][1] >= points[i][1] and points[j] != points[i]
                        for j in finite)]
    return sorted(front, key=lambda i: points[i][0])
