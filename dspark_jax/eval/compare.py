"""Target-only vs speculative decoding on the same prompts, in one process.

Used by ``dspark bench`` and ``scripts/bench_speculative.py``. Every decoder is compiled for every
prompt-length bucket and warmed up with an untimed run at each before anything is timed (every XLA
compilation while timing is counted: ``Comparison.compiles_while_timing``); the prompts are
then run one at a time (B=1), target-only first and each speculative decoder right after it on
the same prompt, so a burst of load from other processes hits all of them alike. Speedup is the
ratio of decode throughputs, ``(Σ speculative tokens / Σ speculative decode time) / (the same for
target-only)`` over the prompts (prefill and compilation excluded; an end-to-end ratio with
prefill is reported next to it). Greedy outputs are identical, so it equals the ratio of decode
times; sampled outputs differ, in length too, and a time ratio would credit whichever decoder
happened to stop sooner. For greedy decoding the speculative output must equal the target-only
output token for token; prompts where it does not are listed.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dspark_jax.config import SamplingConfig
from dspark_jax.decoding.autoregressive import AutoregressiveGenerator, cache_len, prompt_width
from dspark_jax.decoding.batch_job import jsonl_lines
from dspark_jax.diagnostics import count_compilations
from dspark_jax.eval.metrics import accepted_drafts, per_position_acceptance, tau_of

DOMAIN_FILES = {"math": "gsm8k.jsonl", "code": "humaneval.jsonl", "chat": "mt-bench.jsonl"}


# --------------------------------------------------------------------------------------------
# Inputs: prompts, drafters, policies
# --------------------------------------------------------------------------------------------


def read_prompts_jsonl(path, limit: int | None = None) -> list[str]:
    """The first turn of each ``{"turns": [...]}`` line (the paper's MT-Bench protocol), the
    first ``limit`` of them when given."""
    path = Path(path)
    if limit is not None and limit < 1:
        raise ValueError(f"asked for {limit} prompts of {path}: the count must be >= 1")
    if path.is_dir():
        raise IsADirectoryError(f"prompt file {path} is a directory: give the .jsonl file in it")
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    prompts = []
    for number, line in jsonl_lines(path):
        if not line.strip():
            continue
        try:
            turns = json.loads(line)["turns"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{path}:{number}: expected a JSON object with a 'turns' list ({error})") from None
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0]:
            raise ValueError(f"{path}:{number}: 'turns' must be a non-empty list of strings")
        prompts.append(turns[0])
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def load_drafter_spec(spec: str, target, *, dtype="float32"):
    """``(name, drafter)`` from a shipped drafter name or a checkpoint directory, its weights in ``dtype``.

    Raises ``ValueError`` / ``FileNotFoundError`` with a message that names the problem (unknown
    name, drafter not shipped yet, not a checkpoint, does not fit the ``target`` model or was
    trained for another).
    """
    from dspark_jax.checkpoints.drafter import load_drafter
    from dspark_jax.drafters import resolve_drafter

    name, path = resolve_drafter(spec)
    return name, load_drafter(path, target=target, dtype=dtype)


def policy_for(drafter_cfg, policy, *, directory=None, sampling=None):
    """The policy to run ``drafter_cfg`` with, and a note when it had to differ from ``policy``.

    ``None`` keeps the decoder's default. ``fixed:K`` with K past the drafter's block size γ is an
    error (it cannot verify drafts that are never proposed). Threshold and scheduler policies need
    a confidence head; drafters without one (DFlash, EAGLE-3) verify the whole block instead
    (``fixed:γ``). A scheduler policy without calibrations gets the drafter's from
    ``directory/calibration.json`` (``training.calibrate``; each request is served by the one for
    its own sampling); when none serves ``sampling`` (default greedy; a batch job passes each
    request's) the note says that it runs on the raw confidences.
    """
    import dataclasses

    from dspark_jax.config import SamplingConfig
    from dspark_jax.decoding.speculative import FixedPolicy, ThresholdPolicy
    from dspark_jax.scheduler.prefix import SchedulerPolicy, calibration_for
    from dspark_jax.training.calibrate import read_calibrations

    gamma = drafter_cfg.block_size
    if isinstance(policy, FixedPolicy):
        policy.check_gamma(gamma)
    if isinstance(policy, (ThresholdPolicy, SchedulerPolicy)) and not drafter_cfg.confidence_head:
        asked = f"threshold:{policy.threshold}" if isinstance(policy, ThresholdPolicy) else (
            "scheduler-ahead" if policy.plan_ahead else "scheduler")
        return FixedPolicy(gamma), f"{drafter_cfg.kind} drafter has no confidence head: fixed:{gamma} instead of {asked}"
    if isinstance(policy, SchedulerPolicy) and not policy.calibrations:
        several = sampling is not None and not isinstance(sampling, SamplingConfig)
        samplings = list(sampling) if several else [SamplingConfig() if sampling is None else sampling]
        policy = dataclasses.replace(policy, calibrations=() if directory is None else read_calibrations(directory))
        unserved = sorted({s.describe() for s in samplings if calibration_for(policy.calibrations, s) is None})
        if unserved:
            return policy, (f"no calibration for {' or '.join(unserved)} decoding for this drafter (dspark calibrate): "
                            f"the scheduler uses raw confidences{' for those requests' if several else ''}")
    return policy, None


def decoding_cache_len(target, drafter, prompt_lens: Sequence[int], max_new_tokens: int) -> int:
    """The cache length these prompts decode with at the drafter's widest verify (γ + 1 slots of
    slack): what a scheduler's cost table should be timed at, since a round's cost grows with the
    cache (a 667-token prompt decodes on 768 slots, where the default table times 256)."""
    return cache_len(prompt_lens, max_new_tokens, target.cfg.max_position_embeddings, drafter.cfg.block_size + 1)


def make_decoder(target, drafter, policy, *, profile_batches: Sequence[int] = (1,), profile_max_len: int = 256,
                 profile_sampling=None, mesh=None):
    """A decoder for ``policy`` (None: the decoder's default), its batches split over ``mesh`` if given.

    A fixed policy verifies the same number of drafts every round, so only that one verify width
    is ever used: the decoder gets just it (plus the full-block width it always adds) and its
    warm-up compiles nothing else. Other policies keep the default width buckets. A scheduler
    policy without a cost table is profiled here, at each of ``profile_batches`` with a
    ``profile_max_len`` cache, decoding with ``profile_sampling`` (default greedy): sampled rounds
    cost more than greedy ones (the filters and softmaxes over every verified position).
    """
    from dspark_jax.decoding.speculative import FixedPolicy, SpeculativeDecoder
    from dspark_jax.scheduler.profile import profiled

    policy = FixedPolicy(drafter.cfg.block_size) if policy is None else policy
    kwargs = {"policy": policy}
    if isinstance(policy, FixedPolicy):
        kwargs["verify_widths"] = (policy.k + 1,)
    if getattr(policy, "widths", None):
        kwargs["verify_widths"] = policy.widths
    return profiled(SpeculativeDecoder(target, drafter, mesh=mesh, **kwargs), tuple(profile_batches),
                    max_len=profile_max_len, sampling=profile_sampling)


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """One prompt through the baseline and every speculative decoder (best of ``repeats``)."""

    prompt_tokens: int
    baseline: object  # GenerationResult
    speculative: dict  # name -> SpeculativeResult


class Comparison:
    """A target-only generator and named speculative decoders over one target, B=1."""

    def __init__(self, target, decoders: dict, *, max_new_tokens: int, stop_ids: Sequence[int] = (),
                 sampling: SamplingConfig | None = None):
        self.target, self.decoders = target, dict(decoders)
        self.baseline = AutoregressiveGenerator(target)
        self.max_new_tokens, self.stop_ids = max_new_tokens, list(stop_ids)
        self.sampling = sampling or SamplingConfig()
        self.max_len_ar = self.max_len_spec = None
        self.compile_s: dict[str, float] = {}
        self.compiles_while_timing = 0

    def prepare(self, prompt_lens: Sequence[int]) -> dict[str, float]:
        """Fix the cache lengths for these prompts, compile every bucket and warm up; returns
        compile + warm-up seconds per decoder."""
        import time

        limit = self.target.cfg.max_position_embeddings
        slack = max((d.slack for d in self.decoders.values()), default=0)
        # One cache length for both: each decode step attends over the whole cache, so target-only
        # on a cache one 128-slot step shorter (the verify slack can cross a multiple of 128) runs
        # cheaper steps (about 7% at 128 vs 256 slots on the embedded target) and the speedup
        # would be understated for it. The slack slots are never written by target-only.
        self.max_len_ar = self.max_len_spec = cache_len(prompt_lens, self.max_new_tokens, limit, slack)
        # One prompt length per bucket: warmup() compiles the jitted steps for it, and a warm run
        # at it compiles what generate() itself does per prompt shape (target-only's prefill turns
        # the bucket's prompt array into a device array, an eager compile per bucket that warmup()
        # does not make, and that would otherwise land in the first timed prefill of each bucket).
        lengths = sorted({prompt_width(n, self.max_len_ar): n for n in prompt_lens}.values())
        start = time.perf_counter()
        for n in lengths:
            self.baseline.warmup(1, n, self.max_len_ar)
            self._warm_run(self.baseline, n, self.max_len_ar)
        self.compile_s["target_only"] = time.perf_counter() - start
        for name, decoder in self.decoders.items():
            start = time.perf_counter()
            for n in lengths:
                decoder.warmup(1, n, self.max_len_spec)
                self._warm_run(decoder, n, self.max_len_spec)
            self.compile_s[name] = time.perf_counter() - start
        return dict(self.compile_s)

    def _warm_run(self, generator, prompt_len, max_len):
        """One short untimed generation: exercises the host loop and every transfer once."""
        generator.generate([[1] * prompt_len], max_new_tokens=min(self.max_new_tokens, 4),
                           sampling=self.sampling, stop_ids=(), max_len=max_len)

    def run(self, prompts: Sequence[Sequence[int]], *, repeats: int = 1, seed: int = 0, progress=None) -> list[Run]:
        if self.max_len_ar is None:
            raise RuntimeError("call prepare() with the prompt lengths first")
        runs = []
        # Every XLA compilation counts, eager ones included: the jitted steps' own caches miss those.
        with count_compilations() as compiled:
            for index, ids in enumerate(prompts):
                runs.append(self._run_one(index, ids, repeats, seed))
                if progress is not None:
                    progress(index)
        self.compiles_while_timing += compiled.count
        return runs

    def _run_one(self, index: int, ids: Sequence[int], repeats: int, seed: int) -> Run:
        """Prompt ``index`` through the baseline, then every decoder, ``repeats`` times (best of)."""
        kwargs = dict(max_new_tokens=self.max_new_tokens, sampling=self.sampling, seeds=[seed + index],
                      stop_ids=self.stop_ids)
        best_base, best_spec = None, {}
        for _ in range(max(repeats, 1)):  # the same seed each time: the same tokens, best time
            base = self.baseline.generate([ids], max_len=self.max_len_ar, **kwargs)
            if best_base is None or base.decode_s < best_base.decode_s:
                best_base = base
            for name, decoder in self.decoders.items():
                spec = decoder.generate([ids], max_len=self.max_len_spec, **kwargs)
                if name not in best_spec or spec.decode_s < best_spec[name].decode_s:
                    best_spec[name] = spec
        return Run(len(ids), best_base, best_spec)


# --------------------------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------------------------


def _decode_tokens(tokens_per_request) -> int:
    """Tokens made by the decode loop: each request's first token comes from prefill."""
    return sum(max(len(t) - 1, 0) for t in tokens_per_request)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    if list(a) == list(b):
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def summarize(runs: Sequence[Run], name: str, gamma: int, *, greedy: bool, labels: Sequence | None = None) -> dict:
    """Aggregate numbers for decoder ``name`` over ``runs`` (one domain)."""
    labels = list(labels) if labels is not None else list(range(len(runs)))
    if len(labels) != len(runs):  # zip would pair them off silently and drop the rest
        raise ValueError(f"summarize: {len(labels)} labels for {len(runs)} runs")
    base = [r.baseline for r in runs]
    spec = [r.speculative[name] for r in runs]
    base_decode = sum(r.decode_s for r in base)
    spec_decode = sum(r.decode_s for r in spec)
    base_total = base_decode + sum(r.prefill_s for r in base)
    spec_total = spec_decode + sum(r.prefill_s for r in spec)
    accepted, committed, offered = ([a for r in spec for a in getattr(r, log)]
                                    for log in ("accepted_per_round", "committed_per_round", "verify_lengths"))
    accepted_all = accepted_drafts(np.concatenate(accepted), np.concatenate(committed)) if accepted else np.zeros(0, int)
    offered_all = np.concatenate(offered) if offered else np.zeros(0, int)
    widths: dict[int, int] = {}
    for r in spec:
        for width, count in r.width_histogram.items():
            widths[width] = widths.get(width, 0) + count
    draft_s = sum(r.draft_s for r in spec)
    verify_s = sum(r.verify_s for r in spec)
    # Only greedy outputs must equal target-only's token for token; sampled ones draw from other
    # random streams, so a difference there says nothing.
    differing = []
    for label, b, s in zip(labels, base, spec) if greedy else ():
        at = first_difference(b.tokens[0], s.tokens[0])
        if at is not None:
            differing.append({"prompt": label, "first_difference_at": at,
                              "target_only_tokens": len(b.tokens[0]), "speculative_tokens": len(s.tokens[0])})
    base_tokens = _decode_tokens([t for r in base for t in r.tokens])
    spec_tokens = _decode_tokens([t for r in spec for t in r.tokens])
    base_all = sum(len(t) for r in base for t in r.tokens)
    spec_all = sum(len(t) for r in spec for t in r.tokens)
    return {
        "prompts": len(runs),
        "speedup": _ratio(_ratio(spec_tokens, spec_decode), _ratio(base_tokens, base_decode)),
        "speedup_with_prefill": _ratio(_ratio(spec_all, spec_total), _ratio(base_all, base_total)),
        "tau": tau_of([c for r in spec for c in r.committed_per_round]),
        "per_position_acceptance": per_position_acceptance(accepted_all, offered_all, gamma).tolist()
        if accepted_all.size else [float("nan")] * gamma,
        "acceptance_rate": _ratio(float(accepted_all.sum()), float(offered_all.sum())),
        "mean_verify_length": float(offered_all.mean()) if offered_all.size else float("nan"),
        "width_histogram": {str(k): v for k, v in sorted(widths.items())},
        "rounds": int(sum(r.rounds for r in spec)),
        "tokens": {"target_only": sum(len(r.tokens[0]) for r in base), "speculative": sum(len(r.tokens[0]) for r in spec)},
        "decode_s": {"target_only": base_decode, "speculative": spec_decode},
        "prefill_s": {"target_only": sum(r.prefill_s for r in base), "speculative": sum(r.prefill_s for r in spec)},
        "tokens_per_s": {"target_only": _ratio(base_tokens, base_decode), "speculative": _ratio(spec_tokens, spec_decode)},
        "time_split": {
            "draft_s": draft_s,
            "verify_s": verify_s,
            "host_s": spec_decode - draft_s - verify_s,
            "draft_share": _ratio(draft_s, spec_decode),
            "verify_share": _ratio(verify_s, spec_decode),
            "ms_per_round": {"draft": 1e3 * _ratio(draft_s, sum(r.rounds for r in spec)),
                             "verify": 1e3 * _ratio(verify_s, sum(r.rounds for r in spec))},
        },
        "identical": (not differing) if greedy else None,
        "differing_prompts": differing if greedy else None,
        "per_prompt": [
            {"prompt": label, "prompt_tokens": r.prompt_tokens, "tokens": len(s.tokens[0]),
             "finish": s.finish_reasons[0], "target_only_decode_s": b.decode_s, "speculative_decode_s": s.decode_s,
             "tau": s.tau if s.rounds else None, "rounds": s.rounds}
            for label, r, b, s in zip(labels, runs, base, spec)
        ],
    }


def tau_ratio_interval(runs_by_domain: dict[str, Sequence[Run]], numerator: str, denominator: str, *, paths: int = 1,
                       **kwargs) -> list[float]:
    """:func:`ratio_interval` of two decoders' benchmark runs (same keyword arguments). With
    ``paths`` sampled paths per prompt (each domain's runs: every prompt once per path, path by
    path), a prompt's rounds from all its paths are pooled, so the bootstrap resamples prompts."""
    committed = {}
    for domain, runs in runs_by_domain.items():
        if len(runs) % paths:
            raise ValueError(f"{domain}: {len(runs)} runs are not {paths} paths of the same prompts")
        prompts = len(runs) // paths
        committed[domain] = {
            name: [np.concatenate([c for r in runs[i::prompts] for c in r.speculative[name].committed_per_round]
                                  or [np.zeros(0, int)]) for i in range(prompts)]
            for name in (numerator, denominator)}
    return ratio_interval(committed, numerator, denominator, **kwargs)


def ratio_interval(committed_by_domain: dict[str, dict[str, Sequence[np.ndarray]]], numerator: str, denominator: str,
                   *, level: float = 0.9, draws: int = 4000, seed: int = 0, drafts_only: bool = False) -> list[float]:
    """Percentile-bootstrap interval ``[low, high]`` of the macro τ ratio ``numerator / denominator``.

    ``committed_by_domain[domain][name]`` holds, per prompt, the tokens committed in each round
    (``SpeculativeResult.committed_per_round``; the same prompts, in the same order, for both
    decoders). Each draw resamples every domain's prompts with replacement, the same prompts for
    both decoders, and recomputes each domain's τ as the summaries do (committed tokens / rounds,
    pooled over the prompts). Greedy τ is
    deterministic, so the interval says how much the ratio depends on which prompts were drawn:
    the question a handful of prompts per domain leaves open.

    ``drafts_only`` takes the ratio of ``τ − 1`` (the accepted drafts per round, but for a stop
    token among them) instead: the target's token almost every round commits dilutes the τ ratio
    while acceptance is low (τ 1.5 vs 2.0 is a ratio of 1.33 where the drafts alone differ 2×), so
    this one compares the drafters alone.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    rng = np.random.default_rng(seed)
    target_token = 1 if drafts_only else 0  # taken off every round
    macro_tau = {numerator: np.zeros(draws), denominator: np.zeros(draws)}
    for by_name in committed_by_domain.values():
        prompts = len(by_name[numerator])
        picks = rng.integers(0, prompts, size=(draws, prompts))
        for name, total in macro_tau.items():
            per_prompt = by_name[name]
            rounds = np.array([c.size for c in per_prompt])[picks].sum(axis=1)
            committed = np.array([(c - target_token).sum() for c in per_prompt])[picks].sum(axis=1)
            with np.errstate(invalid="ignore", divide="ignore"):
                total += committed / rounds  # a draw of round-less prompts only gives NaN
    ratio = macro_tau[numerator] / macro_tau[denominator]  # the 1/domains of both means cancels
    if np.isnan(ratio).all():  # no rounds at all (e.g. max_new_tokens=1): no ratio, and no numpy warning
        return [float("nan"), float("nan")]
    return [float(q) for q in np.nanquantile(ratio, [(1 - level) / 2, (1 + level) / 2])]


def macro(per_domain: dict[str, dict], key: str) -> float:
    """Unweighted mean over domains of a scalar entry (NaN entries skipped)."""
    values = [d[key] for d in per_domain.values() if d.get(key) is not None and not math.isnan(d[key])]
    return float(np.mean(values)) if values else float("nan")


def json_clean(value):
    """JSON-safe copy: NaN / inf become null, numpy scalars become Python numbers."""
    if isinstance(value, dict):
        return {str(k): json_clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_clean(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
