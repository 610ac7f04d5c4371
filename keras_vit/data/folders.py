"""Image folders, one subfolder per class, local or on gs://: listed by file name and read on the fly.

`load_folder` gives an `ImageSource`; its splits are the folder's train/, validation/ and test/ subfolders
when it has them, otherwise seeded shares of its files, held out stratified by class.
"""

import os

import numpy as np
import tensorflow as tf
from absl import logging

from keras_vit.data.decode import DecodeFailures
from keras_vit.data.header import as_image_limits
from keras_vit.data.image_source import ImageSource, check_fraction, input_pipelines
from keras_vit.data.positions import permutation

# The file names a folder's images are listed by (any case); the files are not opened to list them.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp", ".webp")


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
    check_fraction("validation_fraction", validation_fraction, zero=True)
    limits = as_image_limits(image_limits)
    root = str(root).rstrip("/")
    if not tf.io.gfile.isdir(root):
        raise ValueError(f"No folder at {root!r}.")
    skipped = DecodeFailures()  # Files left out when listed, then those that fail to decode.
    if tf.io.gfile.isdir(f"{root}/train") and tf.io.gfile.isdir(f"{root}/test"):
        classes, splits, described = _split_by_subfolder(root, skipped, validation_fraction, seed)
    else:
        classes, splits, described = _split_by_share(root, skipped, test_fraction, validation_fraction, seed)
    for name, split in splits.items():
        if not split:
            raise ValueError(f"No images in the {name} split of {root!r}.")
    splits = {name: sorted(split) for name, split in splits.items()}
    return ImageSource(
        len(classes), classes, len(splits["train"]), len(splits["test"]),
        read=_folder_reader(splits), read_pass=_folder_pass_reader(splits), load=tf.io.read_file,
        reload=tf.io.read_file, skipped=skipped,
        num_validation=len(splits.get("validation", ())),
        splits={name: described[name] for name in ("train", "validation", "test") if name in splits},
        image_limits=limits,
    )


def _split_by_subfolder(root, skipped, validation_fraction, seed):
    """(classes, {split: [(path, label)]}, {split: what it is, in words}) of a folder with train/ and test/
    subfolders (and validation/, else `validation_fraction` of train/ when it is not 0)."""
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
    return classes, splits, described


def _split_by_share(root, skipped, test_fraction, validation_fraction, seed):
    """(classes, {split: [(path, label)]}, {split: what it is, in words}) of a folder of class subfolders
    only: `test_fraction` of its files held out for testing, then `validation_fraction` of the others."""
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
    return classes, splits, described


def _folder_reader(splits):
    """`ImageSource.read` for a folder whose splits are the sorted lists of (path, label) `splits`."""

    def read(split, input_context, shuffle, seed, shuffle_buffer):
        del shuffle_buffer  # The list of names is shuffled whole.
        paths = [path for path, _ in splits[split]]
        labels = np.array([label for _, label in splits[split]], np.int32)
        count, index = input_pipelines(input_context)
        # Sharded by file, before anything is read: each pipeline reads its own.
        records = tf.data.Dataset.from_tensor_slices((paths, labels, paths)).shard(count, index)
        total = len(range(index, len(paths), count))
        if shuffle:
            records = records.shuffle(max(total, 1), seed=seed, reshuffle_each_iteration=True)
        return records, total

    return read


def _folder_pass_reader(splits):
    """`ImageSource.read_pass` for a folder whose splits are the sorted lists of (path, label) `splits`: this
    pipeline's share of the files (as `read` shards them), the whole list in one order drawn from the seed."""

    def read_pass(split, input_context, order_seed, shuffle_buffer):
        del shuffle_buffer  # The list of names is shuffled whole.
        count, index = input_pipelines(input_context)
        share = splits[split][index::count]
        paths = tf.constant([path for path, _ in share])
        labels = tf.constant(np.array([label for _, label in share], np.int32))
        order = tf.data.Dataset.from_tensor_slices(permutation(len(share), order_seed))
        return order.map(lambda i: (tf.gather(paths, i), tf.gather(labels, i), tf.gather(paths, i)))

    return read_pass
