"""The scheduler's cost table: seconds a speculative round takes at each verify width, per batch.

A round is one draft call and one verify forward at width ``W``, so the table is timed on the
decoder itself (this target, this drafter, this machine), round-robin over the widths so that
a burst of load from other processes hits every width alike; the median of ``repeats`` rounds
counts. Drafting is included because it is paid every round whatever the scheduler picks: the
throughput the scheduler maximises is tokens per second of the whole round. Verify lengths are 0
while timing (a forward's cost depends on its width, not on how many of its tokens count), so
each round commits one token and the cache barely grows.

A plain round (no draft, ℓ = 0: a target step through the narrowest verify program) is timed
too, under width ``0``: it is what the decoder switches to while drafts do not pay.

Files (``dspark profile --out``): JSON ``{"format": "dspark-jax-cost-table", "version": 1,
"tables": {"<batch>": {"<width>": seconds}}, ...}`` (width ``"0"``: the plain round) plus the
machine, drafter and settings it was timed with.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.config import SamplingConfig, output_file, write_json
from dspark_jax.decoding.autoregressive import prompt_width
from dspark_jax.sampling import SamplingParams, request_keys
from dspark_jax.scheduler.prefix import PLAIN, SchedulerPolicy, cost_tables

FORMAT = "dspark-jax-cost-table"
VERSION = 1


def profile_round_costs(
    decoder,
    batch: int = 1,
    *,
    max_len: int = 256,
    prompt_len: int = 32,
    repeats: int = 8,
    sampling: SamplingConfig | None = None,
    seed: int = 0,
) -> dict[int, float]:
    """``{verify width: median seconds of a round}`` for ``decoder`` at ``batch`` rows, and under
    ``PLAIN`` (0) the seconds of a round that skips the draft (a target step at the narrowest width).

    ``max_len`` is the cache length (part of the compiled shape, so time the one decoding will
    use); ``prompt_len`` random prompt tokens are prefilled first.
    """
    if batch < 1 or repeats < 1 or prompt_len < 1:
        raise ValueError(f"batch, repeats and prompt_len must be >= 1, got {batch}, {repeats}, {prompt_len}")
    if max_len > decoder.target.cfg.max_position_embeddings:  # generation would refuse this cache length
        raise ValueError(f"max_len {max_len} is past the target's {decoder.target.cfg.max_position_embeddings} "
                         "positions")
    widths = decoder.verify_widths
    rounds = (repeats + 1) * (len(widths) + 1)  # one untimed warm-up round per width and the plain one
    if prompt_len + rounds + widths[-1] > max_len:
        raise ValueError(f"max_len {max_len} cannot hold a {prompt_len}-token prompt and {rounds} profiling rounds")
    from dspark_jax.decoding.speculative import NO_FLOOR, FixedPolicy, stop_id_array

    if isinstance(decoder.policy, SchedulerPolicy):  # it may have no table yet; its own work (a sort) is negligible
        decoder = decoder.with_policy(FixedPolicy(decoder.cfg.block_size))
    target = decoder.target
    with decoder.rows.scope():  # as the decoder's own methods run (rows.in_mesh_scope)
        params, keys, active, lengths = decoder.rows.on_rows((
            SamplingParams.broadcast(sampling or SamplingConfig(), batch), request_keys(range(seed, seed + batch)),
            jnp.asarray(np.ones(batch, bool)), jnp.zeros((batch,), jnp.int32),
        ))
        stops = stop_id_array(())
        prompts = np.random.default_rng(seed).integers(0, target.cfg.vocab_size, (batch, prompt_width(prompt_len, max_len)), dtype=np.int32)
        _, state = decoder.prefill(batch, max_len, prompts, [prompt_len] * batch, keys, params)
        times = {w: [] for w in (PLAIN, *widths)}
        block = None
        for repeat in range(repeats + 1):
            for width in times:
                start = time.perf_counter()
                if width != PLAIN or block is None:
                    block, _, _ = decoder._draft(decoder.params, decoder.drafter_state, state, keys, params, active, NO_FLOOR)
                _, state = decoder._verify(
                    decoder.params, decoder.drafter_state, state, block, lengths, keys, params, active, stops,
                    width=widths[0] if width == PLAIN else width,
                )
                jax.block_until_ready(state)
                if repeat > 0:
                    times[width].append(time.perf_counter() - start)
    return {w: statistics.median(t) for w, t in times.items()}


def profiled(decoder, batches: Sequence[int] = (1,), **kwargs):
    """``decoder`` with its scheduler policy's cost table filled in by timing it now (a decoder
    whose policy needs no profile comes back unchanged)."""
    policy = decoder.policy
    if not isinstance(policy, SchedulerPolicy) or policy.costs is not None:
        return decoder
    tables = {b: profile_round_costs(decoder, b, **kwargs) for b in batches}
    return decoder.with_policy(policy.with_tables(tables))


def cost_table_path(path) -> Path:
    """Where ``save_cost_tables`` will write, checked before the profiling (minutes) rather than
    after (``config.output_file``)."""
    return output_file(path, "the cost table")


def save_cost_tables(path, tables: dict[int, dict[int, float]], **info) -> Path:
    path = cost_table_path(path)
    body = {
        "format": FORMAT,
        "version": VERSION,
        "tables": {str(b): {str(w): s for w, s in sorted(t.items())} for b, t in sorted(tables.items())},
        **info,
    }
    return write_json(path, body, indent=1)  # a kill mid-write leaves any earlier table whole


def load_cost_tables(path) -> dict[int, dict[int, float]]:
    """``{batch: {width: seconds}}`` from a file ``save_cost_tables`` wrote; clear errors otherwise."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"cost table {path} is a directory (give the JSON file `dspark profile --out` wrote)")
    if not path.is_file():
        raise FileNotFoundError(f"cost table {path} does not exist (write one with `dspark profile --out {path}`)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"cost table {path} is not JSON ({error})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} file")
    if raw.get("version") != VERSION:
        raise ValueError(f"{path} has version {raw.get('version')!r}; this code reads version {VERSION}")
    if "tables" not in raw:
        raise ValueError(f"{path} has no 'tables'")
    try:
        return cost_tables(raw["tables"])
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def policy_summary(policy: SchedulerPolicy) -> dict:
    """The policy's table in milliseconds and its calibrations, for logs and benchmark JSON."""
    return {
        "costs_ms": {str(b): {str(w): round(s * 1e3, 3) for w, s in t} for b, t in policy.costs or ()},
        "calibrations": [dataclasses.asdict(c) for c in policy.calibrations],
        "plan_ahead": policy.plan_ahead,
    }

