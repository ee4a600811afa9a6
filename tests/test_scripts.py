"""The benchmark scripts' flags and inputs, checked before any model loads (``scripts/*.py``)."""

import json
import math

import pytest

from tests.test_cli import REPO, load_script

# Every script that writes a JSON report with --out (eval_calibration's --out is required).
WRITERS = ["bench_batch", "bench_cache", "bench_drafter", "bench_one_program", "bench_scheduler", "bench_serving", "bench_speculative",
           "bench_startup", "bench_target", "eval_calibration", "eval_heldout", "eval_long_answers", "exactness_report"]
PLOTTERS = ["bench_scheduler", "bench_serving", "bench_speculative", "bench_target"]  # a PNG beside the JSON


def parse(script: str, argv: list[str]):
    return load_script(script).parse_args(argv)


def refusal(script: str, argv: list[str], capsys) -> str:
    """The one-line usage error ``script`` answers ``argv`` with."""
    with pytest.raises(SystemExit) as exit_info:
        parse(script, argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("script", WRITERS)
def test_an_out_path_that_cannot_be_written_is_refused_before_the_run(script, tmp_path, capsys):
    assert "is a directory: give the JSON file a file name" in refusal(script, ["--out", str(tmp_path)], capsys)
    (tmp_path / "file").write_text("")
    assert "cannot create the folder of" in refusal(script, ["--out", str(tmp_path / "file" / "r.json")], capsys)
    # A missing folder is made up front, not found missing when the run ends.
    out = tmp_path / "new" / "deeper" / "r.json"
    assert parse(script, ["--out", str(out)]).out == out and out.parent.is_dir()


@pytest.mark.parametrize("script", PLOTTERS)
def test_an_out_path_ending_in_png_is_refused_where_the_plot_goes_beside_the_json(script, tmp_path, capsys):
    error = refusal(script, ["--out", str(tmp_path / "r.png")], capsys)
    assert "names the JSON file; the PNG is written beside it" in error and "r.json" in error


@pytest.mark.parametrize("script", ["bench_batch", "bench_cache", "bench_drafter", "bench_one_program", "bench_scheduler",
                                    "bench_serving", "bench_speculative", "bench_startup", "bench_target", "eval_heldout",
                                    "eval_long_answers"])
def test_default_out_paths_are_in_the_repository_docs_wherever_the_script_runs(script, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = parse(script, []).out
    assert out.is_absolute() and out.parent.is_relative_to(REPO / "docs") and out.suffix == ".json"
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("script, argv", [
    ("bench_scheduler", ["--batches-per-size", "0"]),
    ("bench_scheduler", ["--max-new-tokens", "0"]),
    ("bench_serving", ["--requests", "0"]),
    ("bench_serving", ["--batch-sizes", "0"]),
    ("bench_batch", ["--per-set", "0"]),
    ("bench_batch", ["--batch-size", "0"]),
    ("bench_batch", ["--max-new-tokens", "0"]),
    ("eval_long_answers", ["--prompts-per-domain", "0"]),
    ("eval_long_answers", ["--max-new-tokens", "-1"]),
    ("bench_target", ["--repeats", "0"]),
    ("bench_target", ["--repeats", "-1"]),
    ("bench_target", ["--steps", "0"]),
    ("bench_drafter", ["--repeats", "0"]),
    ("bench_one_program", ["--prompts", "0"]),
    ("bench_one_program", ["--repeats", "0"]),
    ("bench_startup", ["--rounds", "0"]),
    ("bench_startup", ["--rounds", "-1"]),
    ("eval_calibration", ["--prompts", "0", "--out", "x.json"]),
    ("exactness_report", ["--new-tokens", "0"]),
])
def test_counts_below_one_are_usage_errors_not_the_default(script, argv, capsys):
    flag, value = argv[0], argv[1]
    assert refusal(script, argv, capsys).endswith(f"error: argument {flag}: must be >= 1, got {value}")


def test_quick_defaults_fill_only_the_counts_left_unset():
    args = parse("bench_scheduler", ["--quick", "--max-new-tokens", "1"])
    assert (args.batches, args.batches_per_size, args.max_new_tokens) == ([1, 4], 1, 1)
    args = parse("bench_target", ["--steps", "8", "4"])
    assert args.steps == [1, 4, 8] and args.repeats == 15  # T = 1 is always measured: the ratios are against it


def test_one_program_batches_must_divide_the_prompts(capsys):
    """Every batch of the comparison holds B prompts: a last, smaller one would compile its own shapes."""
    assert parse("bench_one_program", ["--quick"]).batches == [1]
    assert "--prompts 6 is not a multiple of batch size 4" in refusal("bench_one_program", ["--prompts", "6"], capsys)


def test_scheduler_ratios_are_nan_when_target_only_timed_no_decode_step():
    """--max-new-tokens 1: every answer is the prefill's token, so no decode seconds to divide by."""
    empty = {"tokens": 0, "decode_s": 0.0, "committed": [], "lengths": [], "widths": [], "plain_rounds": 0,
             "identical": True}
    table = load_script("bench_scheduler").results_table({"target_only": {1: dict(empty)}, "fixed:1": {1: dict(empty)}})
    assert math.isnan(table["target_only"]["1"]["tokens_per_s"])
    assert math.isnan(table["fixed:1"]["1"]["speedup"]) and table["fixed:1"]["1"]["rounds"] == 0


def test_serving_rates_are_positive_or_inf_and_target_only_is_not_a_policy(capsys):
    args = parse("bench_serving", ["--quick"])
    assert (args.requests, args.rates, args.batch_sizes, args.policy) == (4, [2.0, math.inf], [2], ["fixed:7", "scheduler"])
    assert parse("bench_serving", ["--rates", "0.5", "inf"]).rates == [0.5, math.inf]
    assert parse("bench_serving", ["--temperature", "0.7", "--top-p", "0.8"]).sampling.describe() == "T=0.7 top-p 0.8"
    assert "--temperature/--top-k/--top-p" in refusal("bench_serving", ["--temperature", "-1"], capsys)
    for rate in ("0", "-1", "nan", "soon"):
        assert f"{rate!r} is not an arrival rate" in refusal("bench_serving", ["--rates", rate], capsys)
    assert "target-only decoding always runs" in refusal("bench_serving", ["--policy", "target-only"], capsys)


def test_serving_runs_are_compared_with_target_only_at_the_same_batch_and_rate():
    def run(throughput, per_user, p90):
        return {"throughput": throughput, "per_user_tokens_per_s": per_user, "latency_s": {"p90": p90}}

    summaries = {"target-only": {"B=1": {"1": run(10.0, 10.0, 4.0), "inf": run(16.0, 10.0, 8.0)}},
                 "fixed:7": {"B=1": {"1": run(15.0, 20.0, 2.0), "inf": run(8.0, 9.0, 16.0)}}}
    compared = load_script("bench_serving").compare_runs(summaries)
    assert compared["ratios"] == {"fixed:7": {"B=1": {"1": {"throughput": 1.5, "latency_p90": 0.5},
                                                      "inf": {"throughput": 0.5, "latency_p90": 2.0}}}}
    # The most per-user speed and the most throughput; the other two runs are beaten on both.
    assert compared["pareto_front"] == ["fixed:7 B=1 rate 1", "target-only B=1 rate inf"]


def bad_benchmarks(tmp_path):
    """A benchmark directory whose code set has a line without a first turn."""
    for name in ("gsm8k", "mt-bench"):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"turns": ["What is 2+2?"]}) + "\n")
    (tmp_path / "humaneval.jsonl").write_text('{"turns": []}\n')
    return tmp_path


def test_bad_benchmark_prompts_end_the_scripts_with_one_line(tmp_path):
    directory = bad_benchmarks(tmp_path)
    scheduler, batch = load_script("bench_scheduler"), load_script("bench_batch")
    with pytest.raises(SystemExit, match=r"^--benchmarks .*missing: not a directory$"):
        scheduler.interleaved_texts(tmp_path / "missing", 3)
    with pytest.raises(SystemExit, match=r"humaneval.jsonl:1: 'turns' must be a non-empty list of strings$"):
        scheduler.interleaved_texts(directory, 3)
    with pytest.raises(SystemExit, match=r"humaneval.jsonl:1: 'turns' must be a non-empty list of strings$"):
        batch.prompt_texts(directory, ["humaneval"], 1)
    with pytest.raises(SystemExit, match=r"nosuchset.jsonl does not exist$"):
        batch.prompt_texts(directory, ["nosuchset"], 1)
    with pytest.raises(SystemExit, match="gsm8k.jsonl has 1 prompts, fewer than --per-set 2"):
        batch.prompt_texts(directory, ["gsm8k"], 2)
    fixtures = REPO / "tests" / "fixtures" / "bench_prompts"
    texts = batch.prompt_texts(fixtures, ["gsm8k", "humaneval"], 2)
    first = {name: [json.loads(line)["turns"][0] for line in (fixtures / f"{name}.jsonl").read_text().splitlines()[:2]]
             for name in ("gsm8k", "humaneval")}
    assert texts == [first["gsm8k"][0], first["humaneval"][0], first["gsm8k"][1], first["humaneval"][1]]


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "-1"], "--temperature/--top-k/--top-p: temperature must be 0 (greedy)"),
    (["--top-p", "0"], "--temperature/--top-k/--top-p: top_p must be in"),
    (["--drafter", "smollm2_135m_dflash"], "a dflash drafter has no confidence head to calibrate"),
])
def test_eval_calibration_checks_sampling_and_the_drafter_before_loading_the_target(argv, message, tmp_path, capsys):
    assert message in refusal("eval_calibration", argv + ["--out", str(tmp_path / "c.json")], capsys)


def test_exactness_report_takes_only_the_batch_sizes_it_has_prompt_groups_for(capsys):
    assert "argument --batches: invalid choice: 2 (choose from 1, 4)" in refusal("exactness_report", ["--batches", "2"], capsys)
    assert "argument --ells: invalid choice: 8" in refusal("exactness_report", ["--ells", "8"], capsys)
    assert parse("exactness_report", ["--batches", "4"]).batches == [4]


def test_eval_heldout_refuses_fewer_prompts_than_one_scoring_batch(capsys):
    assert "--num-prompts must be >= 8" in refusal("eval_heldout", ["--num-prompts", "3"], capsys)
    assert parse("eval_heldout", ["--num-prompts", "8"]).num_prompts == 8


def test_eval_long_answers_last_bucket_ends_at_the_last_answer_position():
    script = load_script("eval_long_answers")
    # Rounds starting at 96-99 of 100 answer positions are counted in the last bucket.
    assert script.bucket_names(100, 32) == ["0-31", "32-63", "64-99"]
    assert script.bucket_names(96, 32) == ["0-31", "32-63", "64-95"]


def test_write_json_replaces_the_file_whole(tmp_path):
    from dspark_jax.config import write_json

    out = tmp_path / "new" / "r.json"
    write_json(out, {"a": 1})
    write_json(out, {"b": [1, 2]}, indent=1)
    assert json.loads(out.read_text()) == {"b": [1, 2]} and out.read_text().endswith("\n")
    assert [p.name for p in out.parent.iterdir()] == ["r.json"]  # no partial file left behind
    # Another writer's partial file of the same JSON is not this one's to write into or rename.
    from dspark_jax.config import partial_path

    theirs = partial_path(out)
    theirs.write_text("half of another process's")
    write_json(out, {"c": 3})
    assert json.loads(out.read_text()) == {"c": 3} and theirs.read_text() == "half of another process's"
    assert partial_path(out) != partial_path(out)


@pytest.mark.parametrize("script", ["bench_batch", "bench_scheduler", "bench_serving", "bench_speculative"])
def test_the_decoding_benchmarks_run_on_the_users_target_in_the_dtype_asked(script, monkeypatch, tmp_path):
    """``--checkpoint`` / ``--dtype`` reach the target's loader (a GPU user benchmarks their own
    model in bfloat16), and a checkpoint that does not load is one line that names it."""
    loaded = []

    def load_target(checkpoint=None, dtype="float32"):
        loaded.append((checkpoint, dtype))
        raise ValueError("not a checkpoint")

    monkeypatch.setattr("dspark_jax.checkpoints.load_target", load_target)
    argv = ["--quick", "--benchmarks", str(REPO / "tests" / "fixtures" / "bench_prompts"), "--out",
            str(tmp_path / "r.json"), "--checkpoint", "my_model.gguf", "--dtype", "bfloat16"]
    with pytest.raises(SystemExit, match=r"^--checkpoint 'my_model.gguf': not a checkpoint$"):
        load_script(script).main(argv)
    assert loaded == [("my_model.gguf", "bfloat16")]


def test_benchmarks_name_their_target_and_its_dtype():
    from dspark_jax.eval.bench import target_label

    assert target_label(None) == "SmolLM2-135M-Instruct"
    assert target_label("/models/qwen3-4b/", "bfloat16") == "qwen3-4b (bfloat16)"
    assert target_label("llama.Q4_0.gguf") == "llama.Q4_0.gguf"


def test_drafters_of_the_same_weights_share_a_digest_whatever_their_calibration(tmp_path):
    """bench_speculative gives scheduler decoders of identical weights one cost table (an A/B of
    calibrations); a DeepSpec checkpoint, which has other files than a drafter saved here, has one too."""
    import shutil

    from dspark_jax.drafters import shipped_drafter_path
    from dspark_jax.eval.bench import weights_digest

    shipped = shipped_drafter_path("smollm2_135m_dspark")
    copy = shutil.copytree(shipped, tmp_path / "copy")
    (copy / "calibration.json").write_text("{}")
    assert weights_digest(copy) == weights_digest(shipped)
    deepspec = REPO / "tests" / "fixtures" / "tiny_deepspec"
    digests = {weights_digest(deepspec / name) for name in ("gated", "rnn", "dflash")} | {weights_digest(shipped)}
    assert len(digests) == 4
