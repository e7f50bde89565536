#!/usr/bin/env bash
# ZeRO-3 host cost on a lent GPU, this checkout against an older commit, on the same machine in one call
# (how docs/gpu.md runs 6 and 7 were taken). Prepare here, then carry the folder:
#
#     mkdir -p .gpu_before && git archive <old-commit> deepspeed | tar -x -C .gpu_before
#     echo /.gpu_before/ >> .git/info/exclude          # ignored, so it travels only through `carry`
#     # device run: command "OUT=$OUT bash benchmarks/gpu_zero3_compare.sh", carry [".whl", ".gpu_before"]
#
# Files in $OUT: env.txt (machine, versions, step timings), host_cost.json (plain / ZeRO-2 / ZeRO-3 / FSDP2,
# this checkout), host_cost_before.json (ZeRO-3 and plain with .gpu_before first on PYTHONPATH; each JSON
# records which deepspeed it imported), gpu_tests.txt (pytest tests/gpu), profile.json (cProfile of the
# ZeRO-3 step). Every step runs under `timeout`; about 3.5 minutes on an H200.
set -u
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-/tmp/gpu_zero3_compare}"
mkdir -p "$OUT"
T0=$(date +%s); note() { echo "[+$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/env.txt"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >> "$OUT/env.txt" 2>&1
export PYTHONPATH=/tmp/site:$PWD DEEPSPEED_LOG_LEVEL=WARNING PYTHONUNBUFFERED=1
(nvidia-smi -L; python3 -c 'import torch,sys;print(sys.version, torch.__version__, torch.version.cuda, torch.cuda.nccl.version())'
 nproc; uptime) >> "$OUT/env.txt" 2>&1
timeout -k 5 110 python3 benchmarks/zero3_host_cost.py --device cuda --timeout 60 --out "$OUT/host_cost.json" \
    > "$OUT/host_cost.log" 2>&1
note "host_cost rc=$?"
if [ -d .gpu_before/deepspeed ]; then
    PYTHONPATH=/tmp/site:$PWD/.gpu_before:$PWD timeout -k 5 60 python3 benchmarks/zero3_host_cost.py --device cuda \
        --timeout 60 --modes zero3 plain --out "$OUT/host_cost_before.json" > "$OUT/host_cost_before.log" 2>&1
    note "host_cost before rc=$?"
else
    note "no .gpu_before/deepspeed: the older code is not measured"
fi
timeout -k 5 90 python3 -m pytest tests/gpu -q -rfE -p no:cacheprovider -n 4 --tb=short > "$OUT/gpu_tests.txt" 2>&1
note "tests/gpu rc=$? $(tail -n 1 "$OUT/gpu_tests.txt")"
timeout -k 5 45 python3 benchmarks/gpu_profile_zero3.py --python-profile --steps 5 --stages 3 \
    --out "$OUT/profile.json" > "$OUT/profile.log" 2>&1
note "profile rc=$?"
