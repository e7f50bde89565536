#!/usr/bin/env bash
# The one GPU verification run. From the repository root, on the GPU machine:
#
#     OUT=/some/dir bash benchmarks/gpu_check.sh
#
# Every step runs under `timeout` (nothing can hang) and the whole script stays under about
# 6 minutes (TOTAL_BUDGET seconds, default 360; the last step gets whatever time is left). Files in $OUT:
#   env.txt        machine, versions, which deepspeed is imported, step exit codes + timings
#   gpu_tests.txt  python -m pytest tests/gpu (the CUDA-path tests, each vs plain PyTorch)
#   zero3_host_cost.json  benchmarks/zero3_host_cost.py: plain / ZeRO-2 / ZeRO-3 / FSDP2 step time,
#                  copies, kernel launches and CPU per step (SKIP_HOST_COST=1 skips it)
#   gpu_step.json  benchmarks/gpu_step.py: step time / peak memory, plain vs ZeRO 0-3 (bf16)
#   gpu_step.log   its stdout/stderr
#   nvme_step.json benchmarks/nvme_step.py (ZeRO-2 optimizer on NVMe vs CPU memory, overlap on/off; CPU side)
#   smoke.txt      single-process CPU-era test files re-run with DS_ACCELERATOR=cuda (informative:
#                  failures there may be tests that build CPU tensors, not bugs - read them;
#                  SKIP_SMOKE=1 / SKIP_NVME=1 skip this and the NVMe step)
set -u
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
TOTAL_BUDGET="${TOTAL_BUDGET:-360}"
T0=$(date +%s)
ENV_TXT="$OUT/env.txt"
: > "$ENV_TXT"

elapsed() { echo $(( $(date +%s) - T0 )); }
note() { echo "[gpu_check +$(elapsed)s] $*" | tee -a "$ENV_TXT"; }
left() { echo $(( TOTAL_BUDGET - $(elapsed) )); }

# ---------------------------------------------------------------- dependencies (no internet)
note "installing wheels from .whl into /tmp/site"
timeout -k 5 90 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >> "$ENV_TXT" 2>&1
note "pip install exit code: $?"
export PYTHONPATH="/tmp/site:$PWD"
export PYTHONUNBUFFERED=1
export DEEPSPEED_LOG_LEVEL="${DEEPSPEED_LOG_LEVEL:-WARNING}"

# ---------------------------------------------------------------- environment
{
    echo "===== nvidia-smi"
    timeout -k 5 30 nvidia-smi 2>&1
    echo "===== python / torch"
    command -v python3
    timeout -k 5 60 python3 - <<'EOF' 2>&1
import sys, platform
print("python", sys.version.replace("\n", " "), platform.platform())
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0),
          "memory_GiB", round(p.total_memory / 2**30, 1), "bf16", torch.cuda.is_bf16_supported())
    try:
        print("nccl", torch.cuda.nccl.version())
    except Exception as e:
        print("nccl version unknown:", e)
for mod in ("pydantic", "hjson", "numpy", "psutil", "transformers", "pytest", "xdist", "pytest_timeout"):
    try:
        m = __import__(mod)
        print(mod, getattr(m, "__version__", "?"), getattr(m, "__file__", ""))
    except Exception as e:
        print(mod, "NOT importable:", e)
EOF
    echo "===== deepspeed import"
    timeout -k 5 60 python3 -c 'import deepspeed, sys; print(deepspeed.__file__, deepspeed.__version__); from deepspeed.accelerator import get_accelerator as g; a = g(); print("accelerator", a.device_name(), a.communication_backend_name(), a.device_count())' 2>&1
    echo "===== nproc $(nproc)   free -g:"; free -g 2>&1 | head -3
} >> "$ENV_TXT" 2>&1
note "environment recorded"

DS_FILE=$(timeout -k 5 60 python3 -c 'import deepspeed; print(deepspeed.__file__)' 2>/dev/null)
case "$DS_FILE" in
    "$PWD"/deepspeed/*) note "deepspeed imported from this checkout: $DS_FILE" ;;
    *) note "WARNING: deepspeed imported from '$DS_FILE', not from $PWD" ;;
esac

XDIST=""
if timeout -k 5 30 python3 -c 'import xdist' 2>/dev/null; then XDIST="-n 4"; fi
HAVE_PT_TIMEOUT=0
if timeout -k 5 30 python3 -c 'import pytest_timeout' 2>/dev/null; then HAVE_PT_TIMEOUT=1; fi
pt_timeout() { [ "$HAVE_PT_TIMEOUT" = 1 ] && echo "--timeout $1"; }

# ---------------------------------------------------------------- 1. CUDA-path tests
note "tests/gpu: start (pytest $XDIST)"
# shellcheck disable=SC2046
timeout -k 10 180 python3 -m pytest tests/gpu -v -rA -p no:cacheprovider $XDIST $(pt_timeout 150) \
    --tb=short > "$OUT/gpu_tests.txt" 2>&1
RC_TESTS=$?
note "tests/gpu: exit code $RC_TESTS (124 = timed out); last line: $(tail -n 1 "$OUT/gpu_tests.txt")"

# ---------------------------------------------------------------- 1b. ZeRO-3 host cost vs plain / ZeRO-2 / FSDP2
if [ "${SKIP_HOST_COST:-0}" != 1 ] && [ "$(left)" -ge 150 ]; then
    note "benchmarks/zero3_host_cost.py: start (timeout 170s)"
    timeout -k 10 170 python3 benchmarks/zero3_host_cost.py --device cuda --timeout 60 \
        --out "$OUT/zero3_host_cost.json" ${HOST_COST_ARGS:-} > "$OUT/zero3_host_cost.log" 2>&1
    note "zero3_host_cost: exit code $?; ratios: $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d.get("ratios"))' "$OUT/zero3_host_cost.json" 2>&1 | tail -n 1)"
fi

# ---------------------------------------------------------------- 2. benchmark
BUDGET_BENCH=$(( $(left) - 60 ))
[ "$BUDGET_BENCH" -gt 110 ] && BUDGET_BENCH=110
if [ "$BUDGET_BENCH" -ge 40 ]; then
    note "benchmarks/gpu_step.py: start (timeout ${BUDGET_BENCH}s)"
    # shellcheck disable=SC2086  # GPU_STEP_ARGS (e.g. "--size tiny" for a dry run) splits on purpose
    timeout -k 10 "$BUDGET_BENCH" python3 benchmarks/gpu_step.py --budget $(( BUDGET_BENCH - 25 )) \
        --out "$OUT/gpu_step.json" ${GPU_STEP_ARGS:-} > "$OUT/gpu_step.log" 2>&1
    RC_BENCH=$?
    note "gpu_step: exit code $RC_BENCH; ratios: $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d.get("ratio_vs_plain"), "errors:", list(d.get("errors", {})))' "$OUT/gpu_step.json" 2>&1 | tail -n 1)"
else
    RC_BENCH=skipped
    note "gpu_step: skipped, only $(left)s left"
fi

# ---------------------------------------------------------------- 2b. NVMe optimizer step on this machine's disk (16 cores)
if [ "${SKIP_NVME:-0}" != 1 ] && [ "$(left)" -ge 120 ]; then
    note "benchmarks/nvme_step.py: start (timeout 60s)"
    DS_ACCELERATOR=cpu timeout -k 5 60 python3 benchmarks/nvme_step.py --nvme_path /tmp/nvme_step \
        > "$OUT/nvme_step.json" 2>> "$ENV_TXT"
    note "nvme_step: exit code $?; $(df -h /tmp | tail -n 1)"
fi

# ---------------------------------------------------------------- 3. broader smoke (informative)
SMOKE=(
    tests/accelerator tests/surface/test_accelerators.py
    tests/ops/test_adam.py tests/ops/test_lamb.py tests/ops/test_lion.py tests/ops/test_adagrad.py
    tests/ops/test_state_round_trip.py tests/ops/aio/test_aio_handle.py
    tests/ops/sparse_attention/test_sparse_self_attention.py tests/ops/sparse_attention/test_bert_and_utils.py
    tests/ops/transformer
    tests/runtime/activation_checkpointing/test_checkpoint.py tests/runtime/activation_checkpointing/test_rng.py
    tests/runtime/precision/test_loss_scaler.py tests/runtime/precision/test_mixed_precision.py
    tests/runtime/test_engine.py tests/runtime/test_engine_queries.py tests/runtime/test_optimizers.py
    tests/runtime/zero/test_zero12_errors.py tests/moe/test_gating.py
    tests/runtime/pipe/test_pipe_units.py tests/runtime/swap_tensor/test_async_swapper.py
    tests/runtime/swap_tensor/test_optimizer_swapper.py tests/profiling/test_flops_profiler.py
    tests/behaviours/test_deepspeed_behaviours.py tests/surface/test_runtime_utils.py
    tests/surface/test_z3_leaf_api.py tests/runtime/activation_checkpointing/test_config.py
)
BUDGET_SMOKE=$(( $(left) - 10 ))
[ "$BUDGET_SMOKE" -gt 150 ] && BUDGET_SMOKE=150
if [ "${SKIP_SMOKE:-0}" != 1 ] && [ "$BUDGET_SMOKE" -ge 30 ]; then
    SMOKE_XDIST=""
    [ -n "$XDIST" ] && SMOKE_XDIST="-n 8"
    note "smoke (DS_ACCELERATOR=cuda): start (timeout ${BUDGET_SMOKE}s)"
    DS_ACCELERATOR=cuda timeout -k 10 "$BUDGET_SMOKE" python3 -m pytest "${SMOKE[@]}" -v -p no:cacheprovider \
        $SMOKE_XDIST $(pt_timeout $(( BUDGET_SMOKE - 20 ))) -rfE --tb=short > "$OUT/smoke.full.txt" 2>&1
    RC_SMOKE=$?
    # keep the file a reasonable size: its head (collection problems) and its tail (the summary)
    if [ "$(wc -c < "$OUT/smoke.full.txt")" -gt 1500000 ]; then
        { head -c 300000 "$OUT/smoke.full.txt"; echo; echo "[... cut ...]"; tail -c 1100000 "$OUT/smoke.full.txt"; } \
            > "$OUT/smoke.txt"
    else
        cp "$OUT/smoke.full.txt" "$OUT/smoke.txt"
    fi
    rm -f "$OUT/smoke.full.txt"
    note "smoke: exit code $RC_SMOKE (124 = timed out); last line: $(tail -n 1 "$OUT/smoke.txt")"
else
    RC_SMOKE=skipped
    note "smoke: skipped, only $(left)s left"
fi

note "done in $(elapsed)s: tests/gpu=$RC_TESTS gpu_step=$RC_BENCH smoke=$RC_SMOKE"
ls -la "$OUT" >> "$ENV_TXT" 2>&1
exit 0
