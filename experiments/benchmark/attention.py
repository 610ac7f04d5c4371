"""`--mode=attention`: the model's forward pass with fused and with explicit attention.

Attention as `keras.ops.dot_product_attention` (cuDNN's fused attention on an
NVIDIA GPU under JAX) and as explicit batched matmuls and softmax, in the
whole compiled model (XLA on JAX, a tf.function with --jit's choice on
TensorFlow): the largest difference between their outputs, and each one's
time, interleaved; on JAX also whether the compiled programs call a cuDNN
attention kernel, and the largest difference of the two forms' training-mode
weight gradients (the fused form's backward pass).
"""

import functools

import keras
import numpy as np

import keras_vit
from experiments.benchmark.timing import machine_name, time_calls
from keras_vit import kernels
from keras_vit.testing import randomize_weights


def random_model(variant, image_size):
    """The variant with 1000 classes and every weight drawn from N(0, 0.02): zero
    biases would be constant-folded away, and identical outputs could hide a
    wrong path."""
    model = keras_vit.build_vit(variant, image_size=image_size, num_classes=1000)
    return randomize_weights(model, scale=0.02, unit_scales=False)


def compiled_forward(model, jit_compile):
    """A function images -> logits running `model`'s inference forward pass compiled."""
    if keras.backend.backend() == "jax":
        import jax

        trainable = [v.value for v in model.trainable_variables]
        fixed = [v.value for v in model.non_trainable_variables]
        forward = jax.jit(lambda t, n, x: model.stateless_call(t, n, x, training=False)[0])
        function = functools.partial(forward, trainable, fixed)
        function.lowered = lambda x: forward.lower(trainable, fixed, x)
        return function
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.function(lambda x: model(x, training=False), jit_compile=jit_compile)
    return lambda x: model(x, training=False)


def uses_cudnn_attention(program):
    """Whether a compiled program's text calls one of cuDNN's fused attention kernels."""
    return "cudnn" in program and ("fmha" in program or "fused_attention" in program)


def training_gradients(model, images):
    """On JAX: a jitted function () -> (loss, gradients of the trainable weights) of a training-mode
    forward pass (mean of the logits times fixed weights), and its compiled program's text."""
    import jax
    import jax.numpy as jnp

    trainable = [v.value for v in model.trainable_variables]
    fixed = [v.value for v in model.non_trainable_variables]
    weights = jnp.asarray(np.random.default_rng(2).normal(size=model.output_shape[1:]), "float32")

    def loss(trainable, x):
        logits, _ = model.stateless_call(trainable, fixed, x, training=True)
        return jnp.mean(logits.astype("float32") * weights)

    function = jax.jit(jax.value_and_grad(loss))
    return functools.partial(function, trainable), function.lower(trainable, images).compile().as_text()


def attention(variant, image_size, batch_size, precision, jit, repeats):
    """Fused vs explicit attention in the whole model; prints and returns {"figures", "ratios", "xla"}.

    figures: the largest |fused - explicit| of the logits (and the largest |logit|), each form's
    seconds per batch and images/s, on JAX whether each compiled program calls cuDNN's attention
    and the gradients' largest relative difference; ratios: fused / explicit speed.
    """
    keras.mixed_precision.set_dtype_policy(precision)
    model = random_model(variant, image_size)
    jit_compile = keras_vit.training.resolve_jit_compile(jit, precision, training=False)
    rng = np.random.default_rng(1)
    images = keras.ops.convert_to_tensor(
        rng.uniform(0, 255, (batch_size, image_size, image_size, 3)).astype("float32")
    )
    functions, outputs, cudnn, gradients = {}, {}, {}, {}
    for form, fused in (("fused", True), ("explicit", False)):
        function = compiled_forward(model, jit_compile)
        with kernels.fused_attention(fused):  # Traced here, on the first call.
            outputs[form] = keras.ops.convert_to_numpy(function(images)).astype("float32")
            if hasattr(function, "lowered"):
                cudnn[form] = uses_cudnn_attention(function.lowered(images).compile().as_text())
                gradient, program = training_gradients(model, images)
                gradients[form] = [np.asarray(g, "float32") for g in gradient(images)[1]]
                cudnn[f"{form} training"] = uses_cudnn_attention(program)
        functions[form] = function
    medians = time_calls(functions, images, repeats)
    difference = float(np.max(np.abs(outputs["fused"] - outputs["explicit"])))
    largest = float(np.max(np.abs(outputs["explicit"])))
    print(
        f"{variant} inference at {image_size} px, batch {batch_size}, {precision}, backend "
        f"{keras.backend.backend()} on {machine_name()}, {'XLA' if jit_compile else 'no XLA'}"
    )
    print(f"Largest |fused - explicit| of the logits: {difference:.3g} (largest |logit| {largest:.3g})")
    figures = {
        "max_abs_difference": difference,
        "largest_abs_logit": largest,
        "seconds": medians,
        "images_per_second": {form: batch_size / seconds for form, seconds in medians.items()},
    }
    if gradients:
        relative = max(
            float(np.max(np.abs(f - e)) / max(float(np.max(np.abs(e))), 1e-30))
            for f, e in zip(gradients["fused"], gradients["explicit"])
        )
        figures["gradient_relative_difference"] = relative
        print(
            f"Training-mode weight gradients, largest |fused - explicit| / largest |explicit| of a weight: "
            f"{relative:.3g}; cuDNN attention kernel in the training program: fused "
            f"{'yes' if cudnn['fused training'] else 'no'}, explicit {'yes' if cudnn['explicit training'] else 'no'}"
        )
    if cudnn:
        figures["cudnn_attention"] = cudnn
    for form, seconds in medians.items():
        kernel = f", cuDNN attention kernel: {'yes' if cudnn[form] else 'no'}" if form in cudnn else ""
        print(f"  {form:9s} {1000 * seconds:9.2f} ms  {batch_size / seconds:10.1f} images/s{kernel}")
    speed = medians["explicit"] / medians["fused"]
    print(f"fused / explicit speed: {speed:.2f}x")
    return {"figures": figures, "ratios": {"fused / explicit": {"ratio": speed}}, "xla": jit_compile}
