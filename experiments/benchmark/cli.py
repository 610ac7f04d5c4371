"""The command line of `python -m experiments.benchmark`: its flags and `main`.

`define_flags()` defines the flags (only `__main__` calls it, so importing the package defines none);
`main` checks what it can before importing Keras, runs the mode and, with --results_file, appends the
run's row (`results.make_row`) to that file.
"""

import importlib
import os
import sys

from absl import flags

from experiments.benchmark import peers

MODES = (
    "infer", "train", "attention", "profile", "train_profile", "patch_projection", "serving", "input", "peaks",
    "predict",
)  # fmt: skip
# The modes that run on any Keras backend; the others use TensorFlow's own APIs.
ANY_BACKEND_MODES = ("infer", "train", "attention")
# keras_vit.training.JIT_COMPILE, written out so that defining the flags imports no Keras.
JIT_COMPILE = ("auto", "on", "off")
# The flags each mode reads: its config in a results row.
MODE_FLAGS = {
    "infer": (
        "variant", "image_size", "batch_size", "precision", "jit", "compare", "steps", "repeats", "float32_row",
        "quantize",
    ),  # fmt: skip
    "attention": ("variant", "image_size", "batch_size", "precision", "jit", "repeats"),
    "profile": ("variant", "image_size", "batch_size", "precision", "repeats"),
    "train_profile": ("variant", "image_size", "batch_size", "repeats"),
    "patch_projection": ("variant", "image_size", "batch_size", "repeats"),
    "serving": ("variant", "image_size", "repeats", "serving_batches", "threads", "timm_python"),
    "peaks": ("variant", "image_size", "batch_size", "repeats", "threads"),
    "predict": ("variant", "image_size", "repeats", "predict_batches", "synthetic_images", "threads", "timm_python"),
    "input": (
        "image_size", "batch_size", "repeats", "data", "data_dir", "synthetic", "synthetic_images", "synthetic_size",
        "randaugment", "model_garden", "input_images",
    ),  # fmt: skip
}
MODE_FLAGS["train"] = MODE_FLAGS["infer"][:-1]

FLAGS = flags.FLAGS


def define_flags(flag_values=FLAGS):
    """Defines the benchmark's flags in `flag_values` (by default absl's global registry, where a flag
    is defined once per process); returns their names."""
    f = {"flag_values": flag_values}
    flags.DEFINE_enum("mode", "infer", list(MODES), "What to measure.", **f)
    flags.DEFINE_string("variant", "B/16", "ViT variant, e.g. B/16.", **f)
    flags.DEFINE_integer("image_size", 224, "Square image size in pixels.", **f)
    flags.DEFINE_integer("batch_size", 16, "Images per batch.", **f)
    flags.DEFINE_integer(
        "repeats", None,
        "Timed repetitions (default: 5 for infer, train, profile, train_profile and input, 30 for the others).",
        **f,
    )  # fmt: skip
    flags.DEFINE_integer("steps", 2, "infer/train: batches per timed repetition.", **f)
    flags.DEFINE_integer(
        "threads", 0, "peaks/serving: the threads of TensorFlow's ops and LiteRT's interpreter (0: one per core).", **f
    )
    flags.DEFINE_list("serving_batches", ["1", "8"], "serving: the batch sizes timed.", **f)
    flags.DEFINE_list("predict_batches", ["8", "32"], "predict: the prediction job's batch sizes timed.", **f)
    for name in ("serving_batches", "predict_batches"):
        flags.register_validator(
            name, _batch_sizes, message="expected positive integers separated by commas, e.g. 1,8", **f
        )
    flags.DEFINE_enum("precision", "float32", ["float32", "mixed_bfloat16"], "infer/train: Keras dtype policy.", **f)
    flags.DEFINE_enum("jit", "auto", list(JIT_COMPILE), "infer/train: XLA for keras_vit.", **f)
    flags.DEFINE_list(
        "compare", [], f"infer/train: peers to measure, of {','.join(peers.PEERS)} (timm with torch.compile).", **f
    )
    flags.DEFINE_string(
        "data", "", "input: an image folder (local or gs://) or tfds:NAME[:SPLIT]; default: synthetic JPEGs.", **f
    )
    flags.DEFINE_string("data_dir", "", "input: the TFDS data_dir of --data=tfds:NAME.", **f)
    flags.DEFINE_enum(
        "synthetic", "photos", ["photos", "gradients"],
        "input: the synthetic folder's JPEGs: cut from scikit-image's photos, or drawn gradients and noise.", **f,
    )  # fmt: skip
    flags.DEFINE_integer("synthetic_images", 512, "input, predict: JPEGs in the synthetic folder.", **f)
    flags.DEFINE_string(
        "synthetic_size", "500x375", "input: WIDTHxHEIGHT of the synthetic JPEGs (500x375: a typical ImageNet photo).",
        **f,
    )  # fmt: skip
    flags.DEFINE_list(
        "randaugment", ["2", "10"],
        "input: NUM_OPS,MAGNITUDE of the RandAugment measured beside decode + crop + flip (the ImageNet recipe's "
        "2,10); none if empty.", **f,
    )  # fmt: skip
    flags.DEFINE_boolean(
        "model_garden", True,
        "input: also measure the pipeline with TF Model Garden's RandAugment (where `official` imports).", **f,
    )  # fmt: skip
    flags.DEFINE_integer("input_images", 1024, "input: images per timed repetition.", **f)
    flags.DEFINE_string(
        "timm_python", "",
        "infer/train: the Python that runs the timm peers (default: this one), where PyTorch lives apart; "
        "serving/predict: the one that exports timm's ViT to ONNX (default: this one, where timm imports).", **f,
    )  # fmt: skip
    flags.DEFINE_boolean(
        "float32_row", True,
        "infer/train with a 16-bit --precision: also measure our float32 model (the 16-bit speed-up).", **f,
    )  # fmt: skip
    flags.DEFINE_enum(
        "quantize", "none", ["none", "int8"],
        "infer: keras_vit's model quantized with Keras' model.quantize (int8 weights and activations in every matmul "
        "but the patch embedding's), and also measured unquantized: the quantization's speed-up.", **f,
    )  # fmt: skip
    flags.DEFINE_string(
        "results_file", "",
        "Appends the run's row (figures, ratios, command, commit, versions, device) to this JSON-lines file, "
        "e.g. results/cpu.jsonl (see experiments/benchmark/results.py).", **f,
    )  # fmt: skip
    return [name for name in flag_values if flag_values.find_module_defining_flag(name) == __name__]


def _batch_sizes(values):
    return bool(values) and all(value.isdigit() and int(value) > 0 for value in values)


def default_repeats(mode):
    if mode == "predict":
        return 3
    return 5 if mode in ("infer", "train", "profile", "train_profile", "input", "peaks") else 30


def check_tensorflow(mode):
    """Exits naming the modes that run without TensorFlow when `mode` needs it and it is missing."""
    if mode in ANY_BACKEND_MODES:
        return
    try:
        importlib.import_module("tensorflow")
    except ImportError:
        raise SystemExit(
            f"--mode={mode} needs TensorFlow; without it --mode={', '.join(ANY_BACKEND_MODES[:-1])} and "
            f"{ANY_BACKEND_MODES[-1]} run."
        ) from None


def measure(mode, repeats):
    """Runs `mode` with the flags' values; returns what it measured (see `results.make_row`)."""
    if mode in ("infer", "train"):
        from experiments.benchmark.throughput import throughput

        if mode == "train" and FLAGS.quantize != "none":
            raise SystemExit(f"--quantize={FLAGS.quantize} measures inference: use it with --mode=infer.")
        return throughput(
            FLAGS.variant, FLAGS.image_size, FLAGS.batch_size, mode, FLAGS.precision, FLAGS.jit, FLAGS.compare,
            repeats, FLAGS.steps, FLAGS.float32_row, timm_python=FLAGS.timm_python or None,
            quantize=None if FLAGS.quantize == "none" else FLAGS.quantize,
        )  # fmt: skip
    if mode == "attention":
        from experiments.benchmark.attention import attention

        return attention(FLAGS.variant, FLAGS.image_size, FLAGS.batch_size, FLAGS.precision, FLAGS.jit, repeats)
    if mode == "profile":
        from experiments.benchmark.profiling import profile

        return profile(FLAGS.variant, FLAGS.image_size, FLAGS.batch_size, FLAGS.precision, repeats)
    if mode == "train_profile":
        from experiments.benchmark.profiling import train_profile

        return train_profile(FLAGS.variant, FLAGS.image_size, FLAGS.batch_size, repeats)
    if mode == "patch_projection":
        from experiments.benchmark.profiling import patch_projection

        return patch_projection(FLAGS.variant, FLAGS.image_size, FLAGS.batch_size, repeats)
    if mode == "serving":
        from experiments.benchmark.serving import serving

        return serving(FLAGS.variant, FLAGS.image_size, repeats, batches=[int(b) for b in FLAGS.serving_batches],
                       threads=FLAGS.threads or None, timm_python=FLAGS.timm_python or None)  # fmt: skip
    if mode == "predict":
        from experiments.benchmark.predict import predict_throughput

        return predict_throughput(
            FLAGS.variant, FLAGS.image_size, [int(b) for b in FLAGS.predict_batches], FLAGS.synthetic_images, repeats,
            threads=FLAGS.threads or None, timm_python=FLAGS.timm_python or None,
        )  # fmt: skip
    if mode == "peaks":
        from experiments.benchmark.peaks import peaks

        return peaks(FLAGS.variant, FLAGS.image_size, FLAGS.batch_size, repeats, threads=FLAGS.threads or None)
    from experiments.benchmark.inputs import input_benchmark

    return input_benchmark(
        FLAGS.image_size, FLAGS.batch_size, repeats, data=FLAGS.data, data_dir=FLAGS.data_dir,
        synthetic=FLAGS.synthetic, synthetic_images=FLAGS.synthetic_images, synthetic_size=FLAGS.synthetic_size,
        randaugment=FLAGS.randaugment, model_garden=FLAGS.model_garden, input_images=FLAGS.input_images,
    )  # fmt: skip


def main(argv):
    del argv
    mode = FLAGS.mode
    if mode in ("infer", "train"):
        peers.check_compare(FLAGS.compare, FLAGS.timm_python or None)  # Before the seconds that importing Keras takes.
    check_tensorflow(mode)
    if mode == "train_profile":
        # XLA's CPU runtime names each op of the compiled program to the profiler only when asked;
        # it reads the flags when it first compiles, which is after this.
        flags_now = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags_now} --xla_cpu_enable_xprof_traceme=true".strip()
    import keras

    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_dtype_policy("float32")
    repeats = FLAGS.repeats or default_repeats(mode)
    measured = measure(mode, repeats)
    if FLAGS.results_file:
        from experiments.benchmark import results

        config = {name: FLAGS[name].value for name in MODE_FLAGS[mode]}
        config["repeats"] = repeats
        row = results.make_row(mode, config, measured, argv=sys.argv)
        results.append_row(FLAGS.results_file, row)
        print(f"Appended the run's row to {FLAGS.results_file}")
