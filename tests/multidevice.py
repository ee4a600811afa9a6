"""Multi-device tests: a fresh process that sees 8 simulated CPU devices (the device count is
fixed when JAX starts, so it cannot change inside the pytest worker), or several processes joined
as one multi-host run."""

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COLLECTIVE = re.compile(r" (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")


def run_on_eight_devices(script: str, *args: str) -> dict:
    """Run ``script`` (Python source; ``sys.argv[1:]`` are ``args``) from the repository root on 8
    devices; returns the JSON object its last line of output prints."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_processes(args: list[str], *, processes: int = 2, devices_each: int = 2,
                  timeout: float = 600) -> list[tuple[str, str]]:
    """``python *args --coordinator HOST:PORT --num-processes N --process-id I`` (``-m
    dspark_jax.cli ...``, or ``-c SCRIPT`` that passes those to ``multihost.initialize``) in
    ``processes`` fresh processes on this machine, each with ``devices_each`` simulated CPU
    devices, joined as one multi-process JAX run through a coordinator on a free local port;
    returns each one's (stdout, stderr) once all have exited 0. A process that fails leaves the others
    waiting at a barrier: they are killed, and the failure's stderr is what the assertion shows."""
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_each}", JAX_PLATFORMS="cpu")
    # Files, not pipes: nobody reads a pipe while the processes run, and a full one would block them.
    logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(processes)]
    runs = [subprocess.Popen([sys.executable, *args, "--coordinator", f"localhost:{port}",
                              "--num-processes", str(processes), "--process-id", str(i)],
                             env=env, cwd=REPO, stdout=out, stderr=err, text=True)
            for i, (out, err) in enumerate(logs)]
    deadline = time.monotonic() + timeout
    while any(r.poll() is None for r in runs) and not any(r.returncode for r in runs) and time.monotonic() < deadline:
        time.sleep(0.5)
    for r in runs:
        if r.poll() is None:
            r.kill()
        r.wait()
    outputs = []
    for out, err in logs:
        out.seek(0), err.seek(0)
        outputs.append((out.read(), err.read()))
        out.close(), err.close()
    failed = [(i, r.returncode, err[-3000:]) for i, (r, (_, err)) in enumerate(zip(runs, outputs)) if r.returncode]
    assert not failed, failed
    return outputs


def collectives(lowered) -> list[str]:
    """The cross-device collectives in a lowered program once compiled: one line of HLO each."""
    return [line.strip() for line in lowered.compile().as_text().splitlines() if COLLECTIVE.search(line)]


def value_errors(*attempts) -> list[str | None]:
    """Each call's ``ValueError`` message, or None where it raised none."""
    messages = []
    for attempt in attempts:
        try:
            attempt()
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return messages
