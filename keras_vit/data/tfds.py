"""TensorFlow Datasets image classification sets, prepared beforehand and read encoded on the fly.

`load_tfds` gives an `ImageSource` (train, test and an optional validation split held apart from both);
`load_tfds_evaluation` one split for evaluation only (extra test sets such as ImageNet-v2 and ReaL).
"""

import collections
import os

import numpy as np
import tensorflow as tf

from keras_vit.data.decode import decode_image
from keras_vit.data.header import as_image_limits
from keras_vit.data.image_source import ImageSource, check_fraction, input_pipelines
from keras_vit.data.positions import permutation, seeded_shuffle


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
    check_fraction("validation_fraction", validation_fraction, zero=True)
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
        read=read, read_pass=_tfds_pass_reader(builder, splits, names, read), load=lambda encoded: encoded,
        reload=reload,
        num_validation=counts.get("validation", 0),
        splits={split: names[split] for split in ("train", "validation", "test") if split in names},
        image_limits=limits,
    )


def _pipeline_share(splits, split, input_context):
    """(TFDS split string, its file instructions, sharded by file) of what `input_context`'s input pipeline reads
    of `split`: all of it for one pipeline; every count-th file where there are at least as many files as
    pipelines (as TFDS shards by an input context); else an even range of the examples.  A sliced split
    ("train[:99%]") has file instructions too: (file, skip, take) for each file it reads."""
    import tensorflow_datasets as tfds

    count, index = input_pipelines(input_context)
    files = splits[split].file_instructions
    if count == 1:
        return split, files, False
    if len(files) >= count:
        return split, files[index::count], True
    split = tfds.even_splits(split, n=count)[index]
    return split, splits[split].file_instructions, False


def _tfds_reader(builder, splits, names):
    """`ImageSource.read` for a TFDS set whose splits ("train", ...) are the TFDS split strings `names`."""
    import tensorflow_datasets as tfds

    def read(split, input_context, shuffle, seed, shuffle_buffer):
        read_config = tfds.ReadConfig(shuffle_seed=seed, add_tfds_id=True)
        split, files, by_files = _pipeline_share(splits, names[split], input_context)
        if by_files:
            read_config = read_config.replace(input_context=input_context)  # TFDS takes every count-th file.
            total = sum(f.take for f in files)
        else:
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


def _tfds_pass_reader(builder, splits, names, read):
    """`ImageSource.read_pass` for a TFDS set: this pipeline's share of the split's files (as `read` shares
    them) in an order drawn from the seed, read 16 at a time as TFDS reads them, the records shuffled in the
    buffer with the same seed; each named by its TFDS id (FILE__INDEX).  A set stored in another format than
    TFRecord: its files in TFDS's order, the records shuffled in the buffer."""
    import tensorflow_datasets as tfds

    decoders = {"image": tfds.decode.SkipDecoding()}

    def read_pass(split, input_context, order_seed, shuffle_buffer):
        if builder.info.file_format != tfds.core.FileFormat.TFRECORD:
            return seeded_shuffle(read(split, input_context, False, None, shuffle_buffer)[0], shuffle_buffer,
                                  order_seed)  # fmt: skip
        _, files, _ = _pipeline_share(splits, names[split], input_context)
        paths = tf.constant([str(f.filename) for f in files])
        first = tf.constant([f.skip for f in files], tf.int64)
        takes = tf.constant([f.take if f.take >= 0 else f.examples_in_shard - f.skip for f in files], tf.int64)

        def records_of(i):
            path = tf.gather(paths, i)
            name = tf.strings.regex_replace(path, r".*/", "")
            records = tf.data.TFRecordDataset(path).skip(tf.gather(first, i)).take(tf.gather(takes, i))
            numbered = tf.data.Dataset.zip((records, tf.data.Dataset.range(tf.gather(first, i), tf.int64.max)))
            return numbered.map(lambda record, at: (record, tf.strings.join([name, "__", tf.strings.as_string(at)])))

        order = tf.data.Dataset.from_tensor_slices(permutation(len(files), order_seed))
        serialized = order.interleave(
            records_of, cycle_length=min(16, len(files)), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True
        )

        def parsed(record, tfds_id):
            example = builder.info.features.deserialize_example(record, decoders=decoders)
            return example["image"], tf.cast(example["label"], tf.int32), tfds_id

        # Parsed after the buffer: it holds the serialized records, no bigger than their images.
        return seeded_shuffle(serialized, shuffle_buffer, order_seed).map(parsed)

    return read_pass


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
