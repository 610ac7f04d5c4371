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

import contextlib
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
from keras_vit import export, parallel, training, visualize
from keras_vit.distribute import STRATEGIES, get_strategy, is_chief

_CONFIG = config_flags.DEFINE_config_file(
    "config", "experiments/configs/digits.py", "Python config file; fields can be overridden."
)
_WORKDIR = flags.DEFINE_string("workdir", "runs/digits", "Where the model and metrics go.")
_STRATEGY = flags.DEFINE_enum("strategy", "auto", list(STRATEGIES), "Distribution strategy.")
_TPU = flags.DEFINE_string("tpu", None, "TPU name, grpc:// address or 'local' (with --strategy=tpu or auto).")
_DISTRIBUTION = flags.DEFINE_enum(
    "distribution", "auto", ["auto", "none", "data_parallel", "model_parallel"],
    "Keras' JAX backend: keras.distribution over the devices (auto: data_parallel with more than "
    "one device). model_parallel shards attention by heads and the MLP by its hidden units.",
)
_MESH_SHAPE = flags.DEFINE_list(
    "mesh_shape", None, "JAX: the (batch, model) device mesh, e.g. 2,4; default: every device on the batch axis "
    "for data_parallel, see keras_vit.parallel.make_distribution for model_parallel."
)
_MULTI_HOST = flags.DEFINE_bool(
    "multi_host", False, "JAX on several hosts (a TPU pod slice, GPU hosts): run the same command on every "
    "host; keras.distribution.initialize() connects them first."
)


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
    """What the job needs of a data set, whatever its source.

    `train` yields batches of (uint8 pixels, one-hot labels), augmented.  For
    image folders and TFDS it is endless: each host reads its share of the
    files over and over, so that every host runs the steps `fit` is given
    (`steps_per_epoch=num_train // global batch`) whatever its share of the
    images that fail to decode; it is built through the strategy's
    `distribute_datasets_from_function` when a strategy is given.  The digits
    are one epoch per pass (`steps_per_epoch` equal to it is fine).
    """

    train: tf.data.Dataset | tf.distribute.DistributedDataset
    test: tf.data.Dataset  # batches of (uint8 pixels, one-hot labels), every example
    calibration: tf.data.Dataset  # unaugmented training images, for int8 export
    num_classes: int
    class_names: list
    num_train: int  # examples listed; the ones that fail to decode are in `skipped`
    num_test: int
    # Images skipped because they failed to read or decode (`.count`, `.paths`), filled as the
    # pipelines meet them: read it after training.
    skipped: vit_data.DecodeFailures = dataclasses.field(default_factory=vit_data.DecodeFailures)


def load_data(config, strategy=None):
    """The data set named by config.dataset: "digits", "tfds:NAME[:SPLIT]" or "folder:PATH".

    With a `tf.distribute.Strategy`, the training data of image sets is made by
    `strategy.distribute_datasets_from_function`: each input pipeline (a host)
    reads and decodes its own files and batches `config.batch_size /
    replicas` per replica.  The digits, in memory, stay one `tf.data.Dataset`
    that the strategy splits by example.
    """
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
    if kind not in ("tfds", "folder") or not rest:
        raise ValueError(
            f"Unknown dataset {name!r}. Expected 'digits', 'tfds:NAME[:SPLIT]' or 'folder:PATH'."
        )
    source = vit_data.load_image_source(
        name,
        data_dir=config.data_dir or None,
        test_split=config.test_split or None,
        test_fraction=config.test_fraction,
        seed=config.seed,
    )
    augment = config.augment
    # One input pipeline's training data (given an InputContext): its own files, endless.
    training_data = functools.partial(
        vit_data.training_pipeline,
        source,
        config.image_size,
        config.batch_size,
        seed=config.seed,
        crop=augment.inception_crop,
        flip=augment.flip,
        randaugment=augment.randaugment,
        cache=config.cache,
    )
    pipeline = functools.partial(
        vit_data.image_pipeline,
        image_size=config.image_size,
        num_classes=source.num_classes,
        crop_fraction=config.crop_fraction,
        cache=config.cache,
    )
    if strategy is not None:
        train = strategy.distribute_datasets_from_function(training_data)
    else:
        train = training_data(jax_input_context())
    return Data(
        train=train,
        test=pipeline(source.test, batch_size=config.batch_size, training=False),
        calibration=pipeline(source.train, batch_size=1, training=False).map(lambda x, y: x[0]),
        num_classes=source.num_classes,
        class_names=source.class_names,
        num_train=source.num_train,
        num_test=source.num_test,
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


def _process_index():
    """This process's index among the hosts of a multi-host JAX job; 0 otherwise."""
    if keras.backend.backend() == "jax":
        import jax

        return jax.process_index()
    return 0


def train_and_evaluate(config, workdir, strategy=None, callbacks=()):
    """Runs the whole job; returns the metrics it writes to `workdir`.

    TensorFlow backend: `strategy` is a `tf.distribute.Strategy`, by default
    one device.  Other backends: no strategy; on JAX the `keras.distribution`
    in force (`keras.distribution.set_distribution`) spreads the work.  The
    batch size in `config` is global.  `callbacks` are added to `fit`'s own.
    """
    if keras.backend.backend() == "tensorflow":
        strategy = strategy or get_strategy("one_device")
        scope, chief = strategy.scope(), is_chief(strategy)
        worker = getattr(getattr(strategy, "cluster_resolver", None), "task_id", 0)
    elif strategy is not None:
        raise ValueError(
            f"A tf.distribute strategy needs Keras' TensorFlow backend; this is {keras.backend.backend()!r}. "
            "On JAX, set a keras.distribution (keras_vit.parallel.make_distribution). "
            f"Received: strategy={strategy!r}"
        )
    else:
        worker = _process_index()
        scope, chief = contextlib.nullcontext(), worker == 0
    if not chief:
        # Every worker runs the same program; only the chief writes the job's
        # outputs, the others write theirs apart (Keras's BackupAndRestore
        # handles its own files per worker).
        workdir = tf.io.gfile.join(workdir, "workers", str(worker))
    exports = export_kinds(config)
    if exports and keras.backend.backend() != "tensorflow":
        raise ValueError(
            f"config.export={config.export!r} needs Keras' TensorFlow backend (exports are TensorFlow "
            f"graphs); this is {keras.backend.backend()!r}. Export the saved model.keras from a "
            "TensorFlow process: python -m experiments.export."
        )

    # === Data ===
    dataset = load_data(config, strategy)
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
    with scope:
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
            # Under the strategy's scope: "auto" follows the strategy (see resolve_jit_compile).
            jit_compile=keras_vit.training.resolve_jit_compile(config.jit_compile, config.precision),
            # Several steps per call: what keeps a TPU busy.
            steps_per_execution=config.steps_per_execution,
        )
        # MixUp / CutMix inside the compiled step: uint8 batches cross to the device, mixed there.
        keras_vit.enable_batch_mixing(
            model,
            mixup_alpha=config.augment.mixup_alpha,
            cutmix_alpha=config.augment.cutmix_alpha,
            switch_prob=config.augment.switch_prob,
            seed=config.seed,
        )

    # === Train ===
    throughput = Throughput()
    history = model.fit(
        train_ds,
        epochs=config.epochs,
        # Image sets repeat: each host runs the same steps whatever its share of skipped files.
        steps_per_epoch=steps_per_epoch,
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
            *callbacks,
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
        # Images that failed to read or decode, skipped (this host's share of the files).
        "skipped_files": dataset.skipped.count,
        "skipped_examples": dataset.skipped.paths[:100],
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


def vit_config(config):
    """The `ViTConfig` the job's model will have (its variant and the overrides in config.model)."""
    from keras_vit.variants import ViTConfig, parse_variant

    fields = set(ViTConfig.__dataclass_fields__)
    model = dict(config.model)
    return parse_variant(model.pop("variant"), **{k: v for k, v in model.items() if k in fields})


def distribute_on_jax(config):
    """Sets the keras.distribution of --distribution / --mesh_shape (Keras' JAX backend)."""
    if _MULTI_HOST.value:
        # Reads the coordinator from the environment (KERAS_DISTRIBUTION_* or the TPU pod's own).
        keras.distribution.initialize()
    kind = _DISTRIBUTION.value
    if kind == "auto":
        kind = "data_parallel" if len(keras.distribution.list_devices()) > 1 else "none"
    if kind == "none":
        logging.info("Distribution: none (one device)")
        return
    mesh_shape = tuple(int(n) for n in _MESH_SHAPE.value) if _MESH_SHAPE.value else None
    distribution = parallel.make_distribution(
        kind, mesh_shape, batch_size=config.batch_size, config=vit_config(config)
    )
    keras.distribution.set_distribution(distribution)
    logging.info(
        "Distribution: %s over a %s mesh %s", type(distribution).__name__,
        dict(zip(distribution.device_mesh.axis_names, distribution.device_mesh.shape)),
        "of this host's devices" if not _MULTI_HOST.value else "across hosts",
    )


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    workdir = _WORKDIR.value
    if keras.backend.backend() == "jax":
        if _STRATEGY.value != "auto" or _TPU.value:
            raise app.UsageError("--strategy and --tpu are for the TensorFlow backend; on JAX use --distribution.")
        distribute_on_jax(_CONFIG.value)
        strategy = None
    elif keras.backend.backend() == "tensorflow":
        if _DISTRIBUTION.value not in ("auto", "none") or _MESH_SHAPE.value or _MULTI_HOST.value:
            raise app.UsageError(
                "--distribution, --mesh_shape and --multi_host are for Keras' JAX backend (KERAS_BACKEND=jax); "
                "on TensorFlow use --strategy."
            )
        # First: a TPU is connected before anything is built or traced. It logs its choice.
        strategy = get_strategy(_STRATEGY.value, _TPU.value)
    else:
        strategy = None
    metrics = train_and_evaluate(_CONFIG.value, workdir, strategy)
    logging.info("Metrics: %s", metrics)
    print(json.dumps(metrics, indent=2))
    where = workdir if "://" in workdir else os.path.abspath(workdir)
    print(f"Wrote the model, metrics.json and history.json to {where}")


if __name__ == "__main__":
    app.run(main)
