"""What every job in experiments/ builds from its config: the model, the optimizer, the data, the outputs.

The jobs (`train`, `scaling`, `transfer`, `export`, `visualize`) are thin and
alike: each reads top to bottom and calls these helpers, so that a ViT, an
optimizer or a data set is made from a config in one place whichever job
asks.  The helpers take a config, never a flag.  The command line is glued
on the same way for every job (`run_job`): its flags are defined when the
job runs as a program, never on import, so that the jobs can be imported
together, as libraries, without side effects.

    >>> from experiments.configs import digits
    >>> config = digits.get_config()
    >>> build_model(config, num_classes=10).count_params()
    139722
    >>> vit_config(config).hidden_dim, vit_config(config).patch_size
    (64, (2, 2))
"""

import dataclasses
import functools
import json
import sys
import types
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf
from absl import app, flags, logging
from ml_collections import config_flags

import keras_vit
from keras_vit import data as vit_data
from keras_vit import evaluation, training, visualize
from keras_vit.files import write_text_atomically
from keras_vit.variants import ViTConfig, parse_variant, to_pair

# === Model and optimizer ===


def build_model(config, num_classes, class_names=None):
    """The ViT of config.model (a variant and `build_vit`'s keyword arguments) at config.image_size, with the
    data's `class_names` (kept in the model's spec, so in every file it is saved to)."""
    model = dict(config.model)
    return keras_vit.build_vit(model.pop("variant"), image_size=config.image_size, num_classes=num_classes,
                               class_names=class_names, **model)  # fmt: skip


def vit_config(config):
    """The `ViTConfig` the job's model will have (its variant and the overrides in config.model), without
    building it: what a device mesh is planned from."""
    fields = set(ViTConfig.__dataclass_fields__)
    model = dict(config.model)
    return parse_variant(model.pop("variant"), **{k: v for k, v in model.items() if k in fields})


def make_optimizer(config, steps, warmup_steps, recipe=None, model=None):
    """`keras_vit.training.make_optimizer` for `steps` steps with `warmup_steps` of warm-up (at most steps - 1).

    The optimizer, learning rate and weight decay are `recipe`'s (by default
    config's: a job with a second recipe, such as transfer's fine-tuning,
    passes it); the decay, the gradient clipping, the moving average and the
    layer-wise decay (of `model`) are config's.  With
    config.weight_decay_kernels_only, the weight decay reaches only the
    kernels of `model` (big_vision's default), not its biases, norms and
    embeddings.
    """
    recipe = recipe or config
    optimizer = training.make_optimizer(
        recipe.optimizer,
        recipe.learning_rate,
        steps,
        min(warmup_steps, steps - 1),
        weight_decay=recipe.weight_decay,
        decay=config.decay,
        grad_clip_norm=config.grad_clip_norm,
        ema_momentum=config.get("ema_momentum", 0.0),
        layer_decay=config.get("layer_decay", 1.0),
        model=model,
    )
    if config.get("weight_decay_kernels_only") and recipe.weight_decay:
        if model is None:
            raise ValueError("config.weight_decay_kernels_only needs the model, to find its kernels.")
        optimizer.exclude_from_weight_decay(
            var_list=[w for w in model.trainable_weights if not w.name.endswith("kernel")]
        )
    return optimizer


def whole_executions(steps_per_execution, steps_per_epoch):
    """The largest divisor of `steps_per_epoch` that is at most `steps_per_execution`.

    Keras runs each execution whole: with 95 steps per epoch and 50 steps
    per execution, an epoch would run 100 steps, and the run more steps than
    its schedule has (the last ones at a learning rate of 0).
    """
    return max(n for n in range(1, min(steps_per_execution, steps_per_epoch) + 1) if steps_per_epoch % n == 0)


def compile_model(model, config, optimizer, *, steps_per_execution=1):
    """Compiles `model` for one-hot labels: cross-entropy on logits with config.label_smoothing, accuracy,
    XLA as config.jit_compile and config.precision ask (`keras_vit.training.resolve_jit_compile`).

    Under a strategy's scope, "auto" follows the strategy.
    """
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=config.label_smoothing),
        metrics=[keras.metrics.CategoricalAccuracy(name="accuracy")],
        jit_compile=training.resolve_jit_compile(config.jit_compile, config.precision),
        steps_per_execution=steps_per_execution,
    )
    return model


# === Data, streamed ===


@dataclasses.dataclass
class Data:
    """What the training job needs of a data set, whatever its source.

    `train` yields batches of (uint8 pixels, one-hot labels), augmented.  For
    image folders and TFDS it is endless: each host reads its share of the
    files over and over, so that every host runs the steps `fit` is given
    (`steps_per_epoch=num_train // global batch`) whatever its share of the
    images that fail to decode; it is built through the strategy's
    `distribute_datasets_from_function` when a strategy is given.  The digits
    are one epoch per pass (`steps_per_epoch` equal to it is fine).

    Model selection sees `validation` only, a split held out of the training
    data.  The test split is not touched until `make_test()` is called, which
    the job does once training is over.
    """

    train: tf.data.Dataset | tf.distribute.DistributedDataset
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
            train=pipeline(
                digits.train, config.batch_size, training=True, seed=config.seed, max_shift=config.max_shift
            ),
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
    if strategy is not None:
        train = strategy.distribute_datasets_from_function(training_data)
    else:
        train = training_data(jax_input_context())
    counts = {"train": source.num_train, "validation": source.num_validation, "test": source.num_test}
    kind, _, rest = config.dataset.partition(":")
    # A TFDS split by its data set and split string ("tfds:imagenet2012:train[:99%]"); a folder's in words.
    prefix = f"tfds:{rest.partition(':')[0]}:" if kind == "tfds" else ""
    return Data(
        train=train,
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


# === Data, in memory ===


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


# === Evaluation after training ===


def real_accuracy(logits, real_labels):
    """ImageNet ReaL accuracy (Beyer et al. 2020, "Are we done with ImageNet?"): the share of images whose
    top-1 prediction is one of their real labels (`real_labels`: multi-hot rows); images with no real
    label are left out.

    >>> logits = np.array([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1], [0.2, 0.3, 0.5]])
    >>> real_accuracy(logits, np.array([[0, 1, 1], [0, 1, 0], [0, 0, 0]]))
    0.5
    """
    real_labels = np.asarray(real_labels)
    labelled = real_labels.any(axis=-1)
    if not labelled.any():
        raise ValueError("No image has a real label: ReaL accuracy is undefined.")
    hits = real_labels[np.arange(len(real_labels)), np.argmax(logits, axis=-1)] > 0
    return float(hits[labelled].mean())


def extra_evaluations(config, model, strategy=None):
    """`model` on each test set of config.extra_evals that is prepared in config.data_dir (ImageNet-v2,
    ReaL, ...): {name: {"data", "examples", "accuracy"}}, or {name: {"data", "skipped": why}} (and a log
    line) for a set that is not there.

    Images are evaluated as the job's own test split (`center_crop_resize` at
    config.image_size with config.crop_fraction).  A label that is a
    Sequence of classes (ReaL's "real_label") gives `real_accuracy`, with
    "examples_with_labels" beside it.
    """
    size = to_pair(config.image_size, "image_size")
    results = {}
    for name, spec in config.extra_evals.items():
        data = f"tfds:{spec.dataset}:{spec.split}"
        try:
            images, count, num_classes = vit_data.load_tfds_evaluation(
                spec.dataset, spec.split, data_dir=config.data_dir or None, label_key=spec.get("label", "label"),
                image_limits=image_limits(config),
            )
            if num_classes != model.output_shape[-1]:
                raise ValueError(f"it has {num_classes} classes, the model {model.output_shape[-1]}.")
        except ValueError as error:
            logging.info("Skipped the extra evaluation %r on %s: %s", name, data, error)
            results[name] = {"data": data, "skipped": str(error)}
            continue
        batches = images.map(
            lambda x, y: (vit_data.center_crop_resize(x, size, config.crop_fraction), y),
            num_parallel_calls=tf.data.AUTOTUNE,
        ).batch(config.batch_size).prefetch(tf.data.AUTOTUNE)
        logits, labels = evaluation.predict_with_labels(model, batches, strategy)
        result = {"data": data, "examples": count, "examples_evaluated": len(labels)}
        if labels.ndim == 2:
            result["accuracy"] = real_accuracy(logits, labels)
            result["examples_with_labels"] = int(labels.any(axis=-1).sum())
        else:
            result["accuracy"] = float(np.mean(np.argmax(logits, axis=-1) == labels))
        logging.info("Extra evaluation %r on %s: %s", name, data, result)
        results[name] = result
    return results


# === Outputs ===


def write_text(path, text):
    """Writes `text` to `path` (local or gs://) whole or not at all (`keras_vit.files.atomic_path`): under a
    temporary name, renamed when complete; returns path."""
    return write_text_atomically(str(path), text)


def write_json(path, data):
    """Writes `data` as indented JSON to `path` (`write_text`); returns path."""
    return write_text(path, json.dumps(data, indent=2))


def markdown_table(header, rows):
    """A Markdown table of `header` and `rows` (lists of cells).

    >>> print(markdown_table(["size", "accuracy"], [[10, "0.5"]]))
    | size | accuracy |
    |---|---|
    | 10 | 0.5 |
    """
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_outputs(workdir, name, results, table, figure):
    """Writes `name`.json (results), `name`.md (table) and `name`.png (figure) into workdir; returns their paths."""
    tf.io.gfile.makedirs(workdir)
    paths = [tf.io.gfile.join(workdir, f"{name}.{ext}") for ext in ("json", "md", "png")]
    write_json(paths[0], results)
    write_text(paths[1], table + "\n")
    visualize.save_figure(figure, paths[2])
    return paths


def plot_curves(xs, curves, *, xlabel, ylabel, title, marks=()):
    """A figure of curves ({label: points with "mean" and "std"}) against `xs` on a log axis, standard
    deviations as error bars, vertical dotted lines at `marks`."""
    plt = visualize.pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for label, points in curves.items():
        ax.errorbar(
            xs, [p["mean"] for p in points], yerr=[p["std"] for p in points], marker="o", capsize=3, label=label
        )
    for x in marks:
        ax.axvline(x, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.minorticks_off()
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


# === The command line ===


def define_config_and_workdir(config_file, workdir, workdir_help):
    """Defines --config (a Python config file, default `config_file`, whose fields `--config.FIELD=VALUE`
    overrides) and --workdir; returns their flag holders (config, workdir)."""
    return (
        config_flags.DEFINE_config_file("config", config_file, "Python config file; fields can be overridden."),
        flags.DEFINE_string("workdir", workdir, workdir_help),
    )


def run_job(main, define_flags):
    """Runs a job from the command line: `define_flags()` defines its flags and returns them (a dict of name to
    flag holder), absl parses the command line, then `main(flags)` runs with them as attributes.

    Called from a job's `if __name__ == "__main__":` block only, so that no
    flag is defined when a job is imported.  Positional arguments are refused.
    """
    job_flags = types.SimpleNamespace(**define_flags())
    for holder in vars(job_flags).values():
        # --help lists the program's own flags: these, wherever they were defined (--config and --workdir here).
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[holder.name])

    def absl_main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
        main(job_flags)

    app.run(absl_main)
