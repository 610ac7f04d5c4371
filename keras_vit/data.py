"""Data sets and tf.data input pipelines.

Images stay uint8 in [0, 255] until the model, which rescales them itself
(`build_vit(include_rescaling=True)`), so the same pipeline feeds training,
evaluation and exported models.

The bundled default data set is scikit-learn's digits (1,797 8x8 grey-scale
images of the ten digits, shipped inside the scikit-learn package, so it needs
no download).  Image folders and TFDS sets are read and decoded on the fly
(`load_folder`, `load_tfds`): sharded by file over the input pipelines of a
distributed run, and an image that fails to decode is skipped and named, never
fatal.
"""

import dataclasses
import os
import re
import threading
from typing import Callable

import keras
import numpy as np
import tensorflow as tf
from absl import logging


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
    # In memory, on every worker already: sharded by example across workers
    # (the FILE policy needs files, and there is no decoding to save).
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

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp", ".webp")
# The first bytes of each format tf.io.decode_image reads.
IMAGE_MAGIC = {"JPEG": b"\xff\xd8\xff", "PNG": b"\x89PNG", "GIF": b"GIF8", "BMP": b"BM"}


def decode_image(encoded):
    """Encoded JPEG, PNG, GIF, BMP or WebP bytes -> uint8 (H, W, 3).

    Grey-scale and palette images are expanded to RGB, an alpha channel is
    dropped, CMYK JPEGs are converted, 16-bit PNGs are scaled to 8 bits
    (`value >> 8`) and a GIF gives its first frame.  Data it cannot decode
    raises `tf.errors.InvalidArgumentError`.
    """
    image = tf.io.decode_image(encoded, channels=3, dtype=tf.uint8, expand_animations=False)
    image.set_shape([None, None, 3])
    return image


class DecodeFailures:
    """The examples of an `ImageSource` that could not be read or decoded: skipped, and named here.

    Filled by the input pipelines as they meet each failure; each one is
    logged once (an absl warning with its name and the error) when first met.
    `count` and `paths` (in the order met) are what a job reports at its end.
    In a run over several hosts each host holds the failures of the files it
    read itself.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._errors = {}
        self._unnamed = {}

    def record(self, name, error):
        """Adds one failure; returns whether `name` was new."""
        with self._lock:
            new = name not in self._errors
            if new:
                self._errors[name] = error
        if new:
            logging.warning("Skipped %s: it could not be read or decoded as an image: %s", name, error)
        return new

    def record_unnamed(self, count, before):
        """Adds `count` failures in a row whose names were not kept, met just before `before`."""
        with self._lock:
            new = before not in self._unnamed
            self._unnamed[before] = count
        if new:
            logging.warning("Skipped %d more examples that failed in a row before %s (not named).", count, before)

    @property
    def count(self):
        """The number of distinct examples skipped."""
        with self._lock:
            return len(self._errors) + sum(self._unnamed.values())

    @property
    def paths(self):
        """The names (paths, TFDS ids) of the examples skipped, in the order met."""
        with self._lock:
            return list(self._errors)

    @property
    def errors(self):
        """{name: the error's message}."""
        with self._lock:
            return dict(self._errors)

    def __len__(self):
        return self.count

    def __contains__(self, name):
        with self._lock:
            return name in self._errors

    def __repr__(self):
        paths = self.paths
        return f"DecodeFailures(count={self.count}, paths={paths[:3]}{'...' if len(paths) > 3 else ''})"


def _error_message(error):
    """The useful part of an eager op's error: no function-node prefix, no op suffix."""
    message = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", error.message).split(" [Op:")[0]
    return message.strip() or type(error).__name__


# A 1x1 PNG: the record that ends each pass of `decode_skipping_failures`.
_ONE_PIXEL_PNG = (
    b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x02\x00\x00\x00\x90wS\xde"
    b"\x00\x00\x00\x0cIDAT\x08\xd7c```\x00\x00\x00\x04\x00\x01'4'\n\x00\x00\x00\x00IEND\xaeB`\x82"
)
# The names of up to this many failures in a row are kept; more are counted.
NAMED_IN_A_ROW = 64


def decode_skipping_failures(records, load, failures, what, reload):
    """One pass of (reference, label, name) records -> (uint8 (H, W, 3) image, label), failures left out.

    `load` maps a reference to encoded bytes in the graph (`tf.io.read_file`
    for paths, the identity for bytes); `reload(name)` gives them again,
    eagerly, for the message of an error.

    The records are numbered, each carrying the names of the
    `NAMED_IN_A_ROW` records before it; they are loaded and decoded by a
    parallel map in order, and `ignore_errors` drops a record that fails.  A
    gap in the numbers that come out is the failures, named by the record
    after them, which calls Python (to log them and fill `failures`, a
    `DecodeFailures`); a valid 1x1 image ends the pass so that failures at the
    end are seen too.  Good records never leave the graph: no Python, no GIL,
    no dataset per record (the two other ways to catch one record's error,
    both slower).  When every record of the pass fails, iterating raises an
    error naming `what`: there is nothing to train on, and a repeated pipeline
    would otherwise spin forever.
    """
    end = tf.data.Dataset.from_tensors((tf.constant(""), tf.constant(-1, tf.int32), tf.constant("")))

    def number(state, record):
        index, previous = state
        reference, label, name = record
        return (index + 1, tf.concat([previous[1:], [name]], 0)), (index, reference, label, previous)

    def decode(index, reference, label, previous):
        encoded = tf.cond(label < 0, lambda: tf.constant(_ONE_PIXEL_PNG), lambda: load(reference))
        return index, decode_image(encoded), label, previous

    def measure_gap(last, element):
        index, image, label, previous = element
        return index, (index - last - 1, last < 0, image, label, previous)

    def note(missing, nothing_yet, label, previous):
        missing = int(missing)
        names = [name.decode("utf-8", errors="replace") for name in previous.numpy()[-missing:]]
        for name in names:
            if name in failures:  # Met in an earlier pass.
                continue
            try:  # Once more, eagerly, for the error's message.
                decode_image(reload(name))
                error = "failed in the input pipeline, decoded when tried again (a transient read error?)"
            except tf.errors.OpError as e:
                error = _error_message(e)
            failures.record(name, error)
        if missing > len(names):
            failures.record_unnamed(missing - len(names), names[0])
        if label < 0 and nothing_yet:
            raise ValueError(
                f"All {missing} examples of {what} failed to read or decode (e.g. {names[-1]}: "
                f"{failures.errors.get(names[-1])}). Expected JPEG, PNG, GIF, BMP or WebP images."
            )
        return True

    def keep(missing, nothing_yet, image, label, previous):
        noted = tf.cond(
            missing > 0,
            lambda: tf.reshape(tf.py_function(note, [missing, nothing_yet, label, previous], tf.bool), []),
            lambda: tf.constant(True),
        )
        return tf.logical_and(noted, label >= 0)

    names = tf.fill([NAMED_IN_A_ROW], "")
    ds = records.concatenate(end).scan((tf.constant(0, tf.int64), names), number)
    # In order, whatever the options say: the numbers must come out as they went in.
    ds = ds.map(decode, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).ignore_errors()
    ds = ds.scan(tf.constant(-1, tf.int64), measure_gap).filter(keep)
    return ds.map(lambda missing, nothing_yet, image, label, previous: (image, label))


@dataclasses.dataclass
class ImageSource:
    """Images decoded on the fly: tf.data of (uint8 (H, W, 3) of any size, int32 label).

    `decoded("train" | "test", input_context=..., shuffle=..., seed=...)` is
    the data of one input pipeline (one host): with a
    `tf.distribute.InputContext` of several pipelines each reads and decodes
    its own files only.  `train` and `test` are all of a split, in order.
    Images that fail to read or decode are skipped and named in `skipped`.
    """

    num_classes: int
    class_names: list
    num_train: int
    num_test: int
    # (split, input_context, shuffle, seed, shuffle_buffer) -> (tf.data of (reference, label, name),
    # the number of records this pipeline reads per pass).
    read: Callable[..., tuple]
    load: Callable[[tf.Tensor], tf.Tensor]  # reference -> encoded bytes, in the graph
    reload: Callable[[str], tf.Tensor]  # name -> encoded bytes, eagerly (for error messages)
    skipped: DecodeFailures = dataclasses.field(default_factory=DecodeFailures)

    def decoded(self, split, *, input_context=None, shuffle=False, seed=0, shuffle_buffer=10_000):
        """The decoded (image, label) pairs of `split` ("train" or "test") for one input pipeline.

        shuffle: a new order each pass, from `seed` (files, then records for
        TFDS within `shuffle_buffer`; a folder's list of names is shuffled
        whole).  Without it, the split's order.
        """
        if split not in ("train", "test"):
            raise ValueError(f"`split` must be 'train' or 'test'. Received: split={split!r}")
        records, total = self.read(split, input_context, shuffle, seed, shuffle_buffer)
        what = f"the {split} split"
        if input_context is not None and input_context.num_input_pipelines > 1:
            what += f" read by input pipeline {input_context.input_pipeline_id} of {input_context.num_input_pipelines}"
        if total < 1:
            raise ValueError(f"No examples in {what}.")
        return decode_skipping_failures(records, self.load, self.skipped, what, self.reload)

    @property
    def train(self):
        return self.decoded("train")

    @property
    def test(self):
        return self.decoded("test")


def _pipelines(input_context):
    """(number of input pipelines, this one's index)."""
    if input_context is None:
        return 1, 0
    return input_context.num_input_pipelines, input_context.input_pipeline_id


def _list_class_folders(root):
    """Class names and the image files of each, by name (extension) only: no file is opened."""
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


def load_image_source(name, *, data_dir=None, test_split=None, test_fraction=0.2, seed=0):
    """The `ImageSource` named "tfds:NAME[:SPLIT]" (`load_tfds`, SPLIT the training split, default
    "train") or "folder:PATH" (`load_folder`)."""
    kind, _, rest = str(name).partition(":")
    if kind == "tfds" and rest:
        tfds_name, _, split = rest.partition(":")
        return load_tfds(tfds_name, data_dir=data_dir, train_split=split or "train", test_split=test_split)
    if kind == "folder" and rest:
        return load_folder(rest, test_fraction=test_fraction, seed=seed)
    raise ValueError(f"Unknown image data set {name!r}. Expected 'tfds:NAME[:SPLIT]' or 'folder:PATH'.")


def load_folder(root, *, test_fraction=0.2, seed=0):
    """An image folder: `root/<class>/*.jpg|png|...`, or `root/train/<class>/...` and `root/test/<class>/...`.

    Files are listed by name (extensions in `IMAGE_EXTENSIONS`, any case):
    none is opened before the input pipeline reads it, which matters on gs://
    (one round trip per file).  Files that then fail to read or decode are
    skipped and named in `source.skipped`.  Without train/ and test/
    subfolders, a stratified held-out split of `test_fraction` is drawn with
    `seed`.  Each split is kept sorted by path, so that sharding it over
    input pipelines (every n-th file) gives each a share of every class.
    """
    from sklearn.model_selection import train_test_split

    root = str(root).rstrip("/")
    if not tf.io.gfile.isdir(root):
        raise ValueError(f"No folder at {root!r}.")
    if tf.io.gfile.isdir(f"{root}/train") and tf.io.gfile.isdir(f"{root}/test"):
        classes, train_paths, train_labels = _list_class_folders(f"{root}/train")
        test_classes, test_paths, test_labels = _list_class_folders(f"{root}/test")
        if test_classes != classes:
            raise ValueError(f"train/ and test/ of {root!r} have different classes: {classes} vs {test_classes}.")
        splits = [list(zip(train_paths, train_labels)), list(zip(test_paths, test_labels))]
    else:
        classes, paths, labels = _list_class_folders(root)
        if len(paths) < 2:
            raise ValueError(
                f"No images to split in {root!r}: {len(paths)} file(s) named {'|'.join(IMAGE_EXTENSIONS)}."
            )
        stratify = labels if min(np.bincount(labels)) >= 2 and len(paths) * test_fraction >= len(classes) else None
        splits = train_test_split(
            list(zip(paths, labels)), test_size=test_fraction, random_state=seed, stratify=stratify
        )
    for name, split in zip(("train", "test"), splits):
        if not split:
            raise ValueError(f"No images in the {name} split of {root!r}.")
    splits = dict(zip(("train", "test"), (sorted(split) for split in splits)))

    def read(split, input_context, shuffle, seed, shuffle_buffer):
        del shuffle_buffer  # The list of names is shuffled whole.
        paths = [path for path, _ in splits[split]]
        labels = np.array([label for _, label in splits[split]], np.int32)
        count, index = _pipelines(input_context)
        # Sharded by file, before anything is read: each pipeline reads its own.
        records = tf.data.Dataset.from_tensor_slices((paths, labels, paths)).shard(count, index)
        total = len(range(index, len(paths), count))
        if shuffle:
            records = records.shuffle(max(total, 1), seed=seed, reshuffle_each_iteration=True)
        return records, total

    return ImageSource(
        len(classes), classes, len(splits["train"]), len(splits["test"]),
        read=read, load=tf.io.read_file, reload=tf.io.read_file,
    )


def load_tfds(name, *, data_dir=None, train_split="train", test_split=None):
    """A TensorFlow Datasets image classification set, read from `data_dir` (local or gs://).

    Nothing is downloaded: prepare the data set beforehand (`tfds build` or
    `download_and_prepare` on a machine with network access).  The images are
    read encoded and decoded here (`decode_image`), so a record that fails to
    decode is skipped and named in `source.skipped` by its TFDS id
    (`NAME-SPLIT.tfrecord-SHARD__INDEX`).  Sharded over input pipelines by
    file; a split with fewer files than pipelines is cut into even ranges of
    examples instead.
    """
    import tensorflow_datasets as tfds

    not_prepared = (
        f"TFDS data set {name!r} is not prepared in data_dir={data_dir!r}; prepare it first "
        "(`tfds build` or `builder.download_and_prepare()` where the network is reachable)."
    )
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.DatasetNotFoundError:  # Neither a TFDS builder nor prepared files of that name.
        raise ValueError(not_prepared) from None
    splits = builder.info.splits
    if not splits:
        raise ValueError(not_prepared)
    features = dict(builder.info.features.items())
    if not (isinstance(features.get("image"), tfds.features.Image)
            and isinstance(features.get("label"), tfds.features.ClassLabel)):
        raise ValueError(
            f"TFDS data set {name!r} has features {({k: type(v).__name__ for k, v in features.items()})}. "
            "Expected an 'image' (tfds.features.Image) and a 'label' (tfds.features.ClassLabel)."
        )
    label = features["label"]
    if test_split is None:
        test_split = "test" if "test" in splits else "validation"
    names = {"train": train_split, "test": test_split}
    counts = [splits[names[split]].num_examples for split in ("train", "test")]
    if not all(counts):
        raise ValueError(f"TFDS {name!r} has an empty split: {train_split}={counts[0]}, {test_split}={counts[1]}.")

    def read(split, input_context, shuffle, seed, shuffle_buffer):
        split = names[split]
        read_config = tfds.ReadConfig(shuffle_seed=seed, add_tfds_id=True)
        count, index = _pipelines(input_context)
        files = splits[split].file_instructions
        if count == 1:
            total = splits[split].num_examples
        elif len(files) >= count:
            read_config = read_config.replace(input_context=input_context)  # TFDS takes every count-th file.
            total = sum(f.take for f in files[index::count])
        else:
            split = tfds.even_splits(split, n=count)[index]
            total = splits[split].num_examples
        ds = builder.as_dataset(
            split=split,
            shuffle_files=shuffle,
            read_config=read_config,
            decoders={"image": tfds.decode.SkipDecoding()},
        )
        if shuffle:
            # Encoded records: a buffer of them costs a tenth of decoded images.
            ds = ds.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
        return ds.map(lambda ex: (ex["image"], tf.cast(ex["label"], tf.int32), ex["tfds_id"])), total

    # A TFDS id is FILE__INDEX, FILE a shard of a split: the record is found again by its place in the split.
    first_of_shard = {}
    for split in set(names.values()):
        offsets = np.cumsum([0] + list(splits[split].shard_lengths))
        first_of_shard.update(
            {os.path.basename(file): (split, int(offset)) for file, offset in zip(splits[split].filenames, offsets)}
        )

    def reload(tfds_id):
        shard, _, index = tfds_id.rpartition("__")
        split, offset = first_of_shard[os.path.basename(shard)]
        at = offset + int(index)
        ds = builder.as_dataset(split=f"{split}[{at}:{at + 1}]", decoders={"image": tfds.decode.SkipDecoding()})
        return next(iter(ds))["image"]

    return ImageSource(
        label.num_classes, list(label.names), counts[0], counts[1],
        read=read, load=lambda encoded: encoded, reload=reload,
    )


def training_pipeline(
    source, image_size, global_batch_size, input_context=None, *, seed=0, crop=True, flip=True, randaugment=None,
    cache=False,
):
    """What one input pipeline (one host) feeds `fit`: batches of its share of `source`'s training files.

    Sharded by file (with `input_context`), shuffled before decoding, images
    that fail to decode skipped, augmented as `image_pipeline` does, batched
    per replica (`global_batch_size / replicas`), and endless: `fit` is given
    `steps_per_epoch`, the same on every host.  Made for
    `strategy.distribute_datasets_from_function(functools.partial(training_pipeline, source, size, batch))`;
    without a strategy, call it as it is.
    """
    pipeline_id = input_context.input_pipeline_id if input_context else 0
    batch_size = input_context.get_per_replica_batch_size(global_batch_size) if input_context else global_batch_size
    return image_pipeline(
        source.decoded("train", input_context=input_context, shuffle=True, seed=seed),
        image_size,
        batch_size,
        training=True,
        num_classes=source.num_classes,
        seed=seed + pipeline_id,  # Each pipeline draws its own crops.
        crop=crop,
        flip=flip,
        randaugment=randaugment,
        cache=cache,
        # The source shuffles before decoding; what a cache replays needs shuffling after it.
        shuffle_buffer=10_000 if cache else 0,
        repeat=True,
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
    crop_fraction=1.0,
    cache=False,
    shuffle_buffer=10_000,
    repeat=False,
):
    """Batches of (uint8 pixels, one-hot labels) from decoded (image, label) pairs.

    Training: shuffled with `seed` in a buffer of `shuffle_buffer` decoded
    images (0: none, for a source that shuffles before decoding, as
    `ImageSource.decoded(shuffle=True)` does), Inception crop and horizontal
    flip (stateless, seeded per example: the same seed gives the same
    batches), optional RandAugment (num_ops, magnitude);
    `drop_remainder=True`; with `repeat`, endless, so that `fit` (given
    `steps_per_epoch`) runs the same number of steps on every host of a
    distributed run, whatever its share of the files and of the images that
    fail to decode.
    Evaluation: `center_crop_resize`, every example.  Pixels stay uint8 up to
    the model; batch mixing (MixUp, CutMix) is not done here.
    """
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    if cache:
        ds = ds.cache()
    if training:
        if repeat:
            ds = ds.repeat()
        if shuffle_buffer:
            ds = ds.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
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
    # Handed to `fit` as a tf.data.Dataset (evaluation), it is split by example
    # across workers; built inside `strategy.distribute_datasets_from_function`
    # (training), each input pipeline has read its own files and no policy applies.
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return ds.with_options(options).prefetch(tf.data.AUTOTUNE)
