"""The benchmark's aggregate numbers (``dspark_jax.eval.compare``) on hand-made runs."""

import numpy as np
import pytest

from dspark_jax.decoding.speculative import SpeculativeResult
from dspark_jax.eval.compare import Run, macro, read_prompts_jsonl, summarize, tau_ratio_interval


def result(accepted_per_round, stop_after: int | None = None) -> SpeculativeResult:
    """A one-request result; ``stop_after``: the last round stops at that many drafts (a stop token
    among its accepted drafts, so it commits no target token)."""
    accepted = [np.array([a]) for a in accepted_per_round]
    committed = [a + 1 for a in accepted]
    if stop_after is not None:
        committed[-1] = np.array([stop_after])
    return SpeculativeResult(tokens=[[1] * int(sum(c.sum() for c in committed))], finish_reasons=["length"],
                             prefill_s=0.0, decode_s=1.0, rounds=len(accepted), accepted_per_round=accepted,
                             committed_per_round=committed, verify_lengths=[np.array([7])] * len(accepted),
                             verify_widths=[8] * len(accepted))


def runs(per_prompt: list[dict]) -> list[Run]:
    """One Run per prompt from ``{decoder: accepted drafts per round}``."""
    return [Run(prompt_tokens=10, baseline=result([0]), speculative={k: result(v) for k, v in p.items()})
            for p in per_prompt]


def mixed_domain(copies: int = 1) -> list[Run]:
    """Prompts where a's lead over b varies from prompt to prompt."""
    prompts = [{"a": [3, 1, 2], "b": [1, 1, 2]}, {"a": [0, 0, 1], "b": [0, 1, 0]},
               {"a": [5, 4], "b": [2, 2]}, {"a": [1, 1, 1, 1], "b": [1, 0, 1, 1]}, {"a": [2], "b": [2]}]
    return runs(prompts * copies)


def test_the_interval_brackets_the_reported_ratio_and_narrows_with_more_prompts():
    domains = {"math": mixed_domain(), "chat": runs([{"a": [1, 0], "b": [0, 0]}, {"a": [2, 2], "b": [1, 3]},
                                                     {"a": [0], "b": [0]}])}
    taus = {name: macro({d: summarize(r, name, 7, greedy=False) for d, r in domains.items()}, "tau")
            for name in ("a", "b")}
    low, high = tau_ratio_interval(domains, "a", "b")
    assert low < taus["a"] / taus["b"] < high
    # Four times the prompts (the same mix): a bootstrap interval about half as wide.
    bigger = {d: r * 4 for d, r in domains.items()}
    big_low, big_high = tau_ratio_interval(bigger, "a", "b")
    assert big_high - big_low < 0.7 * (high - low)
    assert tau_ratio_interval(domains, "a", "b") == [low, high]  # seeded


def test_the_interval_is_a_point_when_the_ratio_does_not_depend_on_the_prompts():
    same = {"math": runs([{"a": [1, 3], "b": [1, 3]}, {"a": [0], "b": [0]}])}
    assert tau_ratio_interval(same, "a", "b") == [1.0, 1.0]
    double = {"math": runs([{"a": [1, 1], "b": [0, 0]}, {"a": [1], "b": [0]}, {"a": [1, 1, 1], "b": [0, 0, 0]}])}
    np.testing.assert_allclose(tau_ratio_interval(double, "a", "b"), [2.0, 2.0])
    # Accepted drafts alone: 1 vs 0.5 per round is 2x, where τ (2 vs 1.5) is only 1.33x.
    halves = {"math": runs([{"a": [1, 1], "b": [1, 0]}, {"a": [1, 1, 1, 1], "b": [0, 1, 0, 1]}])}
    np.testing.assert_allclose(tau_ratio_interval(halves, "a", "b"), [4 / 3, 4 / 3])
    np.testing.assert_allclose(tau_ratio_interval(halves, "a", "b", drafts_only=True), [2.0, 2.0])
    with pytest.raises(ValueError, match="level"):
        tau_ratio_interval(same, "a", "b", level=1.0)


def test_sampled_paths_of_a_prompt_are_resampled_together():
    """--seeds N: each prompt's N paths are pooled, so the bootstrap draws prompts, not paths."""
    path0 = [{"a": [3, 1], "b": [1, 1]}, {"a": [0, 0], "b": [0, 1]}, {"a": [5], "b": [2]}]
    path1 = [{"a": [2], "b": [0, 0]}, {"a": [1, 1, 0], "b": [1]}, {"a": [0, 4], "b": [3, 3]}]
    pooled = [{k: p[k] + q[k] for k in ("a", "b")} for p, q in zip(path0, path1)]
    interval = tau_ratio_interval({"math": runs(path0 + path1)}, "a", "b", paths=2)
    assert interval == tau_ratio_interval({"math": runs(pooled)}, "a", "b")
    assert interval != tau_ratio_interval({"math": runs(path0 + path1)}, "a", "b")  # six "prompts"
    with pytest.raises(ValueError, match="not 4 paths"):
        tau_ratio_interval({"math": runs(path0 + path1)}, "a", "b", paths=4)


def test_only_greedy_runs_report_differing_prompts():
    """A greedy output that differs from target-only's is a bug to report; a sampled one is not."""
    domain = runs([{"a": [1, 0]}, {"a": [0]}])  # the baseline made 1 token, "a" made 3 and 1
    greedy = summarize(domain, "a", 7, greedy=True, labels=["p0", "p1"])
    assert greedy["identical"] is False
    assert [d["prompt"] for d in greedy["differing_prompts"]] == ["p0"]
    sampled = summarize(domain, "a", 7, greedy=False)
    assert sampled["identical"] is None and sampled["differing_prompts"] is None
    with pytest.raises(ValueError, match="1 labels for 2 runs"):  # zip dropped the second prompt's check
        summarize(domain, "a", 7, greedy=True, labels=["p0"])


def test_speedup_is_a_throughput_ratio_when_outputs_differ_in_length():
    """A sampled decoder that stops sooner must not look faster for it: 1 s for 7 decoded tokens
    against target-only's 1 s for 3 is 7/3x, and a quarter of the tokens in the same time is 0.25x."""
    longer = [Run(prompt_tokens=10, baseline=result([0, 0, 0, 0]), speculative={"a": result([3, 3])})]
    assert summarize(longer, "a", 7, greedy=False)["speedup"] == pytest.approx(7 / 3)
    shorter = [Run(prompt_tokens=10, baseline=result([0, 0, 0, 0, 0]), speculative={"a": result([1])})]
    assert summarize(shorter, "a", 7, greedy=False)["speedup"] == pytest.approx(1 / 4)


def test_a_round_that_stops_on_an_accepted_draft_counts_its_drafts_up_to_the_stop():
    """Spec §6.4 step 4 and §6.6: τ counts such a round's drafts through the stop token, no target
    token, and so does its accepted count; the drafts after the stop were offered, not accepted."""
    domain = {"math": [Run(prompt_tokens=10, baseline=result([0]),
                           speculative={"a": result([3, 5], stop_after=2), "b": result([3, 5])})]}
    a, b = (summarize(domain["math"], name, 7, greedy=False) for name in ("a", "b"))
    assert (a["tau"], b["tau"]) == (3.0, 5.0)  # (4 + 2) / 2 and (4 + 6) / 2
    assert (a["acceptance_rate"], b["acceptance_rate"]) == (5 / 14, 8 / 14)
    # Round 2 of "a" ends at its 2nd draft: position 3 is tried in both rounds, accepted in the first.
    assert a["per_position_acceptance"][:4] == [1.0, 1.0, 0.5, 0.0] and np.isnan(a["per_position_acceptance"][4])
    assert b["per_position_acceptance"][:6] == [1.0, 1.0, 1.0, 0.5, 1.0, 0.0]
    spec = domain["math"][0].speculative["a"]
    assert spec.per_position_acceptance(7)[:4].tolist() == [1.0, 1.0, 0.5, 0.0]
    assert tau_ratio_interval(domain, "a", "b") == [0.6, 0.6]
    assert tau_ratio_interval(domain, "a", "b", drafts_only=True) == [0.5, 0.5]  # (3 + 1) / 2 against (3 + 5) / 2


def test_a_prompt_file_splits_only_on_newlines_and_names_a_line_that_is_not_utf8(tmp_path):
    """A turn may hold U+2028 or U+0085 raw (valid JSON that ``str.splitlines`` would cut)."""
    path = tmp_path / "prompts.jsonl"
    path.write_bytes('{"turns": ["one\u2028two"]}\r\n\n{"turns": ["three\u0085four"]}\n'.encode())
    assert read_prompts_jsonl(path) == ["one\u2028two", "three\u0085four"]
    path.write_bytes(b'{"turns": ["fine"]}\n{"turns": ["caf\xe9"]}\n')
    with pytest.raises(ValueError, match=f"{path}:2: not UTF-8"):
        read_prompts_jsonl(path)


def test_a_prompt_file_refuses_a_count_below_one_and_says_when_it_is_a_directory(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"turns": ["a"]}\n{"turns": ["b"]}\n')
    assert read_prompts_jsonl(path, 1) == ["a"]
    for limit in (0, -1):
        with pytest.raises(ValueError, match=f"asked for {limit} prompts of .*: the count must be >= 1"):
            read_prompts_jsonl(path, limit)
    with pytest.raises(IsADirectoryError, match=f"prompt file {tmp_path} is a directory"):
        read_prompts_jsonl(tmp_path)


def test_nothing_compiles_while_timing_and_both_sides_get_the_same_cache(embedded_target):
    """Warm-up must cover every prompt-length bucket of the host loop, not only of the jitted steps:
    target-only's prefill converts each bucket's prompt array on the device, an eager compile that
    used to land in its timed prefill for every bucket but the warm run's, and that the old check
    (jit cache sizes) did not see."""
    from dspark_jax.decoding.speculative import FixedPolicy
    from dspark_jax.diagnostics import count_compilations
    from dspark_jax.eval.compare import Comparison, make_decoder
    from tests.prompts import random_drafter

    # What is warmed up depends on prompt buckets, not on depth: 4 of the 30 layers compile faster.
    target = embedded_target[0].truncated(4)
    prompts = [[5] * 9, [7] * 40, [11] * 122]  # three buckets (16, 64, 128)
    drafter = random_drafter(target.cfg, 3, tap_layers=(1, 2))
    comparison = Comparison(target, {"a": make_decoder(target, drafter, FixedPolicy(3))}, max_new_tokens=3)
    comparison.prepare([len(p) for p in prompts])
    # 122 + 3 tokens fit 128 slots, + the verify slack (4) does not: both still get the same cache,
    # since a step's cost grows with it.
    assert comparison.max_len_ar == comparison.max_len_spec == 256
    with count_compilations() as counter:
        comparison.run(prompts)
    assert counter.count == 0 and comparison.compiles_while_timing == 0
    # A bucket that was not warmed up compiles while timing, and the comparison says so.
    unprepared = Comparison(target, comparison.decoders, max_new_tokens=3)
    unprepared.prepare([len(prompts[0])])
    unprepared.run([prompts[1]])
    assert unprepared.compiles_while_timing > 0


def test_runs_without_rounds_give_nan_not_errors_or_warnings():
    """--max-new-tokens 1, or every prompt stopping at its first token: no decode time, no rounds.
    Every ratio is NaN (null in the JSON), including the bootstrap interval, quietly."""
    import warnings

    from dspark_jax.decoding.autoregressive import GenerationResult

    def no_rounds() -> SpeculativeResult:
        return SpeculativeResult(tokens=[[4]], finish_reasons=["stop"], prefill_s=0.01, decode_s=0.0, rounds=0,
                                 accepted_per_round=[], committed_per_round=[], verify_lengths=[], verify_widths=[])

    domain = [Run(prompt_tokens=10, baseline=GenerationResult([[4]], ["stop"], 0.01, 0.0, 0, None),
                  speculative={"a": no_rounds(), "b": no_rounds()})] * 2  # two identical prompts
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        summary = summarize(domain, "a", 7, greedy=True)
        interval = tau_ratio_interval({"math": domain}, "a", "b")
    assert np.isnan(summary["speedup"]) and np.isnan(summary["tau"]) and np.isnan(summary["acceptance_rate"])
    assert summary["speedup_with_prefill"] == 1.0 and summary["identical"] is True and summary["rounds"] == 0
    assert np.isnan(summary["per_position_acceptance"]).all() and np.isnan(interval).all()
    assert [p["tau"] for p in summary["per_prompt"]] == [None, None]
    # Next to a prompt with rounds, one that stopped at its first token adds no round and no decode time.
    rounds = Run(prompt_tokens=10, baseline=result([0, 0, 0]), speculative={"a": result([2, 0])})  # 2 and 3 decoded in 1 s
    mixed = summarize(domain[:1] + [rounds], "a", 7, greedy=False)
    assert mixed["tau"] == 2.0 and mixed["rounds"] == 2 and mixed["speedup"] == pytest.approx(3 / 2)
