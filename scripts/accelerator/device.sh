#!/usr/bin/env bash
# The accelerator run's steps on the device machine, in the repository root of the copy the
# device tool made (docs/ACCELERATOR.md):
#
#   device.sh stash        keep the target's first part (carried in this call) for the next call,
#                          and print the stack's versions and devices
#   device.sh train TOTAL  join the target's parts, smoke-test the training pipeline on the
#                          device (stopping there if it fails, so the lease is not spent on a
#                          broken run), then train the three accelerator configs with equal
#                          steps in what is left of TOTAL seconds, and pack the drafters and
#                          logs into $OUT; TOTAL is this command's own limit, so give the call's
#                          timeout_s a little more ($ACCEL_CONFIGS replaces the config list, for a
#                          rehearsal on a CPU)
set -uo pipefail
STAGE=/root/dspark-stage
: "${OUT:?the device tool sets OUT}"

install_wheels() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .device/wheels/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD"
}

case "${1:-}" in
stash)
    mkdir -p "$STAGE" && cp .device/target/part-00 .device/target/SHA256 "$STAGE"/ || exit 1
    install_wheels
    python3 - <<'PYEOF'
import importlib.metadata as md, jax
print({p: md.version(p) for p in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "gguf", "numpy")})
print(jax.default_backend(), jax.devices())
PYEOF
    ;;
train)
    total="${2:?usage: device.sh train TOTAL_SECONDS}"
    cat "$STAGE/part-00" .device/target/part-01 > "$STAGE/smollm2.gguf" || exit 1
    (cd "$STAGE" && sha256sum -c SHA256) || exit 1
    install_wheels
    # The configs check their prompts against ../shared/benchmarks, beside the repository.
    mkdir -p ../shared && cp -r .device/benchmarks ../shared/ || exit 1
    export DSPARK_SMOLLM2_GGUF="$STAGE/smollm2.gguf" TQDM_MININTERVAL=15 PYTHONUNBUFFERED=1
    mkdir -p runs
    # The three drafter kinds through a cache of token ids and a budget, on the tiny config
    # (under a minute on this project's CPU).
    timeout 180 python3 -m pytest -q -x -p no:cacheprovider tests/test_train.py \
        -k budgeted_training_gives > runs/smoke.log 2>&1
    smoke=$?
    tail -c 3000 runs/smoke.log
    if [ "$smoke" != 0 ]; then
        echo "smoke test failed ($smoke): not training"; cp runs/smoke.log "$OUT/"; exit 1
    fi
    # What is left, less a minute for the hard stop's slack and the packing.
    budget=$((total - SECONDS - 60))
    if [ "$budget" -lt 120 ]; then
        echo "only ${budget} s left for training: not training"; exit 1
    fi
    echo "training budget ${budget} s"
    # A hard stop 30 s past the budget, so that whatever was exported is still packed.
    configs=${ACCEL_CONFIGS:-configs/smollm2_135m_accel_dspark.py configs/smollm2_135m_accel_dflash.py configs/smollm2_135m_accel_eagle3.py}
    timeout $((budget + 30)) python3 -m dspark_jax.cli train $(printf -- '--config %s ' $configs) \
        --budget-s "$budget" > runs/accelerator_train.log 2>&1
    echo "train exit code $?"
    tail -c 4000 runs/accelerator_train.log
    # At most 8 files of 16 MiB come back: the drafters, logs and plan, packed and cut into 15 MiB parts.
    tar czf - runs/smoke.log runs/accelerator_train.log runs/smollm2_135m_accel_*/{drafter,log.jsonl,budget.json} \
        runs/smollm2_135m_accel_cache/manifest.json 2>/dev/null | split -b 15M -d - "$OUT/result.tgz.part-"
    ls -la "$OUT"
    ;;
*)
    sed -n '2,14p' "$0"; exit 2
    ;;
esac
