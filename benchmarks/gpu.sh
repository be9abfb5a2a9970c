#!/usr/bin/env bash
# tapdraft's GPU checks and figures in one run (under 8 minutes on one GPU): CUDA capture parity with
# the CPU, bf16 capture overhead at the Qwen shape, Flex vs dense DFlash training step, fused CE at
# V=151,936, the host's shard writer with 1/2/4 lanes. Details and options: benchmarks/gpu.py.
# Writes benchmarks/results/gpu.json (or --name).
# Without a GPU the GPU parts are recorded as skipped (add --tiny for a seconds-long run).
#
#   bash benchmarks/gpu.sh                      # the full run
#   bash benchmarks/gpu.sh --tiny               # seconds, shapes shrunk (figures meaningless)
#
# Exits non-zero when a part failed (its error is in the JSON) or the run passed its time limit.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
exec timeout --signal=INT 470 python -m benchmarks.gpu "$@"
