#!/usr/bin/env bash
# The GPU measurements of README "Performance": keras_vit on Keras' JAX backend (no TensorFlow needed)
# against keras-hub (same Keras loop) and timm (PyTorch eager, CUDA), B/16 at 224 px, bfloat16, plus
# fused-vs-explicit attention and an S/16 float32 training step. Needs jax with CUDA, keras, keras-hub,
# timm and torch importable by $PY; WHEELS=<folder of .whl files> installs missing ones into /tmp/site
# first, for a machine without a package index. Logs go to $OUT (default /tmp/keras_vit-gpu).
#
#     bash experiments/gpu_benchmark.sh
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}; OUT=${OUT:-/tmp/keras_vit-gpu}; mkdir -p "$OUT"
# JAX takes 75% of the GPU's memory by default; the timm worker is a second process on the same GPU.
export KERAS_BACKEND=jax XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 PYTHONUNBUFFERED=1
if [ -n "${WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
nvidia-smi -L
$PY -c "import jax, keras, keras_hub, timm, torch
print('jax', jax.__version__, jax.devices(), '| keras', keras.__version__, '| keras-hub', keras_hub.__version__,
      '| timm', timm.__version__, '| torch', torch.__version__)" || exit 1
status=0
run() {  # log name, time limit in seconds, benchmark flags
  local name=$1 limit=$2; shift 2
  echo "=== python -m experiments.benchmark $*"
  timeout "$limit" $PY -m experiments.benchmark "$@" > "$OUT/$name.log" 2>&1 || { echo "failed: see $OUT/$name.log"; status=1; }
  grep -E "^(  |[A-Z]|keras_vit|fused)" "$OUT/$name.log" | grep -v "^[IWE][0-9]" | tail -12
}
B16="--variant=B/16 --image_size=224 --precision=mixed_bfloat16 --compare=keras_hub,timm"
run infer_b16 300 --mode=infer $B16 --batch_size=16 --steps=20
run attention 300 --mode=attention --variant=B/16 --precision=mixed_bfloat16 --batch_size=64 --repeats=10
run infer_b256 300 --mode=infer $B16 --batch_size=256 --steps=4
run train_b64 400 --mode=train $B16 --batch_size=64 --steps=5
run train_s16_f32 400 --mode=train --variant=S/16 --precision=float32 --compare=keras_hub,timm --batch_size=64 --steps=5
exit $status
