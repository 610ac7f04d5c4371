"""The jobs' data, made from a config: streamed for the training job (`load_data`: the digits, an image
folder or TFDS, through a strategy's input pipelines), or whole in memory for the short runs of `scaling` and
`transfer` (`load_in_memory`, stratified subsets)."""

import dataclasses
import functools
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from keras_vit import data as vit_data
from keras_vit.variants import to_pair


@dataclasses.dataclass
class Data:
    """What the training job needs of a data set, whatever its source.

    `train_from(step, input_position)` makes the training batches of (uint8
    pixels, one-hot labels), augmented, endless, for a run that starts (or
    resumes) at batch `step`, and the `keras_vit.data.InputPositions` a
    backup reads where the input is from (None: the step says it).  A resumed
    run sees the batches the uninterrupted run saw from that step.  The
    digits are a function of the position in the stream
    (`keras_vit.data.training_stream`).  Image folders and TFDS: each host
    reads its share of the files in passes, over and over, so that every host
    runs the steps `fit` is given (`steps_per_epoch=num_train // global
    batch`) whatever its share of the images that fail to decode, built
    through the strategy's `distribute_datasets_from_function` when a
    strategy is given; each pass's order is drawn from (seed, pass) alone,
    and the run resumes at the pass and record its backup saved
    (`input_position`; None: a new run, or a backup that saved none, which
    starts the passes over).  With tf.data service, workers draw their own
    orders: a resumed run starts new ones.

    Model selection sees `validation` only, a split held out of the training
    data.  The test split is not touched until `make_test()` is called, which
    the job does once training is over.
    """

    train_from: Callable[[int, dict | None], tuple]  # -> (batches, InputPositions or None)
    validation: tf.data.Dataset | None  # batches of (uint8 pixels, one-hot labels), every example; None: none held out
    make_test: Callable[[], tf.data.Dataset]  # the test split's batches, every example: called after training
    calibration: tf.data.Dataset  # unaugmented training images, for int8 export
    num_classes: int
    class_names: list
    num_train: int  # examples listed; the ones that fail to decode are in `skipped`
    num_validation: int
    num_test: int
    # What each split is: {"train" | "validation" | "test": {"data": in words, "examples": listed}}.
    splits: dict = dataclasses.field(default_factory=dict)
    # Images skipped because they failed to read or decode (`.count`, `.paths`), filled as the
    # pipelines meet them: read it after training.
    skipped: vit_data.DecodeFailures = dataclasses.field(default_factory=vit_data.DecodeFailures)


def image_source(config):
    """The `keras_vit.data.ImageSource` of config.dataset ("tfds:NAME[:SPLIT]" or "folder:PATH"), with the
    validation split config asks for: the names are `keras_vit.data.load_image_source`'s, which refuses any
    other."""
    return vit_data.load_image_source(
        config.dataset,
        data_dir=config.data_dir or None,
        test_split=config.test_split or None,
        test_fraction=config.test_fraction,
        seed=config.seed,
        validation_fraction=config.validation_fraction,
        validation_split=config.validation_split or None,
        image_limits=image_limits(config),
    )


def image_limits(config):
    """config.image_limits as a `keras_vit.data.ImageLimits`."""
    return vit_data.ImageLimits(**config.image_limits)


def load_digits(config):
    """The bundled digits (`keras_vit.data.load_digits`) at config.image_size, split as config says."""
    return vit_data.load_digits(
        image_size=config.image_size, test_fraction=config.test_fraction, seed=config.seed,
        validation_fraction=config.validation_fraction,
    )


def describe_digits_splits(config, digits):
    """`Data.splits` of the digits as `load_digits(config)` split them."""
    seed, rest = config.seed, len(digits.train) + len(digits.validation or ())
    splits = {
        "train": f"digits: the rest of the other {rest:,}" if digits.validation else f"digits: the other {rest:,}",
        "test": f"digits: {config.test_fraction * 100:g}% of the 1,797 images, stratified by class (seed {seed})",
    }
    if digits.validation:
        splits["validation"] = (
            f"digits: {config.validation_fraction * 100:g}% of the other {rest:,}, stratified by class (seed {seed})"
        )
    counts = {"train": len(digits.train), "test": len(digits.test), "validation": len(digits.validation or ())}
    return {name: {"data": splits[name], "examples": counts[name]} for name in ("train", "validation", "test")
            if name in splits}


def load_data(config, strategy=None):
    """The data set named by config.dataset: "digits", or an image source ("tfds:NAME[:SPLIT]", "folder:PATH").

    With a `tf.distribute.Strategy`, the training data of image sets is made by
    `strategy.distribute_datasets_from_function`: each input pipeline (a host)
    reads and decodes its own files and batches `config.batch_size /
    replicas` per replica.  The digits, in memory, stay one `tf.data.Dataset`
    that the strategy splits by example.
    """
    # Evaluation batches: with gradient accumulation, the micro-batches (what the device was sized for).
    eval_batch_size = config.batch_size // config.get("grad_accum_steps", 1)
    if config.dataset == "digits":
        digits = load_digits(config)
        pipeline = functools.partial(vit_data.make_pipeline, num_classes=digits.num_classes)
        return Data(
            train_from=lambda step, input_position=None: (vit_data.training_stream(
                digits.train, config.batch_size, num_classes=digits.num_classes, seed=config.seed,
                max_shift=config.max_shift, start_step=step,
            ), None),
            validation=pipeline(digits.validation, eval_batch_size, training=False) if digits.validation else None,
            make_test=lambda: pipeline(digits.test, eval_batch_size, training=False),
            calibration=tf.data.Dataset.from_tensor_slices(digits.train.images),
            num_classes=digits.num_classes,
            class_names=digits.class_names,
            num_train=len(digits.train),
            num_validation=len(digits.validation or ()),
            num_test=len(digits.test),
            splits=describe_digits_splits(config, digits),
        )
    source = image_source(config)
    augment = config.augment
    # One input pipeline's training data (given an InputContext): its own files, endless.
    training_data = functools.partial(
        vit_data.training_pipeline,
        source,
        config.image_size,
        config.batch_size,
        seed=config.seed,
        crop=augment.inception_crop,
        crop_area_range=tuple(augment.crop_area_range),
        flip=augment.flip,
        randaugment=augment.randaugment,
        cache=config.cache,
        shuffle_buffer=config.shuffle_buffer,
        data_service=config.data_service or None,
    )
    pipeline = functools.partial(
        vit_data.image_pipeline,
        image_size=config.image_size,
        num_classes=source.num_classes,
        crop_fraction=config.crop_fraction,
    )

    def train_from(step, input_position=None):
        if config.data_service:  # Its workers draw their own orders: nothing to resume from.
            positions, made = None, training_data
        else:
            positions = vit_data.InputPositions(step, input_position)
            made = functools.partial(training_data, positions=positions)
        if strategy is not None:
            return strategy.distribute_datasets_from_function(made), positions
        return made(jax_input_context()), positions

    counts = {"train": source.num_train, "validation": source.num_validation, "test": source.num_test}
    kind, _, rest = config.dataset.partition(":")
    # A TFDS split by its data set and split string ("tfds:imagenet2012:train[:99%]"); a folder's in words.
    prefix = f"tfds:{rest.partition(':')[0]}:" if kind == "tfds" else ""
    return Data(
        train_from=train_from,
        validation=(
            # Read every epoch: cached decoded with config.cache, as a small set affords.
            pipeline(source.validation, batch_size=eval_batch_size, training=False, cache=config.cache)
            if source.num_validation else None
        ),
        make_test=lambda: pipeline(source.test, batch_size=eval_batch_size, training=False),
        calibration=pipeline(source.train, batch_size=1, training=False).map(lambda x, y: x[0]),
        num_classes=source.num_classes,
        class_names=source.class_names,
        num_train=source.num_train,
        num_validation=source.num_validation,
        num_test=source.num_test,
        splits={
            name: {"data": prefix + what, "examples": counts[name]}
            for name, what in source.splits.items()
        },
        skipped=source.skipped,
    )


def jax_input_context():
    """This host's `tf.distribute.InputContext` in a multi-host JAX job whose hosts each hold whole
    model replicas, with Keras' own sharding of the input turned off; None otherwise.

    Keras' distribution shards a multi-host input by example (each host reads
    and decodes everything and keeps its share); with this context each host
    reads its own files and batches global batch / hosts.  Where a model
    replica spans hosts, those hosts need the same examples, and Keras' sharding
    stays.
    """
    distribution = keras.distribution.distribution() if keras.backend.backend() == "jax" else None
    if distribution is None:
        return None
    import jax

    hosts = jax.process_count()
    if hosts == 1 or distribution.num_model_replicas % hosts:
        return None
    distribution.auto_shard_dataset = False
    return tf.distribute.InputContext(
        num_input_pipelines=hosts, input_pipeline_id=jax.process_index(), num_replicas_in_sync=hosts
    )


def load_in_memory(config):
    """The train, test and (with config.validation_fraction or validation_split) validation splits of
    config.dataset as uint8 arrays (`keras_vit.data.Dataset`).

    The digits are in memory already.  A `folder:` or `tfds:` data set is
    read whole, each image resized and centre-cropped to config.image_size
    as the training job evaluates them (`keras_vit.data.center_crop_resize`):
    for the experiments on small training sets.
    """
    if config.dataset == "digits":
        return load_digits(config)
    source = image_source(config)
    size = to_pair(config.image_size, "image_size")

    def to_arrays(pairs):
        pairs = pairs.map(lambda x, y: (vit_data.center_crop_resize(x, size, config.crop_fraction), y)).batch(256)
        images, labels = zip(*((x.numpy(), y.numpy()) for x, y in pairs))
        return vit_data.Split(np.concatenate(images), np.concatenate(labels).astype(np.int32))

    dataset = vit_data.Dataset(
        to_arrays(source.train), to_arrays(source.test), source.num_classes, source.class_names,
        validation=to_arrays(source.validation) if source.num_validation else None,
    )
    if source.skipped.count:
        logging.warning("Skipped %d images that failed to decode: %s", source.skipped.count, source.skipped.paths[:10])
    return dataset


def stratified_subset(labels, seed, *, fraction=None, per_class=None):
    """Indices of a class-stratified subset: `fraction` of each class (at least one) or `per_class` of each.

    Each class's examples are put in a random order drawn from `seed` alone,
    and the first ones are taken, so for one seed a smaller subset is part of
    every larger one.  The indices come back sorted.
    """
    if (fraction is None) == (per_class is None):
        raise ValueError(
            f"Give one of `fraction` and `per_class`. Received: fraction={fraction!r}, per_class={per_class!r}"
        )
    if fraction is not None and not 0.0 < fraction <= 1.0:
        raise ValueError(f"`fraction` must be in (0, 1]. Received: fraction={fraction!r}")
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    chosen = []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        count = max(1, round(fraction * len(members))) if fraction is not None else per_class
        if count > len(members):
            raise ValueError(
                f"Class {label} has {len(members)} examples; {count} were asked for (per_class={per_class})."
            )
        chosen.append(members[:count])
    return np.sort(np.concatenate(chosen))


def take(split, indices, labels=None):
    """The examples of `split` at `indices`, with their labels mapped through `labels` (a dict) if given."""
    targets = split.labels[indices]
    if labels is not None:
        targets = np.array([labels[int(y)] for y in targets], np.int32)
    return vit_data.Split(split.images[indices], targets)
