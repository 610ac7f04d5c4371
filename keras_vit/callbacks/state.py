"""The run's state and its stop: `Backup`, `StopOnSignal` (with `StoppedBySignal` and `any_process`)."""

import logging
import os
import signal
import sys
import threading
import time

import keras
import numpy as np

from keras_vit import backups
from keras_vit.layers.common import check_positive_int

log = logging.getLogger("keras_vit")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _steps_per_epoch(callback):
    """The run's steps per epoch, as `fit` (or the run's `CallbackList`) gives it; None if unknown."""
    return (callback.params or {}).get("steps")


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
    reports what the uninterrupted run's reports.  The model's compiled metrics must exist by then: Keras makes
    them at `fit`'s start under a tf.distribute strategy and on JAX, but TensorFlow without a strategy makes them
    as it traces the first step (make them first: `keras_vit.compat.build_for_fit(model, batches.element_spec)`).
    Set `keep_at_end` to keep the backups when training ends.
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
                    "this run's, or the model's compiled metrics are not made yet (see Backup's `resumed`)."
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

    A program that exits after the stop (a command-line job) gives `exits=True`: the deadline then stays armed
    once the backup is written, and if the process has not exited when it passes (its teardown waits, say, on an
    input pipeline's thread), it exits at once with the signal's status, saying the backup is written.  By
    default the backup cancels it, for callers that go on after `fit`.

    Args:
        backup: the run's `Backup` (among `fit`'s callbacks too, before this one).
        grace_seconds: how long the step in flight and the backup may take after the signal (with `exits`,
            until the process exits).
        workers: processes training together; above 1, `agree` is needed (else the signals are left alone).
        agree: with several workers, `agree(signalled)`: True when any worker was signalled.
        exits: whether the process exits after a stop (the deadline then holds until it does).
    """

    def __init__(self, backup, grace_seconds=30.0, workers=1, agree=None, *, exits=False):
        super().__init__()
        if not grace_seconds > 0:
            raise ValueError(f"`grace_seconds` must be > 0. Received: grace_seconds={grace_seconds!r}")
        self.backup, self.grace_seconds, self.workers, self.agree = backup, float(grace_seconds), workers, agree
        self.exits = exits
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
        name = signal.Signals(self.signal_number).name
        if self.backup_path is not None:  # With `exits`: the stop is complete, the process's exit is not.
            message = (f"Stopped by {name}: the backup of step {self.backup.step} is written ({self.backup_path}), "
                       f"but the process had not exited {self.grace_seconds:g} s after the signal; it exits now. "
                       "Run the same command to resume from it.")  # fmt: skip
        else:
            reason = reason or f"the grace period of {self.grace_seconds:g} s passed before the step in flight ended"
            message = (f"Stopped by {name}: {reason}. The previous backup in {self.backup.folder} is intact; run the "
                       "same command to resume from it.")  # fmt: skip
        sys.stderr.write(message + "\n")
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
        if self._deadline is not None and not self.exits:
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
