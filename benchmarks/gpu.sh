#!/usr/bin/env bash
# tapdraft's GPU checks and figures in one run (under 8 minutes on one GPU): CUDA capture parity with
# the CPU, bf16 capture overhead at the Qwen shape, Flex vs dense DFlash training step, fused CE at
# V=151,936, the host's shard writer with 1/2/4 lanes. Details and options: benchmarks/gpu.py.
# Writes benchmarks/results/gpu.json (or --name).
# Then, on a GPU, the DSpark serving step: vLLM's CUDA build (engines/venv.sh vllm_gpu, built once, minutes)
# serves a DSpark export through its V2 model runner (GPU only) and must match the target alone and
# `tapdraft speculate` round by round (tests/engines/test_vllm_dspark.py, marked gpu; --no-serve or --tiny skips it);
# then the same for a LiLiCorr export (method dflash, LiLiCorrDraftModel: tests/engines/test_vllm_lilicorr.py).
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
serve=1
args=()
for a in "$@"; do
  case "$a" in
    --no-serve) serve=0 ;;
    --tiny) serve=0; args+=("$a") ;;  # seconds-long: no vLLM build or serving
    *) args+=("$a") ;;
  esac
done
rc=0
timeout --signal=INT 470 python -m benchmarks.gpu "${args[@]}" || rc=$?
if [ "$serve" = 1 ] && python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  # DSpark served by vLLM's V2 runner: greedy identity with the target alone, acceptance equal to speculate's
  timeout --signal=INT 1800 python -m pytest -q -p no:cacheprovider -m gpu tests/engines/test_vllm_dspark.py \
    || rc=$?
  # LiLiCorr served by vLLM's V2 runner (its lattice walk): the same two checks
  timeout --signal=INT 1800 python -m pytest -q -p no:cacheprovider -m gpu tests/engines/test_vllm_lilicorr.py \
    || rc=$?
else
  echo "DSpark and LiLiCorr serving steps skipped (no CUDA device, --tiny or --no-serve)"
fi
exit "$rc"
