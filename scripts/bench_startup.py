#!/usr/bin/env python
"""How long a ``dspark generate`` command takes from start to exit, with and without the user cache.

Each round runs the same command three times, each in a fresh process:

* ``off``: ``DSPARK_CACHE_DIR=off``, so the GGUF target is parsed and dequantized and every
  program compiles (what every run paid before the cache);
* ``cold``: an empty cache directory, so the run also writes the target's float32 copy and the
  compiled programs;
* ``warm``: the same directory again, as a user's second run finds it.

The JSON holds each run's wall seconds and the compile seconds the command reports, the medians per
way, ``warm / off`` and ``cold / off``, the cache's size on disk, and whether every run printed the
same text (greedy decoding: it must).

    .venv/bin/python scripts/bench_startup.py             # 2 rounds, with the DSpark drafter: ~5 min
    .venv/bin/python scripts/bench_startup.py --rounds 1 --target-only
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dspark_jax.cli import positive_int
from dspark_jax.config import write_json
from dspark_jax.eval.bench import json_output

REPO = Path(__file__).resolve().parents[1]
WAYS = ("off", "cold", "warm")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=positive_int, default=2)
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32)
    parser.add_argument("--target-only", action="store_true", help="no drafter (default: smollm2_135m_dspark)")
    parser.add_argument("--out", type=json_output, default=str(REPO / "docs" / "bench_startup.json"))
    return parser.parse_args(argv)


def run_once(command: list[str], cache: str) -> dict:
    # The caller's own JAX cache settings would hide what the user cache does.
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env["DSPARK_CACHE_DIR"] = cache
    start = time.perf_counter()
    run = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{run.stderr}")
    compile_s = re.search(r"compile ([\d.]+) s\]", run.stderr)
    return {"wall_s": round(wall, 2), "compile_s": float(compile_s.group(1)) if compile_s else None,
            "text": run.stdout}


def directory_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def main(argv=None) -> int:
    args = parse_args(argv)
    command = [str(REPO / ".venv" / "bin" / "dspark"), "generate", "--prompt", args.prompt, "--chat",
               "--max-new-tokens", str(args.max_new_tokens)]
    if not args.target_only:
        command += ["--drafter", "smollm2_135m_dspark"]
    runs = {way: [] for way in WAYS}
    sizes = {}
    for round_index in range(args.rounds):
        root = Path(tempfile.mkdtemp(prefix="dspark-bench-startup-"))
        try:
            for way in WAYS:
                runs[way].append(run_once(command, "off" if way == "off" else str(root)))
                print(f"round {round_index + 1} {way}: {runs[way][-1]['wall_s']} s "
                      f"(compile {runs[way][-1]['compile_s']} s)", file=sys.stderr)
            sizes = {part.name: directory_bytes(part) for part in root.iterdir()}
        finally:
            shutil.rmtree(root, ignore_errors=True)
    median = {way: statistics.median(r["wall_s"] for r in runs[way]) for way in WAYS}
    texts = {r["text"] for way in WAYS for r in runs[way]}
    from dspark_jax.eval.bench import machine_info

    report = {
        "command": command[1:],
        "rounds": args.rounds,
        "runs": {way: [{k: r[k] for k in ("wall_s", "compile_s")} for r in runs[way]] for way in WAYS},
        "median_wall_s": median,
        "warm_over_off": round(median["warm"] / median["off"], 3),
        "cold_over_off": round(median["cold"] / median["off"], 3),
        "cache_bytes": sizes,
        "same_text_every_run": len(texts) == 1,
        "machine": machine_info(),
    }
    write_json(args.out, report, indent=2)
    print(json.dumps({k: report[k] for k in ("median_wall_s", "warm_over_off", "cold_over_off", "cache_bytes",
                                              "same_text_every_run")}, indent=2))
    return 0 if len(texts) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
