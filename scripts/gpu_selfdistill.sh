#!/usr/bin/env bash
# Self-distillation data and an EAGLE-3 head for SmolLM2-135M-Instruct on a GPU machine that
# can download nothing (issue 44): the GGUF travels split in parts (.gpu/smollm2.gguf.part*,
# with .gpu/smollm2.gguf.sha256), the two wheels the machine lacks in .whl/. Each stage has a
# time budget, so a slower machine yields less data or fewer steps rather than nothing.
#
#   split -n 2 -d "$GGUF" .gpu/smollm2.gguf.part    # here
#   # call 1 carries .gpu/smollm2.gguf.part00 and copies it to /tmp/p (ignored files under a
#   # carried folder do not outlast a call; /tmp on the warm machine does); call 2 carries
#   # part01, the .sha256 and .whl, and runs:
#   cat /tmp/p/smollm2.gguf.part00 .gpu/smollm2.gguf.part01 > /tmp/p/smollm2.gguf
#   GGUF=/tmp/p/smollm2.gguf bash scripts/gpu_selfdistill.sh
#
# The defaults are the run that made checkpoints/smollm2-eagle3 (one H200, about 6 minutes).
#
# What comes back (under $OUT): the data and training logs, the data manifest, the exported
# head as a tar in parts of at most 15 MB (cat head.tar.* | tar x).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_selfdistill}
WORK=${WORK:-.gpu/run}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
GGUF=${GGUF:-$WORK/smollm2.gguf}
if [ ! -f "$GGUF" ]; then cat .gpu/smollm2.gguf.part* > "$GGUF" || exit 1; fi
if [ -f .gpu/smollm2.gguf.sha256 ]; then
    [ "$(sha256sum < "$GGUF" | cut -d' ' -f1)" = "$(cat .gpu/smollm2.gguf.sha256)" ] \
        || { echo "GGUF checksum mismatch"; exit 1; }
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"

# Data: every prompt answered twice (the second sampled), batch 256, the matmuls in float32.
JAX_DEFAULT_MATMUL_PRECISION=highest python3 -m specjax.train data --target "$GGUF" \
    --out "$WORK/data" --batch-size "${BATCH:-256}" --max-tokens "${MAX_TOKENS:-256}" \
    --self-instruct "${ASK:-3072}" --answers "${ANSWERS:-2}" --limit "${LIMIT:-3000}" \
    --max-seconds "${DATA_SECONDS:-190}" --max-model-len "${MAX_LEN:-768}" \
    --prefill-chunk "${PREFILL_CHUNK:-256}" --max-prefill-rows "${PREFILL_ROWS:-8}" \
    2>&1 | grep -v "it/s\]$" | tee "$OUT/data.log"
cp "$WORK/data/manifest.json" "$OUT/" || exit 1

python3 -m specjax.train eagle3 --target "$GGUF" --hidden-states "$WORK/data/hidden" \
    --out "$WORK/smollm2-eagle3" --layers 1,14,26 --draft-vocab "${DRAFT_VOCAB:-8192}" \
    --steps "${STEPS:-2000}" --batch-size "${TRAIN_BATCH:-32}" --seq-len "${SEQ_LEN:-512}" \
    --lr "${LR:-2e-3}" --warmup "${WARMUP:-100}" --save-dtype bfloat16 \
    --max-seconds "${TRAIN_SECONDS:-250}" --no-progress 2>&1 | tee "$OUT/train.log"
rm -rf "$WORK/smollm2-eagle3/work"
tar cf - -C "$WORK" smollm2-eagle3 | split -b 15M -d - "$OUT/head.tar."
ls -la "$OUT"
