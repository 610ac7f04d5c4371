"""The `fit` callbacks of a training run, each usable alone with `model.fit`:

- `Backup`: the run's state (`keras_vit.backups`) every epoch, every few steps or minutes, and at a stop.
- `StopOnSignal`: SIGTERM or SIGINT end `fit` after the step in flight, with a backup and without validating.
- `EMAWeights`: the moving average of the weights where `fit` validates and at each epoch's end.
- `AtomicModelCheckpoint`: `ModelCheckpoint` that writes each file whole or not at all.
- `CSVLog`: the epochs' metrics as CSV on any file system, across restarts.
- `TensorBoardFigures`: the validation confusion matrix and attention rollouts in TensorBoard.
- `Progress`: Keras' progress bar and epoch lines, for a run that may resume mid-epoch.
- `Throughput`: images per second of the training steps.

A run stopped mid-epoch and resumed runs as the uninterrupted run (what `experiments.train` does): `fit` once
for the rest of the interrupted epoch, with `Backup(resumed=...)`, which puts the epoch's metrics back, then
`fit` for the epochs after it, both with one `RunCallbacks` (a `CallbackList` made with the run's `epochs` and
`steps` per epoch, whose training begins with the first `fit` and ends at its `end()`), so that every callback
sees one run and its epochs, not each `fit`'s.
"""

import logging
import os
import signal
import sys
import threading
import time

import keras
import numpy as np

from keras_vit import backups
from keras_vit.compat import swap_moving_average
from keras_vit.evaluation import confusion_image, confusion_matrix, rollout_images
from keras_vit.files import atomic_path, write_text_atomically
from keras_vit.layers.common import check_positive_int

log = logging.getLogger("keras_vit")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _steps_per_epoch(callback):
    """The run's steps per epoch, as `fit` (or the run's `CallbackList`) gives it; None if unknown."""
    return (callback.params or {}).get("steps")


class RunCallbacks(keras.callbacks.CallbackList):
    """The callbacks of a run made of several `fit` calls, as one: pass it as `fit(callbacks=...)` to each.
    Built with the run's `epochs` and `steps` (per epoch), which every callback reads as `params`; their
    `on_train_begin` runs at the first `fit`'s start, their `on_train_end` at `end()` (call it once the run is
    over, stopped or not), not between the calls (Keras' TensorBoard would close its writers there).

    Set `goes_on_after` to the last epoch of a `fit` that another follows: with an optimizer that keeps a
    moving average of the weights, `fit` puts the average in the model when it returns
    (`finalize_variable_values`); the trained weights are kept at that epoch's end and put back when the next
    `fit` begins, so that the run trains on from them."""

    def __init__(self, callbacks, *, model, epochs, steps, verbose=1):
        super().__init__(list(callbacks), add_history=True, add_progbar=False, model=model, verbose=verbose,
                         epochs=epochs, steps=steps)  # fmt: skip
        self.goes_on_after = None
        self._begun, self._ended, self._logs, self._trained = False, False, None, None

    def on_train_begin(self, logs=None):
        if self._trained is not None:
            for variable, value in zip(self.model.trainable_variables, self._trained, strict=True):
                variable.assign(value)
            self._trained = None
        if not self._begun:
            self._begun = True
            super().on_train_begin(logs)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        optimizer = getattr(self.model, "optimizer", None)
        if epoch == self.goes_on_after and getattr(getattr(optimizer, "inner_optimizer", optimizer), "use_ema", False):
            self._trained = [keras.ops.copy(v.value) for v in self.model.trainable_variables]

    def on_train_end(self, logs=None):
        self._logs = logs

    def end(self):
        """The callbacks' `on_train_end`, once."""
        if self._begun and not self._ended:
            self._ended = True
            super().on_train_end(self._logs)


# === The run's state ===


class Backup(keras.callbacks.Callback):
    """Saves the run's state into `folder` every epoch (`save_freq="epoch"`) or every `save_freq` steps, and
    also every `save_seconds` seconds of training when given, keeping the last `keep` backups; removes the
    folder when the run's last step is done (`total_steps`, by default `fit`'s epochs times its steps).

    It counts the run's steps (batches) in `step`, from `start_step` (where a resumed run starts; by default
    the optimizer's step counter when training begins), across the `fit` calls of a `RunCallbacks`; every
    `save_freq` steps means at the run's steps `save_freq`, 2 `save_freq`, ...  An epoch ends, and its backup
    is written, at a multiple of the steps per epoch or after a whole epoch of `fit`.  Pass `resumed`
    (`keras_vit.backups.restore_state`'s answer) when the run goes on by finishing the interrupted epoch: the
    epoch's metrics, saved with a backup written mid-epoch, are put back at its start, so that the epoch
    reports what the uninterrupted run's reports.  Set `keep_at_end` to keep the backups when training ends.
    """

    def __init__(self, folder, save_freq="epoch", keep=2, save_seconds=None, *, total_steps=None, resumed=None,
                 start_step=None):  # fmt: skip
        super().__init__()
        if save_freq != "epoch" and (not isinstance(save_freq, int) or isinstance(save_freq, bool) or save_freq < 1):
            raise ValueError(f"`save_freq` must be 'epoch' or a positive integer. Received: save_freq={save_freq!r}")
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"`keep` must be a positive integer. Received: keep={keep!r}")
        if save_seconds is not None and not save_seconds > 0:
            raise ValueError(f"`save_seconds` must be > 0 or None. Received: save_seconds={save_seconds!r}")
        self.folder, self.save_freq, self.keep = str(folder).rstrip("/"), save_freq, keep
        self.save_seconds = save_seconds
        self.total_steps = check_positive_int("total_steps", total_steps, optional=True)
        self.start_step = resumed.step if resumed is not None and start_step is None else start_step
        self._resumed_metrics = resumed.metrics if resumed is not None else None
        self.step = 0
        # step -> where the input pipelines are after it (JSON), saved with each backup; None: nothing to save.
        self.input_position = None
        self.keep_at_end = False
        self._epoch = 0
        self._epoch_start = 0
        self._saved_at = time.monotonic()

    def on_train_begin(self, logs=None):
        if self.start_step is not None:
            self.step = self.start_step
        else:
            self.step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        self._saved_at = time.monotonic()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch, self._epoch_start = epoch, self.step
        if self._resumed_metrics is not None:
            metrics, self._resumed_metrics = self._resumed_metrics, None
            variables = self.model.metrics_variables
            if len(metrics) != len(variables):
                raise ValueError(
                    f"The backup holds {len(metrics)} metric variables; the model has {len(variables)}: it is not "
                    "this run's."
                )
            for variable, value in zip(variables, metrics):
                _assign_metric(self.model, variable, np.asarray(value, dtype=variable.dtype))

    def _epoch_done(self):
        steps = _steps_per_epoch(self)
        return steps is None or self.step - self._epoch_start >= steps or self.step % steps == 0

    def on_epoch_end(self, epoch, logs=None):
        if not self._epoch_done():
            return  # Stopped mid-epoch (a NaN): its state, if any, is saved already.
        self._epoch = epoch + 1
        if self.save_freq == "epoch":
            self.save()

    def on_train_batch_end(self, batch, logs=None):
        self.step = self._epoch_start + batch + 1
        if self.save_freq != "epoch" and self.step % self.save_freq == 0:
            self.save()
        elif self.save_seconds is not None and time.monotonic() - self._saved_at >= self.save_seconds:
            self.save()

    def on_train_end(self, logs=None):
        total = self.total_steps
        if total is None:
            epochs, steps = self.params.get("epochs"), _steps_per_epoch(self)
            total = epochs * steps if epochs is not None and steps is not None else None
        if self.keep_at_end or (total is not None and self.step < total):
            return  # Stopped early (a signal, a NaN), or more to run: the backup is what a rerun resumes from.
        backups.remove_backups(self.folder)

    def save(self):
        """Writes the next backup (weights, then the JSON that completes it) and removes the oldest past `keep`;
        returns the JSON's path. Mid-epoch, the epoch's metrics so far are saved with it."""
        record = {"epoch": self._epoch, "step": self.step}
        steps = _steps_per_epoch(self)
        if steps and self.step % steps:
            record["metrics"] = [keras.ops.convert_to_numpy(v).tolist() for v in self.model.metrics_variables]
        where = self.input_position(self.step) if self.input_position is not None else None
        if where is not None:
            record["input"] = where
        path = backups.write_state(self.model, self.folder, record, keep=self.keep)
        self._saved_at = time.monotonic()
        return path


def _assign_metric(model, variable, value):
    """Sets a metric's variable. Under a tf.distribute strategy of several replicas a metric's variables are
    summed over the replicas when read (synchronized on read): the first replica takes the value, the others
    zero."""
    strategy = getattr(model, "distribute_strategy", None) if keras.backend.backend() == "tensorflow" else None
    if strategy is None or strategy.num_replicas_in_sync == 1:
        variable.assign(value)
        return
    import tensorflow as tf

    def per_replica():
        first = tf.distribute.get_replica_context().replica_id_in_sync_group == 0
        variable.assign(tf.where(first, tf.constant(value), tf.zeros_like(value)))

    strategy.run(per_replica)


# === Stopping on a signal ===


class StoppedBySignal(SystemExit):
    """Raised out of `fit` by `StopOnSignal` after the backup of the step in flight: `code` is 128 + the signal's
    number (what a shell reports for a process the signal ended), so a script that does not catch it exits
    with that status."""

    def __init__(self, signal_number, step, backup_path):
        super().__init__(128 + signal_number)
        self.signal_number, self.step, self.backup_path = signal_number, step, backup_path

    def __str__(self):
        return (f"Stopped by {signal.Signals(self.signal_number).name} at step {self.step}; the state is in "
                f"{self.backup_path}")  # fmt: skip


class StopOnSignal(keras.callbacks.Callback):
    """Stops `fit` after the step in flight on SIGTERM or SIGINT, with `backup.save()` written first.

    Cloud TPU spot and preemptible VMs, GKE and most GPU clouds stop a job with SIGTERM and a grace period
    (about 30 s) before SIGKILL; Ctrl-C sends SIGINT.  A signal during the training steps ends `fit` after the
    step in flight and its backup by raising `StoppedBySignal` (a `SystemExit` with 128 + the signal's number,
    143 for SIGTERM, 130 for SIGINT): the epoch is not validated nor ended, its callbacks' `on_epoch_end` and
    `on_train_end` do not run.  A signal during `fit`'s validation lets the epoch end (the validation is of
    trained steps) and `fit` returns with `signal_number` set.  If the step in flight and the backup have not
    ended `grace_seconds` after the signal, the process exits at once with the same status and a message: the
    previous backup is intact.  A second signal ends the process the same way.  The handlers are installed for
    the duration of `fit` and only in the main thread; the previous ones come back after.

    Every worker of a multi-worker job must stop at the same step, or the others would wait for it in their next
    collective.  Given `agree` (a function every worker calls at the same points, True on all when its argument
    is True on any: `keras_vit.distribute.any_replica(strategy)` for TensorFlow strategies, `any_process()` for
    JAX's processes), every worker asks it after each step whether any was signalled, and all stop together,
    each writing its own backup.  With several workers and no `agree`, the callback leaves the signals alone and
    logs so: the job then resumes from its last periodic backup.

    Args:
        backup: the run's `Backup` (among `fit`'s callbacks too, before this one).
        grace_seconds: how long the step in flight and the backup may take after the signal.
        workers: processes training together; above 1, `agree` is needed (else the signals are left alone).
        agree: with several workers, `agree(signalled)`: True when any worker was signalled.
    """

    def __init__(self, backup, grace_seconds=30.0, workers=1, agree=None):
        super().__init__()
        if not grace_seconds > 0:
            raise ValueError(f"`grace_seconds` must be > 0. Received: grace_seconds={grace_seconds!r}")
        self.backup, self.grace_seconds, self.workers, self.agree = backup, float(grace_seconds), workers, agree
        self.signal_number = None
        self.backup_path = None
        self._previous = {}
        self._deadline = None

    def exit_code(self):
        """128 + the signal's number once one was caught, else None."""
        return None if self.signal_number is None else 128 + self.signal_number

    def on_train_begin(self, logs=None):
        self.signal_number, self.backup_path = None, None
        if self.workers > 1 and self.agree is None:
            log.info("%d workers train together: SIGTERM and SIGINT end the job without a backup of their own; "
                     "it resumes from the last periodic backup.", self.workers)  # fmt: skip
            return
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only.
        for number in SIGNALS:
            self._previous[number] = signal.signal(number, self._caught)

    def _caught(self, number, frame):
        if self.signal_number is not None:  # A second signal: now.
            self._expire(reason="a second signal arrived")
        self.signal_number = number
        name = signal.Signals(number).name
        log.warning("%s: finishing the step in flight and writing a backup (grace period %g s).", name,
                    self.grace_seconds)  # fmt: skip
        self._deadline = threading.Timer(self.grace_seconds, self._expire)
        self._deadline.daemon = True
        self._deadline.start()

    def _expire(self, reason=None):
        reason = reason or f"the grace period of {self.grace_seconds:g} s passed before the step in flight ended"
        sys.stderr.write(
            f"Stopped by {signal.Signals(self.signal_number).name}: {reason}. The previous backup in "
            f"{self.backup.folder} is intact; run the same command to resume from it.\n"
        )
        sys.stderr.flush()
        os._exit(self.exit_code())

    def _stop_if_signalled(self):
        if self.backup_path is not None:
            return
        signalled = self.signal_number is not None
        if self.workers > 1 and self.agree is not None:
            if not self.agree(signalled):  # Every worker asks, at every step: none may skip a collective.
                return
            if not signalled:
                log.warning("Another worker was signalled: stopping at this step with it.")
                self.signal_number = signal.SIGTERM
        elif not signalled:
            return
        self.backup_path = self.backup.save()
        self.backup.keep_at_end = True
        self.model.stop_training = True
        if self._deadline is not None:
            self._deadline.cancel()
        return True

    def on_train_batch_end(self, batch, logs=None):
        if self._stop_if_signalled():
            # Out of `fit` now: the rest of the epoch, its validation and its end are the resumed run's.
            self._restore_handlers()
            raise StoppedBySignal(self.signal_number, self.backup.step, self.backup_path)

    def on_epoch_end(self, epoch, logs=None):
        # A signal during validation: the epoch ends (its logs, its checkpoint) and `fit` returns.
        self._stop_if_signalled()

    def on_train_end(self, logs=None):
        self._restore_handlers()

    def _restore_handlers(self):
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}


def any_process():
    """`agree(flag)` for a job of several JAX processes (`jax.process_count()` > 1): every process calls it
    together, and it is True on all when `flag` is True on any.  One gather of one integer from every process
    (`jax.experimental.multihost_utils.process_allgather`), a few milliseconds a step."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() < 2:
        return lambda flag: bool(flag)

    def agree(flag):
        return bool(np.any(multihost_utils.process_allgather(np.array(int(bool(flag)), np.int32))))

    return agree


# === What the run writes and shows ===


class EMAWeights(keras.callbacks.Callback):
    """Puts the optimizer's moving average of the weights (`use_ema=True`) in the model where `fit` evaluates
    and after each epoch, and the trained weights back before training goes on.

    - Validation inside `fit` sees the average (swapped in at `on_test_begin`,
      out at `on_test_end`).
    - At the end of each epoch the average is swapped in by this callback and
      out by `restorer()`, a second callback: the callbacks placed between
      the two see the averaged model (a checkpoint of the best epoch, figures),
      the ones before and after see the trained weights (a backup of the run's
      state: weights and the average both, in their places).
    - When `fit` returns, the model holds the average (Keras' own
      `finalize_variable_values`), ready to evaluate, save and export.

    The swaps exchange values exactly (`keras_vit.compat.swap_moving_average`),
    so training goes on from the same weights as without them.

        ema = EMAWeights()
        model.fit(..., callbacks=[backup, ema, best_checkpoint, ema.restorer()])
    """

    def __init__(self):
        super().__init__()
        self._in_model = False
        self._restorer = _EMARestorer(self)

    def restorer(self):
        """The callback that puts the trained weights back at the end of an epoch: place it after the ones that
        should see the average."""
        return self._restorer

    def _set(self, averaged):
        if self._in_model != averaged:
            swap_moving_average(self.model.optimizer)
            self._in_model = averaged

    def _check_restored(self):
        if self._in_model:
            raise RuntimeError(
                "EMAWeights left the moving average in the model after an epoch: its `restorer()` must be among "
                "fit's callbacks, after the EMAWeights callback (callbacks run in the order given)."
            )

    def on_train_begin(self, logs=None):
        optimizer = getattr(self.model.optimizer, "inner_optimizer", self.model.optimizer)
        if not getattr(optimizer, "use_ema", False):
            raise ValueError(
                f"EMAWeights needs an optimizer that keeps a moving average (use_ema=True, or "
                f"make_optimizer(ema_momentum=...)). Received: {type(optimizer).__name__} with use_ema=False."
            )

    def on_epoch_begin(self, epoch, logs=None):
        self._check_restored()

    def on_train_end(self, logs=None):
        self._check_restored()

    def on_test_begin(self, logs=None):
        self._set(True)

    def on_test_end(self, logs=None):
        self._set(False)

    def on_epoch_end(self, epoch, logs=None):
        self._set(True)


class _EMARestorer(keras.callbacks.Callback):
    def __init__(self, ema):
        super().__init__()
        self.ema = ema

    def on_epoch_end(self, epoch, logs=None):
        self.ema._set(False)


class CSVLog(keras.callbacks.Callback):
    """Per-epoch metrics as CSV, on any file system tf.io.gfile reaches (gs:// included).

    Keras's CSVLogger fails on remote paths (keras 3.15: it asks the GFile for
    `closed`) and object stores cannot append, so the whole file is rewritten
    after each epoch, whole or not at all (`keras_vit.files.atomic_path`).
    Rows already in the file (a resumed run) are kept, but for those of epochs
    from `first_epoch` on (set it to the epoch a resumed run starts at): an
    epoch is logged once, by the run that finished it last.
    """

    def __init__(self, path, first_epoch=None):
        super().__init__()
        self.path = path
        self.header, self.rows = None, []
        self.first_epoch = first_epoch

    def read(self):
        """Reads the rows the file holds, those of epochs from `first_epoch` on left out: the rows this log
        goes on from. Returns them as `columns()`."""
        import tensorflow as tf

        self.header, self.rows = None, []
        if tf.io.gfile.exists(self.path):
            with tf.io.gfile.GFile(self.path, "r") as f:
                lines = f.read().splitlines()
            if lines:
                self.header, self.rows = lines[0].split(","), lines[1:]
        if self.first_epoch is not None:
            self.rows = [row for row in self.rows if int(row.split(",", 1)[0]) < self.first_epoch]
        return self.columns()

    def on_train_begin(self, logs=None):
        self.read()

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        if self.header is None:
            self.header = ["epoch"] + sorted(logs)
        values = {"epoch": epoch, **logs}
        self.rows.append(",".join(str(float(values[k]) if k != "epoch" else epoch) for k in self.header))
        write_text_atomically(self.path, "\n".join([",".join(self.header), *self.rows]) + "\n")

    def columns(self):
        """{name: [value per logged epoch]}, the epochs of every run that wrote the file, in order."""
        header = self.header or []
        values = [row.split(",") for row in self.rows]
        return {name: [float(v[i]) if v[i] else float("nan") for v in values] if name != "epoch"
                else [int(v[i]) for v in values] for i, name in enumerate(header)}  # fmt: skip


class AtomicModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keras' `ModelCheckpoint` (same arguments, monitor and `save_best_only`
    included) that writes each checkpoint whole or not at all.

    Keras writes `filepath` in place: a save that fails (a full disk) would
    leave a damaged file where the best model was.  Here each save goes to a
    temporary beside `filepath` (`keras_vit.files.atomic_path`), renamed onto
    it once complete.  Saves once per epoch (`save_freq="epoch"`), to one
    path (no `{epoch}` placeholders).
    """

    def __init__(self, filepath, **kwargs):
        if kwargs.get("save_freq", "epoch") != "epoch":
            raise ValueError(f"AtomicModelCheckpoint saves once per epoch. Received: save_freq={kwargs['save_freq']!r}")
        filepath = str(filepath)
        if "{" in filepath:
            raise ValueError(f"AtomicModelCheckpoint writes one path, without placeholders. Received: {filepath!r}")
        super().__init__(filepath, **kwargs)
        self.destination = filepath

    def on_epoch_end(self, epoch, logs=None):
        # Keras reads the format from the name's end (".keras", ".h5", ".weights.h5"): the temporary keeps it.
        suffix = ".weights.h5" if self.destination.endswith(".weights.h5") else "." + self.destination.split(".")[-1]
        try:
            with atomic_path(self.destination, suffix=suffix) as temporary:
                # What `ModelCheckpoint` saves, if anything, goes to the temporary.
                self.filepath = temporary
                super().on_epoch_end(epoch, logs)
        finally:
            self.filepath = self.destination


class TensorBoardFigures(keras.callbacks.Callback):
    """Writes, at the end of epochs spread over the run, the validation confusion matrix (`confusion_image`: rows
    are the true classes, in order, columns the predicted ones) and the attention rollout of a few fixed
    validation images as TensorBoard images (`confusion_matrix`, `attention_rollout`), beside Keras' own scalars.

    Args:
        log_dir: the TensorBoard folder (local or gs://); the images go to its
            `validation` run, where Keras' TensorBoard callback writes the
            validation scalars.
        validation_data: a `tf.data.Dataset` of (images, labels) batches,
            labels integer or one-hot.
        num_images: how many of the first validation images get a rollout
            (0: none).
        max_examples: about this many validation examples (whole batches
            of them, the first ones: the split is not shuffled) are predicted
            for the matrix.
        max_figures: at most this many epochs of a run get the images,
            evenly spaced, the last epoch always (None: every epoch). The
            default, 10, is what TensorBoard shows of an image tag unless
            started with `--samples_per_plugin=images=N`: it keeps 10 steps
            of a tag, sampled at random but for the last, so more epochs would
            cost their predictions and not be shown.
    """

    def __init__(self, log_dir, validation_data, *, num_images=4, max_examples=2048, max_figures=10):
        super().__init__()
        self.max_figures = check_positive_int("max_figures", max_figures, optional=True)
        self.log_dir, self.validation_data = str(log_dir), validation_data
        self.num_images, self.max_examples = num_images, max_examples
        self.writer = self.images = self.labels = self.rollout_inputs = None

    def writes_at(self, epoch):
        """Whether the images are written at the end of `epoch` (0-based) of the run's `params["epochs"]`: every
        `ceil(epochs / max_figures)`-th epoch and the last, the same epochs in a run resumed part way."""
        epochs = self.params.get("epochs") if self.params else None
        if self.max_figures is None or not epochs:
            return True
        every = -(-epochs // self.max_figures)
        return (epoch + 1) % every == 0 or epoch + 1 == epochs

    def _prepare(self):
        """The writer, the examples and their labels, and the rollout images: read at the first epoch's end, so
        that nothing of the validation split is read before training starts."""
        import tensorflow as tf

        self.writer = tf.summary.create_file_writer(tf.io.gfile.join(self.log_dir, "validation"))
        batch = self.validation_data.element_spec[0].shape[0]
        batches = self.validation_data.take(-(-self.max_examples // batch) if batch else self.max_examples)
        # The images stay a dataset (2,048 ImageNet images are 300 MB); the labels and the few rollout images
        # are read once.
        self.images = batches.map(lambda x, y: x)
        labels = np.concatenate([np.asarray(y) for y in batches.map(lambda x, y: y).as_numpy_iterator()])
        self.labels = labels.argmax(-1) if labels.ndim == 2 else labels.astype(np.int64)
        rollout_batches = batches.unbatch().take(self.num_images).batch(max(self.num_images, 1))
        self.rollout_inputs = next(iter(rollout_batches.map(lambda x, y: x).as_numpy_iterator()), np.zeros((0,)))

    def on_epoch_end(self, epoch, logs=None):
        import tensorflow as tf

        if not self.writes_at(epoch):
            return
        if self.writer is None:
            self._prepare()
        logits = self.model.predict(self.images, verbose=0)
        confusion = confusion_matrix(self.labels, logits.argmax(axis=-1), logits.shape[-1])
        with self.writer.as_default():
            tf.summary.image("confusion_matrix", confusion_image(confusion)[None], step=epoch)
            if len(self.rollout_inputs):
                tf.summary.image("attention_rollout", rollout_images(self.model, self.rollout_inputs), step=epoch,
                                 max_outputs=len(self.rollout_inputs))
        self.writer.flush()


class Progress(keras.callbacks.Callback):
    """Keras' progress bar (`verbose=1`) or a line per epoch (`verbose=2`), with the run's epochs, for a run
    that may resume mid-epoch: its first epoch reads "Epoch 2/6: resumed at step 9 of 20" and its bar counts
    the steps that run (11).  A stopped epoch's bar stays where the steps stopped.  With `fit`'s own
    callbacks, Keras adds its `ProgbarLogger` unless `verbose=0`; give this one in a `CallbackList` made with
    `add_progbar=False`."""

    def __init__(self, start_step=0):
        super().__init__()
        self.start_step = start_step
        self.bar, self.seen = None, 0

    def on_epoch_begin(self, epoch, logs=None):
        verbose, epochs, steps = (self.params.get(k) for k in ("verbose", "epochs", "steps"))
        verbose = 1 if verbose == "auto" else verbose
        done = self.start_step - epoch * steps if steps else 0
        done = done if 0 < done < steps else 0
        self.bar, self.seen = None, 0
        if not verbose:
            return
        if epochs and epochs > 1 or done:
            where = f": resumed at step {done} of {steps}" if done else ""
            print(f"Epoch {epoch + 1}/{epochs}{where}", flush=True)
        self.bar = keras.utils.Progbar(steps - done if steps else None, verbose=verbose, unit_name="step")

    def on_train_batch_end(self, batch, logs=None):
        self.seen = batch + 1
        if self.bar is not None and self.params.get("verbose") in (1, "auto"):
            self.bar.update(self.seen, list((logs or {}).items()), finalize=False)

    def on_epoch_end(self, epoch, logs=None):
        if self.bar is not None:
            self.bar.update(self.seen, list((logs or {}).items()), finalize=True)


class Throughput(keras.callbacks.Callback):
    """Times the training steps of each epoch and, apart, the first step of the process (tracing and
    compiling) and `fit`'s validation. The rate leaves the first epoch of the process out."""

    def __init__(self):
        super().__init__()
        self.epochs = []  # (steps, seconds) per epoch, validation excluded
        self.first_step_seconds = None  # from the first epoch's start to its first step's end
        self.validation_seconds = 0.0
        self.start = self.last_step = self._test_start = None
        self.steps = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.start = self.last_step = time.perf_counter()
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.last_step, self.steps = time.perf_counter(), batch + 1
        if self.first_step_seconds is None:
            self.first_step_seconds = self.last_step - self.start

    def on_test_begin(self, logs=None):
        self._test_start = time.perf_counter()

    def on_test_end(self, logs=None):
        self.validation_seconds += time.perf_counter() - self._test_start

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append((self.steps, self.last_step - self.start))

    def images_per_second(self, batch_size):
        timed = self.epochs[1:] or self.epochs
        seconds = sum(s for _, s in timed)
        return batch_size * sum(n for n, _ in timed) / seconds if seconds else float("nan")

    def step_seconds(self):
        """(seconds of the first step, seconds of the other training steps)."""
        total = sum(s for _, s in self.epochs)
        first = self.first_step_seconds or 0.0
        return first, total - first
