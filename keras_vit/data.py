"""Data sets and tf.data input pipelines.

Images stay uint8 in [0, 255] until the model, which rescales them itself
(`build_vit(include_rescaling=True)`), so the same pipeline feeds training,
evaluation and exported models.

The bundled default data set is scikit-learn's digits (1,797 8x8 grey-scale
images of the ten digits, shipped inside the scikit-learn package, so it needs
no download).
"""

import dataclasses

import keras
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


# === Image data sets: TFDS and folders ===

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp")
# The first bytes of each format tf.io.decode_image reads.
IMAGE_MAGIC = {"JPEG": b"\xff\xd8\xff", "PNG": b"\x89PNG", "GIF": b"GIF8", "BMP": b"BM"}


@dataclasses.dataclass
class ImageSource:
    """Decoded-on-the-fly images: tf.data of (uint8 (H, W, 3) of any size, int32 label)."""

    train: tf.data.Dataset
    test: tf.data.Dataset
    num_classes: int
    class_names: list
    num_train: int
    num_test: int
    skipped: list = dataclasses.field(default_factory=list)


def _decode(path, label):
    image = tf.io.decode_image(tf.io.read_file(path), channels=3, expand_animations=False)
    image.set_shape([None, None, 3])
    return image, label


def _is_image_file(path):
    """Reads the first bytes: is this a JPEG, PNG, GIF or BMP at all?"""
    try:
        with tf.io.gfile.GFile(path, "rb") as f:
            head = f.read(8)
    except tf.errors.OpError:
        return False
    return any(head.startswith(magic) for magic in IMAGE_MAGIC.values())


def _list_class_folders(root):
    classes = sorted(
        name.rstrip("/") for name in tf.io.gfile.listdir(root) if tf.io.gfile.isdir(f"{root}/{name.rstrip('/')}")
    )
    if not classes:
        raise ValueError(f"No class subfolders in {root!r}. Expected one subfolder of images per class.")
    paths, labels = [], []
    for label, name in enumerate(classes):
        for file in sorted(tf.io.gfile.listdir(f"{root}/{name}")):
            if file.lower().endswith(IMAGE_EXTENSIONS):
                paths.append(f"{root}/{name}/{file}")
                labels.append(label)
    return classes, paths, labels


def load_folder(root, *, test_fraction=0.2, seed=0):
    """An image folder: `root/<class>/*.jpg|png|...`, or `root/train/<class>/...` and `root/test/<class>/...`.

    Files that are not images (checked from their first bytes) are skipped,
    counted and logged.  Without train/ and test/ subfolders, a stratified
    held-out split of `test_fraction` is drawn with `seed`.
    """
    from absl import logging
    from sklearn.model_selection import train_test_split

    root = str(root).rstrip("/")
    if not tf.io.gfile.isdir(root):
        raise ValueError(f"No folder at {root!r}.")
    skipped = []

    def readable(paths, labels):
        good = []
        for path, label in zip(paths, labels):
            if _is_image_file(path):
                good.append((path, label))
            else:
                skipped.append(path)
        return good

    if tf.io.gfile.isdir(f"{root}/train") and tf.io.gfile.isdir(f"{root}/test"):
        classes, train_paths, train_labels = _list_class_folders(f"{root}/train")
        test_classes, test_paths, test_labels = _list_class_folders(f"{root}/test")
        if test_classes != classes:
            raise ValueError(f"train/ and test/ of {root!r} have different classes: {classes} vs {test_classes}.")
        splits = [readable(train_paths, train_labels), readable(test_paths, test_labels)]
    else:
        classes, paths, labels = _list_class_folders(root)
        good = readable(paths, labels)
        if len(good) < 2:
            raise ValueError(
                f"No readable images to split in {root!r}: {len(good)} image(s), {len(skipped)} skipped."
            )
        labels = [label for _, label in good]
        stratify = labels if min(np.bincount(labels)) >= 2 and len(good) * test_fraction >= len(classes) else None
        splits = train_test_split(good, test_size=test_fraction, random_state=seed, stratify=stratify)
    for split in splits:
        if not split:
            raise ValueError(f"No readable images in a split of {root!r} ({len(skipped)} files skipped).")
    if skipped:
        logging.warning(
            "Skipped %d file(s) of %r that are not readable images, e.g. %s", len(skipped), root, skipped[:3]
        )
    datasets = [
        tf.data.Dataset.from_tensor_slices(([p for p, _ in good], np.array([l for _, l in good], np.int32))).map(
            _decode, num_parallel_calls=tf.data.AUTOTUNE
        )
        for good in splits
    ]
    return ImageSource(datasets[0], datasets[1], len(classes), classes, len(splits[0]), len(splits[1]), skipped)


def load_tfds(name, *, data_dir=None, train_split="train", test_split=None):
    """A TensorFlow Datasets image classification set, read from `data_dir` (local or gs://).

    Nothing is downloaded: prepare the data set beforehand (`tfds build` or
    `download_and_prepare` on a machine with network access).
    """
    import tensorflow_datasets as tfds

    builder = tfds.builder(name, data_dir=data_dir)
    label = builder.info.features["label"]
    splits = builder.info.splits
    if not splits:
        raise ValueError(
            f"TFDS data set {name!r} is not prepared in data_dir={data_dir!r}; prepare it first "
            "(`tfds build` or `builder.download_and_prepare()` where the network is reachable)."
        )
    if test_split is None:
        test_split = "test" if "test" in splits else "validation"

    def as_pairs(split):
        ds = builder.as_dataset(split=split, shuffle_files=False)
        return ds.map(lambda ex: (ex["image"], tf.cast(ex["label"], tf.int32)), num_parallel_calls=tf.data.AUTOTUNE)

    counts = [splits[split].num_examples for split in (train_split, test_split)]
    if not all(counts):
        raise ValueError(f"TFDS {name!r} has an empty split: {train_split}={counts[0]}, {test_split}={counts[1]}.")
    return ImageSource(
        as_pairs(train_split), as_pairs(test_split), label.num_classes, list(label.names), counts[0], counts[1]
    )


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


def image_pipeline(
    ds,
    image_size,
    batch_size,
    *,
    training,
    num_classes,
    seed=0,
    crop=True,
    flip=True,
    randaugment=None,
    mixup_alpha=0.0,
    cutmix_alpha=0.0,
    crop_fraction=1.0,
    cache=False,
):
    """Batches of (pixels, one-hot labels) from decoded (image, label) pairs.

    Training: shuffled with `seed`, Inception crop and horizontal flip
    (stateless, seeded per example: the same seed gives the same batches),
    optional RandAugment (num_ops, magnitude), MixUp/CutMix on batches;
    `drop_remainder=True`.  Evaluation: `center_crop_resize`, every example.
    Pixels stay uint8 until MixUp/CutMix, which blend images into float32.
    """
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    if cache:
        ds = ds.cache()
    if training:
        ds = ds.shuffle(10_000, seed=seed, reshuffle_each_iteration=True)
        randoms = tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True).batch(2)

        def augment(pair, rnd):
            image, label = pair
            rnd_seed = tf.cast(rnd, tf.int32)
            if crop:
                image = inception_crop(image, rnd_seed)
            image = tf.ensure_shape(tf.image.resize(image, (height, width), antialias=True), (height, width, 3))
            if flip:
                image = tf.image.stateless_random_flip_left_right(image, seed=rnd_seed[::-1])
            return tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8), label

        ds = tf.data.Dataset.zip((ds, randoms)).map(augment, num_parallel_calls=tf.data.AUTOTUNE)
        if randaugment:
            # Keras core's RandAugment: keras-cv's is no longer developed and
            # targets older Keras; this one ships with the Keras we depend on.
            num_ops, magnitude = randaugment
            layer = keras.layers.RandAugment(
                value_range=(0, 255), num_ops=num_ops, factor=magnitude / 10.0, seed=seed
            )
            ds = ds.map(lambda x, y: (tf.cast(tf.clip_by_value(layer(x), 0, 255), tf.uint8), y),
                        num_parallel_calls=tf.data.AUTOTUNE)
    else:
        ds = ds.map(
            lambda x, y: (center_crop_resize(x, (height, width), crop_fraction), y),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
    ds = ds.map(lambda x, y: (x, tf.one_hot(y, num_classes)))
    ds = ds.batch(batch_size, drop_remainder=training)
    if training and (mixup_alpha or cutmix_alpha):
        # Keras core layers, for the same reason as RandAugment.
        mixer = (keras.layers.MixUp(alpha=mixup_alpha, seed=seed) if mixup_alpha
                 else keras.layers.CutMix(factor=cutmix_alpha, seed=seed))

        def mix(x, y):
            out = mixer({"images": tf.cast(x, tf.float32), "labels": y})
            return out["images"], out["labels"]

        ds = ds.map(mix, num_parallel_calls=tf.data.AUTOTUNE)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return ds.with_options(options).prefetch(tf.data.AUTOTUNE)
