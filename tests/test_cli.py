"""The `dspark` command line on the embedded target, and the speculative benchmark script."""

import contextlib
import copy
import importlib.util
import io
import json
from pathlib import Path

import pytest

from dspark_jax.cli import main

FRANCE = ["--prompt", "What is the capital of France?", "--chat", "--max-new-tokens", "8"]


@pytest.fixture(scope="module")
def target_only_france(embedded_target):
    """``(stdout, stderr)`` of ``dspark generate`` on FRANCE without a drafter (run once, shared)."""
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        patch.setattr("dspark_jax.cli.load_target", lambda checkpoint=None, dtype="float32": embedded_target)
        assert main(["generate", *FRANCE]) == 0
    return out.getvalue(), err.getvalue()


def test_generate_prints_text_and_speed(target_only_france):
    out, err = target_only_france
    assert "Paris" in out
    assert "tokens/s" in err and "compile" in err


def test_generate_stops_at_the_models_end_of_turn_tokens(capsys, monkeypatch, embedded_target, target_only_france):
    """A model whose generation_config lists stop tokens besides EOS ends there (here " Paris",
    made a stop token, ends the answer a token early)."""
    target, tokenizer = embedded_target
    [paris] = tokenizer.encode(" Paris", add_bos=False)
    stopping = copy.copy(tokenizer)
    stopping.end_of_turn_ids = (paris,)
    monkeypatch.setattr("dspark_jax.cli.load_target", lambda checkpoint=None, dtype="float32": (target, stopping))
    assert main(["generate", *FRANCE]) == 0
    out, err = capsys.readouterr()
    assert "Paris." in target_only_france[0], "without it the answer goes on past Paris"
    assert out.strip().endswith("is Paris") and "finish=stop" in err


def test_generate_streams_its_text_and_reads_a_prompt_from_stdin(monkeypatch, embedded_target, target_only_france):
    """The text comes out token by token as it is generated, not at the end; ``--prompt -`` reads
    the prompt from standard input."""
    writes = []

    class Recorder(io.StringIO):
        def write(self, text):
            writes.append(text)
            return super().write(text)

    out = Recorder()
    monkeypatch.setattr("dspark_jax.cli.load_target", lambda checkpoint=None, dtype="float32": embedded_target)
    monkeypatch.setattr("sys.stdin", io.StringIO(FRANCE[1]))
    with contextlib.redirect_stdout(out):
        assert main(["generate", "--prompt", "-", *FRANCE[2:]]) == 0
    assert out.getvalue() == target_only_france[0]
    assert len([text for text in writes if text]) >= 4, writes


def test_bad_sampling_arguments_are_clear_errors(capsys):
    assert main(["generate", "--prompt", "Hi", "--temperature", "-1"]) == 2
    assert "temperature must be 0 (greedy) or a finite number >= 1e-05" in capsys.readouterr().err
    assert main(["bench", "--temperature", "0.7", "--top-p", "0"]) == 2  # bench samples as generate does
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
    assert main(["calibrate", "--temperature", "0.7", "--top-k", "-3"]) == 2
    assert "top_k must be an int in [0, 2**31)" in capsys.readouterr().err


def test_empty_prompt_is_refused():
    with pytest.raises(SystemExit, match="--prompt is empty"):
        main(["generate", "--prompt", ""])


# --------------------------------------------------------------------------------------------
# Speculative decoding from the command line: --drafter / --policy, and the benchmark script
# --------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """``scripts/<name>.py`` as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_generate_with_drafter_prints_target_text_and_tau(capsys, target_only_france, shared_target,
                                                         random_drafter_dir):
    plain, _ = target_only_france
    assert main(["generate", *FRANCE, "--drafter", str(random_drafter_dir), "--policy", "fixed:3"]) == 0
    out, err = capsys.readouterr()
    assert out == plain  # greedy speculative output is the target's, token for token
    assert "τ " in err and "rounds" in err and "tokens/s" in err
    assert "verify widths {4: " in err and "policy fixed:3" in err and "draft " in err and "verify " in err


def test_unshipped_drafter_names_are_clear(monkeypatch, tmp_path):
    import dspark_jax.drafters as drafters

    monkeypatch.setattr(drafters, "_ROOT", tmp_path)
    with pytest.raises(ValueError, match="shipped names are smollm2_135m_dspark, smollm2_135m_dflash"):
        drafters.shipped_drafter_path("gpt2_drafter")
    with pytest.raises(FileNotFoundError, match="'smollm2_135m_dflash' is not trained/shipped yet"):
        drafters.shipped_drafter_path("smollm2_135m_dflash")
    assert not drafters.is_shipped("smollm2_135m_dflash")
    (tmp_path / "smollm2_135m_dflash").mkdir()
    for name in drafters.FILES:
        (tmp_path / "smollm2_135m_dflash" / name).write_text("{}")
    assert drafters.shipped_drafter_path("smollm2_135m_dflash") == tmp_path / "smollm2_135m_dflash"
    assert drafters.is_shipped("smollm2_135m_dflash")


def _tiny_target_drafter(directory):
    """The config of a drafter for another (tiny) target: refused before any weights are read."""
    from dspark_jax.checkpoints.drafter import CONFIG_FILE, FORMAT, VERSION
    from dspark_jax.config import DrafterConfig
    from tests.tiny import tiny_config

    cfg = DrafterConfig.for_target(tiny_config(), num_layers=1, tap_layers=(0, 1), mask_token_id=0)
    directory.mkdir()
    (directory / CONFIG_FILE).write_text(json.dumps({"format": FORMAT, "version": VERSION, "drafter": cfg.to_dict()}))
    return str(directory)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--drafter", "no_such_drafter"], "neither a shipped drafter"),
        (["--drafter", "smollm2_135m_eagle3"], "not trained/shipped yet"),
        (["--drafter", "{empty}"], "not a drafter checkpoint: no config.json"),
        (["--drafter", "{tiny}"], "drafter does not fit the target: hidden_size"),
        (["--drafter", "{drafter}", "--policy", "greedy:3"], "policy must be 'fixed:K', 'threshold:X'"),
        (["--drafter", "{drafter}", "--policy", "fixed:three"], "--policy 'fixed:three'"),
        (["--drafter", "{drafter}", "--policy", "threshold:1.5"], "threshold must be in"),
        (["--drafter", "{drafter}", "--policy", "fixed:99"], "fixed:99 asks for 99 drafts a round"),
        (["--policy", "fixed:3"], "--policy needs --drafter"),
    ],
)
def test_bad_drafter_or_policy_is_a_one_line_error(extra, message, monkeypatch, tmp_path, shared_target,
                                                   random_drafter_dir):
    import dspark_jax.drafters as drafters

    monkeypatch.setattr(drafters, "_ROOT", tmp_path / "no_shipped_drafters")  # as before they ship
    (tmp_path / "empty").mkdir()
    paths = {"{empty}": str(tmp_path / "empty"), "{drafter}": str(random_drafter_dir)}
    if "{tiny}" in extra:
        paths["{tiny}"] = _tiny_target_drafter(tmp_path / "tiny")
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "Hi", *[paths.get(a, a) for a in extra]])
    text = str(exit_info.value.code)
    assert message in text and "\n" not in text


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "Hi", "--max-new-tokens", "0"],
        ["demo", "--max-new-tokens", "0"],
        ["bench", "--prompts", "0"],
        ["calibrate", "--max-new-tokens", "0"],
        ["profile", "--batch", "1", "0", "--out", "costs.json"],
        ["profile", "--widths", "0", "4", "--out", "costs.json"],
        ["profile", "--repeats", "0", "--out", "costs.json"],
    ],
)
def test_counts_below_one_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    flag = next(a for a in argv if a.startswith("--") and a not in ("--prompt", "--out"))
    assert exit_info.value.code == 2
    assert f"error: argument {flag}: must be >= 1, got 0" in capsys.readouterr().err


def test_missing_train_config_is_a_one_line_error(capsys):
    assert main(["train", "--config", "no/such/config.py"]) == 2
    assert capsys.readouterr().err == "dspark train: error: no config file no/such/config.py\n"


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("", None, "is a directory, not a config file"),
        ("notes.md", "# notes\n", "is not a Python config file (configs/NAME.py)"),
        ("no_config.py", "X = 1\n", "must define CONFIG = TrainConfig(...)"),
    ],
)
def test_a_train_config_that_is_not_one_is_a_one_line_error(tmp_path, name, text, message, capsys):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    assert main(["train", "--config", str(path)]) == 2
    assert capsys.readouterr().err == f"dspark train: error: {path} {message}\n"


def test_a_path_the_system_refuses_is_a_one_line_error(tmp_path, capsys, shared_target):
    """An OSError from a path the user gave (here an output below a regular file) is reported in
    one line, like any other bad input, not as a traceback."""
    inputs = tmp_path / "requests.jsonl"
    inputs.write_text('{"prompt": "Hi"}\n')
    (tmp_path / "a_file").write_text("")
    assert main(["batch", "--input", str(inputs), "--output", str(tmp_path / "a_file" / "out.jsonl"),
                 "--max-new-tokens", "2", "--no-progress"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("dspark batch: error: ") and "a_file" in last, last


def test_threshold_policy_needs_a_confidence_head():
    from dspark_jax.config import DrafterConfig
    from dspark_jax.decoding.speculative import FixedPolicy, ThresholdPolicy
    from dspark_jax.eval.compare import policy_for
    from tests.tiny import tiny_config

    dflash = DrafterConfig.dflash(tiny_config(), num_layers=1, tap_layers=(0, 1), mask_token_id=0, block_size=5)
    policy, note = policy_for(dflash, ThresholdPolicy(0.5))
    assert policy == FixedPolicy(5) and "no confidence head" in note
    dspark = DrafterConfig.for_target(tiny_config(), num_layers=1, tap_layers=(0, 1), mask_token_id=0)
    assert policy_for(dspark, ThresholdPolicy(0.5)) == (ThresholdPolicy(0.5), None)


def test_scheduler_policy_gets_the_drafters_calibrations(tmp_path):
    from dspark_jax.config import DrafterConfig, SamplingConfig
    from dspark_jax.decoding.speculative import FixedPolicy
    from dspark_jax.eval.compare import policy_for
    from dspark_jax.scheduler.prefix import Calibration, SchedulerPolicy
    from dspark_jax.training.calibrate import save_calibration
    from tests.tiny import tiny_config

    dflash = DrafterConfig.dflash(tiny_config(), num_layers=1, tap_layers=(0, 1), mask_token_id=0, block_size=5)
    policy, note = policy_for(dflash, SchedulerPolicy())
    assert policy == FixedPolicy(5) and "instead of scheduler" in note
    dspark = DrafterConfig.for_target(tiny_config(), num_layers=1, tap_layers=(0, 1), mask_token_id=0)
    save_calibration(tmp_path, {"temperatures": [2.0] * 7, "biases": [-0.5] * 7}, SamplingConfig())
    expected = SchedulerPolicy(calibrations=(Calibration((2.0,) * 7, (-0.5,) * 7, SamplingConfig()),))
    assert policy_for(dspark, SchedulerPolicy(), directory=tmp_path) == (expected, None)
    # Sampled requests have no fit of their own: the policy still carries the greedy one, and says so.
    t07 = SamplingConfig(temperature=0.7, top_k=20, top_p=0.8)
    policy, note = policy_for(dspark, SchedulerPolicy(), directory=tmp_path, sampling=t07)
    assert policy == expected and "no calibration for T=0.7 top-k 20 top-p 0.8 decoding" in note
    # A batch job's requests each bring their own sampling: the note names those left unserved.
    policy, note = policy_for(dspark, SchedulerPolicy(), directory=tmp_path, sampling=[SamplingConfig(), t07, t07])
    assert note.startswith("no calibration for T=0.7 top-k 20 top-p 0.8 decoding") and "those requests" in note
    assert policy_for(dspark, SchedulerPolicy(), directory=tmp_path, sampling=[SamplingConfig()] * 2)[1] is None
    save_calibration(tmp_path, {"temperatures": [1.0] * 7, "biases": [0.0] * 7}, SamplingConfig(temperature=1.0))
    policy, note = policy_for(dspark, SchedulerPolicy(), directory=tmp_path, sampling=t07)
    assert len(policy.calibrations) == 2 and note is None
    given = (Calibration((1.0,) * 7, (0.0,) * 7),)
    assert policy_for(dspark, SchedulerPolicy(calibrations=given), directory=tmp_path)[0].calibrations == given


def test_profile_calibrate_and_schedule_from_the_command_line(capsys, tmp_path, shared_shallow_target,
                                                              shallow_drafter_dir):
    import shutil

    from dspark_jax.scheduler.profile import load_cost_tables

    drafter = tmp_path / "drafter"
    shutil.copytree(shallow_drafter_dir, drafter)
    costs = tmp_path / "costs.json"
    assert main(["profile", "--drafter", str(drafter), "--repeats", "1", "--temperature", "1", "--top-k", "20",
                 "--out", str(costs)]) == 0
    assert sorted(load_cost_tables(costs)[1]) == [0, 1, 2, 4, 8]  # 0: a round without a draft
    table = json.loads(costs.read_text())
    assert table["sampling"] == "T=1 top-k 20" and table["dtype"] == "float32"
    assert main(["calibrate", "--drafter", str(drafter), "--prompts", "2", "--max-new-tokens", "8",
                 "--exclude-config", str(REPO / "configs" / "tiny_test.py")]) == 0
    entry = json.loads((drafter / "calibration.json").read_text())["greedy"]
    assert entry["excluded_configs"] == ["tiny_test.py"]
    assert len(entry["temperatures"]) == len(entry["biases"]) == 7 and entry["rounds"] > 0
    assert entry["method"] == "platt" and len(entry["ece_after"]) == len(entry["log_loss_after"]) == 7
    capsys.readouterr()
    assert main(["generate", *FRANCE]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", *FRANCE, "--drafter", str(drafter), "--policy", f"scheduler:{costs}"]) == 0
    out, err = capsys.readouterr()
    assert out == plain  # greedy: the target's text, whatever the scheduler verified
    assert "policy scheduler (calibrated for greedy; round cost B=1: plain " in err and ", W8 " in err



def test_calibrate_and_profile_refuse_where_they_could_not_write_before_working(tmp_path, monkeypatch, capsys, random_drafter_dir):
    """Where the fit cannot be written (a damaged calibration.json it would merge into, a path that
    is not a writable directory), calibrate says so before loading the model, not minutes later;
    so does profile, given a directory for its table."""
    import shutil

    monkeypatch.setattr("dspark_jax.cli.load_target", lambda checkpoint=None, dtype="float32": pytest.fail("loaded the model"))
    drafter = tmp_path / "drafter"
    shutil.copytree(random_drafter_dir, drafter)
    (drafter / "calibration.json").write_text("{half")
    assert main(["calibrate", "--drafter", str(drafter)]) == 2
    assert (f"the calibration goes to {drafter}, but {drafter / 'calibration.json'} is not a calibration file"
            in capsys.readouterr().err)
    (drafter / "calibration.json").unlink()
    assert main(["profile", "--drafter", str(drafter), "--out", str(tmp_path)]) == 2  # profile checks first too
    assert f"{tmp_path} is a directory: give the cost table a file name" in capsys.readouterr().err
    monkeypatch.setattr("os.access", lambda path, mode: False)  # a read-only directory (the tests run as root)
    assert main(["calibrate", "--drafter", str(drafter)]) == 2
    assert f"but {drafter} is not writable; choose another place with --out-dir" in capsys.readouterr().err

def test_bench_speculative_quick_writes_documented_json(tmp_path, capsys, shared_shallow_target, shallow_drafter_dir):
    script = load_script("bench_speculative")
    out = tmp_path / "bench.json"
    argv = ["--quick", "--benchmarks", str(REPO / "tests" / "fixtures" / "bench_prompts"),
            "--drafter", str(shallow_drafter_dir), "--max-new-tokens", "4", "--out", str(out)]
    assert script.main(argv) == 0
    data = json.loads(out.read_text())
    summary_line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary_line == data["summary"]
    assert set(data["summary"]) == {"identical", "speedup", "tau"}  # no tau_ratio without a dflash drafter
    assert data["summary"]["identical"] is True
    assert set(data["summary"]["speedup"]) == {"math", "code", "chat"}
    assert set(data["summary"]["tau"]) == {"random_dspark"}
    assert data["settings"]["prompts_per_domain"] == 2 and data["settings"]["max_new_tokens"] == 4
    assert data["machine"]["backend"] and data["compiles_while_timing"] == 0
    for domain in ("math", "code", "chat"):
        d = data["results"]["random_dspark"]["domains"][domain]
        assert d["prompts"] == 2 and d["identical"] is True and d["differing_prompts"] == []
        assert d["speedup"] > 0 and d["tau"] >= 1.0 and 0.0 <= d["acceptance_rate"] <= 1.0
        assert len(d["per_position_acceptance"]) == 7 and sum(d["width_histogram"].values()) == d["rounds"]
        split = d["time_split"]
        assert 0 < split["draft_s"] and 0 < split["verify_s"]
        assert split["draft_s"] + split["verify_s"] <= d["decode_s"]["speculative"]
        assert d["tokens_per_s"]["target_only"] > 0 and d["tokens_per_s"]["speculative"] > 0
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [[], ["--temperature", "1", "--top-k", "20"]], ids=["greedy", "sampled"])
def test_bench_serving_quick_writes_documented_json(tmp_path, capsys, shared_target, random_drafter_dir, sampling):
    out = tmp_path / "serving.json"
    argv = ["--quick", "--benchmarks", str(REPO / "tests" / "fixtures" / "bench_prompts"), "--requests", "3",
            "--drafter", str(random_drafter_dir), "--max-new-tokens", "3", "--rates", "50", "inf", "--out", str(out)]
    assert load_script("bench_serving").main(argv + sampling) == 0
    data = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == data["summary"]
    # Sampled outputs are not compared (each decoder draws its own numbers); the warm-up compiled
    # the sampled programs too.
    assert data["summary"]["identical"] is (None if sampling else True) and data["compiles_while_timing"] == 0
    assert data["settings"]["sampling"] == ("T=1 top-k 20" if sampling else "greedy")
    assert set(data["runs"]) == {"target-only", "fixed:7", "scheduler"}
    assert set(data["runs"]["scheduler"]) == {"B=2", "B=2 buckets"}  # static rows, and batch buckets
    assert set(data["summary"]["throughput_ratio"]["scheduler"]["B=2"]) == {"50", "inf"}
    assert data["arrivals_s"]["inf"] == [0, 0, 0] and data["arrivals_s"]["50"][0] == 0
    for per_b in data["runs"].values():
        for run in per_b["B=2"].values():
            assert run["requests"] == 3 and run["tokens"] <= 9 and run["throughput"] > 0
            assert 0 <= run["ttft_s"]["p50"] <= run["latency_s"]["p50"] <= run["latency_s"]["p99"]
    assert "tau" in data["runs"]["fixed:7"]["B=2"]["inf"] and "tau" not in data["runs"]["target-only"]["B=2"]["inf"]
    assert data["summary"]["pareto_front"] and out.with_suffix(".png").stat().st_size > 0


@pytest.mark.slow
def test_bench_scheduler_and_bench_batch_quick_write_documented_json(tmp_path, capsys, shared_shallow_target,
                                                                     shallow_drafter_dir):
    fixtures = str(REPO / "tests" / "fixtures" / "bench_prompts")
    out = tmp_path / "scheduler.json"
    argv = ["--quick", "--benchmarks", fixtures, "--drafter", str(shallow_drafter_dir), "--policy", "fixed:7",
            "--policy", "scheduler", "--batches", "1", "2", "--max-new-tokens", "3", "--out", str(out)]
    assert load_script("bench_scheduler").main(argv) == 0
    data = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == data["summary"]
    assert data["summary"]["identical"] is True and data["compiles_while_timing"] == 0
    assert set(data["summary"]["speedup"]) == {"fixed:7", "scheduler"}
    assert (data["settings"]["target"], data["settings"]["dtype"]) == ("SmolLM2-135M-Instruct", "float32")
    assert out.with_suffix(".png").stat().st_size > 0

    out = tmp_path / "batch.json"
    report = load_script("bench_batch").main(["--quick", "--benchmarks", fixtures, "--max-new-tokens", "3",
                                               "--rounds", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == report and all(report["identical"].values())
    assert (report["settings"]["target"], report["settings"]["dtype"]) == ("SmolLM2-135M-Instruct", "float32")


def test_bench_speculative_decodes_each_prompt_on_several_sampled_paths(tmp_path, capsys, shared_shallow_target,
                                                                       shallow_drafter_dir):
    import shutil

    from dspark_jax.config import SamplingConfig
    from dspark_jax.training.calibrate import save_calibration

    script = load_script("bench_speculative")
    with pytest.raises(SystemExit):
        script.parse_args(["--seeds", "2"])  # greedy: one path whatever the seed
    # The same weights twice under the scheduler, one copy calibrated for T = 1: they share one
    # profiled cost table, and each is served by its own calibration.
    calibrated = tmp_path / "calibrated"
    shutil.copytree(shallow_drafter_dir, calibrated)
    save_calibration(calibrated, {"temperatures": [1.5] * 7, "biases": [-0.5] * 7}, SamplingConfig(temperature=1.0))
    out = tmp_path / "bench.json"
    argv = ["--benchmarks", str(REPO / "tests" / "fixtures" / "bench_prompts"), "--drafter", str(shallow_drafter_dir),
            "--drafter", str(calibrated), "--policy", "scheduler", "--prompts-per-domain", "1", "--max-new-tokens", "4",
            "--temperature", "1", "--seeds", "2", "--out", str(out), "--no-plot"]
    assert script.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["settings"]["seeds"] == 2 and data["summary"]["identical"] is None
    for domain in ("math", "code", "chat"):
        d = data["results"]["random_dspark"]["domains"][domain]
        assert d["prompts"] == 2 and [p["prompt"].rsplit(":", 1)[1] for p in d["per_prompt"]] == ["path0", "path1"]
    raw, fitted = (data["drafters"][name]["policy"] for name in ("random_dspark", "calibrated"))
    assert raw.startswith("scheduler (uncalibrated; round cost B=1: ")
    assert fitted.startswith("scheduler (calibrated for T=1; round cost B=1: ")
    assert raw.split("round cost")[1] == fitted.split("round cost")[1]


def test_eval_heldout_names_its_cache_by_prompts_and_answer_sampling():
    from dspark_jax.training.data import TrainingPrompt

    script = load_script("eval_heldout")
    prompts = [TrainingPrompt("math-000001", "math", "Add 2 and 2."), TrainingPrompt("code-000002", "code", "Sort x.")]
    default = script.heldout_cache_dir(script.parse_args([]), prompts)
    stem, digest = default.rsplit("_", 1)
    assert stem == "runs/heldout_cache_seed1_n48" and len(digest) == 8
    assert script.heldout_cache_dir(script.parse_args([]), list(prompts)) == default
    # Configs with a leg on new seeds hold out other prompts under the same seed and count: they
    # get a cache of their own, not the answers to someone else's prompts.
    for other in (prompts[:1] + [TrainingPrompt("code-000002", "code", "Sort y.")],
                  prompts[:1] + [TrainingPrompt("code-000003", "code", "Sort x.")]):
        assert script.heldout_cache_dir(script.parse_args([]), other) != default
    args = script.parse_args(["--mix", "formats", "--temperature", "1"])
    assert (args.top_p, args.top_k) == (1.0, 0)  # top-k and top-p are off unless given
    assert script.heldout_cache_dir(args, prompts) == f"runs/heldout_cache_seed1_n48_formats_t1_p1_k0_{digest}"
    # Benchmark prompts are fixed by the files, the skip and the count.
    args = script.parse_args(["--benchmarks", "b", "--num-prompts", "12", "--benchmark-skip", "3"])
    assert script.heldout_cache_dir(args, prompts) == "runs/heldout_cache_benchmarks_skip3_n12"
    assert script.heldout_cache_dir(script.parse_args(["--cache-dir", "runs/mine"]), prompts) == "runs/mine"


@pytest.mark.parametrize("argv, message", [
    (["--benchmarks", "b", "--mix", "writing"], "do not apply"),  # a mix means nothing for benchmark prompts
    (["--benchmarks", "b", "--data-seed", "2"], "do not apply"),
    (["--benchmarks", "b", "--num-prompts", "10"], "divisible by 3"),  # not a third per domain
    (["--top-k", "20"], "go with --temperature"),
    (["--temperature", "-1"], "temperature must be 0 (greedy) or a finite number >= 1e-05"),  # SamplingConfig's own check
    (["--temperature", "1", "--top-p", "0"], "top_p must be in"),
    (["--replay", "96"], "--replay needs --temperature 0"),  # sampled answers are not greedy decoding's path
    (["--replay", "96", "--temperature", "1"], "--replay needs --temperature 0"),
    (["--replay", "1", "--temperature", "0"], "TOKENS >= 2"),
])
def test_eval_heldout_rejects_contradictory_options(argv, message, capsys):
    with pytest.raises(SystemExit):
        load_script("eval_heldout").parse_args(argv)
    assert message in capsys.readouterr().err


def test_eval_heldout_quick_benchmark_run_takes_a_third_per_domain():
    assert load_script("eval_heldout").parse_args(["--quick", "--benchmarks", "b"]).num_prompts == 9


def test_eval_heldout_reads_benchmark_prompts_past_the_skip():
    script = load_script("eval_heldout")
    fixtures = REPO / "tests" / "fixtures" / "bench_prompts"
    prompts = script.benchmark_prompts(fixtures, per_domain=1, skip=1)
    assert [p.id for p in prompts] == ["math-000001", "code-000001", "chat-000001"]
    second_gsm8k = json.loads((fixtures / "gsm8k.jsonl").read_text().splitlines()[1])["turns"][0]
    assert prompts[0].text == second_gsm8k and prompts[0].domain == "math"
    with pytest.raises(ValueError, match="fewer than 2"):
        script.benchmark_prompts(fixtures, per_domain=2, skip=1)


# --------------------------------------------------------------------------------------------
# dspark train with several configs / a budget, and the target file outside the package
# --------------------------------------------------------------------------------------------


def test_train_data_parallel_flag_overrides_the_config(capsys):
    """--data-parallel reaches the run: more devices than this process sees is refused by name."""
    assert main(["train", "--config", str(REPO / "configs" / "tiny_test.py"), "--data-parallel", "9"]) == 2
    assert "data_parallel=9 but 1 devices are visible" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--config", "a.py", "--config", "b.py", "--out-dir", "x"], "--out-dir names one run's directory"),
    (["--config", "a.py", "--budget-s", "60", "--steps", "5"], "--budget-s chooses the steps"),
])
def test_train_rejects_contradictory_options(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["train", *argv])


def test_the_embedded_target_file_can_be_named_by_a_variable(monkeypatch, tmp_path):
    from dspark_jax.checkpoints.gguf import EMBEDDED_PATH_VARIABLE, embedded_gguf_path

    packaged = embedded_gguf_path()
    monkeypatch.setenv(EMBEDDED_PATH_VARIABLE, str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="missing.gguf, which is not a file"):
        embedded_gguf_path()
    copy = tmp_path / "copy.gguf"
    copy.symlink_to(packaged)
    monkeypatch.setenv(EMBEDDED_PATH_VARIABLE, str(copy))
    assert embedded_gguf_path() == copy


def test_eval_long_answers_buckets_rounds_by_where_they_start_in_the_answer():
    import numpy as np

    class Rounds:  # a decoder whose every answer commits 1, 3, 2 and 4 tokens in its four rounds
        def generate(self, prompts, *, max_new_tokens, stop_ids):
            return type("Result", (), {"committed_per_round": [np.array([c]) for c in (1, 3, 2, 4)]})()

    script = load_script("eval_long_answers")
    # The prefill emits position 0; rounds start at 1, 2, 5 and 7.
    committed = script.committed_by_bucket(Rounds(), [[1], [2]], max_new_tokens=8, bucket=4, stop_ids=[0])
    assert committed == [[[1, 3], [2, 4]]] * 2
    names = script.bucket_names(8, 4)
    assert script.tau_by_bucket(committed, names) == {"0-3": {"tau": 2.0, "rounds": 4}, "4-7": {"tau": 3.0, "rounds": 4}}


def test_eval_long_answers_window_ratio_per_bucket_with_its_bootstrap_interval():
    script = load_script("eval_long_answers")
    names = script.bucket_names(4, 2)
    # Two prompts; the window accepts one more draft in every round of the second bucket only.
    whole = {"d": [[[2, 2], [1, 3]], [[3], [2]]]}
    window = {"d": [[[2, 2], [2, 4]], [[3], [3]]]}
    results = {name: {"committed": committed, "pooled": script.tau_by_bucket(committed["d"], names)}
               for name, committed in (("base", whole), ("w", window))}
    cells = script.window_intervals(results, "base", "w", names)
    assert cells["0-1"] == {"ratio": 1.0, "interval": [1.0, 1.0]}
    assert cells["2-3"]["ratio"] == pytest.approx((1 + 6 / 3) / (1 + 3 / 3))
    low, high = cells["2-3"]["interval"]
    assert 1.0 < low <= cells["2-3"]["ratio"] <= high
    results["w"]["pooled"]["2-3"]["tau"] = None  # a bucket no round reached
    assert script.window_intervals(results, "base", "w", names)["2-3"] == {"ratio": None, "interval": None}


def test_eval_long_answers_windowed_copy_shares_the_weights(tmp_path):
    from dspark_jax.checkpoints.drafter import read_drafter_config
    from dspark_jax.drafters import shipped_drafter_path

    shipped = shipped_drafter_path("smollm2_135m_dflash")
    copy = load_script("eval_long_answers").windowed_copy(shipped, 64, tmp_path)
    assert read_drafter_config(copy)[0].sliding_window == 64
    assert read_drafter_config(shipped)[0].sliding_window != 64
    assert (copy / "model.safetensors").resolve() == (shipped / "model.safetensors").resolve()


@pytest.mark.parametrize("argv, message", [
    (["--window", "0"], "--window must be >= 1"),
    (["--bucket", "64", "--max-new-tokens", "32"], "--bucket <= --max-new-tokens"),
    (["--data-seed", "3"], "--data-seed picks --mix prompts"),
])
def test_eval_long_answers_rejects_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit):
        load_script("eval_long_answers").parse_args(argv)
    assert message in capsys.readouterr().err


def one_benchmark_prompt(directory: Path) -> str:
    """A benchmark directory (the overlap check's input) that holds one unrelated prompt."""
    directory.mkdir(exist_ok=True)
    (directory / "set.jsonl").write_text(json.dumps({"turns": ["Name three rivers in Peru."]}) + "\n")
    return str(directory)


def test_eval_long_answers_mix_prompts_are_held_out_and_grouped_by_domain(embedded_target, tmp_path):
    from dspark_jax.training.data import MIXES
    from dspark_jax.training.train import load_config, training_prompts

    script = load_script("eval_long_answers")
    tokenizer = embedded_target[1]
    args = script.parse_args(["--mix", "writing", "--prompts-per-domain", "2",
                              "--benchmarks", one_benchmark_prompt(tmp_path / "benchmarks")])
    prompts = script.mix_prompts(args, tokenizer)
    assert {domain: len(ids) for domain, ids in prompts.items()} == {domain: 2 for domain in MIXES["writing"]}
    config = load_config(args.config)
    trained = {tuple(tokenizer.apply_chat_template([{"role": "user", "content": p.text}]))
               for leg in config.legs for p in training_prompts(leg)}
    assert not trained & {tuple(ids) for ids in sum(prompts.values(), [])}
    assert all(len(ids) <= config.cache.max_prompt_tokens for ids in sum(prompts.values(), []))


@pytest.mark.parametrize("argv, message", [
    (["--mix", "poetry"], "not a training mix"),
    (["--mix", "writing", "--data-seed", "5"], "is a data seed of"),
])
def test_eval_long_answers_refuses_unknown_mixes_and_training_seeds(embedded_target, argv, message, tmp_path):
    script = load_script("eval_long_answers")
    args = script.parse_args(argv + ["--benchmarks", one_benchmark_prompt(tmp_path / "benchmarks")])
    with pytest.raises(ValueError, match=message):
        script.mix_prompts(args, embedded_target[1])


@pytest.mark.parametrize("command", [["generate", "--prompt", "Hi"], ["batch", "--input", "in.jsonl", "--output", "o"],
                                     ["bench"], ["profile", "--out", "costs.json"], ["calibrate"]], ids=lambda c: c[0])
@pytest.mark.parametrize("dtype", [[], ["--dtype", "bfloat16"]], ids=["float32", "bfloat16"])
def test_every_command_takes_the_users_target_in_the_dtype_asked(command, dtype, monkeypatch, capsys, tmp_path):
    """A drafter trained for your own target (``TrainConfig(target_checkpoint=...)``) is profiled,
    calibrated and benchmarked on that target, as generate and batch decode with it; ``--dtype``
    chooses its weights' dtype."""
    loaded = []

    def load_target(checkpoint=None, dtype="float32"):
        loaded.append((checkpoint, dtype))
        raise ValueError("stopped after choosing the target")

    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"prompt": "Hi"}\n')
    monkeypatch.setattr("dspark_jax.cli.load_target", load_target)
    assert main([*command, "--checkpoint", "my_model.gguf", *dtype]) == 2
    assert loaded == [("my_model.gguf", dtype[-1] if dtype else "float32")]
    assert "stopped after choosing the target" in capsys.readouterr().err


def test_a_drafter_takes_its_targets_dtype(embedded_target, random_drafter_dir):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dspark_jax.cli import load_drafter_arg
    from tests.tiny import cast_target

    target, _ = embedded_target
    half = cast_target(target, jnp.bfloat16)
    for model in (target, half):
        _, drafter, _, _ = load_drafter_arg(str(random_drafter_dir), model)
        dtypes = {leaf.dtype for leaf in jax.tree.leaves(nnx.state(drafter, nnx.Param))
                  if jnp.issubdtype(leaf.dtype, jnp.floating)}
        assert dtypes == {model.dtype}, dtypes


def test_a_scheduler_is_timed_on_the_cache_it_decodes_with(monkeypatch, shared_target, random_drafter_dir):
    """A round costs more on a longer cache, so generate and bench time the scheduler's rounds on
    the cache length their prompts decode with, not a fixed 256 slots: a 601-token prompt with 64
    new tokens (and 8 slots of verify slack) decodes on 768, the demo prompts with 200 on 384."""
    timed = []

    def profile_round_costs(decoder, batch, **kwargs):
        timed.append(kwargs["max_len"])
        raise ValueError("stopped before timing")

    monkeypatch.setattr("dspark_jax.scheduler.profile.profile_round_costs", profile_round_costs)
    scheduled = ["--drafter", str(random_drafter_dir), "--policy", "scheduler"]
    assert main(["generate", "--prompt", "word " * 600, "--max-new-tokens", "64", *scheduled]) == 2
    assert main(["bench", "--max-new-tokens", "200", *scheduled]) == 2
    assert timed == [768, 384]
