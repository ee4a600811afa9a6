"""``dspark batch``: a JSONL of requests answered into a JSONL of completions, resumable, on one
device, split over eight, or shared by two processes."""

import copy
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from dspark_jax import multihost
from dspark_jax.cli import main
from dspark_jax.decoding.batch_job import BatchJob, read_requests
from tests.multidevice import run_on_eight_devices, run_processes

REQUESTS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}], "id": "france"},
    {"messages": [{"role": "system", "content": "Answer in one word."},
                  {"role": "user", "content": "Name a primary colour."}]},
    {"turns": ["Write a haiku about the sea.", "Now a limerick."], "temperature": 1.0, "top_k": 20,
     "metadata": {"source": "test", "tags": [1, 2]}},
    {"prompt": "def fib(n):", "seed": 42, "id": 7, "max_new_tokens": 3},
    {"prompt": "Give me three tips for studying.", "temperature": 0.7, "top_p": 0.8},
]


def write_requests(path: Path, requests=REQUESTS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    return path


def batch(inputs: Path, output: Path, *extra: str) -> None:
    assert main(["batch", "--input", str(inputs), "--output", str(output), "--batch-size", "2",
                 "--max-new-tokens", "8", "--no-progress", *extra]) == 0


def records(output: Path) -> list[dict]:
    # Only "\n" ends a line: str.splitlines would also split on the U+2028 a JSON string may hold.
    return [json.loads(line) for line in output.read_text(encoding="utf-8").split("\n")[:-1]]


def cut_after(output: Path, whole_lines: int, extra_bytes: int) -> None:
    """What a kill leaves: the first ``whole_lines`` lines and a half-written one."""
    data = output.read_bytes()
    keep = sum(len(line) for line in data.splitlines(keepends=True)[:whole_lines]) + extra_bytes
    output.write_bytes(data[:keep])


def rows_a_step(capsys) -> list[float]:
    """The mean batch rows of each ``dspark batch`` run since the last read of the output."""
    return [float(rows) for rows in re.findall(r"([0-9.]+) rows a step", capsys.readouterr().err)]


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
    assert all(r["completion_tokens"] == 8 for r in got if r["finish_reason"] == "length" and r["index"] != 3)
    assert got[3]["completion_tokens"] == 3 and got[3]["finish_reason"] == "length"  # its own max_new_tokens
    tokenizer = shared_target[1]
    assert got[3]["prompt_tokens"] == len(tokenizer.encode("def fib(n):"))  # "prompt" is raw text without --chat
    assert got[0]["prompt_tokens"] == len(tokenizer.apply_chat_template([REQUESTS[0]["messages"][0]]))
    # Target-only, a request's tokens do not depend on the requests decoded beside it: fixed
    # batches write the file continuous batching wrote.
    batch(inputs, tmp_path / "fixed.jsonl", "--fixed-batches")
    assert (tmp_path / "fixed.jsonl").read_bytes() == full
    assert rows_a_step(capsys) == [2.0, 2.0]
    # Batch buckets: the job's tail runs at one row, and a resumed job picks up there; the tokens
    # equal those of fixed rows up to float rounding, so here exactly.
    buckets = tmp_path / "buckets.jsonl"
    batch(inputs, buckets, "--batch-buckets")
    assert buckets.read_bytes() == full
    cut_after(buckets, 3, 10)
    batch(inputs, buckets, "--batch-buckets")
    assert buckets.read_bytes() == full
    rows = rows_a_step(capsys)
    assert len(rows) == 2 and all(1.0 < r < 2.0 for r in rows)

    for whole_lines, extra in ((3, 25), (2, 0)):  # killed while writing a batch; killed between batches
        cut_after(output, whole_lines, extra)
        batch(inputs, output)
        assert output.read_bytes() == full, (whole_lines, extra)
        assert f"({whole_lines} already done)" in capsys.readouterr().err
    batch(inputs, output)  # a finished job: nothing to do, nothing changes
    assert output.read_bytes() == full and "(5 already done): 0 new tokens" in capsys.readouterr().err


def test_a_resumed_scheduled_job_in_fixed_batches_keeps_its_cost_table_and_its_outputs(
        tmp_path, monkeypatch, capsys, shared_shallow_target, shallow_drafter_dir):
    """The scheduler weighs every row of a batch, so a sampled request's tokens depend on its
    batch: fixed batches, rerun whole from the one the kill cut short, reproduce them."""
    inputs, output = write_requests(tmp_path / "requests.jsonl", REQUESTS[:3]), tmp_path / "out.jsonl"
    spec = ("--drafter", str(shallow_drafter_dir), "--policy", "scheduler", "--fixed-batches", "--batch-buckets")
    batch(inputs, output, *spec)
    costs = json.loads((tmp_path / "out.jsonl.job.json").read_text())["scheduler_costs"]
    # Timed at every size the job runs at: the second batch, one request, runs at one row.
    assert set(costs) == {"1", "2"} and all(set(costs[b]) == {"0", "1", "2", "4", "8"} for b in costs)
    assert 1.0 < rows_a_step(capsys)[0] < 2.0
    full = output.read_bytes()

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
    ('{"prompt": "a", "top_k": 2147483648}', "top_k must be an int in [0, 2**31)"),
    ('{"prompt": "a", "temperature": true}', "'temperature' must be a number, got true"),
    ('{"prompt": "a", "temperature": "0.5"}', '\'temperature\' must be a number, got "0.5"'),
    ('{"prompt": "a", "temperature": 1' + "0" * 400 + '}', "'temperature' is out of range, got 1000"),
    ('{"prompt": "a", "seed": 1' + "0" * 5000 + '}', "not JSON (Exceeds the limit (4300 digits)"),
    ('{"prompt": "a", "top_p": null}', "'top_p' must be a number, got null"),
    ('{"prompt": "a", "top_p": "0.5"}', '\'top_p\' must be a number, got "0.5"'),
    ('{"prompt": "a", "top_k": "20"}', '\'top_k\' must be an integer, got "20"'),
    ('{"prompt": "a", "top_k": 1.5}', "'top_k' must be an integer, got 1.5"),
    ('{"prompt": "a", "top_k": false}', "'top_k' must be an integer, got false"),
    ('{"prompt": "a", "seed": "x"}', "'seed' must be an integer"),
    ('{"prompt": "a", "seed": 18446744073709551616}', "'seed' must fit in a signed 64-bit integer"),
    ('{"prompt": "a", "seed": -9223372036854775809}', "'seed' must fit in a signed 64-bit integer"),
    ('{"prompt": "a", "id": [1]}', "'id' must be a string or an integer"),
    ('{"prompt": "a", "max_new_tokens": 0}', "'max_new_tokens' must be an integer >= 1, got 0"),
    ('{"prompt": "a", "max_new_tokens": "8"}', '\'max_new_tokens\' must be an integer >= 1, got "8"'),
    ('{"prompt": "a", "max_new_tokens": 8.0}', "'max_new_tokens' must be an integer >= 1, got 8.0"),
    ('{"prompt": "a", "max_new_tokens": true}', "'max_new_tokens' must be an integer >= 1, got true"),
    ('["a"]', "expected a JSON object, got list"),
    ("{prompt: a}", "not JSON"),
    ('{"prompt": "a", "metadata": {"score": NaN}}', "not JSON (NaN is not a JSON number)"),
    ('{"prompt": "a", "temperature": Infinity}', "not JSON (Infinity is not a JSON number)"),
    ('{"prompt": "a", "metadata": ' + "[" * 100_000 + "]" * 100_000 + "}", "not JSON (nested too deeply)"),
])
def test_a_bad_request_line_is_named(line, message, tmp_path, embedded_target):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError) as error:
        read_requests(path, embedded_target[1])
    assert f"{path}:2: " in str(error.value) and message in str(error.value)


def test_only_newlines_end_request_lines(tmp_path, embedded_target):
    """JSON strings may hold U+2028, U+2029 and U+0085 raw; CRLF files and blank lines still work."""
    path = tmp_path / "requests.jsonl"
    path.write_bytes('{"prompt": "one\u2028two\u0085three", "metadata": "a\u2029b"}\r\n\n{"prompt": "b"}'
                     .encode())
    got = read_requests(path, embedded_target[1])
    assert [r.metadata for r in got] == ["a\u2029b", None]
    assert got[0].ids == embedded_target[1].encode("one\u2028two\u0085three")


def test_a_line_that_is_not_utf8_is_named(tmp_path, embedded_target):
    path = tmp_path / "requests.jsonl"
    path.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"^{path}:2: not UTF-8 \('utf-8' codec can't decode byte 0xe9"):
        read_requests(path, embedded_target[1])


def test_a_derived_seed_out_of_range_is_named(tmp_path, embedded_target):
    path = write_requests(tmp_path / "r.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    assert [r.seed for r in read_requests(path, embedded_target[1], seed=2**63 - 2)] == [2**63 - 2, 2**63 - 1]
    with pytest.raises(ValueError, match=rf"^{path}:2: .*must fit in a signed 64-bit integer"):
        read_requests(path, embedded_target[1], seed=2**63 - 1)


def test_a_conversation_the_chat_template_refuses_is_named(tmp_path, embedded_target):
    tokenizer = copy.copy(embedded_target[1])
    tokenizer.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first turn is the "
                               "user') }}{% endif %}{{ messages[0]['content'] }}")
    path = write_requests(tmp_path / "r.jsonl", [{"messages": [{"role": "user", "content": "hi"}]},
                                                 {"messages": [{"role": "assistant", "content": "hi"}]}])
    with pytest.raises(ValueError, match=rf"^{path}:2: the chat template: the first turn is the user$"):
        read_requests(path, tokenizer)


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
    # Options a job records only when set (jobs written before them still resume) are settings too.
    assert main([*base, "--batch-buckets", "--dtype", "bfloat16"]) == 2
    assert "(batch_buckets: was None, now True; dtype: was None, now 'bfloat16')" in capsys.readouterr().err
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


class EchoRunner:
    """A stand-in for the decoders, for what a job does around them: each request's completion is
    its prompt's first tokens. ``during(position)`` runs before each request finishes."""

    rows = SimpleNamespace(check_batch=lambda batch_size: None)

    def __init__(self, during=lambda position: None):
        self.during = during

    def cache_len_for(self, prompt_lens, max_new_tokens):
        return max(prompt_lens) + max_new_tokens

    def generate(self, prompts, *, max_new_tokens, on_finish, **unused):
        for position, (ids, limit) in enumerate(zip(prompts, max_new_tokens)):  # a job passes one per request
            self.during(position)
            on_finish(position, ids[:limit], "length")


# Raw in the output (json.dumps(..., ensure_ascii=False)), where str.splitlines would split lines.
ODD_BREAKS = "line\u2028separator, paragraph\u2029separator, next\u0085line"
ODD_REQUESTS = [{"prompt": f"Request {i}: {ODD_BREAKS}", "metadata": {"note": ODD_BREAKS, "i": i}} for i in range(5)]


def echo_run(job: BatchJob, requests, tokenizer, runner=None) -> dict:
    return job.run(requests, runner=runner or EchoRunner(), decode=tokenizer.decode, max_new_tokens=64,
                   stop_ids=[], progress=False)


def test_a_job_whose_lines_hold_unicode_line_breaks_resumes(tmp_path, embedded_target):
    tokenizer = embedded_target[1]
    inputs, output = write_requests(tmp_path / "requests.jsonl", ODD_REQUESTS), tmp_path / "out.jsonl"
    requests = read_requests(inputs, tokenizer)
    echo_run(BatchJob(inputs, output, {"batch_size": 2}), requests, tokenizer)
    full = output.read_bytes()
    assert "\u2028".encode() in full and [r["metadata"]["note"] for r in records(output)] == [ODD_BREAKS] * 5
    cut_after(output, 2, 25)
    assert echo_run(BatchJob(inputs, output, {"batch_size": 2}), requests, tokenizer)["resumed"] == 2
    assert output.read_bytes() == full


def test_parts_whose_lines_hold_unicode_line_breaks_merge(tmp_path, embedded_target):
    tokenizer = embedded_target[1]
    inputs = write_requests(tmp_path / "requests.jsonl", ODD_REQUESTS)
    requests = read_requests(inputs, tokenizer)
    echo_run(BatchJob(inputs, tmp_path / "one.jsonl", {"batch_size": 2}), requests, tokenizer)
    job = BatchJob(inputs, tmp_path / "two.jsonl", {"batch_size": 2})
    for process in range(2):
        echo_run(job.part(process, 2), multihost.share(requests, process, 2), tokenizer)
    job.merge(requests, 2)
    assert (tmp_path / "two.jsonl").read_bytes() == (tmp_path / "one.jsonl").read_bytes()


def test_a_second_run_on_an_output_being_written_is_refused(tmp_path, embedded_target):
    """Two copies of one job would both append to the output: the second is refused while the
    first runs, and the lock goes with the run (a run that dies resumes)."""
    tokenizer = embedded_target[1]
    inputs = write_requests(tmp_path / "requests.jsonl", [{"prompt": f"Request {i}"} for i in range(5)])
    output = tmp_path / "out.jsonl"
    requests = read_requests(inputs, tokenizer)
    refusals = []

    def second_copy(position):
        if position == 2:
            with pytest.raises(ValueError) as error:
                echo_run(BatchJob(inputs, output, {"batch_size": 2}), requests, tokenizer)
            refusals.append(str(error.value))
            with pytest.raises(ValueError, match="is being written by another running job"):
                BatchJob(inputs, output, {"batch_size": 2}).merge(requests, 2)

    echo_run(BatchJob(inputs, output, {"batch_size": 2}), requests, tokenizer, EchoRunner(second_copy))
    assert refusals == [f"{output} is being written by another running job (pid {os.getpid()}); "
                        "wait for it to finish, or stop it and run this one again to resume it"]
    full = output.read_bytes()
    assert [r["index"] for r in records(output)] == [0, 1, 2, 3, 4]

    def killed(position):
        if position == 3:
            raise KeyboardInterrupt

    output.unlink()
    (tmp_path / "out.jsonl.job.json").unlink()
    with pytest.raises(KeyboardInterrupt):
        echo_run(BatchJob(inputs, output, {"batch_size": 2}), requests, tokenizer, EchoRunner(killed))
    assert echo_run(BatchJob(inputs, output, {"batch_size": 2}), requests, tokenizer)["resumed"] == 3
    assert output.read_bytes() == full

    # A copy opened before the first run started it does not start it again once it is done.
    output.unlink()
    (tmp_path / "out.jsonl.job.json").unlink()
    first, late = BatchJob(inputs, output, {"batch_size": 2}), BatchJob(inputs, output, {"batch_size": 2})
    echo_run(first, requests, tokenizer)
    with pytest.raises(ValueError, match="was started by another job since this one was opened; run this one again"):
        echo_run(late, requests, tokenizer)
    assert output.read_bytes() == full



def test_dspark_batch_refuses_a_second_copy_before_loading_the_model(tmp_path, monkeypatch, capsys):
    """A second copy of a running job is refused at once, not after the model load and profiling."""
    from dspark_jax import cli

    inputs, output = write_requests(tmp_path / "requests.jsonl"), tmp_path / "out.jsonl"
    loads = []
    monkeypatch.setattr(cli, "load_target", lambda checkpoint, dtype: loads.append(checkpoint) or pytest.fail("loaded"))
    with BatchJob(inputs, output, {"batch_size": 2}).hold():
        assert main(["batch", "--input", str(inputs), "--output", str(output), "--batch-size", "2",
                     "--no-progress"]) == 2
    assert loads == [] and "is being written by another running job" in capsys.readouterr().err

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


@pytest.mark.slow  # about 60 s; in CI: the split rule in two processes (test_multihost), parts merged in one (above)
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
