"""Per-image preprocessing in the graph: the training augmentations (random translation, Inception crop,
flip, RandAugment) and the evaluation resize and center crop.

Images come in as uint8 (H, W, C) and leave as uint8: the model rescales its pixels itself.  A training
image can also come in encoded (`decode_and_crop`): a JPEG is then decoded inside its crop only.
"""

import tensorflow as tf

from keras_vit.data.decode import decode_checked
from keras_vit.data.header import IMAGE_MAGIC, check_jpeg, check_other_formats
from keras_vit.data.randaugment import rand_augment


@tf.autograph.experimental.do_not_convert  # TensorFlow ops as written: no AutoGraph rewrite at each pipeline's trace
def random_translate(image, max_shift, seed=None):
    """Shifts one (H, W, C) image by up to `max_shift` pixels each way, zero padded; with `seed` (a shape [2]
    integer tensor) by a shift that is a function of it."""
    if max_shift <= 0:
        return image
    padded = tf.pad(image, [[max_shift, max_shift], [max_shift, max_shift], [0, 0]])
    if seed is not None:
        return tf.image.stateless_random_crop(padded, tf.shape(image), seed)
    return tf.image.random_crop(padded, tf.shape(image))


@tf.autograph.experimental.do_not_convert
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

def resize_and_crop(image, preprocessing):
    """One (H, W, C) image prepared as a `keras_vit.preprocessing.Preprocessing` says: resized (antialiased; as
    Pillow, the width first and then the height, each pass rounded to uint8), then its center cropped to the
    model's size.  Returns uint8."""
    (height, width), (resize_h, resize_w) = preprocessing.image_size, preprocessing.resize_size
    shape = tf.shape(image, out_type=tf.int64)[:2]
    if preprocessing.keep_aspect_ratio:
        # One scale, the smallest that covers the resize size; the other side floored exactly in integers.
        by_height = resize_h * shape[1] >= resize_w * shape[0]
        new_h = tf.where(by_height, tf.constant(resize_h, tf.int64), tf.math.floordiv(resize_w * shape[0], shape[1]))
        new_w = tf.where(by_height, tf.math.floordiv(resize_h * shape[1], shape[0]), tf.constant(resize_w, tf.int64))
        # A sliver too thin to cover the crop still covers it.
        size = tf.stack([tf.maximum(new_h, resize_h), tf.maximum(new_w, resize_w)])
    else:
        size = tf.constant([resize_h, resize_w], tf.int64)
    # The sizes in int64 above (width x height products), int32 for the ops below.
    size = tf.cast(size, tf.int32)
    method = preprocessing.resize_method
    # As Pillow: the width first, rounded to uint8, then the height (its two passes, within one level).
    resized = image
    for pass_size in (tf.stack([tf.shape(image)[0], size[1]]), size):
        resized = tf.image.resize(resized, pass_size, method=method, antialias=method != "nearest")
        resized = tf.clip_by_value(tf.round(resized), 0, 255)
    resized = tf.cast(resized, tf.uint8)
    margins = size - [height, width]
    if preprocessing.crop_offset == "floor":
        offsets = margins // 2
    else:
        offsets = tf.cast(tf.round(tf.cast(margins, tf.float64) / 2), tf.int32)
    return tf.image.crop_to_bounding_box(resized, offsets[0], offsets[1], height, width)


# The Inception crop's box: 8-100% of the image's area (Szegedy et al. 2015; timm, Keras), aspect 3/4-4/3.
INCEPTION_AREA_RANGE = (0.08, 1.0)
INCEPTION_ASPECT_RANGE = (3 / 4, 4 / 3)


def _crop_box(image_shape, seed, area_range):
    """(begin, size) of an Inception crop of an image of `image_shape` (H, W, C), drawn from `seed`."""
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        image_shape,
        bounding_boxes=tf.zeros([0, 0, 4]),
        seed=seed,
        area_range=area_range,
        aspect_ratio_range=INCEPTION_ASPECT_RANGE,
        min_object_covered=0.0,
        use_image_if_no_bounding_boxes=True,
    )
    return begin, size


def inception_crop(image, seed, area_range=INCEPTION_AREA_RANGE):
    """Inception-style random resized crop: a random box of 8-100% of the area (`area_range`), aspect 3/4-4/3."""
    begin, size = _crop_box(tf.shape(image), seed, area_range)
    return tf.slice(image, begin, size)


@tf.autograph.experimental.do_not_convert
def decode_and_crop(encoded, seed, area_range=INCEPTION_AREA_RANGE, limits=None, *, messages=True):
    """Encoded image bytes -> the uint8 (h, w, 3) Inception crop `inception_crop` takes with the same seed.

    A JPEG is decoded inside the crop only (`tf.image.decode_and_crop_jpeg`,
    its size read from its header), which for a crop of a fraction of the
    image saves most of the decoding, as big_vision's
    `decode_jpeg_and_inception_crop` does; other formats are decoded whole,
    then cropped.  An image past `limits` (an `ImageLimits`; None: the
    defaults) is refused before any decoding (`check_image`, with
    `messages`), and data it cannot decode raises `InvalidArgumentError`.
    """

    def jpeg():
        data, size = check_jpeg(encoded, limits, messages=messages)
        begin, crop = _crop_box(tf.concat([tf.cast(size, tf.int32), [3]], 0), seed, area_range)
        image = tf.image.decode_and_crop_jpeg(data, tf.stack([begin[0], begin[1], crop[0], crop[1]]), channels=3)
        image.set_shape([None, None, 3])
        return image

    def other():
        data, _ = check_other_formats(encoded, limits, messages=messages)
        return inception_crop(decode_checked(data), seed, area_range)

    return tf.cond(tf.strings.substr(encoded, 0, 3) == IMAGE_MAGIC["JPEG"], jpeg, other)


@tf.autograph.experimental.do_not_convert
def resize_flip(image, seed, size, *, flip=True):
    """Resizes one (h, w, 3) image to `size` (bilinear, antialiased) and flips it horizontally with probability
    1/2, drawn from `seed` (an int32 pair).  Returns uint8 (H, W, 3)."""
    height, width = size
    image = tf.ensure_shape(tf.image.resize(image, (height, width), antialias=True), (height, width, 3))
    if flip:
        image = tf.image.stateless_random_flip_left_right(image, seed=seed[::-1])
    return tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)


@tf.autograph.experimental.do_not_convert
def crop_flip_resize(image, seed, size, *, crop=True, flip=True, area_range=INCEPTION_AREA_RANGE):
    """Training augmentation of one (H, W, 3) image: `inception_crop`, resize to `size`, horizontal flip.

    Stateless: `seed` (an int32 pair, one per example) decides the crop and
    the flip, so the same seeds give the same images.  The resize is bilinear
    and antialiased, and happens with or without the crop.  Returns uint8.
    """
    if crop:
        image = inception_crop(image, seed, area_range)
    return resize_flip(image, seed, size, flip=flip)


def randaugment_function(randaugment):
    """`randaugment` as the function of (uint8 image, int32 seed pair) a pipeline applies, or None.

    None: none; (num_ops, magnitude): `keras_vit.data.randaugment.rand_augment`,
    the published policy; a callable of (image, seed) -> image: itself (how a
    benchmark plugs in another implementation).
    """
    if randaugment is None or callable(randaugment):
        return randaugment
    try:
        num_ops, magnitude = randaugment
    except (TypeError, ValueError):
        raise ValueError(
            "`randaugment` must be None, (num_ops, magnitude) or a function of (image, seed). "
            f"Received: randaugment={randaugment!r}"
        ) from None

    def augment(image, seed):
        return rand_augment(image, seed, num_ops=int(num_ops), magnitude=float(magnitude))

    return augment


def randaugment_seed(seed):
    """RandAugment's seed pair for an image, from the image's own (the crop and flip's): independent of it."""
    return tf.random.experimental.stateless_fold_in(tf.cast(seed, tf.int32), 0x52_41)


def make_randaugment(num_ops, magnitude, *, seed=0):
    """The published RandAugment (`keras_vit.data.randaugment.rand_augment`) as a function of uint8 images.

    For use outside a seeded pipeline: each call draws a new seed from a
    generator created here with `seed`, so the same `seed` gives the same
    sequence of images.  Pipelines give each image its own seed instead
    (`rand_augment(image, seed)`), which needs no state.
    """
    generator = tf.random.Generator.from_seed(seed)
    augment = randaugment_function((num_ops, magnitude))

    def rand_augment_image(image):
        return augment(image, generator.uniform_full_int([2], tf.int32))

    return rand_augment_image
