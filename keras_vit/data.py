"""Data sets and tf.data input pipelines.

Images stay uint8 in [0, 255] until the model, which rescales them itself
(`build_vit(include_rescaling=True)`), so the same pipeline feeds training,
evaluation and exported models.

The bundled default data set is scikit-learn's digits (1,797 8x8 grey-scale
images of the ten digits, shipped inside the scikit-learn package, so it needs
no download).
"""

import dataclasses

import numpy as np
import tensorflow as tf


@dataclasses.dataclass
class Split:
    """An in-memory split: uint8 images (N, H, W, C) and int32 labels (N,)."""

    images: np.ndarray
    labels: np.ndarray

    def __len__(self):
        return len(self.labels)


@dataclasses.dataclass
class Dataset:
    train: Split
    test: Split
    num_classes: int
    class_names: list


def load_digits(image_size=8, test_fraction=0.2, seed=0):
    """scikit-learn's digits as RGB uint8 images, split into train and test.

    The 8x8 images (values 0..16) are scaled to 0..255, resized to
    `image_size` with bilinear interpolation if it is not 8, and repeated over
    three channels so the model sees the RGB input every ViT checkpoint and
    exported model expects.  The split is stratified by class and seeded.
    """
    # Imported here: scikit-learn is needed for this data set only.
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    if not 0.0 < test_fraction < 1.0:
        raise ValueError(
            f"`test_fraction` must be in (0, 1). Received: test_fraction={test_fraction!r}"
        )
    digits = sklearn_digits()
    images = digits.images.astype(np.float32) * (255.0 / 16.0)
    if image_size != 8:
        images = tf.image.resize(images[..., None], (image_size, image_size)).numpy()[..., 0]
    images = np.clip(np.round(images), 0, 255).astype(np.uint8)
    images = np.repeat(images[..., None], 3, axis=-1)
    labels = digits.target.astype(np.int32)
    train_x, test_x, train_y, test_y = train_test_split(
        images, labels, test_size=test_fraction, random_state=seed, stratify=labels
    )
    return Dataset(
        train=Split(train_x, train_y),
        test=Split(test_x, test_y),
        num_classes=10,
        class_names=[str(i) for i in range(10)],
    )


def random_translate(image, max_shift):
    """Shifts one (H, W, C) image by up to `max_shift` pixels each way, zero padded."""
    if max_shift <= 0:
        return image
    padded = tf.pad(image, [[max_shift, max_shift], [max_shift, max_shift], [0, 0]])
    return tf.image.random_crop(padded, tf.shape(image))


def center_crop_resize(image, size, crop_fraction=1.0):
    """Evaluation preprocessing of one (H, W, C) image: resize, then center crop to `size`.

    The image is resized (bilinear, antialiased) so that the central
    `crop_fraction` of its shorter side becomes the target's, keeping the
    aspect ratio, then the center is cropped.  `crop_fraction=1.0` keeps the
    whole shorter side; 0.875 is the usual ImageNet evaluation crop.
    Returns uint8.
    """
    height, width = size
    if not 0.0 < crop_fraction <= 1.0:
        raise ValueError(f"`crop_fraction` must be in (0, 1]. Received: crop_fraction={crop_fraction!r}")
    shape = tf.cast(tf.shape(image)[:2], tf.float32)
    scale = tf.maximum(height / shape[0], width / shape[1]) / crop_fraction
    resized_shape = tf.cast(tf.math.ceil(shape * scale), tf.int32)
    resized = tf.image.resize(image, resized_shape, antialias=True)
    top = (resized_shape[0] - height) // 2
    left = (resized_shape[1] - width) // 2
    cropped = tf.image.crop_to_bounding_box(resized, top, left, height, width)
    return tf.cast(tf.clip_by_value(tf.round(cropped), 0, 255), tf.uint8)


def make_pipeline(split, batch_size, *, training, num_classes=None, seed=0, max_shift=0):
    """A tf.data pipeline of (uint8 images, labels) batches over an in-memory split.

    Training: shuffled with `seed` each epoch, `drop_remainder=True` (static
    shapes, as XLA and TPUs want), optional random translation.  Evaluation:
    in order, every example kept.  With `num_classes`, labels are one-hot
    float32 (what label smoothing needs), otherwise int32 class indices.
    """
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be positive. Received: batch_size={batch_size!r}")
    if training and batch_size > len(split):
        raise ValueError(
            f"`batch_size` ({batch_size}) is larger than the training split ({len(split)} "
            "examples); with drop_remainder=True no batch would be produced."
        )
    ds = tf.data.Dataset.from_tensor_slices((split.images, split.labels))
    # In-memory data: shard by example across workers (the FILE policy needs files).
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    ds = ds.with_options(options)
    if training:
        ds = ds.shuffle(len(split), seed=seed, reshuffle_each_iteration=True)
        if max_shift:
            ds = ds.map(
                lambda x, y: (random_translate(x, max_shift), y),
                num_parallel_calls=tf.data.AUTOTUNE,
            )
    if num_classes:
        ds = ds.map(lambda x, y: (x, tf.one_hot(y, num_classes)))
    ds = ds.batch(batch_size, drop_remainder=training)
    return ds.prefetch(tf.data.AUTOTUNE)
