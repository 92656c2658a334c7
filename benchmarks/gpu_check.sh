#!/usr/bin/env bash
# GPU check: parity (bitwise losses and final parameters), step time and peak CUDA memory of fsdp2_compile against
# torch's fully_shard on the GPT of examples/gpt.py, fp32 and bf16 params, compiler aot_eager and inductor.
# One rank per GPU (one GPU: world size 1 over NCCL); at most 8 minutes (GPU_CHECK_TIMEOUT, seconds).
# Without CUDA it prints SKIP and exits 0. Prints a Markdown table; exit 1 when a check fails.
#
#   benchmarks/gpu_check.sh [gpu_check.py options, e.g. --size small --steps 5]
#   PYTHON=/path/to/python NPROC=2 benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if ! gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)'); then
    echo "ERROR: $PYTHON cannot import torch (set PYTHON=...)" >&2
    exit 2
fi
if [ "$gpus" = "0" ]; then
    what=$("$PYTHON" -c 'import torch; print(f"torch {torch.__version__}, CUDA build: {torch.version.cuda}")')
    echo "SKIP: gpu_check needs a CUDA GPU; none is available ($what). Nothing was run."
    echo "      (the same checks run on CPU/gloo: torchrun --nproc-per-node 2 benchmarks/gpu_check.py --device cpu)"
    exit 0
fi
nproc=${NPROC:-$gpus}
echo "gpu_check: $nproc rank(s) on $gpus GPU(s), NCCL" >&2
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}  # deterministic cuBLAS (use_deterministic_algorithms)
exec timeout --kill-after=20 "${GPU_CHECK_TIMEOUT:-480}" \
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$nproc" benchmarks/gpu_check.py --device cuda "$@"
