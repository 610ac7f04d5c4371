"""MixUp and CutMix inside the compiled training step.

Mixing on the host (in tf.data) sends float32 images to the accelerator, four
times the bytes of the uint8 pixels.  Here the uint8 batch (and its one-hot
float32 labels) crosses to the device as it is, and the mixing is the first
thing the training step does, in the same XLA program as the forward and
backward passes.

- MixUp (Zhang et al. 2017): `lam * x + (1 - lam) * x_partner`, labels the
  same, `lam ~ Beta(mixup_alpha, mixup_alpha)`.
- CutMix (Yun et al. 2019): a box of the partner is pasted into the image,
  of area fraction about `1 - lam`, `lam ~ Beta(cutmix_alpha, cutmix_alpha)`;
  the box is clipped at the image's edges and the labels mix by the area
  actually pasted.
- Both: one of the two per batch, CutMix with probability `switch_prob`.

As in timm's `Mixup` (its default "batch" mode), one lambda (and one box) is
drawn per batch and the partner of example i is example B-1-i of the same
batch (the batch reversed; the batches are shuffled already).  The batch is
the replica's: under a tf.distribute strategy the step runs per replica; on
JAX under `keras.distribution`, where the step sees the global batch, it is
reversed within each device's shard, so that the mixing needs no transfer
between devices.  All replicas draw the same lambda and box, as one device
mixing the global batch would.

The draws are a function of the seed and the optimizer's step counter
(`optimizer.iterations`): the same seed gives the same sequence in every
run of the same program, each step its own draws, and a run resumed by
`BackupAndRestore` mixes as the uninterrupted run would have.  (Other
backends draw other numbers from the same seed, and so does TensorFlow with
XLA and without: its random ops pick their algorithm by where they run.)

The model itself is not changed: `enable_batch_mixing` sets the model's
`batch_mixer`, which its training step (`keras_vit.TrainingSteps`) reads, so
evaluation and prediction never mix and what `model.save` and the checkpoint
callbacks write is the plain model.

>>> import numpy as np
>>> mixer = BatchMixer(mixup_alpha=0.8, seed=0)
>>> images = np.stack([np.full((4, 4, 3), 255 * i, "uint8") for i in (0, 1)])
>>> labels = np.eye(2, dtype="float32")
>>> mixed_images, mixed_labels = mixer(images, labels, step=0)
>>> keras.backend.standardize_dtype(mixed_images.dtype), tuple(mixed_images.shape)
('float32', (2, 4, 4, 3))
>>> # Example 0 (black) mixed with example 1 (white): its label says how much.
>>> bool(np.allclose(np.asarray(mixed_images)[0] / 255, np.asarray(mixed_labels)[0, 1], atol=1e-5))
True
"""

import math
import random

import keras
from keras import ops

from keras_vit import train_step

# Candidates drawn per gamma sample (see `sample_beta`).  Each is accepted with
# probability above 0.95, so all 16 are rejected with probability below 1e-20.
_GAMMA_CANDIDATES = 16
# Seed counters reserved for each training step: step s draws with counters
# 16 s, 16 s + 1, ... of the mixer's seed (it makes at most 7 draws), so no
# two steps share a random stream.
_COUNTERS_PER_STEP = 16


def _log_gamma(alpha, shape, seed):
    """log of Gamma(alpha, 1) samples, by Marsaglia and Tsang's method (2000).

    The rejection loop is unrolled into `_GAMMA_CANDIDATES` candidates drawn
    at once and the first accepted is kept: a fixed-shape computation that
    XLA compiles (TensorFlow's own gamma sampler has no XLA kernel).
    """
    boost = alpha < 1.0
    a = alpha + 1.0 if boost else alpha
    d = a - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    z = keras.random.normal((*shape, _GAMMA_CANDIDATES), seed=seed)
    u = keras.random.uniform((*shape, _GAMMA_CANDIDATES), seed=seed)
    v = (1.0 + c * z) ** 3
    positive = v > 0
    log_v = ops.log(ops.where(positive, v, 1.0))
    accept = ops.logical_and(positive, ops.log(u) < 0.5 * z * z + d - d * v + d * log_v)
    first = ops.argmax(ops.cast(accept, "int32"), axis=-1)
    # No candidate accepted (see above): v = 1, the mode of the proposal.
    log_v = ops.take_along_axis(ops.where(accept, log_v, 0.0), first[..., None], axis=-1)[..., 0]
    log_sample = math.log(d) + log_v
    if boost:
        # Gamma(alpha) = Gamma(alpha + 1) * U ** (1 / alpha), in logs: for small
        # alphas U ** (1 / alpha) underflows float32 to 0.
        u = 1.0 - keras.random.uniform(shape, seed=seed)  # in (0, 1]
        log_sample = log_sample + ops.log(u) / alpha
    return log_sample


def sample_beta(alpha, shape=(), seed=None):
    """float32 samples of the symmetric Beta(alpha, alpha) distribution, `alpha > 0`.

    X / (X + Y) for independent X, Y ~ Gamma(alpha), computed as
    sigmoid(log X - log Y) so that it stays finite for small alphas.  Uses
    `keras.random` and compiles with XLA on every backend, unlike
    `keras.random.beta` on TensorFlow.  `seed`: a `keras.random.SeedGenerator`
    (what a traced function needs), or an int or None outside one.
    """
    if not alpha > 0:
        raise ValueError(f"`alpha` must be positive. Received: alpha={alpha!r}")
    if not isinstance(seed, keras.random.SeedGenerator):
        # An int seed would give every draw below the same stream.
        seed = keras.random.SeedGenerator(seed)
    log_samples = _log_gamma(float(alpha), (*shape, 2), seed)
    return ops.sigmoid(log_samples[..., 0] - log_samples[..., 1])


def _check_alpha(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"`{name}` must be a number >= 0 (0 turns it off). Received: {name}={value!r}")
    return float(value)


def _reverse(x, groups):
    """The batch reversed within each of `groups` equal consecutive groups."""
    if groups == 1:
        return ops.flip(x, axis=0)
    shape = tuple(x.shape)
    grouped = ops.reshape(x, (groups, shape[0] // groups, *shape[1:]))
    return ops.reshape(ops.flip(grouped, axis=1), shape)


class BatchMixer:
    """Mixes a batch of images and one-hot labels: MixUp, CutMix or one of them per batch.

    Args:
        mixup_alpha: Beta(alpha, alpha) of MixUp's lambda; 0 turns MixUp off.
        cutmix_alpha: Beta(alpha, alpha) of CutMix's lambda; 0 turns it off.
        switch_prob: with both on, the probability that a batch is CutMixed
            (otherwise it is MixUped), as in timm.
        seed: int; with None, one is drawn from Python's `random` (which
            `keras.utils.set_random_seed` seeds).

    Call it with (images, labels, step): images (batch, height, width,
    channels) of any dtype, labels (batch, classes) float, and the training
    step (an integer scalar, tensor or not).  Returns the mixed images, cast
    to `dtype`, and the mixed labels; the draws depend on `seed` and `step`
    only.  `groups` > 1 pairs examples within each of that many equal
    consecutive parts of the batch.
    """

    def __init__(self, mixup_alpha=0.0, cutmix_alpha=0.0, switch_prob=0.5, seed=None):
        self.mixup_alpha = _check_alpha("mixup_alpha", mixup_alpha)
        self.cutmix_alpha = _check_alpha("cutmix_alpha", cutmix_alpha)
        if isinstance(switch_prob, bool) or not isinstance(switch_prob, (int, float)) or not 0 <= switch_prob <= 1:
            raise ValueError(f"`switch_prob` must be in [0, 1]. Received: switch_prob={switch_prob!r}")
        self.switch_prob = float(switch_prob)
        if seed is None:
            seed = random.randint(0, 2**31 - 1)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
            raise ValueError(f"`seed` must be an int in [0, 2**31). Received: seed={seed!r}")
        self.seed = seed
        # Its variable is never read or written: every draw maps its state to
        # (seed, counter of the step) in a StatelessScope, which works alike
        # in TensorFlow graphs, JAX traces and under distribution strategies.
        self._generator = keras.random.SeedGenerator(seed, name="batch_mixing_seed")

    @property
    def enabled(self):
        return bool(self.mixup_alpha or self.cutmix_alpha)

    def __repr__(self):
        return (
            f"BatchMixer(mixup_alpha={self.mixup_alpha}, cutmix_alpha={self.cutmix_alpha}, "
            f"switch_prob={self.switch_prob}, seed={self.seed})"
        )

    def __call__(self, images, labels, step, *, dtype="float32", groups=1):
        if not hasattr(images, "shape") or len(images.shape) != 4:
            raise ValueError(
                "Batch mixing expects one tensor of images (batch, height, width, channels). Received: "
                + (f"images.shape={tuple(images.shape)}" if hasattr(images, "shape") else f"images={type(images)}")
            )
        if labels is None or not hasattr(labels, "shape") or len(labels.shape) != 2:
            raise ValueError(
                "Batch mixing expects one-hot labels (batch, classes). Received: "
                + (f"labels.shape={tuple(labels.shape)}" if hasattr(labels, "shape") else f"labels={labels!r}")
            )
        if not keras.backend.is_float_dtype(labels.dtype):
            raise ValueError(
                "Batch mixing expects one-hot float labels (batch, classes), e.g. from "
                f"tf.one_hot. Received labels of dtype {keras.backend.standardize_dtype(labels.dtype)}."
            )
        batch, height, width = images.shape[:3]
        if height is None or width is None:
            raise ValueError(f"Batch mixing needs a static image size. Received: images.shape={tuple(images.shape)}")
        if groups != 1 and (batch is None or batch % groups):
            raise ValueError(f"The batch ({batch}) does not split into {groups} equal groups.")
        if not self.enabled:
            return ops.cast(images, dtype), labels

        image_weight, label_weight = self._draw(step, height, width)
        images = ops.cast(images, dtype)
        image_weight = ops.cast(image_weight, dtype)
        label_weight = ops.cast(label_weight, labels.dtype)
        images = images * image_weight + _reverse(images, groups) * (1 - image_weight)
        labels = labels * label_weight + _reverse(labels, groups) * (1 - label_weight)
        return images, labels

    def mix_training_batch(self, model, data, state=None):
        """`fit`'s batch `data` ((x, y) or (x, y, sample_weight)) with x and y mixed, x cast to the model's
        input dtype, for `model`'s training step (`keras_vit.TrainingSteps`).  On JAX, `state` is the
        trainer's (trainable, non-trainable, optimizer, metrics) values, where the step counter is read."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if state is None:
            step, groups = model.optimizer.iterations, 1
        else:  # JAX: the step is a pure function of `state`; the batch is the global one.
            step = _step_value(model.optimizer, state[2])
            groups = _data_shards(tuple(x.shape)) if hasattr(x, "shape") else 1
        x, y = self(x, y, step, dtype=_input_dtype(model), groups=groups)
        return keras.utils.pack_x_y_sample_weight(x, y, sample_weight)

    def _draw(self, step, height, width):
        """(weight of each example's own pixels, (height, width, 1) or scalar; weight of its own label)."""
        state = self._generator.state
        counter = ops.cast(step, state.dtype) * _COUNTERS_PER_STEP
        start = ops.stack([ops.convert_to_tensor(self.seed, state.dtype), counter])
        with keras.StatelessScope(state_mapping=[(state, start)]):
            switch, top_fraction, left_fraction = ops.unstack(keras.random.uniform((3,), seed=self._generator))
            if self.mixup_alpha:
                mixup = sample_beta(self.mixup_alpha, seed=self._generator)
                if not self.cutmix_alpha:
                    return mixup, mixup
            keep, kept_fraction = self._box(
                sample_beta(self.cutmix_alpha, seed=self._generator), top_fraction, left_fraction, height, width
            )
        if not self.mixup_alpha:
            return keep, kept_fraction
        use_cutmix = switch < self.switch_prob
        return ops.where(use_cutmix, keep, mixup), ops.where(use_cutmix, kept_fraction, mixup)

    @staticmethod
    def _box(lam, y_fraction, x_fraction, height, width):
        """CutMix's box: 1 outside it, 0 inside, (height, width, 1); and the fraction outside.

        Its sides are floor(side * sqrt(1 - lam)), its center uniform over the
        pixels; the part outside the image is cut off.  float32 holds these
        integers exactly.
        """
        ratio = ops.sqrt(1.0 - lam)

        def span(size, fraction):
            length = ops.floor(size * ratio)
            center = ops.minimum(ops.floor(fraction * size), size - 1)
            start = center - ops.floor(length / 2)
            return ops.clip(start, 0, size), ops.clip(start + length, 0, size)

        top, bottom = span(height, y_fraction)
        left, right = span(width, x_fraction)
        rows = ops.arange(height, dtype="float32")
        cols = ops.arange(width, dtype="float32")
        inside = ops.logical_and(
            ops.logical_and(rows >= top, rows < bottom)[:, None],
            ops.logical_and(cols >= left, cols < right)[None, :],
        )
        keep = ops.cast(ops.logical_not(inside), "float32")[..., None]
        return keep, 1.0 - (bottom - top) * (right - left) / (height * width)


def _data_shards(batch_shape):
    """How many devices the current `keras.distribution` splits the batch over (1 without one)."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return 1
    axes = distribution.get_data_layout(batch_shape).axes[0]
    if axes is None:
        return 1
    mesh = distribution.device_mesh
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    return math.prod(sizes[axis] for axis in ((axes,) if isinstance(axes, str) else axes))


def _input_dtype(model):
    """The dtype of the model's (single) input if it is a float, else floatx."""
    inputs = getattr(model, "inputs", None) or []
    if len(inputs) == 1 and keras.backend.is_float_dtype(inputs[0].dtype):
        return keras.backend.standardize_dtype(inputs[0].dtype)
    return keras.config.floatx()


def _step_value(optimizer, optimizer_variables):
    """`optimizer.iterations` in the JAX trainer's state (its values, in `optimizer.variables` order)."""
    for variable, value in zip(optimizer.variables, optimizer_variables):
        if variable is optimizer.iterations:
            return value
    raise ValueError(f"{type(optimizer).__name__}.iterations is not among its variables.")


def enable_batch_mixing(model, mixup_alpha=0.0, cutmix_alpha=0.0, switch_prob=0.5, seed=None):
    """Makes `model.fit` mix each training batch (MixUp/CutMix) inside its compiled step.

    The data pipeline delivers the unmixed batches: images (batch, height,
    width, channels), uint8 is best (the bytes that cross to the device), and
    one-hot float labels (batch, classes).  The step casts the images to the
    model's input dtype, mixes images and labels (see `BatchMixer`), then
    trains on them.  Evaluation and prediction do not
    mix; the model's layers, weights and saved files are unchanged.  Sample
    weights (and `class_weight`, which Keras turns into sample weights from
    the unmixed labels) stay with their example.

    Call it before or after `compile`, in or out of a strategy's scope; the
    next `fit` uses it.  Calling it again replaces the mixing; with both
    alphas 0 the model trains on the batches as they come.

    Args:
        model: a `keras_vit.ViT` (or a model whose class derives from
            `keras_vit.TrainingSteps`) with one image input.
        mixup_alpha, cutmix_alpha, switch_prob, seed: see `BatchMixer`.

    Returns:
        The `BatchMixer`.
    """
    train_step.require_training_steps(model, "Batch mixing")
    mixer = BatchMixer(mixup_alpha, cutmix_alpha, switch_prob, seed)
    model.batch_mixer = mixer  # With gradient accumulation, the whole batch is mixed, then split.
    return mixer

