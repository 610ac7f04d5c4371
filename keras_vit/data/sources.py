"""Where examples come from: the bundled digits in memory, image folders and TFDS sets read on the fly.

`load_image_source` turns the names jobs take ("tfds:NAME[:SPLIT]", "folder:PATH") into an `ImageSource`;
`ImageSource.decoded` gives one input pipeline (one host) its own share of the files, decoded by
`keras_vit.data.decode`.

Model selection never looks at the test split: every loader can hold out a validation split taken from the
training data (`validation_fraction`, stratified by class for the digits and folders; for TFDS a slice of the
training split, as big_vision's `train[:99%]` / `train[99%:]`), and the training split is then what is left.
"""

import collections
import dataclasses
import os
from collections.abc import Callable

import numpy as np
import tensorflow as tf
from absl import logging

from keras_vit.data.decode import DecodeFailures, decode_image, decode_skipping_failures
from keras_vit.data.header import ImageLimits, as_image_limits


@dataclasses.dataclass
class Split:
    """An in-memory split: uint8 images (N, H, W, C) and int32 labels (N,)."""

    images: np.ndarray
    labels: np.ndarray

    def __len__(self):
        return len(self.labels)


@dataclasses.dataclass
class Dataset:
    """In-memory splits: `validation` (None when none was held out) is taken from the training data."""

    train: Split
    test: Split
    num_classes: int
    class_names: list
    validation: Split | None = None


def _check_fraction(name, value, *, zero=False):
    low_ok = value >= 0.0 if zero else value > 0.0
    if not (low_ok and value < 1.0):
        interval = "[0, 1)" if zero else "(0, 1)"
        raise ValueError(f"`{name}` must be in {interval}. Received: {name}={value!r}")


def load_digits(image_size=8, test_fraction=0.2, seed=0, validation_fraction=0.0):
    """scikit-learn's digits as RGB uint8 images, split into train, test and (optionally) validation.

    The 8x8 images (values 0..16) are scaled to 0..255, resized to
    `image_size` with bilinear interpolation if it is not 8, and repeated over
    three channels so the model sees the RGB input every ViT checkpoint and
    exported model expects.  The test split is stratified by class and
    seeded; with `validation_fraction`, that share of the remaining training
    images is held out as `validation` (stratified, seeded), and `train` is
    the rest.  The test split does not depend on `validation_fraction`.
    """
    # Imported here: scikit-learn is needed for this data set only.
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    _check_fraction("test_fraction", test_fraction)
    _check_fraction("validation_fraction", validation_fraction, zero=True)
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
    validation = None
    if validation_fraction:
        train_x, val_x, train_y, val_y = train_test_split(
            train_x, train_y, test_size=validation_fraction, random_state=seed, stratify=train_y
        )
        validation = Split(val_x, val_y)
    return Dataset(
        train=Split(train_x, train_y),
        test=Split(test_x, test_y),
        num_classes=10,
        class_names=[str(i) for i in range(10)],
        validation=validation,
    )


# === Image data sets: TFDS and folders ===

# The file names a folder's images are listed by (any case); the files are not opened to list them.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp", ".webp")


@dataclasses.dataclass
class ImageSource:
    """Images decoded on the fly: tf.data of (uint8 (H, W, 3) of any size, int32 label).

    `decoded("train" | "validation" | "test", input_context=..., shuffle=..., seed=...)`
    is the data of one input pipeline (one host): with a
    `tf.distribute.InputContext` of several pipelines each reads and decodes
    its own files only.  `train`, `validation` and `test` are all of a split,
    in order.  The validation split (`num_validation` examples; 0 when none
    was held out) is taken from the training data, and the training split is
    what is left of it.  `splits` says what each split is, in words (a TFDS
    split string such as "train[:99%]", or which files of a folder).  Images
    that fail to read or decode are skipped and named in `skipped`, and so
    are those past `image_limits` (refused before decoding, from the size
    their header declares).
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
    num_validation: int = 0
    splits: dict = dataclasses.field(default_factory=dict)  # split -> what it is, in words
    image_limits: ImageLimits = dataclasses.field(default_factory=ImageLimits)

    def decoded(self, split, *, input_context=None, shuffle=False, seed=0, shuffle_buffer=10_000):
        """The decoded (image, label) pairs of `split` ("train", "validation" or "test") for one input pipeline.

        shuffle: a new order each pass, from `seed` (files, then records for
        TFDS within `shuffle_buffer`; a folder's list of names is shuffled
        whole).  Without it, the split's order.
        """
        self.check_split(split)
        records, total = self.read(split, input_context, shuffle, seed, shuffle_buffer)
        what = f"the {split} split"
        if input_context is not None and input_context.num_input_pipelines > 1:
            what += f" read by input pipeline {input_context.input_pipeline_id} of {input_context.num_input_pipelines}"
        if total < 1:
            raise ValueError(f"No examples in {what}.")
        return decode_skipping_failures(records, self.load, self.skipped, what, self.reload, self.image_limits)

    def check_split(self, split):
        """Raises a ValueError unless this source has `split` ("validation" only when one was held out)."""
        if split in ("train", "test") or (split == "validation" and self.num_validation):
            return
        expected = "'train', 'validation' or 'test'" if self.num_validation else "'train' or 'test'"
        message = f"`split` must be {expected}. Received: split={split!r}"
        if split == "validation":
            message += (
                ". No validation split was held out of the training data: load the data set with "
                "validation_fraction > 0 (or, for TFDS, a validation_split)."
            )
        raise ValueError(message)

    @property
    def train(self):
        return self.decoded("train")

    @property
    def validation(self):
        return self.decoded("validation")

    @property
    def test(self):
        return self.decoded("test")


def _pipelines(input_context):
    """(number of input pipelines, this one's index)."""
    if input_context is None:
        return 1, 0
    return input_context.num_input_pipelines, input_context.input_pipeline_id


def _percent(fraction):
    return f"{fraction * 100:g}%"


def _listdir(folder, skipped):
    """The names in `folder`. On a local disk a name that is not UTF-8 is left out and named in `skipped` (a
    `DecodeFailures`; TensorFlow's listing would raise `UnicodeDecodeError` naming no file); object stores
    (gs://) hold UTF-8 names only."""
    if "://" in folder:
        return [name.rstrip("/") for name in tf.io.gfile.listdir(folder)]
    names = []
    for name in os.listdir(os.fsencode(folder)):
        try:
            names.append(name.decode("utf-8"))
        except UnicodeDecodeError:
            shown = name.decode("utf-8", errors="backslashreplace")
            skipped.record(f"{folder}/{shown}", "its name is not UTF-8: rename it to read it")
    return names


def _links_into(root, folder):
    """Whether the local `folder` is a link to `root` or to a folder above it (listing it would list the data
    set again, as a class)."""
    if "://" in folder or not os.path.islink(folder):
        return False
    target, root = os.path.realpath(folder), os.path.realpath(root)
    return root == target or root.startswith(target.rstrip(os.sep) + os.sep)


def _list_class_folders(root, skipped):
    """Class names and the image files of each, by name (extension) only: no file is opened.

    A subfolder is a class if it holds at least one file named as an image and is not a link back into the
    data set; the others are left out with a warning naming them.  A classifier needs two classes.
    """
    folders = sorted(name for name in _listdir(root, skipped) if tf.io.gfile.isdir(f"{root}/{name}"))
    if not folders:
        raise ValueError(f"No class subfolders in {root!r}. Expected one subfolder of images per class.")
    classes, paths, labels, empty, links = [], [], [], [], []
    for name in folders:
        if _links_into(root, f"{root}/{name}"):
            links.append(name)
            continue
        files = sorted(file for file in _listdir(f"{root}/{name}", skipped) if file.lower().endswith(IMAGE_EXTENSIONS))
        if not files:
            empty.append(name)
            continue
        paths += [f"{root}/{name}/{file}" for file in files]
        labels += [len(classes)] * len(files)
        classes.append(name)
    if links:
        logging.warning("Left out of the classes of %s: %s, links back into the data set.", root, links)
    if empty and classes:
        logging.warning(
            "Left out of the classes of %s: %s, with no file named %s.", root, empty, "|".join(IMAGE_EXTENSIONS)
        )
    if not classes:
        raise ValueError(
            f"No images in {root!r}: none of its subfolders {folders} holds a file named "
            f"{'|'.join(IMAGE_EXTENSIONS)}."
        )
    if len(classes) < 2:
        raise ValueError(
            f"One class in {root!r} ({classes[0]!r}): a classifier needs at least two class subfolders of images."
        )
    return classes, paths, labels


def load_image_source(
    name, *, data_dir=None, test_split=None, test_fraction=0.2, seed=0, validation_fraction=0.0,
    validation_split=None, image_limits=None,
):
    """The `ImageSource` named "tfds:NAME[:SPLIT]" (`load_tfds`, SPLIT the training split, default
    "train", e.g. "train[:99%]") or "folder:PATH" (`load_folder`); `validation_fraction` and (TFDS)
    `validation_split` say what is held out of the training data for validation; `image_limits` (an
    `ImageLimits`) what images are decoded."""
    kind, _, rest = str(name).partition(":")
    if kind == "tfds" and rest:
        tfds_name, _, split = rest.partition(":")
        return load_tfds(
            tfds_name, data_dir=data_dir, train_split=split or "train", test_split=test_split,
            validation_split=validation_split, validation_fraction=validation_fraction, image_limits=image_limits,
        )
    if kind == "folder" and rest:
        if validation_split:
            raise ValueError(
                f"`validation_split` names a TFDS split; a folder holds out `validation_fraction` of its training "
                f"files, or reads its validation/ subfolder. Received: validation_split={validation_split!r}"
            )
        return load_folder(
            rest, test_fraction=test_fraction, seed=seed, validation_fraction=validation_fraction,
            image_limits=image_limits,
        )
    raise ValueError(f"Unknown image data set {name!r}. Expected 'tfds:NAME[:SPLIT]' or 'folder:PATH'.")


def _hold_out_files(items, fraction, seed, num_classes):
    """(kept, held out, how) for a list of (path, label): a seeded share `fraction` held out, stratified by
    class when every class has at least two files and the share is at least one per class, otherwise drawn
    at random (`how` says which)."""
    from sklearn.model_selection import train_test_split

    labels = [label for _, label in items]
    stratified = min(np.bincount(labels)) >= 2 and len(labels) * fraction >= num_classes
    kept, held = train_test_split(
        items, test_size=fraction, random_state=seed, stratify=labels if stratified else None
    )
    return kept, held, "stratified by class" if stratified else "at random"


def load_folder(root, *, test_fraction=0.2, seed=0, validation_fraction=0.0, image_limits=None):
    """An image folder: `root/<class>/*.jpg|png|...`, or `root/train/<class>/...` and `root/test/<class>/...`
    (and `root/validation/<class>/...`, used as the validation split when present).

    Files are listed by name (extensions in `IMAGE_EXTENSIONS`, any case):
    none is opened before the input pipeline reads it, which matters on gs://
    (one round trip per file).  Files that then fail to read or decode are
    skipped and named in `source.skipped`, and so are local files whose
    names are not UTF-8, when listed.  Subfolders with no image file, and
    links back into the data set, are not classes (a warning names them);
    fewer than two classes is an error.  Without train/ and test/
    subfolders, a stratified held-out split of `test_fraction` is drawn with
    `seed`.  With `validation_fraction` (and no validation/ subfolder), that
    share of the training files is held out for validation, stratified and
    seeded; the test split does not depend on it.  Each split is kept sorted
    by path, so that sharding it over input pipelines (every n-th file) gives
    each a share of every class.  `image_limits` (an `ImageLimits`; None: the
    defaults): images past them are skipped and named like those that fail
    to decode, before they are decoded.
    """
    _check_fraction("validation_fraction", validation_fraction, zero=True)
    limits = as_image_limits(image_limits)
    root = str(root).rstrip("/")
    if not tf.io.gfile.isdir(root):
        raise ValueError(f"No folder at {root!r}.")
    skipped = DecodeFailures()  # Files left out when listed, then those that fail to decode.
    if tf.io.gfile.isdir(f"{root}/train") and tf.io.gfile.isdir(f"{root}/test"):
        classes, train_paths, train_labels = _list_class_folders(f"{root}/train", skipped)
        splits = {"train": list(zip(train_paths, train_labels))}
        described = {"train": f"{root}/train", "test": f"{root}/test"}
        folders = ["test"] + (["validation"] if tf.io.gfile.isdir(f"{root}/validation") else [])
        for folder in folders:
            other_classes, paths, labels = _list_class_folders(f"{root}/{folder}", skipped)
            if other_classes != classes:
                raise ValueError(
                    f"train/ and {folder}/ of {root!r} have different classes: {classes} vs {other_classes}."
                )
            splits[folder] = list(zip(paths, labels))
        if "validation" in splits:
            described["validation"] = f"{root}/validation"
        elif validation_fraction:
            splits["train"], splits["validation"], how = _hold_out_files(
                splits["train"], validation_fraction, seed, len(classes)
            )
            described["validation"] = f"{_percent(validation_fraction)} of {root}/train, {how} (seed {seed})"
            described["train"] = f"the rest of {root}/train"
    else:
        classes, paths, labels = _list_class_folders(root, skipped)
        if len(paths) < 2:
            raise ValueError(
                f"No images to split in {root!r}: {len(paths)} file(s) named {'|'.join(IMAGE_EXTENSIONS)}."
            )
        train, test, how = _hold_out_files(list(zip(paths, labels)), test_fraction, seed, len(classes))
        splits = {"train": train, "test": test}
        described = {"test": f"{_percent(test_fraction)} of the files in {root}, {how} (seed {seed})"}
        described["train"] = f"the other files in {root}"
        if validation_fraction:
            splits["train"], splits["validation"], how = _hold_out_files(
                train, validation_fraction, seed, len(classes)
            )
            described["validation"] = f"{_percent(validation_fraction)} of the other files, {how} (seed {seed})"
            described["train"] = f"the rest of the files in {root}"
    for name, split in splits.items():
        if not split:
            raise ValueError(f"No images in the {name} split of {root!r}.")
    splits = {name: sorted(split) for name, split in splits.items()}

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
        read=read, load=tf.io.read_file, reload=tf.io.read_file, skipped=skipped,
        num_validation=len(splits.get("validation", ())),
        splits={name: described[name] for name in ("train", "validation", "test") if name in splits},
        image_limits=limits,
    )


def _prepared_tfds(name, data_dir, label_key="label"):
    """(builder, its splits, the label feature) of a TFDS image set prepared in data_dir; a ValueError that
    says what is missing otherwise."""
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
    label = features.get(label_key)
    if isinstance(label, tfds.features.Sequence):
        label = label.feature
    if not (isinstance(features.get("image"), tfds.features.Image) and isinstance(label, tfds.features.ClassLabel)):
        raise ValueError(
            f"TFDS data set {name!r} has features {({k: type(v).__name__ for k, v in features.items()})}. "
            f"Expected an 'image' (tfds.features.Image) and a {label_key!r} (tfds.features.ClassLabel, or a "
            "Sequence of them)."
        )
    return builder, splits, label


def _shared_examples(a, b):
    """How many examples two TFDS (sub)splits have in common, from their file instructions."""
    ranges = collections.defaultdict(list)
    for f in a.file_instructions:
        ranges[os.path.basename(f.filename)].append((f.skip, f.skip + f.take))
    return sum(
        max(0, min(end, f.skip + f.take) - max(start, f.skip))
        for f in b.file_instructions
        for start, end in ranges[os.path.basename(f.filename)]
    )


def _slice_for_validation(train_split, fraction, num_examples):
    """(training, validation) TFDS split strings: the last `fraction` of `train_split` for validation, as
    big_vision's "train[:99%]" / "train[99%:]" (whole percents), else at an example index."""
    if any(c in train_split for c in "[]+"):
        raise ValueError(
            f"`validation_fraction` slices the training split, and {train_split!r} is sliced already; give the "
            "validation split itself (`validation_split`, e.g. 'train[99%:]' beside 'tfds:NAME:train[:99%]')."
        )
    percent = fraction * 100
    if abs(percent - round(percent)) < 1e-9:
        boundary = f"{100 - round(percent)}%"
    else:
        boundary = str(num_examples - round(num_examples * fraction))
    return f"{train_split}[:{boundary}]", f"{train_split}[{boundary}:]"


def load_tfds(name, *, data_dir=None, train_split="train", test_split=None, validation_split=None,
              validation_fraction=0.0, image_limits=None):
    """A TensorFlow Datasets image classification set, read from `data_dir` (local or gs://).

    Nothing is downloaded: prepare the data set beforehand (`tfds build` or
    `download_and_prepare` on a machine with network access).  The images are
    read encoded and decoded here (`decode_image`), so a record that fails to
    decode is skipped and named in `source.skipped` by its TFDS id
    (`NAME-SPLIT.tfrecord-SHARD__INDEX`).  Sharded over input pipelines by
    file; a split with fewer files than pipelines is cut into even ranges of
    examples instead.

    Validation: `validation_split`, a TFDS split string (e.g. "train[99%:]"
    beside train_split="train[:99%]", big_vision's ImageNet minival), or
    `validation_fraction`, the last share of `train_split` (0.01 gives
    "train[:99%]" and "train[99%:]").  TFDS shuffles a set's examples when it
    prepares it, so a slice is a random sample.  Splits that share examples
    are refused.  `image_limits` (an `ImageLimits`; None: the defaults):
    images past them are skipped and named, before they are decoded.
    """
    limits = as_image_limits(image_limits)
    builder, splits, label = _prepared_tfds(name, data_dir)
    if test_split is None:
        test_split = "test" if "test" in splits else "validation"
    _check_fraction("validation_fraction", validation_fraction, zero=True)
    if validation_fraction and not validation_split:
        train_split, validation_split = _slice_for_validation(
            train_split, validation_fraction, splits[train_split].num_examples
        )
    names = {"train": train_split, "test": test_split}
    if validation_split:
        names["validation"] = validation_split
    counts = {split: splits[names[split]].num_examples for split in names}
    if not all(counts.values()):
        raise ValueError(
            f"TFDS {name!r} has an empty split: " + ", ".join(f"{names[s]}={counts[s]}" for s in names) + "."
        )
    for a, b in (("train", "validation"), ("train", "test"), ("validation", "test")):
        shared = a in names and b in names and _shared_examples(splits[names[a]], splits[names[b]])
        if shared:
            raise ValueError(
                f"TFDS {name!r}: the {a} split {names[a]!r} and the {b} split {names[b]!r} share {shared} "
                "examples. Model selection needs them apart."
            )
    read = _tfds_reader(builder, splits, names)

    # A TFDS id is FILE__INDEX, FILE a shard of a split: the record is found again by its place in that split.
    first_of_shard = {}
    for split in list(splits):
        offsets = np.cumsum([0] + list(splits[split].shard_lengths))
        first_of_shard.update(
            {os.path.basename(file): (split, int(offset)) for file, offset in zip(splits[split].filenames, offsets)}
        )

    def reload(tfds_id):
        import tensorflow_datasets as tfds

        shard, _, index = tfds_id.rpartition("__")
        split, offset = first_of_shard[os.path.basename(shard)]
        at = offset + int(index)
        ds = builder.as_dataset(split=f"{split}[{at}:{at + 1}]", decoders={"image": tfds.decode.SkipDecoding()})
        return next(iter(ds))["image"]

    return ImageSource(
        label.num_classes, list(label.names), counts["train"], counts["test"],
        read=read, load=lambda encoded: encoded, reload=reload,
        num_validation=counts.get("validation", 0),
        splits={split: names[split] for split in ("train", "validation", "test") if split in names},
        image_limits=limits,
    )


def _tfds_reader(builder, splits, names):
    """`ImageSource.read` for a TFDS set whose splits ("train", ...) are the TFDS split strings `names`."""
    import tensorflow_datasets as tfds

    def read(split, input_context, shuffle, seed, shuffle_buffer):
        split = names[split]
        read_config = tfds.ReadConfig(shuffle_seed=seed, add_tfds_id=True)
        count, index = _pipelines(input_context)
        # A sliced split ("train[:99%]") has file instructions too: (file, skip, take) for each file it reads.
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

    return read


def load_tfds_evaluation(name, split, *, data_dir=None, label_key="label", image_limits=None):
    """One split of a prepared TFDS image set, for evaluation only: (tf.data of (uint8 (H, W, 3) image,
    label) in the split's order, its number of examples, number of classes).

    `label_key` names a ClassLabel feature (the label is an int32) or a
    Sequence of them, such as ImageNet ReaL's "real_label" in
    "imagenet2012_real" (the label is then a multi-hot float32 vector of the
    classes, all zero for an image with no label).  Made for extra test sets
    (ImageNet-v2, ReaL); an image that fails to decode, or is past
    `image_limits` (an `ImageLimits`; None: the defaults), is left out with a
    warning, so count what comes out.  A ValueError when the set is not
    prepared in data_dir.
    """
    import tensorflow_datasets as tfds

    limits = as_image_limits(image_limits)
    builder, splits, label = _prepared_tfds(name, data_dir, label_key)
    num_examples = splits[split].num_examples
    multi_label = isinstance(builder.info.features[label_key], tfds.features.Sequence)

    def example(ex):
        labels = ex[label_key]
        if multi_label:
            labels = tf.minimum(tf.reduce_sum(tf.one_hot(labels, label.num_classes), axis=0), 1.0)
        else:
            labels = tf.cast(labels, tf.int32)
        return decode_image(ex["image"], limits), labels

    ds = builder.as_dataset(split=split, shuffle_files=False, decoders={"image": tfds.decode.SkipDecoding()})
    ds = ds.map(example, num_parallel_calls=tf.data.AUTOTUNE).ignore_errors(log_warning=True)
    return ds, num_examples, label.num_classes
