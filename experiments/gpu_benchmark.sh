#!/usr/bin/env bash
# The GPU rows of docs/performance.md: keras_vit on Keras' JAX backend (no TensorFlow needed) against
# keras-hub (the same Keras loop), timm eager and timm with torch.compile (PyTorch on CUDA, bfloat16
# autocast, fused AdamW, scaled_dot_product_attention). Each row is one benchmark process: the
# implementations interleaved on the same GPU, the bfloat16 (or float32) 8192^3 matmul peak measured in
# the same process, so "of peak" is the MFU. Rows run in the order below, most wanted first; ROWS="..."
# picks some. ANCHORS=<path of gpu_anchors.py> also runs its timm and Flax anchors for the B/16 step.
# Needs jax with CUDA, keras and keras-hub importable by $PY, timm and torch by $TIMM_PY (default $PY); WHEELS=<folder of .whl
# files> installs missing ones into /tmp/site first, for a machine without a package index. Logs go to
# $OUT (default /tmp/keras_vit-gpu). Each run appends its row to $RESULTS, by default
# results/gpu_<the GPU's name>.jsonl (results/gpu_h200.jsonl on an NVIDIA H200), whose rows the tables of
# README.md and docs/performance.md are made of (`python -m experiments.benchmark.tables`); with TINY=1 the
# rows go to $OUT/results.jsonl instead, since the testing variant's figures describe no GPU.
#
#     bash experiments/gpu_benchmark.sh
#     ROWS="attention b16_train" STEPS=2 REPEATS=1 bash experiments/gpu_benchmark.sh  # a quick try
#     TINY=1 STEPS=1 REPEATS=1 bash experiments/gpu_benchmark.sh  # the script itself, on any machine
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}; TIMM_PY=${TIMM_PY:-$PY}; OUT=${OUT:-/tmp/keras_vit-gpu}; mkdir -p "$OUT"
ROWS=${ROWS:-"attention b16_train s16_train b16_infer b16_infer_b16 l16_train b16_train_f32"}
STEPS=${STEPS:-10}; REPEATS=${REPEATS:-3}
# JAX takes 75% of the GPU's memory by default; the timm workers are other processes on the same GPU.
export KERAS_BACKEND=jax XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 PYTHONUNBUFFERED=1
if [ -n "${WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
GPU_NAME=unknown
if command -v nvidia-smi > /dev/null; then
  nvidia-smi -L
  # "NVIDIA H200" -> h200, "NVIDIA H100 80GB HBM3" -> h100_80gb_hbm3.
  GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z' 'a-z' | sed -e 's/^nvidia //' -e 's/[^a-z0-9]\{1,\}/_/g' -e 's/_$//')
fi
if [ -n "${TINY:-}" ]; then RESULTS=${RESULTS:-$OUT/results.jsonl}; else RESULTS=${RESULTS:-results/gpu_$GPU_NAME.jsonl}; fi
echo "rows appended to $RESULTS"
$PY -c "import jax, keras, keras_hub
print('jax', jax.__version__, jax.devices(), '| keras', keras.__version__, '| keras-hub', keras_hub.__version__)" || exit 1
$TIMM_PY -c "import timm, torch; print('timm', timm.__version__, '| torch', torch.__version__)" || exit 1
status=0
run() {  # log name, time limit in seconds, benchmark flags
  local name=$1 limit=$2; shift 2
  echo "=== python -m experiments.benchmark $*"
  timeout "$limit" $PY -m experiments.benchmark "$@" --timm_python="$TIMM_PY" --results_file="$RESULTS" > "$OUT/$name.log" 2>&1 || { echo "failed: see $OUT/$name.log"; status=1; }
  grep -E "^(  |[A-Z]|keras_vit|fused)" "$OUT/$name.log" | grep -v "^[IWE][0-9]" | tail -14
}

TIMED="--steps=$STEPS --repeats=$REPEATS --float32_row=false"
B16=B/16 S16=S/16 L16=L/16 SIZE=224 N256=256 N128=128 N64=64 N16=16
if [ -n "${TINY:-}" ]; then B16=testing S16=testing L16=testing SIZE=32 N256=8 N128=4 N64=4 N16=2; fi
BF16="--precision=mixed_bfloat16 --image_size=$SIZE"
for row in $ROWS; do
  case $row in
    attention) run attention 200 --mode=attention --variant=$B16 $BF16 --batch_size=$N64 --repeats=10 ;;
    b16_train) run b16_train 480 --mode=train --variant=$B16 $BF16 --batch_size=$N256 $TIMED --compare=keras_hub,timm,timm_compiled ;;
    s16_train) run s16_train 300 --mode=train --variant=$S16 $BF16 --batch_size=$N256 $TIMED --compare=timm_compiled ;;
    b16_infer) run b16_infer 360 --mode=infer --variant=$B16 $BF16 --batch_size=$N256 $TIMED --compare=keras_hub,timm,timm_compiled ;;
    b16_infer_b16) run b16_infer_b16 240 --mode=infer --variant=$B16 $BF16 --batch_size=$N16 --steps=$((4 * STEPS)) --repeats=$REPEATS --float32_row=false --compare=keras_hub ;;
    l16_train) run l16_train 420 --mode=train --variant=$L16 $BF16 --batch_size=$N128 $TIMED --compare=timm_compiled ;;
    b16_train_f32) run b16_train_f32 420 --mode=train --variant=$B16 --precision=float32 --image_size=$SIZE --batch_size=$N256 $TIMED --compare=timm_compiled ;;
    *) echo "unknown row $row"; status=1 ;;
  esac
done
if [ -n "${ANCHORS:-}" ]; then
  for anchor in "timm" "flax" "flax --attn cudnn_pad"; do
    echo "=== $ANCHORS $anchor --mode train --batch 256 --variant B/16"
    timeout 300 $PY "$ANCHORS" $anchor --mode train --batch 256 --variant B/16 2>&1 | tail -1 || status=1
  done
fi
exit $status
