"""``dspark batch``: a JSONL of requests answered into a JSONL of completions, resumable, on one
device, split over eight, or shared by two processes."""

import json
from pathlib import Path

import pytest

from dspark_jax.cli import main
from dspark_jax.decoding.batch_job import BatchJob, read_requests
from tests.multidevice import run_on_eight_devices, run_processes

REQUESTS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}], "id": "france"},
    {"messages": [{"role": "system", "content": "Answer in one word."},
                  {"role": "user", "content": "Name a primary colour."}]},
    {"turns": ["Write a haiku about the sea.", "Now a limerick."], "temperature": 1.0, "top_k": 20,
     "metadata": {"source": "test", "tags": [1, 2]}},
    {"prompt": "def fib(n):", "seed": 42, "id": 7},
    {"prompt": "Give me three tips for studying.", "temperature": 0.7, "top_p": 0.8},
]


def write_requests(path: Path, requests=REQUESTS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    return path


def batch(inputs: Path, output: Path, *extra: str) -> None:
    assert main(["batch", "--input", str(inputs), "--output", str(output), "--batch-size", "2",
                 "--max-new-tokens", "8", "--no-progress", *extra]) == 0


def records(output: Path) -> list[dict]:
    return [json.loads(line) for line in output.read_text().splitlines()]


def cut_after(output: Path, whole_lines: int, extra_bytes: int) -> None:
    """What a kill leaves: the first ``whole_lines`` lines and a half-written one."""
    data = output.read_bytes()
    keep = sum(len(line) for line in data.splitlines(keepends=True)[:whole_lines]) + extra_bytes
    output.write_bytes(data[:keep])


def test_batch_answers_every_request_in_order_and_a_killed_job_resumes_to_the_same_file(
        tmp_path, capsys, shared_target):
    inputs, output = write_requests(tmp_path / "requests.jsonl"), tmp_path / "out.jsonl"
    batch(inputs, output)
    full = output.read_bytes()
    got = records(output)
    assert [r["index"] for r in got] == [0, 1, 2, 3, 4]
    assert [r.get("id") for r in got] == ["france", None, None, 7, None]
    assert got[2]["metadata"] == {"source": "test", "tags": [1, 2]}
    assert "Paris" in got[0]["completion"] and got[0]["finish_reason"] == "stop"
    assert all(r["completion_tokens"] == 8 for r in got if r["finish_reason"] == "length")
    tokenizer = shared_target[1]
    assert got[3]["prompt_tokens"] == len(tokenizer.encode("def fib(n):"))  # "prompt" is raw text without --chat
    assert got[0]["prompt_tokens"] == len(tokenizer.apply_chat_template([REQUESTS[0]["messages"][0]]))
    # Target-only, a request's tokens do not depend on the requests decoded beside it: fixed
    # batches write the file continuous batching wrote.
    batch(inputs, tmp_path / "fixed.jsonl", "--fixed-batches")
    assert (tmp_path / "fixed.jsonl").read_bytes() == full

    for whole_lines, extra in ((3, 25), (2, 0)):  # killed while writing a batch; killed between batches
        cut_after(output, whole_lines, extra)
        batch(inputs, output)
        assert output.read_bytes() == full, (whole_lines, extra)
        assert f"({whole_lines} already done)" in capsys.readouterr().err
    batch(inputs, output)  # a finished job: nothing to do, nothing changes
    assert output.read_bytes() == full and "(5 already done): 0 new tokens" in capsys.readouterr().err


def test_a_resumed_scheduled_job_in_fixed_batches_keeps_its_cost_table_and_its_outputs(
        tmp_path, monkeypatch, capsys, shared_target, random_drafter_dir):
    """The scheduler weighs every row of a batch, so a sampled request's tokens depend on its
    batch: fixed batches, rerun whole from the one the kill cut short, reproduce them."""
    inputs, output = write_requests(tmp_path / "requests.jsonl", REQUESTS[:3]), tmp_path / "out.jsonl"
    spec = ("--drafter", str(random_drafter_dir), "--policy", "scheduler", "--fixed-batches")
    batch(inputs, output, *spec)
    costs = json.loads((tmp_path / "out.jsonl.job.json").read_text())["scheduler_costs"]
    assert set(costs) == {"2"} and set(costs["2"]) == {"0", "1", "2", "4", "8"}  # timed at the job's batch size
    full = output.read_bytes()
    assert "Paris" in records(output)[0]["completion"]

    # Timed anew, the table would choose other verify lengths and other sampled tokens.
    def must_not_run(*args, **kwargs):
        raise AssertionError("a resumed job profiled the target again, or a finished one decoded")

    monkeypatch.setattr("dspark_jax.scheduler.profile.profile_round_costs", must_not_run)
    cut_after(output, 1, 40)  # killed writing the first batch's second line: that batch runs again whole
    batch(inputs, output, *spec)
    assert output.read_bytes() == full
    assert "τ " in capsys.readouterr().err
    monkeypatch.setattr("dspark_jax.decoding.speculative.SpeculativeDecoder.generate", must_not_run)
    batch(inputs, output, *spec)  # finished: no batch runs again
    assert output.read_bytes() == full and "(3 already done): 0 new tokens" in capsys.readouterr().err


@pytest.mark.parametrize("line, message", [
    ('{"id": 1}', "give exactly one of 'prompt', 'messages', 'turns'"),
    ('{"prompt": "a", "turns": ["b"]}', "(got 'prompt', 'turns')"),
    ('{"prompt": "a", "temprature": 0.5}', "unknown key(s) ['temprature']"),
    ('{"prompt": ""}', "'prompt' must be a non-empty string"),
    ('{"messages": [{"role": "user"}]}', "'messages' must be a non-empty list"),
    ('{"turns": "hello"}', "'turns' must be a non-empty list of strings"),
    ('{"prompt": "a", "temperature": -1}', "temperature must be 0 (greedy) or a finite number >= 1e-05"),
    ('{"prompt": "a", "top_k": 1.5}', "top_k must be an int in [0, 2**31)"),
    ('{"prompt": "a", "seed": "x"}', "'seed' must be an integer"),
    ('{"prompt": "a", "id": [1]}', "'id' must be a string or an integer"),
    ('["a"]', "expected a JSON object, got list"),
    ("{prompt: a}", "not JSON"),
])
def test_a_bad_request_line_is_named(line, message, tmp_path, embedded_target):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError) as error:
        read_requests(path, embedded_target[1])
    assert f"{path}:2: " in str(error.value) and message in str(error.value)


def test_repeated_ids_and_empty_files_are_refused(tmp_path, embedded_target):
    path = write_requests(tmp_path / "r.jsonl", [{"prompt": "a", "id": "x"}, {"prompt": "b", "id": "x"}])
    with pytest.raises(ValueError, match="r.jsonl:2: id 'x' was already used on line 1"):
        read_requests(path, embedded_target[1])
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no requests"):
        read_requests(tmp_path / "empty.jsonl", embedded_target[1])


def test_jobs_refuse_to_mix_settings_inputs_or_other_files(tmp_path, capsys, shared_target):
    inputs, output = write_requests(tmp_path / "requests.jsonl", REQUESTS[:1]), tmp_path / "out.jsonl"
    base = ["batch", "--input", str(inputs), "--output", str(output), "--batch-size", "1", "--max-new-tokens", "4",
            "--no-progress"]
    assert main(base) == 0
    before = output.read_bytes()
    assert main([*base, "--temperature", "0.5"]) == 2
    assert "belongs to a job with other settings (temperature: was 0.0, now 0.5)" in capsys.readouterr().err
    assert main([*base, "--fixed-batches"]) == 2
    assert "(continuous: was True, now False)" in capsys.readouterr().err
    output.write_text(before.decode().replace('"index": 0', '"index": 1'))
    assert main(base) == 2
    assert "out.jsonl:1: index 1 where this job writes 0" in capsys.readouterr().err
    output.write_bytes(before)
    write_requests(inputs, REQUESTS[:2])
    assert main(base) == 2
    assert "the input file's contents" in capsys.readouterr().err
    assert output.read_bytes() == before

    assert main(["batch", "--input", str(inputs), "--output", str(inputs), "--no-progress"]) == 2
    assert "exists and no batch job wrote it" in capsys.readouterr().err
    for broken in ("{half", '{"format": "dspark-jax-batch-job"}', "[]"):
        (tmp_path / "out.jsonl.job.json").write_text(broken)
        assert main(base) == 2
        assert "out.jsonl.job.json is not a dspark-jax-batch-job manifest" in capsys.readouterr().err
    assert main(["batch", "--input", str(tmp_path / "missing.jsonl"), "--output", str(output)]) == 2
    assert "missing.jsonl does not exist" in capsys.readouterr().err

    write_requests(inputs, [{"prompt": "word " * 9000}])
    assert main(["batch", "--input", str(inputs), "--output", str(tmp_path / "long.jsonl"), "--no-progress"]) == 2
    assert "request 0: prompt (" in capsys.readouterr().err and not (tmp_path / "long.jsonl").exists()
    with pytest.raises(SystemExit, match="--policy needs --drafter"):
        main([*base, "--policy", "fixed:3"])


def test_a_batch_size_below_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        BatchJob(write_requests(tmp_path / "r.jsonl"), tmp_path / "o.jsonl", {"batch_size": 0})


EIGHT_DEVICE_BATCH = """
import functools, json, sys
from pathlib import Path
import jax
from dspark_jax import cli

cli.load_target = functools.lru_cache(cli.load_target)  # load once for both runs
inputs, out = Path(sys.argv[1]), Path(sys.argv[2])
common = ["batch", "--input", str(inputs), "--max-new-tokens", "5", "--no-progress"]
codes = [cli.main([*common, "--output", str(out / "one.jsonl"), "--batch-size", "8"]),
         cli.main([*common, "--output", str(out / "eight.jsonl"), "--batch-size", "8", "--data-parallel"])]
try:
    cli.main([*common, "--output", str(out / "bad.jsonl"), "--batch-size", "12", "--data-parallel"])
    refusal = None
except SystemExit as error:
    refusal = str(error)
print(json.dumps({"devices": jax.device_count(), "codes": codes, "refusal": refusal,
                  "one": (out / "one.jsonl").read_text(), "eight": (out / "eight.jsonl").read_text()}))
"""


def test_data_parallel_batches_split_over_eight_devices_give_the_one_device_file(tmp_path):
    requests = [{"prompt": text, "temperature": 1.0 if i % 3 == 0 else 0.0} for i, text in enumerate([
        "What is 7 times 8?", "Name a planet.", "Say hello in French.", "def add(a, b):",
        "Write a haiku about rain.", "What colour is the sky?", "Count to five.", "Who wrote Hamlet?",
    ])]
    got = run_on_eight_devices(EIGHT_DEVICE_BATCH, str(write_requests(tmp_path / "r.jsonl", requests)), str(tmp_path))
    assert got["devices"] == 8 and got["codes"] == [0, 0]
    assert len(got["one"].splitlines()) == len(requests) and got["eight"] == got["one"]
    assert got["refusal"] == "--data-parallel splits each batch over 8 devices: --batch-size 12 is not a multiple of 8"


def test_two_processes_share_a_job_and_write_the_one_process_file(tmp_path, capsys, shared_target):
    """Two processes joined as one multi-host run answer every other request each (sampled ones
    included: a request's seed is its own) into their own parts, and process 0 writes the file one
    process writes. A process killed mid-part resumes its part; a finished job is finished for a
    rerun by one process too."""
    inputs = write_requests(tmp_path / "requests.jsonl")
    batch(inputs, tmp_path / "one.jsonl")
    output = tmp_path / "two.jsonl"
    shared = ["-m", "dspark_jax.cli", "batch", "--input", str(inputs), "--output", str(output), "--batch-size", "2",
              "--max-new-tokens", "8", "--no-progress"]
    run_processes(shared, devices_each=1)
    assert output.read_bytes() == (tmp_path / "one.jsonl").read_bytes()
    parts = [output.with_name("two.jsonl.parts") / f"process-0000{i}-of-00002.jsonl" for i in range(2)]
    assert [[r["index"] for r in records(part)] for part in parts] == [[0, 2, 4], [1, 3]]

    first_part = parts[0].read_bytes()
    cut_after(parts[1], 1, 10)
    output.unlink()
    printed = run_processes(shared, devices_each=1)
    assert output.read_bytes() == (tmp_path / "one.jsonl").read_bytes()
    assert parts[0].read_bytes() == first_part
    assert ["(3 already done)" in err for _, err in printed] == [True, False]
    assert "(1 already done)" in printed[1][1]
    capsys.readouterr()
    batch(inputs, output)  # one process, the same job: nothing left to do
    assert "(5 already done): 0 new tokens" in capsys.readouterr().err
    assert output.read_bytes() == (tmp_path / "one.jsonl").read_bytes()
