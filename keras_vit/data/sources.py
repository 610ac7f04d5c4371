"""Where examples come from: the bundled digits in memory, image folders and TFDS sets read on the fly.

`load_image_source` turns the names jobs take ("tfds:NAME[:SPLIT]", "folder:PATH") into an `ImageSource`;
`ImageSource.decoded` gives one input pipeline (one host) its own share of the files, decoded by
`keras_vit.data.decode`.
"""

import dataclasses
import os
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from keras_vit.data.decode import DecodeFailures, decode_skipping_failures


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


# === Image data sets: TFDS and folders ===

# The file names a folder's images are listed by (any case); the files are not opened to list them.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp", ".webp")


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
