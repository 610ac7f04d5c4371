"""XLA on the TensorFlow backend, what a TPU needs (TPUStrategy compiles the whole training step with XLA): the
training step with every feature of the configs, RandAugment on the device, and the exported serving function,
each in a `tf.function(jit_compile=True)` on the CPU.

A tf.function with jit_compile=True is compiled whole or not run: an op without an XLA kernel, or a shape XLA
cannot know when it compiles, raises InvalidArgumentError ("Detected unsupported operations when trying to compile
graph ...", "... must be a compile-time constant") instead of running outside XLA
(test_an_op_outside_xla_fails_the_compiled_function). So a compiled function that runs is the proof that none of
its ops is left out.

Which function Keras compiles (keras/src/backend/tensorflow/trainer.py, `TensorFlowTrainer._make_function`):
`one_step_on_data`, which runs `strategy.run(train_step)` and reduces its outputs, wrapped in
`tf.function(jit_compile=model.jit_compile)`. Its `train_step` is keras_vit's (`keras_vit.TrainingSteps`):
MixUp/CutMix, gradient accumulation's while loop, the forward and backward passes (dropout, stochastic depth) and
the optimizer's update (clipping, weight decay, the layer-wise rates, the moving average). The loop over
`steps_per_execution` around it (`multi_step_on_iterator`, which reads the tf.data iterator) is a plain
tf.function, not compiled.

RandAugment (`keras_vit.data.randaugment`) runs in the tf.data pipeline (keras_vit/data/pipeline.py), on the host
CPU, also under TPUStrategy: it is not in the step. Applied on the device it would have to compile, and all 16 of
its ops do: each, mapped over a batch, gives the images it gives on the host, bit for bit (Rotate and the shears,
whose host kernel has no XLA form, at many magnitudes and sizes), and so does RandAugment(2, 10) of a batch.

The SavedModel's `serving_images` compiles, but for its `top_k_names` output (strings, which XLA has no type for)
when the export has class names, as the training job's exports do. `serving_bytes` decodes JPEG/PNG strings: not
XLA, as expected, and not called here: a string argument to a jit_compile function aborts the process in
TensorFlow 2.21 ("Check failed: DataTypeCanUseMemcpy(dtype())", while hashing the arguments for the compilation
cache) instead of raising.
"""

import functools
import inspect
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_vit
from experiments import models
from experiments.configs import imagenet_s16
from keras_vit import callbacks, export
from keras_vit.data.randaugment import RANDAUGMENT_OPS, apply_op, rand_augment
from keras_vit.kernels import policy as kernel_policy
from keras_vit.kernels import tf_cpu
from keras_vit.testing import random_images, randomize_weights

# The message of TensorFlow's refusal: an op without an XLA kernel, or a shape argument known only when it runs.
NOT_COMPILED = r"Detected unsupported operations when trying to compile|must be a compile-time constant"


# === The negative check: jit_compile=True does not leave an op outside XLA, it fails ===


@pytest.mark.parametrize(
    "op, name",
    [
        (lambda x: tf.py_function(lambda a: a * 2, [x], tf.float32), "EagerPyFunc"),
        (lambda x: tf.cast(tf.strings.length(tf.strings.as_string(x)), tf.float32), "AsString"),
    ],
    ids=["py_function", "strings"],
)
def test_an_op_outside_xla_fails_the_compiled_function(op, name):
    x = tf.constant([1.0, 2.5])
    assert op(x).shape == (2,)  # The op runs without XLA...
    compiled = tf.function(lambda x: op(x) + 1.0, jit_compile=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match=NOT_COMPILED) as refusal:
        compiled(x)  # ...and the compiled function refuses it rather than run it outside XLA.
    assert name in str(refusal.value)


class PyFunctionHead(keras.Model):
    """A Dense layer whose output goes through tf.py_function: an op without an XLA kernel inside `fit`'s step."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        y = self.dense(x)
        return tf.reshape(tf.py_function(lambda a: a, [y], tf.float32), tf.shape(y))


def test_an_op_outside_xla_fails_keras_compiled_training_step():
    """Keras' step compiled with jit_compile=True refuses the op too: `fit` raises, it does not run the step
    without XLA. (Keras itself turns XLA off, with a warning, for a layer whose `supports_jit` is False: the
    test below asserts that the step's tf.function has jit_compile=True.)"""
    x, y = np.ones((4, 2), "float32"), np.ones((4, 1), "float32")
    for jit_compile in (False, True):
        model = PyFunctionHead()
        model.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=jit_compile)
        assert model.jit_compile is jit_compile
        if not jit_compile:
            assert math.isfinite(model.fit(x, y, epochs=1, verbose=0).history["loss"][0])
            continue
        with pytest.raises(tf.errors.InvalidArgumentError, match=NOT_COMPILED) as refusal:
            model.fit(x, y, epochs=1, verbose=0)
        assert "EagerPyFunc" in str(refusal.value)


# === The training step ===


def every_feature_config(precision):
    """imagenet_s16's config (MixUp 0.2, weight decay on the kernels only, clipping at 1.0, global average pooling,
    sin-cos position embeddings, a pre-logits layer) with a tiny model (`build_vit`'s "testing" variant widened to
    32, 2 layers, patch 8, images of 32) and the configs' other training features on: CutMix beside MixUp, label
    smoothing, dropout, attention dropout, stochastic depth, the moving average, layer-wise decay, gradient
    accumulation; XLA on."""
    config = imagenet_s16.get_config()
    config.image_size = 32
    config.model.update(
        variant="testing", hidden_dim=32, num_layers=2, num_heads=2, mlp_dim=64, patch_size=8, representation_size=32,
        # Not zero, so that the first step's gradients reach every weight.
        head_kernel_initializer="glorot_uniform",
        dropout_rate=0.1, attention_dropout_rate=0.1, stochastic_depth_rate=0.2,
    )  # fmt: skip
    config.augment.cutmix_alpha = 1.0
    config.label_smoothing = 0.1
    config.ema_momentum = 0.9
    config.layer_decay = 0.75
    config.grad_accum_steps = 2
    config.jit_compile = "on"
    config.precision = precision
    return config


def compiled_step(model):
    """The tf.function Keras runs each training step in (`one_step_on_data`, see the module doc)."""
    step = inspect.getclosurevars(model.train_function).nonlocals.get("one_step_on_data")
    step = getattr(step, "__wrapped__", None)  # Under `_autoconvert_optionals`' wrapper.
    assert isinstance(step, tf.types.experimental.PolymorphicFunction), (
        f"Keras' TensorFlow trainer no longer runs its step as `one_step_on_data`: {model.train_function}"
    )
    return step


def counting(monkeypatch, module, names):
    """Counts the calls of `module`'s functions `names`: {name: calls}."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        original = getattr(module, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.slow  # Tracing and compiling the step: 10-25 s on 2 cores.
@pytest.mark.parametrize("forms, precision", [("tpu", "mixed_bfloat16")], ids=["tpu_forms_bfloat16"])
def test_the_training_step_with_every_feature_compiles_with_xla(forms, precision, policy, monkeypatch):
    """The job's path (`experiments.models`: build_model, make_optimizer, compile_model with config.jit_compile
    "on") fits 2 steps of uint8 images with one-hot labels, the step compiled with XLA as a whole.

    The kernels' forms are picked from where the step is traced (`keras_vit.kernels.policy`): "tpu" traces the
    forms a TPU gets (the reference forms: what TPUStrategy's replica step traces), "cpu" this CPU's
    (`keras_vit.kernels.tf_cpu`, whose dropout is XLA's own ThreeFry form)."""
    if forms == "tpu":
        monkeypatch.setattr(kernel_policy, "device", lambda backend=None: "tpu")
    cpu_forms = counting(monkeypatch, tf_cpu, ["attention_for_training", "layer_norm_for_training", "dropout_in_xla"])
    config = every_feature_config(precision)
    policy(config.precision)
    model = models.build_model(config, num_classes=4)
    optimizer = models.make_optimizer(config, 10, 0, model=model)
    models.compile_model(model, config, optimizer)
    # Built before fit, as under a strategy's scope: fit then traces (and compiles) its step once.
    optimizer.build(model.trainable_variables)
    assert model.jit_compile is True
    assert model.batch_mixer.mixup_alpha == 0.2 and model.batch_mixer.cutmix_alpha == 1.0
    assert model.gradient_accumulation_steps == 2 and optimizer.use_ema
    assert len(set(optimizer.learning_rate_scales.values())) == 4  # The embeddings, 2 blocks, the head.

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (8, 32, 32, 3), dtype=np.uint8)
    labels = np.eye(4, dtype="float32")[rng.integers(0, 4, 8)]
    batches = tf.data.Dataset.from_tensor_slices((images, labels)).batch(4, drop_remainder=True)
    before = [w.numpy().copy() for w in model.trainable_weights]
    ema = callbacks.EMAWeights()
    history = model.fit(batches, epochs=1, verbose=0, shuffle=False, callbacks=[ema, ema.restorer()])

    step = compiled_step(model)
    assert step._jit_compile is True  # What Keras gave tf.function; no public accessor.
    assert step.experimental_get_tracing_count() == 1
    assert int(optimizer.iterations.numpy()) == 2  # One update per batch of 2 micro-batches.
    assert math.isfinite(history.history["loss"][0]) and 0 < history.history["loss"][0] < 10
    unchanged = [w.path for w, old in zip(model.trainable_weights, before) if np.array_equal(w.numpy(), old)]
    assert not unchanged, unchanged
    assert all(np.isfinite(w.numpy()).all() for w in model.trainable_weights)
    if forms == "tpu":
        assert not any(cpu_forms.values()), cpu_forms
    else:
        assert all(cpu_forms.values()), cpu_forms


# === RandAugment on the device ===

# The ops that do not compile, and why (keras_vit/data/randaugment.py): none. Three had a TensorFlow kernel that XLA
# lacks (ImageProjectiveTransformV3, for Rotate, ShearX and ShearY) and three a shape that depends on the seed (the
# padding of TranslateX and TranslateY, Cutout's box); traced for XLA they now take forms that compile and give
# the host's pixels (test_the_xla_form_of_rotate_and_shear_is_the_host_kernel_bit_for_bit). Equalize compiled only
# for an image known when compiling (test_randaugment_op_compiles_with_xla's docstring).
RANDAUGMENT_OUTSIDE_XLA = {}

# The ops whose result depends on the seed: the sign of the geometric ops, where Cutout's box falls.
SEEDED = ("Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY", "Cutout")


@functools.cache
def rgb_image(height=24, width=32):
    """A uint8 (height, width, 3) image: random pixels over a gradient, so that every op changes something."""
    ramp = np.add.outer(np.arange(height), np.arange(width))[:, :, None] * max(216 // (height + width - 2), 1)
    return np.clip(ramp + random_images((height, width, 3), seed=1) // 4, 0, 255).astype(np.uint8)


def seed_pairs(count):
    """`count` int32 seed pairs, of both signs for the geometric ops (the first two differ)."""
    return [tf.constant([seed, 7], tf.int32) for seed in range(4, 4 + count)]


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.xfail(
            strict=True, raises=tf.errors.InvalidArgumentError, reason=RANDAUGMENT_OUTSIDE_XLA[name]
        )) if name in RANDAUGMENT_OUTSIDE_XLA else name
        for name in RANDAUGMENT_OPS
    ],
)  # fmt: skip
def test_randaugment_op_compiles_with_xla(name):
    """Each op at imagenet_s16's magnitude (10), at 2 (where TranslateY and Cutout leave part of the 24 x 32 image
    as it was), 7 and 13, compiled, gives the image it gives without XLA, for 3 images (one twice, with seeds of
    either sign).
    (With the products XLA fuses into multiply-adds, AutoContrast of the last image, Contrast and Sharpness at 7
    and Color at 13 would differ.)

    Mapped over a batch, as on the device: a compiled function's arguments are not compile-time constants
    there. (Called on one image, XLA compiles the function for the image's values where an op needs them
    constant: tf.math.bincount's size, which Equalize no longer takes from the data, passed that way.)"""
    magnitudes = (2, 7, imagenet_s16.get_config().augment.randaugment[1], 13)
    # The first image twice, with seeds of either sign; the last of levels 38 to 88, for AutoContrast to stretch.
    images = tf.constant(np.stack([rgb_image(), rgb_image(), 255 - rgb_image(), rgb_image()[::-1, ::-1] // 5 + 37]))
    batch_seeds = tf.stack(seed_pairs(4))

    def each_image(images, seeds):
        return tf.map_fn(
            lambda pair: tf.stack([apply_op(pair[0], name, magnitude, pair[1]) for magnitude in magnitudes]),
            (images, seeds),
            fn_output_signature=tf.TensorSpec((4, 24, 32, 3), tf.uint8),
        )

    result = tf.function(each_image, jit_compile=True)(images, batch_seeds).numpy()
    expected = each_image(images, batch_seeds).numpy()
    assert result.dtype == np.uint8 and result.shape == (4, 4, 24, 32, 3)
    np.testing.assert_array_equal(result, expected)
    # The seeds reach the compiled ops: the same image with either sign, or another box, and only there.
    assert np.array_equal(result[0], result[1]) is (name not in SEEDED)


@pytest.mark.slow  # XLA compiles of many sizes and magnitudes: 4-5 s each on 2 cores.
@pytest.mark.parametrize("name", ["Rotate", "ShearX", "ShearY"])
def test_the_xla_form_of_rotate_and_shear_is_the_host_kernel_bit_for_bit(name):
    """Compiled, Rotate and the shears compute what TensorFlow's ImageProjectiveTransformV3 computes on the host
    (and what the PIL parity tests check), pixel for pixel: at 6 magnitudes (5 random, in [0, 15]) on images that
    are not square, for 4 seeds, in a function traced for static shapes (the usual case: the products of the
    coefficients are NumPy constants) and in one traced for any size (the products are computed; Rotate's
    coefficients are tensors).

    M = 8.8 on 64 x 96 puts a source coordinate where a fused multiply-add rounds otherwise than the host's
    kernel: the form that lets XLA fuse the products differs there (ShearX, ShearY)."""
    magnitudes = [8.8, *np.random.default_rng(RANDAUGMENT_OPS.index(name)).uniform(0, 15, 5).round(2)]

    def each_magnitude(image, seed):
        return tf.stack([apply_op(image, name, magnitude, seed) for magnitude in magnitudes])

    any_size = [tf.TensorSpec([None, None, 3], tf.uint8), tf.TensorSpec([2], tf.int32)]
    for signature, sizes in [(None, [(64, 96), (45, 26)]), (any_size, [(64, 96)])]:
        host = tf.function(each_magnitude, input_signature=signature)
        compiled = tf.function(each_magnitude, input_signature=signature, jit_compile=True)
        for height, width in sizes:
            image = tf.constant(rgb_image(height, width))
            for seed in seed_pairs(4):
                expected = host(image, seed).numpy()
                np.testing.assert_array_equal(compiled(image, seed).numpy(), expected)
                assert not np.array_equal(expected[0], rgb_image(height, width))


@pytest.mark.slow  # 5 s on 2 cores.
def test_randaugment_of_a_batch_compiles_with_xla():
    """imagenet_s16's RandAugment(2, 10) of a batch, one seed per image, compiled: what applying it on the device
    needs. All 16 ops are compiled (tf.switch_case's branches) and the drawn ones give the host's images."""
    num_ops, magnitude = imagenet_s16.get_config().augment.randaugment
    images = tf.constant(np.stack([rgb_image(), 255 - rgb_image()]))
    seeds = tf.constant([[1, 2], [3, 4]], tf.int32)

    def augment(images, seeds):
        return tf.map_fn(
            lambda pair: rand_augment(pair[0], pair[1], num_ops=num_ops, magnitude=magnitude),
            (images, seeds),
            fn_output_signature=tf.TensorSpec((24, 32, 3), tf.uint8),
        )

    result = tf.function(augment, jit_compile=True)(images, seeds).numpy()
    np.testing.assert_array_equal(result, augment(images, seeds).numpy())


# === The exported SavedModel's serving function ===


@pytest.mark.slow  # Exporting and compiling the serving function: 4-25 s on 2 cores.
@pytest.mark.parametrize(
    "class_names",
    [
        None,
        pytest.param(["cat", "dog", "fish", "bird"], marks=pytest.mark.xfail(
            strict=True,
            raises=tf.errors.InvalidArgumentError,
            reason="the top_k_names output: tf.gather of a string constant (keras_vit/export.py:71); XLA has no "
            "string type (an Identity of DT_STRING is refused)",
        )),
    ],
    ids=["without_class_names", "with_class_names"],
)  # fmt: skip
def test_the_saved_models_serving_images_compiles_with_xla(class_names, tmp_path):
    """`serving_images` of the loaded SavedModel, called in a tf.function with jit_compile=True, returns what its
    plain call returns (float32, to 1e-5; the same top k)."""
    model = randomize_weights(
        keras_vit.build_vit("testing", image_size=32, num_classes=4, patch_size=8, num_heads=2, num_layers=2),
        scale=0.1,
    )
    path = export.export_saved_model(model, tmp_path / "sm", class_names=class_names)
    loaded = tf.saved_model.load(str(path))  # Holds the variables the signature reads.
    serving = loaded.signatures["serving_images"]
    images = tf.constant(random_images((3, 32, 32, 3)).astype(np.uint8))
    plain = serving(images=images)
    compiled = tf.function(lambda images: serving(images=images), jit_compile=True)(images)
    assert set(compiled) == set(plain) == {"logits", "probabilities", "top_k", "top_k_probabilities"}
    for key in ("logits", "probabilities", "top_k_probabilities"):
        assert compiled[key].dtype == tf.float32
        np.testing.assert_allclose(compiled[key].numpy(), plain[key].numpy(), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(compiled["top_k"].numpy(), plain["top_k"].numpy())
    # And the SavedModel computes the model: its logits are Keras'.
    np.testing.assert_allclose(plain["logits"].numpy(), model.predict(images, verbose=0), rtol=0, atol=1e-5)
