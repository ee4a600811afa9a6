#!/usr/bin/env bash
# The accelerator run's steps on this machine (docs/ACCELERATOR.md has the whole recipe):
#
#   local.sh stage     put what the run needs beside the working tree into .device/ (git-ignored,
#                      carried by the device tool): the embedded target's GGUF in two parts (a
#                      call carries 64 MiB, the file is 94 MiB), pyproject's pinned pure-Python
#                      packages as Python 3.12 wheels, the benchmark prompt sets
#   local.sh slim      switch to a branch without the shipped drafters' weights (65 MB of the
#                      71 MB tracked), so that the tree fits a call; the run does not need them
#   local.sh restore   back to the branch slim started from, the weights with it
#   local.sh unpack D  join the result parts a call brought back (in D) into runs/
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
SLIM_BRANCH=accelerator-slim-tree
WEIGHTS='dspark_jax/drafters/*/model.safetensors'

case "${1:-}" in
stage)
    rm -rf .device && mkdir -p .device/target .device/wheels
    gguf=$("$PY" -c 'from dspark_jax.checkpoints.gguf import embedded_gguf_path; print(embedded_gguf_path())')
    split -b 48M -d "$gguf" .device/target/part-
    echo "$(sha256sum "$gguf" | cut -d' ' -f1)  smollm2.gguf" > .device/target/SHA256
    # The versions pyproject.toml pins, for the device's Python 3.12; their own dependencies
    # are in the device's image (docs/ACCELERATOR.md).
    pins=$("$PY" - <<'PYEOF'
import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
wanted = {"flax", "optax", "orbax-checkpoint", "chex", "einops", "gguf"}
print(" ".join(d for d in deps if d.split("==")[0] in wanted and "==" in d))
PYEOF
)
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d .device/wheels $pins
    cp -r ../shared/benchmarks .device/benchmarks
    du -sh .device/target/part-* .device/wheels .device/benchmarks
    ;;
slim)
    if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
        echo "local.sh slim: commit or stash your changes first" >&2; exit 1
    fi
    mkdir -p .device && git rev-parse --abbrev-ref HEAD > .device/slim-from
    git switch -q -c "$SLIM_BRANCH"
    git rm -q $WEIGHTS
    git commit -q -m "accelerator run: the tree without the shipped drafters' weights"
    echo "on $SLIM_BRANCH: $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes tracked"
    ;;
restore)
    from=$(cat .device/slim-from)
    git switch -q "$from"
    git branch -q -D "$SLIM_BRANCH"
    ls -la $WEIGHTS
    ;;
unpack)
    parts="${2:?usage: local.sh unpack DIR_WITH_result.tgz.part-*}"
    cat "$parts"/result.tgz.part-* | tar xzf - -C .
    ls -d runs/smollm2_135m_accel_*/drafter
    ;;
*)
    sed -n '2,14p' "$0"; exit 2
    ;;
esac
