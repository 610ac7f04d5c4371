r"""Trains a ViT with `model.fit` and writes the model and its metrics.

    python -m experiments.train --workdir=/tmp/vit_digits
    python -m experiments.train --config=experiments/configs/digits.py \
        --config.epochs=10 --workdir=/tmp/vit_digits

Writes into --workdir: `model.keras` (the trained model), `best.keras` (the
epoch with the best validation accuracy), `metrics.json`, `history.json` (this
process's epochs), `log.csv` (every epoch, across restarts), `tensorboard/`,
`figures/` (with --config.visualize: the
attention and embedding figures of `keras_vit.visualize` for a few test
images) and, while it runs, `backup/` (the state of an interrupted run; `fit`
resumes from it when the same command is run again).
"""

import dataclasses
import functools
import json
import os
import time

import keras
import tensorflow as tf
from absl import app, flags, logging
from ml_collections import config_flags

import keras_vit
from keras_vit import data as vit_data
from keras_vit import export, training, visualize
from keras_vit.distribute import STRATEGIES, get_strategy, is_chief

_CONFIG = config_flags.DEFINE_config_file(
    "config", "experiments/configs/digits.py", "Python config file; fields can be overridden."
)
_WORKDIR = flags.DEFINE_string("workdir", "runs/digits", "Where the model and metrics go.")
_STRATEGY = flags.DEFINE_enum("strategy", "auto", list(STRATEGIES), "Distribution strategy.")
_TPU = flags.DEFINE_string("tpu", None, "TPU name, grpc:// address or 'local' (with --strategy=tpu or auto).")


class Throughput(keras.callbacks.Callback):
    """Times the training steps of each epoch (validation excluded).

    The first epoch (tracing and XLA compilation) is left out of the rate.
    """

    def __init__(self):
        super().__init__()
        self.epoch_seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = self.last_step = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.last_step = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_seconds.append(self.last_step - self.start)

    def images_per_second(self, images_per_epoch):
        timed = self.epoch_seconds[1:] or self.epoch_seconds
        return images_per_epoch * len(timed) / sum(timed)


@dataclasses.dataclass
class Data:
    """What the job needs of a data set, whatever its source."""

    train: tf.data.Dataset  # batches of (pixels, one-hot labels), augmented
    test: tf.data.Dataset  # batches of (pixels, one-hot labels), every example
    calibration: tf.data.Dataset  # unaugmented training images, for int8 export
    num_classes: int
    class_names: list
    num_train: int
    num_test: int


def load_data(config):
    """The data set named by config.dataset: "digits", "tfds:NAME[:SPLIT]" or "folder:PATH"."""
    name = config.dataset
    if name == "digits":
        digits = vit_data.load_digits(
            image_size=config.image_size, test_fraction=config.test_fraction, seed=config.seed
        )
        pipeline = functools.partial(vit_data.make_pipeline, num_classes=digits.num_classes)
        return Data(
            train=pipeline(
                digits.train, config.batch_size, training=True, seed=config.seed, max_shift=config.max_shift
            ),
            test=pipeline(digits.test, config.batch_size, training=False),
            calibration=tf.data.Dataset.from_tensor_slices(digits.train.images),
            num_classes=digits.num_classes,
            class_names=digits.class_names,
            num_train=len(digits.train),
            num_test=len(digits.test),
        )
    kind, _, rest = name.partition(":")
    if kind == "tfds" and rest:
        tfds_name, _, split = rest.partition(":")
        source = vit_data.load_tfds(
            tfds_name,
            data_dir=config.data_dir or None,
            train_split=split or "train",
            test_split=config.test_split or None,
        )
    elif kind == "folder" and rest:
        source = vit_data.load_folder(rest, test_fraction=config.test_fraction, seed=config.seed)
    else:
        raise ValueError(
            f"Unknown dataset {name!r}. Expected 'digits', 'tfds:NAME[:SPLIT]' or 'folder:PATH'."
        )
    augment = config.augment
    pipeline = functools.partial(
        vit_data.image_pipeline,
        image_size=config.image_size,
        num_classes=source.num_classes,
        crop_fraction=config.crop_fraction,
        cache=config.cache,
    )
    return Data(
        train=pipeline(
            source.train,
            batch_size=config.batch_size,
            training=True,
            seed=config.seed,
            crop=augment.inception_crop,
            flip=augment.flip,
            randaugment=augment.randaugment,
            mixup_alpha=augment.mixup_alpha,
            cutmix_alpha=augment.cutmix_alpha,
        ),
        test=pipeline(source.test, batch_size=config.batch_size, training=False),
        calibration=pipeline(source.train, batch_size=1, training=False).map(lambda x, y: x[0]),
        num_classes=source.num_classes,
        class_names=source.class_names,
        num_train=source.num_train,
        num_test=source.num_test,
    )


def build_model(config, num_classes):
    model_config = dict(config.model)
    variant = model_config.pop("variant")
    return keras_vit.build_vit(
        variant, image_size=config.image_size, num_classes=num_classes, **model_config
    )


def make_optimizer(config, steps_per_epoch):
    total_steps = config.epochs * steps_per_epoch
    return training.make_optimizer(
        config.optimizer,
        config.learning_rate,
        total_steps,
        min(config.warmup_steps or config.warmup_epochs * steps_per_epoch, total_steps - 1),
        weight_decay=config.weight_decay,
        decay=config.decay,
        grad_clip_norm=config.grad_clip_norm,
    )


EXPORTS = ("saved_model", "tflite", "tflite_float16", "tflite_dynamic", "tflite_int8", "onnx")


def export_kinds(config):
    """The exports asked for by config.export, checked before training starts."""
    kinds = [kind.strip() for kind in config.export.split(",") if kind.strip()]
    unknown = [kind for kind in kinds if kind not in EXPORTS]
    if unknown:
        raise ValueError(f"Unknown export(s) {unknown} in config.export. Expected a subset of {list(EXPORTS)}.")
    return kinds


def export_model(model, kind, workdir, dataset):
    """Exports into workdir/export/; returns the path written."""
    out = tf.io.gfile.join(workdir, "export")
    if kind == "saved_model":
        return export.export_saved_model(
            model, tf.io.gfile.join(out, "saved_model"), class_names=dataset.class_names, overwrite=True
        )
    if kind == "onnx":
        return export.export_onnx(model, tf.io.gfile.join(out, "model.onnx"), overwrite=True)
    return export.export_tflite(
        model,
        tf.io.gfile.join(out, f"{kind}.tflite"),
        quantize=kind.partition("_")[2] or None,
        representative_data=dataset.calibration,  # Evaluation-pipeline images: unaugmented.
        overwrite=True,
    )


def train_and_evaluate(config, workdir, strategy=None):
    """Runs the whole job; returns the metrics it writes to `workdir`.

    `strategy` defaults to one device; the batch size in `config` is global.
    """
    strategy = strategy or get_strategy("one_device")
    if not is_chief(strategy):
        # Every worker runs the same program; only the chief writes the job's
        # outputs, the others write theirs apart (Keras's BackupAndRestore
        # handles its own files per worker).
        workdir = tf.io.gfile.join(workdir, "workers", str(strategy.cluster_resolver.task_id))
    exports = export_kinds(config)

    # === Data ===
    dataset = load_data(config)
    train_ds, test_ds = dataset.train, dataset.test
    steps_per_epoch = dataset.num_train // config.batch_size
    if steps_per_epoch < 1:
        raise ValueError(
            f"The training split has {dataset.num_train} examples, fewer than one batch of "
            f"{config.batch_size}."
        )
    expected_classes = config.num_classes
    if expected_classes and expected_classes != dataset.num_classes:
        raise ValueError(
            f"config.num_classes={expected_classes} but the data set {config.dataset!r} has "
            f"{dataset.num_classes} classes."
        )

    # Checks passed: from here on the run writes and trains.
    tf.io.gfile.makedirs(workdir)
    keras.utils.set_random_seed(config.seed)
    keras.mixed_precision.set_global_policy(config.precision)

    # === Model, under the strategy's scope ===
    with strategy.scope():
        model = build_model(config, dataset.num_classes)
        if config.pretrained:
            # An original .npz checkpoint; a head of another size stays zero for this task.
            keras_vit.load_pretrained(
                model, config.pretrained, interpolation=config.interpolation
            )
        if config.freeze_backbone:
            keras_vit.freeze_backbone(model)  # A linear probe: only the head trains.
        model.compile(
            optimizer=make_optimizer(config, steps_per_epoch),
            loss=keras.losses.CategoricalCrossentropy(
                from_logits=True, label_smoothing=config.label_smoothing
            ),
            metrics=[keras.metrics.CategoricalAccuracy(name="accuracy")],
            jit_compile=keras_vit.training.resolve_jit_compile(config.jit_compile, config.precision),
            # Several steps per call: what keeps a TPU busy.
            steps_per_execution=config.steps_per_execution,
        )

    # === Train ===
    throughput = Throughput()
    history = model.fit(
        train_ds,
        epochs=config.epochs,
        validation_data=test_ds,
        callbacks=[
            # The state of an interrupted run: a killed run started again with the
            # same command resumes from here, losing at most `backup_every` steps.
            keras.callbacks.BackupAndRestore(
                tf.io.gfile.join(workdir, "backup"), save_freq=config.backup_every
            ),
            keras.callbacks.TerminateOnNaN(),
            keras.callbacks.ModelCheckpoint(
                tf.io.gfile.join(workdir, "best.keras"), monitor="val_accuracy", save_best_only=True
            ),
            training.CSVLog(tf.io.gfile.join(workdir, "log.csv")),
            keras.callbacks.TensorBoard(tf.io.gfile.join(workdir, "tensorboard")),
            throughput,
        ],
        verbose=config.verbose,  # 1: a progress bar, 2: a line per epoch (logs)
    )

    # === Evaluate and save ===
    test_loss, test_accuracy = model.evaluate(test_ds, verbose=0)
    model_path = tf.io.gfile.join(workdir, "model.keras")
    model.save(model_path)
    metrics = {
        "test_accuracy": float(test_accuracy),
        "test_loss": float(test_loss),
        "epochs": int(config.epochs),
        "steps": int(model.optimizer.iterations.numpy()),
        "train_images_per_second": throughput.images_per_second(
            steps_per_epoch * config.batch_size
        ),
        "train_examples": dataset.num_train,
        "test_examples": dataset.num_test,
        "parameters": int(model.count_params()),
    }
    # Did the position embeddings learn the grid structure of the paper's Figure 7?
    metrics.update(visualize.neighbour_similarity(visualize.position_embedding_similarity(model)))
    if config.visualize:
        figures = tf.io.gfile.join(workdir, "figures")
        images = next(iter(test_ds.unbatch().batch(config.visualize_images)))[0].numpy()
        for i, image in enumerate(images):
            visualize.write_figures(model, image, figures, prefix=f"test{i}_")
    for kind in exports:
        metrics[f"export_{kind}"] = export_model(model, kind, workdir, dataset)
    with tf.io.gfile.GFile(tf.io.gfile.join(workdir, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    with tf.io.gfile.GFile(tf.io.gfile.join(workdir, "history.json"), "w") as f:
        json.dump({k: [float(v) for v in vs] for k, vs in history.history.items()}, f, indent=2)
    return metrics


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    workdir = _WORKDIR.value
    strategy = get_strategy(_STRATEGY.value, _TPU.value)
    logging.info("Strategy %s with %d replica(s)", type(strategy).__name__, strategy.num_replicas_in_sync)
    metrics = train_and_evaluate(_CONFIG.value, workdir, strategy)
    logging.info("Metrics: %s", metrics)
    print(json.dumps(metrics, indent=2))
    where = workdir if "://" in workdir else os.path.abspath(workdir)
    print(f"Wrote the model, metrics.json and history.json to {where}")


if __name__ == "__main__":
    app.run(main)
