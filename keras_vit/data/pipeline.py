"""Input pipelines: batches of (uint8 images, labels) for `fit` and `evaluate`.

`make_pipeline` batches an in-memory split (the digits); `image_pipeline` augments and batches decoded
(image, label) pairs; `training_pipeline` is what one input pipeline (one host) of a distributed run feeds
`fit` from an `ImageSource`.
"""

import tensorflow as tf

from keras_vit.data.augment import center_crop_resize, crop_flip_resize, make_randaugment, random_translate


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
            return crop_flip_resize(image, tf.cast(rnd, tf.int32), (height, width), crop=crop, flip=flip), label

        ds = tf.data.Dataset.zip((ds, randoms)).map(augment, num_parallel_calls=tf.data.AUTOTUNE)
        if randaugment:
            rand_augment = make_randaugment(*randaugment, seed=seed)
            ds = ds.map(lambda x, y: (rand_augment(x), y), num_parallel_calls=tf.data.AUTOTUNE)
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
