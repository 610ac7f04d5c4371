"""Input pipelines: batches of (uint8 images, labels) for `fit` and `evaluate`.

`make_pipeline` batches an in-memory split (the digits); `image_pipeline` augments and batches decoded
(image, label) pairs; `training_pipeline` is what one input pipeline (one host) of a distributed run feeds
`fit` from an `ImageSource`: read, decoded inside the crop, augmented and batched, here or on tf.data
service workers.
"""

import tensorflow as tf

from keras_vit.data.augment import (
    INCEPTION_AREA_RANGE,
    center_crop_resize,
    crop_flip_resize,
    decode_and_crop,
    randaugment_function,
    randaugment_seed,
    random_translate,
    resize_flip,
)
from keras_vit.data.decode import (
    ONE_PIXEL_PNG,
    carry_failures,
    decode_image,
    load_or_end,
    mark_failures,
    note_failures,
    record_failures,
)
from keras_vit.data.positions import pass_seed, seeded_shuffle
from keras_vit.data.service import distribute, on_each_worker


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
    ds = ds.with_options(_from_memory())
    if training:
        ds = ds.shuffle(len(split), seed=seed, reshuffle_each_iteration=True)
        if max_shift:
            ds = ds.map(
                _plain(lambda x, y: (random_translate(x, max_shift), y)),
                num_parallel_calls=tf.data.AUTOTUNE,
            )
    ds = ds.batch(batch_size, drop_remainder=training)
    if num_classes:  # A batch's labels at once: half the time of a pass over a small split, one example at a time.
        ds = ds.map(_plain(lambda x, y: (x, tf.one_hot(y, num_classes))))
    return ds.prefetch(tf.data.AUTOTUNE)


def training_stream(split, batch_size, *, num_classes=None, seed=0, max_shift=0, start_step=0):
    """Endless training batches of (uint8 images, labels) over an in-memory split, from batch `start_step` on.

    Each batch is a function of the seed and its position in the stream alone, so a run resumed at step `s`
    (`start_step=s`) sees the batches the uninterrupted run saw from its step `s`: epoch `e` takes the first
    `len(split) // batch_size` batches of a permutation drawn from (seed, e)
    (`tf.random.experimental.index_shuffle`), and each example's random translation is drawn from (seed, its
    position).  Batches are whole (static shapes, as XLA and TPUs want); with `num_classes`, labels are one-hot
    float32, otherwise int32 class indices.
    """
    if batch_size < 1 or batch_size > len(split):
        raise ValueError(
            f"`batch_size` must be in [1, {len(split)}] (the training split's examples). "
            f"Received: batch_size={batch_size!r}"
        )
    if not isinstance(start_step, int) or start_step < 0:
        raise ValueError(f"`start_step` must be an integer >= 0. Received: start_step={start_step!r}")
    images, labels = tf.constant(split.images), tf.constant(split.labels)
    per_epoch = len(split) // batch_size * batch_size

    @_plain
    def example(position):
        epoch, index = position // per_epoch, position % per_epoch
        chosen = tf.random.experimental.index_shuffle(index, tf.stack([tf.constant(seed, tf.int64), epoch]),
                                                      len(split) - 1)  # fmt: skip
        image, label = tf.gather(images, chosen), tf.gather(labels, chosen)
        if max_shift:
            image = random_translate(image, max_shift, seed=tf.stack([tf.constant(seed, tf.int64), position]))
        return image, tf.one_hot(label, num_classes) if num_classes else label

    positions = tf.data.Dataset.range(start_step * batch_size, tf.int64.max)
    ds = positions.map(example, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).with_options(_from_memory())
    return ds.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def _plain(function):
    """`function` traced as written, without AutoGraph's rewrite (for functions with no Python control flow on
    tensors): tf.data otherwise converts every function it traces, a tenth of a second or more each, paid when
    each pipeline is made."""
    return tf.autograph.experimental.do_not_convert(function)


def _by_example():
    """tf.data options that split a dataset by example across the workers of a strategy (auto-sharding
    DATA): each worker already holds the whole of it."""
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return options


def _from_memory():
    """tf.data options for batches gathered from memory: split by example (`_by_example`), and without
    tf.data's autotuner. There is nothing to tune there that matters (no decoding, a map or two), and its thread
    can hold up the deletion of an iterator, at the end of a long `fit`, for up to a minute: TensorFlow's
    OptimizeLoop sleeps between optimizations (its period doubles up to 60 s), the iterator's cancellation wakes
    it before the cancellation is marked done, and a loop that checks in that moment sleeps out its period while
    the deleting thread waits for it. Without the autotuner, AUTOTUNE parallelism is the CPU's cores and
    prefetching sizes its own buffer."""
    options = _by_example()
    options.autotune.enabled = False
    return options


def _one_hot_batches(ds, num_classes):
    """Labels one-hot (what label smoothing and batch mixing need), the distribution policy set."""
    ds = ds.map(_plain(lambda x, y: (x, tf.one_hot(y, num_classes))))
    # Handed to `fit` as a tf.data.Dataset (evaluation), it is split by example
    # across workers; built inside `strategy.distribute_datasets_from_function`
    # (training), each input pipeline has read its own files and no policy applies.
    options = _by_example()
    # The maps work on many images at once: one thread per op, as big_vision's input pipelines run, saves the
    # threads that would split each small op (and spin waiting for each other) their CPU time.
    options.threading.max_intra_op_parallelism = 1
    return ds.with_options(options).prefetch(tf.data.AUTOTUNE)


def training_pipeline(
    source, image_size, global_batch_size, input_context=None, *, seed=0, crop=True, flip=True, randaugment=None,
    cache=False, shuffle_buffer=10_000, crop_area_range=INCEPTION_AREA_RANGE, data_service=None,
    data_service_job="keras_vit_train", positions=None,
):
    """What one input pipeline (one host) feeds `fit`: batches of its share of `source`'s training files.

    Sharded by file (with `input_context`) and shuffled before decoding; each
    image decoded inside its Inception crop (`decode_and_crop`: a JPEG only
    there), resized, flipped, optionally RandAugment-ed (`randaugment`: None,
    (num_ops, magnitude) for the published policy, or a function of (image,
    seed)); images that fail to read or decode, or are past
    `source.image_limits`, skipped and named in `source.skipped`; batched
    per replica (`global_batch_size / replicas`), labels one-hot; endless: `fit` is given `steps_per_epoch`, the same on
    every host.  Every random choice is stateless, from one seed per image
    drawn from `seed` (and the pipeline's index): the same seed gives the
    same batches, each epoch new ones.  The files are read in passes, pass
    `p` in an order drawn from (seed, `p`) alone and each image's random
    choices from (that order's seed, its index in the pass), so a stream
    started part way (`positions`) is the uninterrupted stream from there.

    positions: an `InputPositions`: where this pipeline starts
    (`positions.start_of(pipeline index)`, (0, 0) for a new run) and where
    to record its position after each step's batches, which a backup saves
    for the resumed run (`keras_vit.backups`).  A resumed pass re-reads the
    records before its start (no decoding): at most one pass of reading.

    cache: keep the encoded bytes in memory after the first pass (what
    big_vision caches for ImageNet), then shuffle them in a buffer of
    `shuffle_buffer`; decoding and augmentation still run every epoch.
    data_service: "grpc://HOST:PORT" of a tf.data service dispatcher: all of
    the above up to the batches runs on its workers (`keras_vit.data.service`,
    a job named after `data_service_job`), each worker with its own random
    seeds (every worker produces the whole data set, in its own order, so no
    host reads a share); the files that fail to decode there are named and
    counted here all the same, those that fail to be read into the cache
    are skipped unnamed.

    Made for `strategy.distribute_datasets_from_function(functools.partial(training_pipeline, source, size,
    batch))`; without a strategy, call it as it is.
    """
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    pipeline_id = input_context.input_pipeline_id if input_context else 0
    batch_size = input_context.get_per_replica_batch_size(global_batch_size) if input_context else global_batch_size
    what = "the train split"
    if input_context is not None and input_context.num_input_pipelines > 1 and not data_service:
        what += f" read by input pipeline {pipeline_id} of {input_context.num_input_pipelines}"
    augment = randaugment_function(randaugment)
    transform = _decode_and_augment(source, (height, width), crop, flip, crop_area_range, augment)

    if not data_service:
        def noted(marked):
            return note_failures(marked, source.skipped, what, source.reload, source.image_limits)

        start = positions.start_of(pipeline_id) if positions is not None else (0, 0)
        # Each pipeline draws its own orders and crops.
        passes = _positioned_passes(
            source, input_context, transform, seed + pipeline_id, noted, what, cache=cache,
            shuffle_buffer=shuffle_buffer, start=start,
        )
        ds = noted(passes).map(lambda outputs, label: ((outputs[0], label), outputs[1]))
        ds = ds.batch(batch_size, drop_remainder=True)
        per_step = input_context.num_replicas_in_sync // input_context.num_input_pipelines if input_context else 1
        ds = _recording_positions(ds, positions, pipeline_id, per_step)
        return _one_hot_batches(ds, source.num_classes)

    def marked_passes(context, seed, report):
        """Passes of (image, label) marked with the failures before each (`mark_failures`); `report` turns
        the marked elements of the cache's one pass into (outputs, label)."""
        encoded = _encoded_pass(source, context, seed, report, what, cache=cache, shuffle_buffer=shuffle_buffer)
        return _seeded_and_marked(encoded, transform, seed)

    ds = _served_batches(marked_passes, what, batch_size, data_service, data_service_job)
    return _one_hot_batches(_name_carried_failures(ds, source), source.num_classes)


def _decode_and_augment(source, size, crop, flip, crop_area_range, augment):
    """The function `mark_failures` maps over ((encoded bytes, image seed), is_end): one image of `source`
    decoded (inside its Inception crop with `crop`), resized to `size`, flipped and augmented (`augment`: a
    function of (image, seed), or None)."""

    def transform(inputs, is_end):
        encoded, image_seed = inputs
        encoded = tf.where(is_end, tf.constant(ONE_PIXEL_PNG), encoded)
        if crop:
            image = decode_and_crop(encoded, image_seed, crop_area_range, source.image_limits, messages=False)
        else:
            image = decode_image(encoded, source.image_limits, messages=False)
        image = resize_flip(image, image_seed, size, flip=flip)
        return augment(image, randaugment_seed(image_seed)) if augment else image

    return transform


def _positioned_passes(source, context, transform, seed, report, what, *, cache, shuffle_buffer, start):
    """Endless passes over the training files `context`'s input pipeline reads, from `start` (pass, index):
    `mark_failures`' elements whose outputs are (image, [pass, index]).

    Pass `p` reads the records in an order drawn from (`seed`, `p`) alone
    (`source.read_pass`, or the split's order shuffled in a buffer of
    `shuffle_buffer`; with `cache`, the kept bytes shuffled in that buffer),
    and each image's random choices come from (that seed, its index in the
    pass).
    """
    first_pass, first_index = (tf.constant(value, tf.int64) for value in start)
    records = _training_records(source, context, False, None, shuffle_buffer, what)
    if cache:
        kept = _kept_encoded(source, records, report)

    def positioned(inputs, is_end):
        encoded, image_seed, position = inputs
        return transform((encoded, image_seed), is_end), position

    def one_pass(number):
        order_seed = pass_seed(seed, number)
        offset = tf.where(number == first_pass, first_index, tf.constant(0, tf.int64))
        if cache:
            encoded = seeded_shuffle(kept, shuffle_buffer, order_seed).skip(offset)
        else:
            if source.read_pass is not None:
                ordered = source.read_pass("train", context, order_seed, shuffle_buffer)
            else:
                ordered = seeded_shuffle(records, shuffle_buffer, order_seed)
            encoded = ordered.skip(offset).map(lambda reference, label, name: (source.load(reference), label, name))

        def with_seed(record, index):
            image_seed = tf.random.stateless_uniform(
                [2], tf.stack([order_seed, index]), minval=None, maxval=None, dtype=tf.int32
            )
            return (record[0], image_seed, tf.stack([number, index])), record[1], record[2]

        numbered = tf.data.Dataset.zip((encoded, tf.data.Dataset.range(offset, tf.int64.max))).map(with_seed)
        end = (tf.constant(""), tf.zeros([2], tf.int32), tf.constant([-1, -1], tf.int64))
        return mark_failures(numbered, positioned, end, first_index=offset)

    return tf.data.Dataset.range(first_pass, tf.int64.max).flat_map(one_pass)


def _recording_positions(batches, positions, pipeline_id, per_step):
    """Batches of ((images, labels), positions) -> (images, labels); with `positions` (an `InputPositions`),
    the position after each step's batches (`per_step` of them: one per replica the pipeline feeds) recorded
    in it as they leave the pipeline."""
    if positions is None:
        return batches.map(lambda pair, where: pair)

    def record(step, where):
        positions.record(pipeline_id, int(step), int(where[0]), int(where[1]) + 1)
        return True

    def recorded(count, element):
        (images, labels), where = element
        done = tf.cond(
            (count + 1) % per_step == 0,
            lambda: tf.reshape(tf.py_function(
                record, [positions.start_step + (count + 1) // per_step, where[-1]], tf.bool), []),
            lambda: tf.constant(True),
        )
        with tf.control_dependencies([done]):
            return tf.identity(images), labels

    return batches.enumerate().map(recorded)


def _encoded_pass(source, context, seed, report, what, *, cache, shuffle_buffer):
    """One pass of (encoded bytes, label, name) over the training files of `source` that `context`'s input
    pipeline reads: shuffled as read, or with `cache` read once (the failures to read turned by `report`
    into (outputs, label)), kept, and shuffled in a buffer of `shuffle_buffer`."""
    records = _training_records(source, context, not cache, seed, shuffle_buffer, what)
    if not cache:
        return records.map(lambda reference, label, name: (source.load(reference), label, name))
    encoded = _kept_encoded(source, records, report)
    return encoded.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)


def _training_records(source, context, shuffle, seed, shuffle_buffer, what):
    """`source.read` of the training split for `context`'s pipeline; a ValueError naming `what` if it is empty."""
    records, total = source.read("train", context, shuffle, seed, shuffle_buffer)
    if total < 1:
        raise ValueError(f"No examples in {what}.")
    return records


def _kept_encoded(source, records, report):
    """The encoded bytes of `records`, read once and kept (`cache()`): (encoded, label, name), the failures to
    read them turned by `report` into (outputs, label), so reported once."""

    def load(reference, is_end):
        return load_or_end(source.load, reference, is_end), reference

    loaded = report(mark_failures(records, load, tf.constant("")))
    return loaded.map(lambda outputs, label: (outputs[0], label, outputs[1])).cache()


def _seeded_and_marked(encoded, transform, seed):
    """`transform` mapped over a pass of (encoded bytes, label, name), each image with a seed pair of its own
    (new each pass), the failures marked (`mark_failures`)."""
    seeds = tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True).batch(2)
    one_pass = tf.data.Dataset.zip((encoded, seeds)).map(
        lambda record, image_seed: ((record[0], tf.cast(image_seed, tf.int32)), record[1], record[2])
    )
    return mark_failures(one_pass, transform, (tf.constant(""), tf.zeros([2], tf.int32)))


def _served_batches(marked_passes, what, batch_size, data_service, job_name):
    """Batches of (images, labels, failures missed, their names) made on the tf.data service workers of the
    dispatcher at `data_service`, in a job named after `job_name`.

    Each worker runs the whole pipeline: every file, the random seeds drawn by the worker (`on_each_worker`:
    fixed ones, or ones derived from a global seed, would give every worker the same stream), the failures
    carried with the batches.
    """

    def on_worker():
        def unreported(marked):  # Failures to read, on a worker: skipped, not named.
            marked = marked.filter(lambda outputs, label, missing, nothing_yet, names: label >= 0)
            return marked.map(lambda outputs, label, missing, nothing_yet, names: (outputs, label))

        ds = carry_failures(marked_passes(None, None, unreported).repeat(), what)
        return ds.batch(batch_size, drop_remainder=True)

    return distribute(on_each_worker(on_worker), data_service, job_name=job_name)


def _name_carried_failures(ds, source):
    """(images, labels) batches of the service's `ds`, the failures carried with them recorded and named in
    `source.skipped` as they arrive."""

    def note(missing, names):
        for count, joined in zip(missing.numpy(), names.numpy()):
            if count:
                record_failures(source.skipped, count, joined, source.reload, source.image_limits)
        return True

    def strip(images, labels, missing, names):
        noted = tf.cond(
            tf.reduce_any(missing > 0),
            lambda: tf.reshape(tf.py_function(note, [missing, names], tf.bool), []),
            lambda: tf.constant(True),
        )
        with tf.control_dependencies([noted]):
            return tf.identity(images), labels

    return ds.map(strip)


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
    images (0: none, for a source that shuffles before decoding), Inception
    crop and horizontal flip, optional RandAugment (None, (num_ops,
    magnitude) or a function of (image, seed)), all stateless and seeded per
    example (the same seed gives the same batches); `drop_remainder=True`;
    with `repeat`, endless.  `training_pipeline` is the faster way from
    encoded files (it decodes a JPEG inside its crop only).
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
        augment = randaugment_function(randaugment)

        def augmented(pair, rnd):
            (image, label), rnd = pair, tf.cast(rnd, tf.int32)
            image = crop_flip_resize(image, rnd, (height, width), crop=crop, flip=flip)
            return (augment(image, randaugment_seed(rnd)) if augment else image), label

        ds = tf.data.Dataset.zip((ds, randoms)).map(augmented, num_parallel_calls=tf.data.AUTOTUNE)
    else:
        ds = ds.map(
            lambda x, y: (center_crop_resize(x, (height, width), crop_fraction), y),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
    return _one_hot_batches(ds.batch(batch_size, drop_remainder=training), num_classes)
