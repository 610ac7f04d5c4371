"""Stopping on SIGTERM or SIGINT with the run's state saved: `StopOnSignal`, a `fit` callback.

Cloud TPU spot and preemptible VMs, GKE and most GPU clouds stop a job with SIGTERM and a grace period (about
30 s) before SIGKILL; Ctrl-C sends SIGINT.  While `fit` runs, `StopOnSignal` catches both: the step in flight
finishes, its `Backup` writes the state (weights, optimizer and the step, atomically), `fit` stops, and
`signal_number` tells the caller, which should exit with `exit_code()` (128 + the signal's number, what a
shell reports for a process the signal ended: 143 for SIGTERM, 130 for SIGINT).  A rerun of the same command
resumes at that step.

If the step in flight and the backup have not ended `grace_seconds` after the signal, the process exits at once
with the same code and a message: the previous backup is intact (backups are written whole or not at all).
A second signal while the first is handled ends the process the same way.  The handlers are installed for the
duration of `fit` and only in the main thread; the previous ones come back after.

Every worker of a multi-worker job must stop at the same step, or the others would wait for it in their next
collective.  Given `agree` (a function every worker calls at the same points, True on all when its argument
is True on any: `keras_vit.distribute.any_replica(strategy)` for TensorFlow strategies), every worker asks it
after each step whether any was signalled, and all stop together, each writing its own backup (the chief the
job's).  On Keras' JAX backend with several processes (a TPU pod slice, GPU hosts, `keras.distribution` across
them), `any_process()` is that function.  With several workers and no `agree`, the callback leaves the signals
alone and logs so: the job then resumes from its last periodic backup.
"""

import logging
import os
import signal
import sys
import threading

import keras

log = logging.getLogger("keras_vit")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopOnSignal(keras.callbacks.Callback):
    """Stops `fit` after the step in flight on SIGTERM or SIGINT, with `backup.save()` written first.

    Args:
        backup: the run's `keras_vit.backups.Backup` (among `fit`'s callbacks too).
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

    def on_train_batch_end(self, batch, logs=None):
        self._stop_if_signalled()

    def on_epoch_end(self, epoch, logs=None):
        self._stop_if_signalled()  # A signal during validation: the epoch's state.

    def on_train_end(self, logs=None):
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
