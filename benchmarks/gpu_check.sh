#!/usr/bin/env bash
# The GPU check: run it whenever a CUDA GPU is at hand (`make gpu-check`, or on the lent
# machine with the kit: docs/gpu-workstation.md), under 8 minutes. The doctor's GPU lines,
# the CUDA-only tests, then `slidesnake bench` with H-optimus-0 (random weights) in fp16
# and bf16 with 4, 8 and 16 loader workers, the start-up of an H-optimus-0 job from an
# fp16 safetensors file, loader.decode gpu beside exact (H-optimus-0 and a ViT-B, where
# nvImageCodec is installed), and the workflow on a small cohort with one GPU slot (the
# GPU's duty per slide); one table at the end. Results go to ${OUT:-gpu-check}/.
# CHECK_ON_CPU=1 runs the same steps where there is no GPU, with a tiny model and small
# slides (benchmarks/gpu_kit_offline.py): the kit and the check's CPU side, not speed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
if "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    nvidia-smi -L | tee "$OUT/gpus.txt"
    MODEL=h-optimus-0 PRECISIONS="fp16 bf16" WORKERS="4 8 16" SECONDS_OF_TILES=10
    DECODE_MODELS="h-optimus-0 timm:vit_base_patch16_224" DECODE_WORKERS=4
elif [ "${CHECK_ON_CPU:-0}" = 1 ]; then
    MODEL=timm:vit_tiny_patch16_224 PRECISIONS=fp32 WORKERS="1 2" SECONDS_OF_TILES=3
    DECODE_MODELS=$MODEL DECODE_WORKERS=1
else
    echo "no CUDA GPU here (CHECK_ON_CPU=1 runs the check's CPU side)" >&2
    exit 1
fi
# What this Python runs: the machine's torch beside the kit's packages.
"$PYTHON" -c 'import sys, torch, torchvision, timm, numpy, zarr, openslide, imagecodecs, snakemake
print(sys.version.split()[0], *(f"{m.__name__} {m.__version__}" for m in
      (torch, torchvision, timm, numpy, zarr, openslide, imagecodecs, snakemake)), sep="\n")' \
    | tee "$OUT/versions.txt"
# The pre-flight check's GPU lines (name, memory, driver, fp16 and bf16 tried on each GPU),
# on the demo config and its slides.
"$PYTHON" -m slidesnake demo-slides demo/slides > /dev/null
"$PYTHON" -m slidesnake doctor --configfile config/demo.yaml 2>&1 | tee "$OUT/doctor.txt" || true

# test_cuda.py, and the pipeline-equals-tiles-read-one-by-one and several-models tests on
# the GPU's path (CUDA events, the memory check, shared crops in float).
"$PYTHON" -m pytest -q -p no:cacheprovider -m "not workflow" tests/test_cuda.py \
    tests/test_embedding.py tests/test_model_list.py tests/test_device_decode.py 2>&1 | tee "$OUT/tests.txt" \
    || echo "TESTS FAILED: see $OUT/tests.txt"
for precision in $PRECISIONS; do
    # shellcheck disable=SC2086  # the worker counts are words
    "$PYTHON" -m slidesnake bench --model "$MODEL" --weights random --precision "$precision" \
        --workers $WORKERS --repeats 1 --end-to-end-s "$SECONDS_OF_TILES" --no-memory \
        --json "$OUT/bench-$precision.json" 2>&1 | tee "$OUT/bench-$precision.txt"
done
# loader.decode gpu beside exact, same model, same workers, in fp16 (fp32 on a CPU): the
# whole job's tiles/s and the GPU's duty, with and without nvImageCodec decoding the tiles.
if "$PYTHON" -c 'import nvidia.nvimgcodec' 2>/dev/null; then
    for model in $DECODE_MODELS; do
        for decode in exact gpu; do
            name="decode-${model//[:\/]/-}-$decode"
            "$PYTHON" -m slidesnake bench --model "$model" --weights random \
                --precision "${PRECISIONS%% *}" --decode "$decode" --workers $DECODE_WORKERS \
                --repeats 1 --end-to-end-s "$SECONDS_OF_TILES" --no-memory \
                --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.txt"
        done
    done
else
    echo "decode rows skipped: no nvImageCodec here (pip install '.[gpu-decode]')" \
        | tee "$OUT/decode-skipped.txt"
fi
if [ "$MODEL" = h-optimus-0 ]; then
    "$PYTHON" benchmarks/startup.py --rounds 2 2>&1 | tee "$OUT/startup.txt"
fi
"$PYTHON" benchmarks/gpu_cohort.py --model "$MODEL" --precision "${PRECISIONS%% *}" \
    --out "$OUT" 2>&1 | tee "$OUT/cohort.txt"
shopt -s nullglob
"$PYTHON" benchmarks/gpu_table.py "$OUT"/bench-*.json "$OUT"/decode-*.json | tee "$OUT/table.md"
