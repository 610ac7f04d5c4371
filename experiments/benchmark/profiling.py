"""Where the time goes (TensorFlow): `--mode=profile`, `--mode=train_profile`, `--mode=patch_projection`.

- `profile`: an inference batch without XLA, per TensorFlow op type (oneDNN's
  fused matmuls, batched matmuls of the attention, element-wise ops), with
  the achieved FLOP/s of the whole batch.
- `train_profile`: an XLA-compiled float32 training step (the step `fit`
  runs), each op of the compiled program timed by the profiler, grouped into
  matmuls (dot and convolution, alone or fused) and, by the layer each op came
  from, the rest; with the matmuls' GFLOP/s against the matmul peaks measured
  in the same process, and the step time the matmuls alone would take at each
  peak.
- `patch_projection`: the patch embedding as a strided conv versus patch
  cutting plus one matmul (`PatchEncoder(projection=...)`), same weights,
  with and without XLA, interleaved; the ratio conv / matmul (> 1: the conv
  is faster).
"""

import collections
import glob
import os
import statistics
import tempfile

import keras
import numpy as np

import keras_vit
from experiments.benchmark.attention import random_model
from experiments.benchmark.timing import matmul_peak_functions, matmul_peak_rates, median_peaks, time_calls, timed
from keras_vit.testing import BATCHED_MATMULS, MATMULS, hlo_instructions, step_part, traced_op_times


def profile(variant, image_size, batch_size, precision, repeats):
    """Time per TensorFlow op type of one inference batch, as oneDNN runs it (no XLA).

    Prints the op types and returns {"figures": {"op_seconds": {op type: seconds per batch}, ...}}:
    the mean of `repeats` traced runs (see `traced_op_times`).
    """
    keras.mixed_precision.set_dtype_policy(precision)
    model = random_model(variant, image_size)
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 255, (batch_size, image_size, image_size, 3)).astype("float32")
    seconds = collections.Counter()
    for op, value in traced_op_times(lambda x: model(x, training=False), images, repeats):
        seconds[op] += value / repeats
    total = sum(seconds.values())
    flops = keras_vit.flops.count_flops(variant, image_size=image_size) * batch_size
    print(
        f"{variant} inference at {image_size} px, batch {batch_size}, {precision}, no XLA: time per op "
        f"type, mean of {repeats} traced runs; {total:.3f} s of op time per batch, "
        f"{flops / total / 1e9:.0f} GFLOP/s"
    )
    for op, value in seconds.most_common():
        if value >= 0.001 * total:
            print(f"  {op:28s} {1000 * value:9.1f} ms {100 * value / total:6.1f}%")
    figures = {"op_seconds": dict(seconds.most_common()), "total_seconds": total, "flops_per_second": flops / total}
    return {"figures": figures, "ratios": {}, "xla": False}


def profiled_event_seconds(function, argument, repeats):
    """{event name: seconds} of `repeats` calls of `function` under TensorFlow's profiler."""
    import tensorflow as tf

    try:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
    except ImportError as error:
        raise SystemExit(f"--mode=train_profile reads TensorFlow's profiler output: {error}") from error
    seconds = collections.Counter()
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        try:
            for _ in range(repeats):
                timed(function, argument)
        finally:
            tf.profiler.experimental.stop()
        for path in glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True):
            space = xplane_pb2.XSpace()
            with open(path, "rb") as f:
                space.ParseFromString(f.read())
            for plane in space.planes:
                for line in plane.lines:
                    for event in line.events:
                        seconds[plane.event_metadata[event.metadata_id].name] += event.duration_ps / 1e12
    return seconds


def train_profile(variant, image_size, batch_size, repeats):
    """Op time per part of an XLA-compiled float32 training step.

    Prints the parts and returns {"figures": {"part_seconds": {part: seconds per step}, ...}}.
    XLA's CPU runtime names the ops to the profiler only with
    XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true, set before its first compilation.
    """
    import tensorflow as tf

    keras.mixed_precision.set_dtype_policy("float32")
    model = keras_vit.build_vit(variant, image_size=image_size, num_classes=1000)
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(0)
    batch = (
        tf.constant(rng.uniform(0, 255, (batch_size, image_size, image_size, 3)).astype("float32")),
        tf.constant(rng.integers(0, 1000, batch_size)),
    )
    step = tf.function(model.train_step, jit_compile=True)
    instructions = hlo_instructions(step.experimental_get_compiler_ir(batch)(stage="optimized_hlo"))
    seconds_per_step = statistics.median(timed(step, batch) for _ in range(repeats + 1))
    events = profiled_event_seconds(step, batch, repeats)

    parts = collections.Counter()
    for name, seconds in events.items():
        if name not in instructions:
            continue  # The runtime's own events (executor, thunk executor, tf.data).
        parts[step_part(*instructions[name])] += seconds / repeats
    if not parts:
        raise SystemExit(
            "The profile holds no op of the compiled step: this TensorFlow's XLA records none "
            "(XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true asks it to)."
        )
    total = sum(parts.values())
    attention_seconds = parts[BATCHED_MATMULS]
    matmul_seconds = parts[MATMULS] + attention_seconds
    flops = keras_vit.flops.count_flops(variant, image_size=image_size, training=True) * batch_size
    # Logits and attention-weighted values: 2 x 2 x tokens^2 x width per layer, 3x for a step.
    blocks = [layer for layer in model.layers if isinstance(layer, keras_vit.layers.TransformerBlock)]
    tokens, width = blocks[0].input.shape[1:]  # build_vit always makes at least one block.
    attention_flops = 3 * batch_size * len(blocks) * 4 * tokens**2 * width

    def rate(flops, seconds):
        return f"{flops / seconds / 1e9:.0f} GFLOP/s" if seconds > 0 else "n/a (no op timed)"

    matmuls, matmul_flops = matmul_peak_functions("float32", 2048)
    for function, argument in matmuls.values():
        timed(function, argument)
    peaks = median_peaks(matmul_peak_rates(matmuls, matmul_flops))
    print(
        f"{variant} training step (AdamW) at {image_size} px, batch {batch_size}, float32, XLA: "
        f"{seconds_per_step:.3f} s per step ({batch_size / seconds_per_step:.2f} images/s, median of "
        f"{repeats + 1}); op time per part, mean of {repeats} profiled steps: {total:.3f} s"
    )
    for part, value in parts.most_common():
        print(f"  {part:48s} {1000 * value:9.1f} ms {100 * value / total:6.1f}%")
    print(
        f"Matmuls: {flops / 1e9:.1f} GFLOP per step at {rate(flops, matmul_seconds)} (projections etc. "
        f"{(flops - attention_flops) / 1e9:.3g} GFLOP at {rate(flops - attention_flops, parts[MATMULS])}, "
        f"attention {attention_flops / 1e9:.3g} GFLOP at {rate(attention_flops, attention_seconds)}); "
        "peak (float32 2048^3) "
        + ", ".join(f"{name} {value / 1e9:.0f} GFLOP/s" for name, value in peaks.items())
    )
    rest = total - matmul_seconds
    for name, value in peaks.items():
        alone = flops / value
        print(
            f"At the {name} peak the matmuls alone take {alone:.3f} s per step ({batch_size / alone:.2f} "
            f"images/s); with the rest as profiled, {alone + rest:.3f} s ({batch_size / (alone + rest):.2f} "
            "images/s)"
        )
    figures = {
        "seconds_per_step": seconds_per_step,
        "images_per_second": batch_size / seconds_per_step,
        "part_seconds": dict(parts.most_common()),
        "step_flops": flops,
        "attention_flops": attention_flops,
        "matmul_peak": {"matmul": "float32 2048^3", "flops_per_second": peaks},
    }
    return {"figures": figures, "ratios": {}, "xla": True}


def patch_projection(variant, image_size, batch_size, repeats):
    """The patch embedding as a conv and as a matmul; prints and returns {"figures", "ratios"}."""
    import tensorflow as tf

    config = keras_vit.parse_variant(variant)
    shape = (batch_size, image_size, image_size, 3)
    images = tf.constant(np.random.default_rng(0).uniform(-1, 1, shape).astype("float32"))
    encoders = {}
    for projection in keras_vit.PatchEncoder.PROJECTIONS:
        encoders[projection] = keras_vit.PatchEncoder(
            config.hidden_dim, config.patch_size, projection=projection
        )
        encoders[projection].build(shape)
    weights = encoders["conv"].get_weights()
    encoders["matmul"].set_weights(weights)
    functions = {
        f"{projection} jit={jit}": tf.function(encoder.__call__, jit_compile=jit)
        for projection, encoder in encoders.items()
        for jit in (False, True)
    }
    medians = time_calls(functions, images, repeats)
    print(f"Patch embedding of {variant} at {image_size} px, batch {batch_size}, {repeats} repeats:")
    for name, seconds in medians.items():
        print(f"  {name:18s} {1000 * seconds:8.2f} ms  {batch_size / seconds:10.1f} images/s")
    ratios = {}
    for jit in (False, True):
        ratio = medians[f"matmul jit={jit}"] / medians[f"conv jit={jit}"]
        ratios[f"conv / matmul, jit={jit}"] = {"ratio": ratio}
        print(f"  jit={jit}: conv is {ratio:.2f}x the speed of matmul")
    return {"figures": {"seconds": medians}, "ratios": ratios}
