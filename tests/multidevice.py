"""Multi-device tests: a fresh process that sees 8 simulated CPU devices (the device count is
fixed when JAX starts, so it cannot change inside the pytest worker)."""

import json
import os
import re
import subprocess
import sys
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
