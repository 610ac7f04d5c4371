r"""Benchmarks of keras_vit on this machine.

    python -m experiments.benchmark --mode=infer --variant=B/16 --image_size=224 --batch_size=16 \
        --precision=float32 --jit=auto --compare=keras_hub,timm [--results_file=results/cpu.jsonl]
    python -m experiments.benchmark --mode=train --variant=S/16
    python -m experiments.benchmark --mode=attention --variant=B/16 --precision=mixed_bfloat16
    python -m experiments.benchmark --mode=profile --variant=B/16
    python -m experiments.benchmark --mode=train_profile --variant=S/16
    python -m experiments.benchmark --mode=patch_projection --variant=B/16 --batch_size=16
    python -m experiments.benchmark --mode=serving --variant=Ti/16 --image_size=224 [--serving_batches=1,8] \
        [--threads=2]
    python -m experiments.benchmark --mode=peaks --variant=B/16 --batch_size=1 [--threads=2]
    python -m experiments.benchmark --mode=predict --variant=B/16 --predict_batches=8,32 --synthetic_images=64
    python -m experiments.benchmark --mode=input --image_size=224 --batch_size=64 [--randaugment=2,10] \
        [--model_garden] [--synthetic=photos|gradients] [--data=PATH|tfds:NAME [--data_dir=DIR]]
    python -m experiments.benchmark.tables [--check]

One module per mode (or group of modes), each a function that measures,
prints and returns its figures:

- `throughput` (`infer` / `train`): images per second of Keras `predict`
  (inference) or of `fit` steps (training: AdamW, sparse cross-entropy) on
  in-memory data, after a warm-up call, as the median over --repeats
  repetitions of --steps batches each; the implementations take turns within
  every repetition so that they share the machine's state. For each it prints
  the model's FLOPs per image (`keras_vit.flops`; 3x forward for a training
  step), the achieved FLOP/s and their fraction of the matmul peak: a 2048^3
  matmul (8192^3 on a GPU or TPU) at the same precision timed in the same
  process before and after the repetitions, with and without XLA, the faster
  counting (on an accelerator, that fraction is the MFU). With --compare, the
  same architecture from keras-hub (with and without XLA; ours is compared
  with its faster) and timm (PyTorch eager or torch.compile, in a child
  process, on the GPU when the backend computes on one; `experiments.benchmark.peers`)
  is measured too, with the ratios ours / peer. The peers are the optional
  `bench` extra.
- `attention`: the model's forward pass with fused and with explicit
  attention: their outputs' difference, their times, and on JAX whether the
  programs call cuDNN's attention and the training-mode gradients' difference.
- `profiling` (`profile`, `train_profile`, `patch_projection`, TensorFlow):
  where an inference batch's or an XLA-compiled training step's time goes,
  and the patch embedding as a conv or a matmul.
- `serving`: file size and latency of each export (SavedModel in each
  precision, TFLite, the ONNX export in ONNX Runtime) at each batch size, with
  each one's share of the peak of its runtime and precision.
- `peaks`: the matmul peaks at the model's block shapes in float32, bfloat16
  and int8, in TensorFlow (oneDNN, XLA) and LiteRT (XNNPACK), with the CPU's
  features.
- `predict`: images/s of the prediction job over a folder of JPEGs, end to
  end, with the Keras model and the SavedModel in each precision, against ONNX
  Runtime on the same images decoded beforehand.
- `inputs` (`input`): images per second of this host's training input
  pipeline, to compare with `--mode=train` at the same image size.

`timing` holds what they share: timed calls and the matmul peak. `infer`,
`train` and `attention` also run on the JAX backend without TensorFlow
installed (`KERAS_BACKEND=jax`); the others need TensorFlow.

With --results_file every run appends a row (figures, ratios, command,
commit, versions, device; see `results`) to a JSON-lines file;
`results/<platform>.jsonl` in the repository holds the rows that the tables of
README.md and docs/performance.md are generated from (`tables`).

Importing this package defines no flag and imports no Keras: the command line
(`cli`) defines its flags when run as a program.
"""

# The public functions of the modes, imported when first used (`benchmark.input_rate`).
# (Not the functions named as their modules: `throughput`, `attention`, `serving`.)
_EXPORTS = {
    "keras_contender": "throughput",
    "random_model": "attention",
    "compiled_forward": "attention",
    "profile": "profiling",
    "train_profile": "profiling",
    "patch_projection": "profiling",
    "input_benchmark": "inputs",
    "input_rate": "inputs",
    "write_synthetic_folder": "inputs",
    "machine_name": "timing",
    "time_calls": "timing",
    "timed": "timing",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
