"""Per-image preprocessing in the graph: the training augmentations (random translation, Inception crop,
flip, RandAugment) and the evaluation resize and center crop.

Images come in as uint8 (H, W, C) and leave as uint8: the model rescales its pixels itself.
"""

import keras
import tensorflow as tf


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

def inception_crop(image, seed, area_range=(0.08, 1.0)):
    """Inception-style random resized crop: a random box of 8-100% of the area, aspect 3/4-4/3."""
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.shape(image),
        bounding_boxes=tf.zeros([0, 0, 4]),
        seed=seed,
        area_range=area_range,
        aspect_ratio_range=(3 / 4, 4 / 3),
        min_object_covered=0.0,
        use_image_if_no_bounding_boxes=True,
    )
    return tf.slice(image, begin, size)


def crop_flip_resize(image, seed, size, *, crop=True, flip=True):
    """Training augmentation of one (H, W, 3) image: `inception_crop`, resize to `size`, horizontal flip.

    Stateless: `seed` (an int32 pair, one per example) decides the crop and
    the flip, so the same seeds give the same images.  The resize is bilinear
    and antialiased, and happens with or without the crop.  Returns uint8.
    """
    height, width = size
    if crop:
        image = inception_crop(image, seed)
    image = tf.ensure_shape(tf.image.resize(image, (height, width), antialias=True), (height, width, 3))
    if flip:
        image = tf.image.stateless_random_flip_left_right(image, seed=seed[::-1])
    return tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)


def make_randaugment(num_ops, magnitude, *, seed=0):
    """Keras' `RandAugment` layer as a function of uint8 images; returns uint8.

    `num_ops` operations are drawn at random for each call (each image, in a
    map over images), at `magnitude` on RandAugment's 0-10 scale (Keras'
    `factor = magnitude / 10`).  The layer is created here, once, with `seed`;
    its generator advances with every call.
    """
    # Keras core's RandAugment: keras-cv's is no longer developed and
    # targets older Keras; this one ships with the Keras we depend on.
    layer = keras.layers.RandAugment(value_range=(0, 255), num_ops=num_ops, factor=magnitude / 10.0, seed=seed)

    def rand_augment(image):
        return tf.cast(tf.clip_by_value(layer(image), 0, 255), tf.uint8)

    return rand_augment
