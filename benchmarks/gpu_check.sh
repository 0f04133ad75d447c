#!/usr/bin/env bash
# The GPU check: run it whenever a CUDA GPU is at hand (`make gpu-check`), under 8 minutes.
# The doctor's GPU lines, the CUDA-only tests, then `slidesnake bench` with H-optimus-0 (random weights) in fp16
# and bf16 with 4, 8 and 16 loader workers, and the start-up of an H-optimus-0 job from
# an fp16 safetensors file; one table at the end. Results go to ${OUT:-gpu-check}/.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
"$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU here")'
nvidia-smi -L | tee "$OUT/gpus.txt"
# The pre-flight check's GPU lines (name, memory, driver, fp16 and bf16 tried on each GPU).
"$PYTHON" -m slidesnake doctor --configfile config/demo.yaml 2>&1 | tee "$OUT/doctor.txt" || true

# test_cuda.py, and the pipeline-equals-tiles-read-one-by-one and several-models tests on
# the GPU's path (CUDA events, the memory check, shared crops in float).
"$PYTHON" -m pytest -q -m "not workflow" tests/test_cuda.py tests/test_embedding.py \
    tests/test_model_list.py 2>&1 | tee "$OUT/tests.txt" || echo "TESTS FAILED: see $OUT/tests.txt"
for precision in fp16 bf16; do
    "$PYTHON" -m slidesnake bench --model h-optimus-0 --weights random --precision "$precision" \
        --workers 4 8 16 --repeats 1 --end-to-end-s 10 --no-memory \
        --json "$OUT/bench-$precision.json" 2>&1 | tee "$OUT/bench-$precision.txt"
done
"$PYTHON" benchmarks/startup.py --rounds 2 2>&1 | tee "$OUT/startup.txt"
"$PYTHON" benchmarks/gpu_table.py "$OUT"/bench-*.json | tee "$OUT/table.md"
