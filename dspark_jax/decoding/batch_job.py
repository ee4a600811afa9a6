"""Batch generation jobs: a JSONL file of requests in, a JSONL file of completions out (``dspark batch``).

Input: one JSON object per line, with exactly one of
  ``"prompt"``    text, tokenized as is (or through the chat template with ``chat=True``),
  ``"messages"``  a chat, ``[{"role": ..., "content": ...}, ...]``, through the chat template,
  ``"turns"``     a list of user turns, of which the first is asked (the benchmark files' form),
and optionally ``"id"`` (a string or int, unique in the file), ``"temperature"``, ``"top_k"``,
``"top_p"``, ``"seed"`` and ``"max_new_tokens"`` (this request's sampling and length limit,
instead of the job's), and ``"metadata"`` (anything; copied to the output). Any other key is an
error, so that a misspelt option is not silently ignored.

Output: one line per request, in input order: ``{"index", "id"?, "completion", "finish_reason",
"prompt_tokens", "completion_tokens", "metadata"?}``.

The requests run in batches of ``batch_size`` rows with continuous batching: when a request
finishes, the next one in the file is prefilled into its row between steps, so short answers do
not leave rows idle while long ones finish (``continuous=False``: fixed batches of the file, in
order, each starting once the last has finished). With ``batch_buckets`` (``dspark batch
--batch-buckets``) each step runs at the smallest of 1, 2, 4, ..., ``batch_size`` rows that holds
the requests in flight, so that the job's tail does not pay for idle rows. Each finished
request's line is appended and synced as soon as every earlier request's is (the file stays in
input order); the settings and the scheduler's cost table are kept next to the output
(``<output>.job.json``).

A job that is killed resumes where it stopped when run again with the same settings: a
half-written last line is cut and the requests already written are skipped. A request's tokens
depend on its prompt, its sampling and its seed (``"seed"``, or the job's seed plus its index), so
the resumed file is byte for byte the one an uninterrupted run writes, with two exceptions, both
under continuous batching, where the requests in flight beside a request differ after a resume.
A sampled request under a ``threshold`` or ``scheduler`` policy, whose verify lengths (and so its
random draws) weigh the other requests in flight, is drawn again, from the same exact
distribution. With batch buckets, the batch sizes a request runs at depend on the requests in
flight, and a batch size is part of every compiled shape: a resumed request's logits equal the
uninterrupted run's up to float rounding (so a token may differ where two are all but tied;
``docs/EXACTNESS.md``). Fixed batches, rerun whole from the one a kill cut short (with the job's
recorded cost table), reproduce both. Different settings, another input or an output file that
no job wrote are refused rather than mixed into it, and so is a second run while one is writing
the output (it holds ``<output>.lock``; a killed run's lock goes with it).

Only a newline (LF, or CRLF) ends a line of the input or the output: a JSON string may hold
U+2028, U+2029 or U+0085 raw, which ``str.splitlines`` would split on.

Several processes (``dspark_jax.multihost``) share a job: each answers its ``multihost.share`` of
the requests as a job of its own (``BatchJob.part``, resumable the same way), and process 0 then
writes the output from the parts (``BatchJob.merge``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from dspark_jax import multihost
from dspark_jax.config import SamplingConfig, write_json
from dspark_jax.eval.metrics import mean_batch_rows, tau_of
from dspark_jax.sampling import seed_fits

FORMAT = "dspark-jax-batch-job"
VERSION = 1
PROMPT_KEYS = ("prompt", "messages", "turns")
OPTIONAL_KEYS = ("id", "temperature", "top_k", "top_p", "seed", "max_new_tokens", "metadata")
# A request's own sampling, and its type: JSON numbers only, so that neither true nor "0.5"
# passes for one (nor 20.0 for a top-k).
SAMPLING_KEYS = {"temperature": float, "top_k": int, "top_p": float}


@dataclasses.dataclass(frozen=True)
class Request:
    index: int  # position among the file's requests (0-based)
    id: str | int | None
    ids: list[int]  # prompt token ids
    sampling: SamplingConfig
    seed: int
    metadata: object = None
    max_new_tokens: int | None = None  # None: the job's

    def limit(self, job_max_new_tokens: int) -> int:
        """This request's max_new_tokens: its own, or the job's."""
        return job_max_new_tokens if self.max_new_tokens is None else self.max_new_tokens


def _prompt_ids(record: dict, where: str, tokenizer, chat: bool) -> list[int]:
    given = [key for key in PROMPT_KEYS if key in record]
    if len(given) != 1:
        raise ValueError(f"{where}: give exactly one of {', '.join(map(repr, PROMPT_KEYS))}"
                         + (f" (got {', '.join(map(repr, given))})" if given else ""))
    value = record[given[0]]
    if given[0] == "prompt":
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        if not chat:
            return tokenizer.encode(value)
        messages = [{"role": "user", "content": value}]
    elif given[0] == "turns":
        if not isinstance(value, list) or not value or not isinstance(value[0], str) or not value[0]:
            raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
        messages = [{"role": "user", "content": value[0]}]
    else:
        if (not isinstance(value, list) or not value
                or not all(isinstance(m, dict) and set(m) == {"role", "content"}
                           and isinstance(m["role"], str) and isinstance(m["content"], str) for m in value)):
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{\"role\": str, \"content\": str}}")
        messages = value
    try:
        return tokenizer.apply_chat_template(messages)
    except ValueError as error:  # the template refused this conversation (roles that do not alternate, say)
        raise ValueError(f"{where}: {error}") from None


def _lines(data: bytes) -> list[bytes]:
    """A JSONL file's lines, without their LF (or CRLF); what follows the last LF is a line unless
    it is empty."""
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return [line.removesuffix(b"\r") for line in lines]


def _not_a_json_number(name: str):
    """Python's json reads NaN and ±Infinity, which strict JSON (and the output's readers) do not."""
    raise ValueError(f"{name} is not a JSON number")


def jsonl_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` for each line of a JSONL file (``_lines``: only LF or CRLF ends
    one); a line that is not UTF-8 is a ``ValueError`` naming it."""
    for number, raw in enumerate(_lines(path.read_bytes()), 1):
        try:
            yield number, raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}:{number}: not UTF-8 ({error})") from None


def jsonl_objects(path, what: str) -> Iterator[tuple[int, str, dict]]:
    """``(line number, "path:line", object)`` for each non-blank line of a JSONL file of ``what`` (e.g. "request");
    a missing file, or a line that is not a JSON object, is an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} file {path} does not exist")
    for number, line in jsonl_lines(path):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line, parse_constant=_not_a_json_number)
        except ValueError as error:  # a JSONDecodeError, or an integer of more digits than Python reads
            raise ValueError(f"{where}: not JSON ({error})") from None
        except RecursionError:
            raise ValueError(f"{where}: not JSON (nested too deeply)") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        yield number, where, record


def _sampling(record: dict, where: str, sampling: SamplingConfig) -> SamplingConfig:
    """``sampling`` with the fields ``record`` gives of its own."""
    own = {}
    for key, kind in SAMPLING_KEYS.items():
        if key not in record:
            continue
        value = record[key]
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
            raise ValueError(f"{where}: {key!r} must be {'a number' if kind is float else 'an integer'}, "
                             f"got {json.dumps(value, ensure_ascii=False)}")
        try:
            own[key] = kind(value)
        except OverflowError:  # an integer past float's range
            raise ValueError(f"{where}: {key!r} is out of range, got {value}") from None
    try:
        return dataclasses.replace(sampling, **own)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def read_requests(path, tokenizer, *, chat: bool = False, sampling: SamplingConfig | None = None,
                  seed: int = 0) -> list[Request]:
    """Parse and tokenize every request of a JSONL file; any bad line is a ``ValueError`` naming it.
    ``sampling`` (default greedy) and ``seed + index`` serve the requests that do not give their own."""
    sampling = SamplingConfig() if sampling is None else sampling
    requests, seen = [], {}
    for number, where, record in jsonl_objects(path, "request"):
        unknown = sorted(set(record) - set(PROMPT_KEYS) - set(OPTIONAL_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; a request has one of {list(PROMPT_KEYS)} and "
                             f"optionally {list(OPTIONAL_KEYS)} (put your own fields under 'metadata')")
        request_id = record.get("id")
        if request_id is not None:
            if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
                raise ValueError(f"{where}: 'id' must be a string or an integer")
            if request_id in seen:
                raise ValueError(f"{where}: id {request_id!r} was already used on line {seen[request_id]}")
            seen[request_id] = number
        own = _sampling(record, where, sampling)
        request_seed = record.get("seed", seed + len(requests))
        if isinstance(request_seed, bool) or not isinstance(request_seed, int):
            raise ValueError(f"{where}: 'seed' must be an integer")
        if not seed_fits(request_seed):
            given = "'seed'" if "seed" in record else f"the job's seed {seed} + {len(requests)} (this request's index)"
            raise ValueError(f"{where}: {given} must fit in a signed 64-bit integer")
        limit = record.get("max_new_tokens")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"{where}: 'max_new_tokens' must be an integer >= 1, got {json.dumps(limit)}")
        ids = _prompt_ids(record, where, tokenizer, chat)
        if not ids:
            raise ValueError(f"{where}: the prompt has no tokens")
        requests.append(Request(len(requests), request_id, ids, own, request_seed, record.get("metadata"), limit))
    if not requests:
        raise ValueError(f"{path} holds no requests")
    return requests


def _file_sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _completed(output: Path, indices: Sequence[int]) -> list[bytes]:
    """The lines ``output`` holds (without their LF): those of the first of ``indices`` (the job's
    requests), in order (a half-written last line, from a killed write, is cut off)."""
    if not output.exists():
        return []
    data = output.read_bytes()
    whole = data.rfind(b"\n") + 1
    if whole < len(data):
        with open(output, "r+b") as f:
            f.truncate(whole)
    lines = _lines(data[:whole])
    for number, line in enumerate(lines, 1):
        try:
            index = json.loads(line.decode("utf-8"))["index"]
        except (ValueError, KeyError, TypeError):  # not UTF-8, not JSON, or not a completion
            raise ValueError(f"{output}:{number} is not a completion this job wrote; "
                             "write to another output or delete it") from None
        if number > len(indices) or index != indices[number - 1]:
            expected = indices[number - 1] if number <= len(indices) else "nothing"
            raise ValueError(f"{output}:{number}: index {index!r} where this job writes {expected}; "
                             "write to another output or delete it")
    return lines


class BatchJob:
    """One job: ``input`` (a request file) answered into ``output`` with ``settings``.

    ``settings`` (JSON values: batch size, max new tokens, drafter, policy, sampling, ...) are
    everything besides the input that decides the outputs. Opening a job whose output already
    exists checks, before anything is loaded, that it was started with the same input and settings;
    a job that never wrote its manifest (``<output>.job.json``) is refused as somebody else's file.
    """

    def __init__(self, input_path, output, settings: dict):
        self.input_path, self.output = Path(input_path), Path(output)
        self.manifest_path = self.output.with_name(self.output.name + ".job.json")
        self.lock_path = self.output.with_name(self.output.name + ".lock")
        self._holding = False
        self.batch_size = settings["batch_size"]
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {self.batch_size!r}")
        self.continuous = settings.get("continuous", True)
        self.batch_buckets = settings.get("batch_buckets", False)
        for name, value in (("continuous", self.continuous), ("batch_buckets", self.batch_buckets)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
        if not self.input_path.is_file():
            raise FileNotFoundError(f"request file {self.input_path} does not exist")
        self.manifest = {"format": FORMAT, "version": VERSION, "input": str(self.input_path),
                         "input_sha256": _file_sha256(self.input_path), "settings": settings}
        self.started = None  # the manifest of the run that started this job, when resuming
        if self.manifest_path.exists():
            try:
                self.started = json.loads(self.manifest_path.read_text())
            except json.JSONDecodeError:
                self.started = None
            if not isinstance(self.started, dict) or self.started.get("format") != FORMAT \
                    or not isinstance(self.started.get("settings"), dict):
                raise ValueError(f"{self.manifest_path} is not a {FORMAT} manifest; "
                                 "write to another output or delete it and the output")
            was = self.started["settings"]
            differ = [f"{key}: was {was.get(key)!r}, now {settings.get(key)!r}"
                      for key in sorted(set(was) | set(settings)) if was.get(key) != settings.get(key)]
            if self.started.get("input_sha256") != self.manifest["input_sha256"]:
                differ.insert(0, f"the input file's contents ({self.started.get('input')} then)")
            if differ:
                raise ValueError(f"{self.output} belongs to a job with other settings ({'; '.join(differ)}): "
                                 "rerun it as it was to resume it, or write to another output")
        elif self.output.exists() and self.output.stat().st_size > 0:
            raise ValueError(f"{self.output} exists and no batch job wrote it (there is no "
                             f"{self.manifest_path.name}); write to another output or delete it")

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Hold the output for this process, or refuse: two runs appending to one output would
        interleave their lines. ``flock`` goes with the process, so a killed run leaves no lock.
        ``run`` and ``merge`` hold it themselves; a caller holds it around them too (``dspark batch``
        does, from before it loads the model) to refuse a second copy before it spends any time."""
        if self._holding:  # held around this call already
            yield
            return
        self.output.parent.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.seek(0)
                holder = lock.read().strip()  # empty while the holder has not yet written its pid
                raise ValueError(f"{self.output} is being written by another running job"
                                 + (f" (pid {holder})" if holder else "")
                                 + "; wait for it to finish, or stop it and run this one again to resume it") from None
            lock.truncate(0)
            lock.write(f"{os.getpid()}\n")
            lock.flush()
            self._holding = True
            try:
                yield
            finally:
                self._holding = False

    def _start(self, manifest: dict) -> None:
        write_json(self.manifest_path, manifest, indent=2)
        self.started = manifest

    def part(self, process: int, processes: int) -> BatchJob:
        """The job of process ``process`` of ``processes`` that share this one (``multihost.share``):
        its own output and manifest in ``<output>.parts/``, resumable like any job's."""
        parts = self.output.with_name(self.output.name + ".parts")
        return BatchJob(self.input_path, parts / f"process-{process:05d}-of-{processes:05d}.jsonl",
                        self.manifest["settings"])

    def merge(self, requests: Sequence[Request], processes: int) -> None:
        """Write the output, in input order, from the finished parts of ``processes`` processes
        (``part``), with the manifest of a finished job: a rerun, by any number of processes,
        then finds nothing left to do."""
        with self.hold():
            lines = [b""] * len(requests)
            for process in range(processes):
                part, ours = self.part(process, processes).output, multihost.share(requests, process, processes)
                written = _completed(part, [r.index for r in ours])
                if len(written) != len(ours):
                    raise ValueError(f"{part} holds fewer than its {len(ours)} completions: "
                                     f"run the job again with {processes} processes to finish it")
                for request, line in zip(ours, written):
                    lines[request.index] = line + b"\n"
            self._start({**self.manifest, "requests": len(requests), "processes": processes})
            partial = self.output.with_name(self.output.name + ".tmp")
            with open(partial, "wb") as out:
                out.write(b"".join(lines))
                out.flush()
                os.fsync(out.fileno())
            os.replace(partial, self.output)

    @property
    def scheduler_costs(self) -> dict | None:
        """The cost table the job started with (``{batch: {width: seconds}}``), to schedule a resumed
        run as it started: a table timed anew would choose other verify lengths."""
        return None if self.started is None else self.started.get("scheduler_costs")

    def run(self, requests: Sequence[Request], *, runner, decode: Callable[[list[int]], str], max_new_tokens: int,
            stop_ids: Sequence[int], scheduler_costs: dict | None = None, progress: bool = True) -> dict:
        """Generate every request not yet in the output with ``runner`` (an ``AutoregressiveGenerator``
        or ``SpeculativeDecoder``); returns a summary of this run. Every request must fit the target
        with its new tokens (its own ``max_new_tokens``, or the job's): that is checked for all of
        them before anything runs. ``scheduler_costs`` (the scheduler policy's table, if any) goes
        into the manifest.
        """
        from tqdm import tqdm

        runner.rows.check_batch(self.batch_size)
        limits = [r.limit(max_new_tokens) for r in requests]
        cache_lens = []
        for request, limit in zip(requests, limits):
            try:
                cache_lens.append(runner.cache_len_for([len(request.ids)], limit))
            except ValueError as error:
                name = f" (id {request.id!r})" if request.id is not None else ""
                raise ValueError(f"request {request.index}{name}: {error}") from None
        # One cache length for the whole job, resumed or not (it is part of every compiled shape).
        max_len = max(cache_lens)
        with self.hold():
            if self.started is None and self.manifest_path.exists():
                raise ValueError(f"{self.output} was started by another job since this one was opened; "
                                 "run this one again to resume it")
            if self.started is None:
                self._start({**self.manifest, "requests": len(requests), "scheduler_costs": scheduler_costs})
                self.output.write_bytes(b"")
            resumed = len(_completed(self.output, [r.index for r in requests]))
            # Fixed batches: a batch cut short by the kill runs again whole, so that its requests
            # share a batch as they did (its lines already written are not written again).
            first = resumed if self.continuous else resumed - resumed % self.batch_size
            todo = list(requests[first:]) if resumed < len(requests) else []
            finished: dict[int, str] = {}  # position in ``todo`` -> its line, until the lines before it are written
            next_line = resumed - first
            generated = 0
            start = time.perf_counter()
            bar = tqdm(total=len(requests), initial=resumed, unit="request", disable=not progress, desc="dspark batch")
            with open(self.output, "a", encoding="utf-8") as out:

                def on_finish(position: int, tokens: list[int], reason: str) -> None:
                    nonlocal generated, next_line
                    request = todo[position]
                    if first + position < resumed:
                        return
                    record = {"index": request.index, **({"id": request.id} if request.id is not None else {}),
                              "completion": decode(tokens), "finish_reason": reason,
                              "prompt_tokens": len(request.ids), "completion_tokens": len(tokens)}
                    if request.metadata is not None:
                        record["metadata"] = request.metadata
                    finished[position] = json.dumps(record, ensure_ascii=False) + "\n"
                    generated += len(tokens)
                    ready = []
                    while next_line in finished:
                        ready.append(finished.pop(next_line))
                        next_line += 1
                    if ready:
                        out.write("".join(ready))
                        out.flush()
                        os.fsync(out.fileno())
                        bar.update(len(ready))
                        bar.set_postfix_str(f"{generated / (time.perf_counter() - start):.1f} tok/s")

                result = None if not todo else runner.generate(
                    [r.ids for r in todo], max_new_tokens=limits[first:], sampling=[r.sampling for r in todo],
                    seeds=[r.seed for r in todo], stop_ids=stop_ids, max_len=max_len, batch_size=self.batch_size,
                    continuous=self.continuous, batch_buckets=self.batch_buckets, on_finish=on_finish,
                )
        bar.close()
        elapsed = time.perf_counter() - start
        committed = getattr(result, "committed_per_round", None)  # speculative: τ over every request-round
        return {"requests": len(requests), "resumed": resumed, "completion_tokens": generated, "seconds": elapsed,
                "tokens_per_s": generated / elapsed if elapsed > 0 else float("nan"),
                "tau": None if not committed else tau_of(committed), "mean_batch_rows": mean_batch_rows(result)}
