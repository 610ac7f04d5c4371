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
from keras_vit.distribute import STRATEGIES, get_strategy

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


def load_data(config):
    if config.dataset != "digits":
        raise ValueError(f"Unknown dataset {config.dataset!r}. Expected 'digits'.")
    return vit_data.load_digits(
        image_size=config.image_size, test_fraction=config.test_fraction, seed=config.seed
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
        min(config.warmup_epochs * steps_per_epoch, total_steps - 1),
        weight_decay=config.weight_decay,
        decay=config.get("decay", "cosine"),
        grad_clip_norm=config.grad_clip_norm,
    )


EXPORTS = ("saved_model", "tflite", "tflite_float16", "tflite_dynamic", "tflite_int8", "onnx")


def export_kinds(config):
    """The exports asked for by config.export, checked before training starts."""
    kinds = [kind.strip() for kind in config.get("export", "").split(",") if kind.strip()]
    unknown = [kind for kind in kinds if kind not in EXPORTS]
    if unknown:
        raise ValueError(f"Unknown export(s) {unknown} in config.export. Expected a subset of {list(EXPORTS)}.")
    return kinds


def export_model(model, kind, workdir, dataset):
    """Exports into workdir/export/; returns the path written."""
    out = os.path.join(workdir, "export")
    if kind == "saved_model":
        return export.export_saved_model(
            model, os.path.join(out, "saved_model"), class_names=dataset.class_names, overwrite=True
        )
    if kind == "onnx":
        return export.export_onnx(model, os.path.join(out, "model.onnx"), overwrite=True)
    return export.export_tflite(
        model,
        os.path.join(out, f"{kind}.tflite"),
        quantize=kind.partition("_")[2] or None,
        representative_data=dataset.train.images,  # Evaluation-pipeline images: unaugmented.
        overwrite=True,
    )


def train_and_evaluate(config, workdir, strategy=None):
    """Runs the whole job; returns the metrics it writes to `workdir`.

    `strategy` defaults to one device; the batch size in `config` is global.
    """
    strategy = strategy or get_strategy("one_device")
    exports = export_kinds(config)
    tf.io.gfile.makedirs(workdir)
    keras.utils.set_random_seed(config.seed)
    keras.mixed_precision.set_global_policy(config.precision)

    # === Data ===
    dataset = load_data(config)
    train_ds = vit_data.make_pipeline(
        dataset.train,
        config.batch_size,
        training=True,
        num_classes=dataset.num_classes,
        seed=config.seed,
        max_shift=config.max_shift,
    )
    test_ds = vit_data.make_pipeline(
        dataset.test, config.batch_size, training=False, num_classes=dataset.num_classes
    )
    steps_per_epoch = len(dataset.train) // config.batch_size

    # === Model, under the strategy's scope ===
    with strategy.scope():
        model = build_model(config, dataset.num_classes)
        if config.get("pretrained"):
            # An original .npz checkpoint; a head of another size stays zero for this task.
            keras_vit.load_pretrained(
                model, config.pretrained, interpolation=config.get("interpolation", "bicubic")
            )
        if config.get("freeze_backbone"):
            keras_vit.freeze_backbone(model)  # A linear probe: only the head trains.
        model.compile(
            optimizer=make_optimizer(config, steps_per_epoch),
            loss=keras.losses.CategoricalCrossentropy(
                from_logits=True, label_smoothing=config.label_smoothing
            ),
            metrics=[keras.metrics.CategoricalAccuracy(name="accuracy")],
            jit_compile=config.jit_compile,
            # Several steps per call: what keeps a TPU busy.
            steps_per_execution=config.get("steps_per_execution", 1),
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
                os.path.join(workdir, "backup"), save_freq=config.get("backup_every", "epoch")
            ),
            keras.callbacks.TerminateOnNaN(),
            keras.callbacks.ModelCheckpoint(
                os.path.join(workdir, "best.keras"), monitor="val_accuracy", save_best_only=True
            ),
            keras.callbacks.CSVLogger(os.path.join(workdir, "log.csv"), append=True),
            keras.callbacks.TensorBoard(os.path.join(workdir, "tensorboard")),
            throughput,
        ],
        verbose=2,
    )

    # === Evaluate and save ===
    test_loss, test_accuracy = model.evaluate(test_ds, verbose=0)
    model_path = os.path.join(workdir, "model.keras")
    model.save(model_path)
    metrics = {
        "test_accuracy": float(test_accuracy),
        "test_loss": float(test_loss),
        "epochs": int(config.epochs),
        "steps": int(model.optimizer.iterations.numpy()),
        "train_images_per_second": throughput.images_per_second(
            steps_per_epoch * config.batch_size
        ),
        "train_examples": len(dataset.train),
        "test_examples": len(dataset.test),
        "parameters": int(model.count_params()),
    }
    # Did the position embeddings learn the grid structure of the paper's Figure 7?
    metrics.update(visualize.neighbour_similarity(visualize.position_embedding_similarity(model)))
    if config.visualize:
        figures = os.path.join(workdir, "figures")
        for i in range(config.visualize_images):
            visualize.write_figures(model, dataset.test.images[i], figures, prefix=f"test{i}_")
    for kind in exports:
        metrics[f"export_{kind}"] = export_model(model, kind, workdir, dataset)
    with tf.io.gfile.GFile(os.path.join(workdir, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    with tf.io.gfile.GFile(os.path.join(workdir, "history.json"), "w") as f:
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
    print(f"Wrote the model, metrics.json and history.json to {os.path.abspath(workdir)}")


if __name__ == "__main__":
    app.run(main)
