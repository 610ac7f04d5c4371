r"""Trains a ViT with `model.fit` and writes the model and its metrics.

    python -m experiments.train --workdir=/tmp/vit_digits
    python -m experiments.train --config=experiments/configs/digits.py \
        --config.epochs=10 --workdir=/tmp/vit_digits

Writes into --workdir: `model.keras` (the trained model), `best.keras` (the
epoch with the best accuracy on the validation split), `metrics.json`,
`history.json` and `log.csv` (every epoch, across restarts), `tensorboard/`,
`figures/` (with --config.visualize: the attention and embedding figures of
`keras_vit.visualize` for a few test images) and, while it runs, `backup/`
(the state of an interrupted run; the same command run again resumes from it:
the rest of the interrupted epoch, then the uninterrupted run's epochs).
SIGTERM and SIGINT stop the run after the step in flight with a backup and no
validation (exit status 143, 130); a
workdir that holds a finished run is refused unless --overwrite; a wrong flag,
config field or value is one message and exit status 2.  --help lists every
config field with its default.

Model selection never sees the test split: each epoch is validated on a
split held out of the training data (config.validation_fraction or
validation_split), and `best.keras` is chosen there.  The test split is read
once training is over, for the final model and for `best.keras`, reported
apart (`test_accuracy`, `best_test_accuracy`); `metrics.json` names the
data behind each split under "splits".
"""

import contextlib
import dataclasses
import json
import os
import signal
import time
import warnings

import keras
import tensorflow as tf
from absl import app, flags, logging

import keras_vit
from experiments import config_checks, datasets, extra_test_sets, jobs, models, outputs, topology
from keras_vit import backups, evaluation, export, visualize
from keras_vit import callbacks as vit_callbacks
from keras_vit.distribute import STRATEGIES, get_strategy
from keras_vit.files import atomic_path


def define_flags():
    """The job's flags, defined when it runs as a program (`jobs.run_job`), not on import."""
    config, workdir = jobs.define_config_and_workdir(
        "experiments/configs/digits.py", "runs/digits", "Where the model and metrics go."
    )
    return {
        "config": config,
        "workdir": workdir,
        "strategy": flags.DEFINE_enum("strategy", "auto", list(STRATEGIES), "Distribution strategy."),
        "tpu": flags.DEFINE_string("tpu", None, "TPU name, grpc:// address or 'local' (with --strategy=tpu or auto)."),
        "distribution": flags.DEFINE_enum(
            "distribution", "auto", ["auto", "none", "data_parallel", "model_parallel"],
            "Keras' JAX backend: keras.distribution over the devices (auto: data_parallel with more than "
            "one device). model_parallel shards attention by heads and the MLP by its hidden units.",
        ),
        "mesh_shape": flags.DEFINE_list(
            "mesh_shape", None, "JAX: the (batch, model) device mesh, e.g. 2,4; default: every device on the batch "
            "axis for data_parallel, see keras_vit.distribute.make_distribution for model_parallel."
        ),
        "multi_host": flags.DEFINE_bool(
            "multi_host", False, "JAX on several hosts (a TPU pod slice, GPU hosts): run the same command on every "
            "host; keras.distribution.initialize() connects them first."
        ),
        "profile_phases": flags.DEFINE_bool(
            "profile_phases", False, "Print the seconds of each phase of the job (imports, data, tracing, the "
            "training steps, validation, the test split, best.keras, figures, exports, writing) at its end."
        ),
        "overwrite": flags.DEFINE_bool(
            "overwrite", False, "Delete what --workdir holds first, a finished run included, and train from scratch."
        ),
    }


def export_kinds(config):
    """The exports config.export asks for (`keras_vit.export.ARTEFACTS`, comma separated), checked before
    training starts."""
    kinds = [kind.strip() for kind in config.export.split(",") if kind.strip()]
    for kind in kinds:
        try:
            export.parse_artefact(kind)
        except ValueError as error:
            raise ValueError(f"config.export={config.export!r}: {error}") from None
    return kinds


def export_stem(kind):
    """Export `kind` as its file's stem and its metric's name: "tflite:int8" -> "tflite_int8"."""
    return kind.replace(":", "_")


def export_file_name(kind):
    """The name of the file or folder export `kind` writes in workdir/export: "tflite:int8" ->
    "tflite_int8.tflite", "saved_model:bfloat16" -> "saved_model_bfloat16"."""
    stem = export_stem(kind)
    return {"saved_model": stem, "tflite": f"{stem}.tflite", "onnx": "model.onnx"}[export.parse_artefact(kind)[0]]


def export_model(model, kind, workdir, dataset, config):
    """Exports into workdir/export/; returns the path written."""
    return export.export_artefact(
        model, kind, tf.io.gfile.join(workdir, "export", export_file_name(kind)),
        representative_data=dataset.calibration,  # Evaluation-pipeline images: unaugmented.
        class_names=dataset.class_names, crop_fraction=config.crop_fraction,
        image_limits=datasets.image_limits(config), overwrite=True,
    )  # fmt: skip


@dataclasses.dataclass
class Run:
    """What the job's stages share: the config, where the run writes, where it runs, its data and schedule."""

    config: object
    workdir: str
    topology: topology.Topology
    dataset: object  # datasets.Data
    steps_per_epoch: int
    steps_per_execution: int
    exports: list
    overwrite: bool = False  # Whether `make_workdir` deletes what the work directory holds first.
    # Whether the process exits after a stop by a signal (the command): the grace period then holds until it does.
    exits_after_stop: bool = False

    @property
    def strategy(self):
        """The tf.distribute strategy (TensorFlow); None on the other backends."""
        return self.topology.strategy

    @property
    def scope(self):
        """The strategy's scope (a no-op context on the other backends)."""
        return contextlib.nullcontext if self.strategy is None else self.strategy.scope

    @property
    def total_steps(self):
        return self.config.epochs * self.steps_per_epoch

    @property
    def best_path(self):
        return tf.io.gfile.join(self.workdir, "best.keras")


@dataclasses.dataclass(frozen=True)
class Start:
    """Where the run starts: `restore`'s answer, read by every stage after it."""

    step: int  # the steps trained
    epoch: int  # the epoch in progress at `step`
    resumed: backups.Resumed  # what the backup held (all zeros and None for a run that starts afresh)


@dataclasses.dataclass
class Fitting:
    """The `fit` callbacks of a run, and those the other stages read."""

    callbacks: list
    throughput: vit_callbacks.Throughput
    selection: vit_callbacks.AtomicModelCheckpoint | None  # best.keras, chosen on the validation split
    backup: vit_callbacks.Backup
    stop: vit_callbacks.StopOnSignal
    log: vit_callbacks.CSVLog


def train_and_evaluate(config, workdir, strategy=None, callbacks=(), *, overwrite=False, phases=None,
                       exits_after_stop=False):
    """Runs the whole job; returns the metrics it writes to `workdir`.

    TensorFlow backend: `strategy` is a `tf.distribute.Strategy`, by default
    the one in force (outside every scope none: TensorFlow's default).  Other
    backends: no strategy; on JAX the `keras.distribution` in force
    (`keras.distribution.set_distribution`) spreads the work.  The
    batch size in `config` is global.  `callbacks` are added to `fit`'s own.
    A `workdir` that holds a finished run (its metrics.json) is refused
    (`FinishedRunError`) unless `overwrite`, which deletes it first; one that
    holds an interrupted run's backup resumes it.  `phases` (a `jobs.Phases`)
    gets the seconds of each phase.  `exits_after_stop`: the caller exits
    when the run is stopped by a signal (`jobs.Stopped`), as the command does;
    the grace period then holds until the process exits.

    The stages, each a function of its own, in order: `prepare_run` (where it runs, every check, the data;
    nothing written), `make_workdir`, `build_model` (seeded, compiled, under the strategy's scope), `restore`
    (the backup's state, if any: the step every later stage starts from), `fit_callbacks` (made from that
    step), `fit` (the rest of an interrupted epoch, then the epochs after it) and `report` (the test split,
    model.keras, metrics.json, figures, exports, best.keras).
    """
    phases = jobs.Phases() if phases is None else phases
    with phases.timing("checks, data"):
        run = prepare_run(config, workdir, strategy, overwrite=overwrite, exits_after_stop=exits_after_stop)
    with phases.timing("model: built, compiled; restored from a backup"):
        make_workdir(run)
        model = build_model(run)
        start = restore(run, model)
        fitting = fit_callbacks(run, model, start, callbacks)
    with warnings.catch_warnings():
        # Keras warns so at the end of every split of unknown length (images that fail to decode are skipped,
        # so an image set's validation and test splits have none) the first time it reads it; the training
        # data is endless, so the warning can only be about those.
        warnings.filterwarnings("ignore", message="Your input ran out of data")
        started = time.perf_counter()
        fit(run, model, start, fitting)
        phases.add_fit(time.perf_counter() - started, fitting.throughput)
        return report(run, model, fitting, phases)


class FinishedRunError(ValueError):
    """The work directory holds a finished run, and no --overwrite."""


def _check_not_finished(workdir):
    path = tf.io.gfile.join(workdir, "metrics.json")
    if not tf.io.gfile.exists(path):
        return
    try:
        with tf.io.gfile.GFile(path) as f:
            finished = json.load(f)
        what = f" (test_accuracy {finished['test_accuracy']:.4f})" if "test_accuracy" in finished else ""
    except (ValueError, KeyError, TypeError):
        what = ""
    raise FinishedRunError(
        f"{workdir} holds a finished run{what}: its {path}. Train into another --workdir, or pass --overwrite "
        "to delete it and train again."
    )


def prepare_run(config, workdir, strategy=None, *, overwrite=False, exits_after_stop=False):
    """Where the job runs (`topology`), every check and the data, before anything is written: a bad value fails
    here, before a work directory is made or a file replaced. A worker that is not the chief writes under
    workdir/workers/INDEX."""
    config_checks.check_config(config)
    where = topology.topology(strategy)
    if not overwrite:
        _check_not_finished(workdir)
    if not where.chief:
        # Every worker runs the same program; only the chief writes the job's
        # outputs, the others write theirs apart (each its own backups too).
        workdir = tf.io.gfile.join(workdir, "workers", str(where.worker))
    exports = export_kinds(config)
    if exports and where.backend != "tensorflow":
        raise ValueError(
            f"config.export={config.export!r} needs Keras' TensorFlow backend (exports are TensorFlow "
            f"graphs); this is {where.backend!r}. Export the saved model.keras from a "
            "TensorFlow process: python -m experiments.export."
        )
    dataset = datasets.load_data(config, where.strategy)
    steps_per_epoch = dataset.num_train // config.batch_size
    if steps_per_epoch < 1:
        raise ValueError(
            f"The training split has {dataset.num_train} examples, fewer than one batch of "
            f"{config.batch_size}."
        )
    steps_per_execution = models.whole_executions(config.steps_per_execution, steps_per_epoch)
    if steps_per_execution != config.steps_per_execution:
        logging.warning(
            "config.steps_per_execution=%d does not divide the %d steps of an epoch: %d steps per execution, "
            "so that each epoch runs its steps and no more.", config.steps_per_execution, steps_per_epoch,
            steps_per_execution,
        )
    expected_classes = config.num_classes
    if expected_classes and expected_classes != dataset.num_classes:
        raise ValueError(
            f"config.num_classes={expected_classes} but the data set {config.dataset!r} has "
            f"{dataset.num_classes} classes."
        )
    if dataset.validation is None:
        logging.warning(
            "No validation split (config.validation_fraction=0 and no validation_split): no per-epoch "
            "validation and no best.keras."
        )
    return Run(config, workdir, where, dataset, steps_per_epoch, steps_per_execution, exports,
               overwrite and where.chief, exits_after_stop)  # fmt: skip


def make_workdir(run):
    """Makes the work directory; with --overwrite, deletes what it held first."""
    if run.overwrite and tf.io.gfile.exists(run.workdir):
        logging.warning("--overwrite: deleting %s and what it holds.", run.workdir)
        tf.io.gfile.rmtree(run.workdir)
    tf.io.gfile.makedirs(run.workdir)


def build_model(run):
    """The run's model, compiled, under the strategy's scope, the seed and the dtype policy set first; the
    pretrained weights, the frozen backbone, MixUp/CutMix and accumulation as asked."""
    config, dataset = run.config, run.dataset
    keras.utils.set_random_seed(config.seed)
    keras.mixed_precision.set_global_policy(config.precision)
    with run.scope():
        model = models.build_model(config, dataset.num_classes, dataset.class_names)
        if config.pretrained:
            # An original .npz checkpoint; a head of another size stays zero for this task.
            keras_vit.load_pretrained(model, config.pretrained, interpolation=config.interpolation)
        if config.freeze_backbone:
            keras_vit.freeze_backbone(model)  # A linear probe: only the head trains.
        warmup_steps = config.warmup_steps or config.warmup_epochs * run.steps_per_epoch
        models.compile_model(
            model,
            config,
            models.make_optimizer(config, run.total_steps, warmup_steps, model=model),
            # Several steps per call: what keeps a TPU busy; whole executions per epoch.
            steps_per_execution=run.steps_per_execution,
        )  # With config.augment's MixUp/CutMix and config.grad_accum_steps in the training step.
    return model


def restore(run, model):
    """The newest usable backup of an interrupted run loaded into `model` (weights, optimizer, random
    generators), and where the run starts (`Start`); a run that starts at step 0 removes what an earlier attempt
    that left no backup logged."""
    folder = tf.io.gfile.join(run.workdir, "backup")
    with run.scope():  # The optimizer's variables are made (and loaded) where the strategy places them.
        resumed = backups.restore_state(model, folder)
    step = resumed.step if resumed.step is not None else resumed.epoch * run.steps_per_epoch
    epoch, into = divmod(step, run.steps_per_epoch)
    if step:
        logging.info("Resuming from %s at step %d of %d (epoch %d of %d, step %d of %d).", folder, step,
                     run.total_steps, epoch + 1, run.config.epochs, into, run.steps_per_epoch)  # fmt: skip
    else:
        _clear_earlier_attempt(run.workdir)
    return Start(step, epoch, resumed)


def fit_callbacks(run, model, start, extra=()):
    """`fit`'s callbacks, made from where the run starts: the backup, the stop on a signal, the NaN stop, model
    selection (best.keras, written whole or not at all, beating the best epoch logged before `start`), the log,
    the progress, the throughput, the epoch figures and, with config.ema_momentum, the moving average (validated,
    checkpointed and shown in the figures: the callbacks between `ema` and `ema.restorer()`); `extra` last."""
    config, dataset, workdir = run.config, run.dataset, run.workdir
    throughput = vit_callbacks.Throughput()
    ema = vit_callbacks.EMAWeights() if config.ema_momentum else None
    averaged, restored = ([ema], [ema.restorer()]) if ema else ([], [])
    # An epoch is logged once: a resumed run goes on from the rows of the epochs before the one it resumes in.
    log = vit_callbacks.CSVLog(tf.io.gfile.join(workdir, "log.csv"), first_epoch=start.epoch)
    logged = log.read().get("val_accuracy") if tf.io.gfile.exists(run.best_path) else None
    selection = []
    if dataset.validation is not None:
        selection = [vit_callbacks.AtomicModelCheckpoint(
            # best.keras is replaced only by an epoch better than those it was chosen among.
            run.best_path, monitor="val_accuracy", save_best_only=True,
            initial_value_threshold=max(logged) if logged else None,
        )]
    epoch_figures = []  # After Throughput: their time is not the training's.
    if dataset.validation is not None and config.tensorboard_figures:
        epoch_figures = [vit_callbacks.TensorBoardFigures(
            tf.io.gfile.join(workdir, "tensorboard"), dataset.validation, num_images=config.tensorboard_figures,
            max_figures=config.tensorboard_figure_epochs or None,
        )]
    backup = vit_callbacks.Backup(
        tf.io.gfile.join(workdir, "backup"),
        save_freq="epoch" if config.backup_every == "epoch" else int(config.backup_every),
        save_seconds=config.backup_minutes * 60 or None,
        total_steps=run.total_steps,
        resumed=start.resumed,  # With a backup written mid-epoch, that epoch's metrics so far.
        start_step=start.step,
    )
    # Several workers stop together: each asks the others after every step (one collective of one integer).
    stop = vit_callbacks.StopOnSignal(backup, config.grace_seconds, workers=run.topology.workers,
                                      agree=run.topology.agree(), exits=run.exits_after_stop)  # fmt: skip
    callbacks = [
        backup,  # First: the others read its step.
        stop,
        keras.callbacks.TerminateOnNaN(),
        *averaged,
        *selection,
        log,
        vit_callbacks.TensorBoard(tf.io.gfile.join(workdir, "tensorboard")),
        vit_callbacks.Progress(start.step),
        throughput,
        *epoch_figures,
        *restored,
        *extra,
    ]
    return Fitting(callbacks, throughput, selection[0] if selection else None, backup, stop, log)


def fit(run, model, start, fitting):
    """`model.fit` on the training split from `start`, validated on the validation split (never the test split).

    A run resumed mid-epoch first runs the rest of that epoch (its steps, its validation, its logs), then the
    epochs after it: the epochs, their logs and the best epoch are those of the uninterrupted run, and so are
    the weights (the digits' batches are those of the uninterrupted run from any step, an image set's read on
    from the position its backup saved).  A run stopped by SIGTERM or SIGINT wrote its backup after the step in
    flight, did not validate, and raises `jobs.Stopped`."""
    config, spe = run.config, run.steps_per_epoch
    # One list for every `fit` of the run: the callbacks see the run's epochs and steps per epoch.
    callback_list = vit_callbacks.RunCallbacks(fitting.callbacks, model=model, epochs=config.epochs, steps=spe,
                                               verbose=config.verbose)  # fmt: skip
    step, position = start.step, start.resumed.input
    stopped = None
    try:
        while step < run.total_steps:
            epoch, into = divmod(step, spe)
            batches, positions = run.dataset.train_from(step, position)
            if step and position is None and positions is not None:
                logging.warning("The backup does not say where the input was: the input starts new passes.")
            fitting.backup.input_position = positions.after if positions is not None else None
            if step == start.step and isinstance(batches, tf.data.Dataset):
                # What fit makes before its first step (the compiled metrics, the loss) made from the batches'
                # shapes, as Keras does under a strategy and on JAX. TensorFlow without a strategy makes them as it
                # traces the first step, so that tf.function traces it twice; and a resumed epoch's metrics go back
                # before that step (Backup).
                with run.scope():
                    keras_vit.compat.build_for_fit(model, batches.element_spec)
            callback_list.goes_on_after = epoch if into else None
            model.fit(
                batches,
                epochs=epoch + 1 if into else config.epochs,
                initial_epoch=epoch,
                # Image sets repeat: each host runs the same steps whatever its share of skipped files.
                steps_per_epoch=spe - into,
                validation_data=run.dataset.validation,
                callbacks=callback_list,
                shuffle=False,  # The pipelines shuffle.
                verbose=config.verbose,  # 1: a progress bar, 2: a line per epoch (logs)
            )
            if fitting.stop.signal_number is not None or model.stop_training or fitting.backup.step <= step:
                break
            step = fitting.backup.step
            position = positions.after(step) if positions is not None else None
    except vit_callbacks.StoppedBySignal as error:
        # The backup is written; what the callbacks hold open (TensorBoard's writers) closes below. The error
        # stays referenced, and with it fit's input iterator: deleted, an iterator can wait up to a minute on
        # tf.data's autotuning thread; a process that exits now need not delete it (`jobs.run_job`).
        stopped = error
    finally:
        callback_list.end()
    stop = fitting.stop
    if stop.signal_number is not None:
        raise jobs.Stopped(
            f"Stopped by {signal.Signals(stop.signal_number).name} at step {fitting.backup.step} of "
            f"{run.total_steps}; the state is in {stop.backup_path}. Run the same command to resume from it.",
            stop.exit_code(),
        ) from stopped


def _clear_earlier_attempt(workdir):
    """Before a run starts at step 0: the log and TensorBoard events of an earlier attempt in `workdir` that
    left no backup, removed, so that they never mix with this run's."""
    for name in ("log.csv", "tensorboard"):
        path = tf.io.gfile.join(workdir, name)
        if tf.io.gfile.exists(path):
            logging.warning("No backup to resume from: removing %s of an earlier attempt.", path)
            (tf.io.gfile.rmtree if tf.io.gfile.isdir(path) else tf.io.gfile.remove)(path)


def report(run, model, fitting, phases=None):
    """After training (with config.ema_momentum, of the moving average): the test split, first read now, with
    eval/ (top-1 and top-5, the loss without label smoothing, per-class figures, calibration); model.keras;
    the figures and exports; best.keras on the same data; metrics.json and history.json (every epoch of the
    run, those before a restart included, as log.csv has them). Returns the metrics."""
    config, dataset, workdir = run.config, run.dataset, run.workdir
    timing = (jobs.Phases() if phases is None else phases).timing
    test_ds = dataset.make_test()
    with timing("test split: evaluated, eval/ written"):
        final = evaluation.evaluate(model, test_ds, class_names=dataset.class_names, strategy=run.strategy)
        final.metrics.update(split=dataset.splits.get("test", {}), skipped_files=dataset.skipped.count)
        final.write(tf.io.gfile.join(workdir, "eval"))
    with timing("model.keras written"):
        with atomic_path(tf.io.gfile.join(workdir, "model.keras"), suffix=".keras") as temporary:
            model.save(temporary)
    metrics = {
        "test_accuracy": float(final.metrics["top1_accuracy"]),  # The final model's.
        "test_loss": float(final.metrics["loss"]),
        "test_top5_accuracy": final.metrics["top5_accuracy"],
        "test_expected_calibration_error": final.metrics["expected_calibration_error"],
        "epochs": int(config.epochs),
        "steps": int(model.optimizer.iterations.numpy()),
        "train_images_per_second": fitting.throughput.images_per_second(config.batch_size),
        "train_examples": dataset.num_train,
        "validation_examples": dataset.num_validation,
        "test_examples": dataset.num_test,
        # The data behind each figure: train_*, validation_* / best_validation_*, test_* / best_test_*.
        "splits": dataset.splits,
        "parameters": int(model.count_params()),
        # Images that failed to read or decode, skipped (this host's share of the files).
        "skipped_files": dataset.skipped.count,
        "skipped_examples": dataset.skipped.paths[:100],
    }
    if dataset.validation is not None:
        with timing("validation split evaluated again, without label smoothing"):
            metrics["validation_loss"], metrics["validation_accuracy"] = plain_loss_and_accuracy(
                model, dataset.validation, run.strategy
            )
    with timing("figures"):
        # Did the position embeddings learn the grid structure of the paper's Figure 7?
        metrics.update(visualize.neighbour_similarity(visualize.position_embedding_similarity(model)))
        if config.visualize:
            figures = tf.io.gfile.join(workdir, "figures")
            images = next(iter(test_ds.unbatch().batch(config.visualize_images)))[0].numpy()
            for i, image in enumerate(images):
                visualize.write_figures(model, image, figures, prefix=f"test{i}_")
    with timing("exports"):
        for kind in run.exports:
            metrics[f"export_{export_stem(kind)}"] = export_model(model, kind, workdir, dataset, config)
    with timing("extra test sets"):
        extra = extra_test_sets.extra_evaluations(config, model, run.strategy)
    if fitting.selection is not None and tf.io.gfile.exists(run.best_path):
        with timing("best.keras: evaluated unless it is the final model"):
            if fitting.selection.saved_epoch == run.config.epochs - 1:
                # Written at the last epoch's end, best.keras is the final model (with a moving average, both
                # are the average): its figures are the final model's, measured above.
                best = {f"best_{name}": metrics[name] for name in
                        ("validation_loss", "validation_accuracy", "test_loss", "test_accuracy")}  # fmt: skip
                best_extra = {name: result["accuracy"] for name, result in extra.items() if "accuracy" in result}
            else:
                best, best_extra = report_best(run, model, test_ds)
        metrics.update(best)
        for name, accuracy in best_extra.items():
            extra[name]["best_accuracy"] = accuracy
    if extra:
        metrics["extra_evals"] = extra
    with timing("metrics.json, history.json written"):
        outputs.write_json(tf.io.gfile.join(workdir, "metrics.json"), metrics)
        history = fitting.log.columns()
        history.pop("epoch", None)
        outputs.write_json(tf.io.gfile.join(workdir, "history.json"), history)
    return metrics


def plain_loss_and_accuracy(model, batches, strategy=None):
    """(the cross-entropy without label smoothing, top-1 accuracy) of `model` on `batches` of (images, one-hot
    labels), in one pass: as `evaluation.evaluate` reports the test split's, so every loss in metrics.json is
    on one scale."""
    logits, labels = evaluation.predict_with_labels(model, batches, strategy)
    report = evaluation.classification_report(logits, labels.argmax(axis=-1))
    return float(report["loss"]), float(report["top1_accuracy"])


def report_best(run, model, test_ds):
    """best.keras, the model selected on the validation split, on the same data as the final model: (its
    metrics, {extra test set: its accuracy there}). The final model is saved by then: its variables are
    reused."""
    model.load_weights(run.best_path)
    metrics = {}
    metrics["best_validation_loss"], metrics["best_validation_accuracy"] = plain_loss_and_accuracy(
        model, run.dataset.validation, run.strategy
    )
    metrics["best_test_loss"], metrics["best_test_accuracy"] = plain_loss_and_accuracy(model, test_ds, run.strategy)
    extra = {name: result["accuracy"]
             for name, result in extra_test_sets.extra_evaluations(run.config, model, run.strategy).items()
             if "accuracy" in result}  # fmt: skip
    return metrics, extra


def main(cli):
    """The command line's job: the strategy or distribution first, then `train_and_evaluate`."""
    config, workdir = cli.config.value, cli.workdir.value
    if keras.backend.backend() == "jax":
        if cli.strategy.value != "auto" or cli.tpu.value:
            raise app.UsageError("--strategy and --tpu are for the TensorFlow backend; on JAX use --distribution.")
        topology.distribute_on_jax(config, cli.distribution.value, cli.mesh_shape.value, cli.multi_host.value)
        strategy = None
    elif keras.backend.backend() == "tensorflow":
        if cli.distribution.value not in ("auto", "none") or cli.mesh_shape.value or cli.multi_host.value:
            raise app.UsageError(
                "--distribution, --mesh_shape and --multi_host are for Keras' JAX backend (KERAS_BACKEND=jax); "
                "on TensorFlow use --strategy."
            )
        # First: a TPU is connected before anything is built or traced. It logs its choice.
        strategy = get_strategy(cli.strategy.value, cli.tpu.value)
    else:
        strategy = None
    phases = jobs.Phases()
    imported = jobs.process_seconds()
    if imported is not None:
        phases.add("imports, flags, distribution (from the process's start)", imported)
    metrics = train_and_evaluate(config, workdir, strategy, overwrite=cli.overwrite.value, phases=phases,
                                 exits_after_stop=True)  # fmt: skip
    logging.info("Metrics: %s", metrics)
    print(json.dumps(metrics, indent=2))
    if cli.profile_phases.value:
        print(phases.table())
    where = workdir if "://" in workdir else os.path.abspath(workdir)
    print(f"Wrote the model, metrics.json and history.json to {where}")


if __name__ == "__main__":
    jobs.run_job(main, define_flags)
