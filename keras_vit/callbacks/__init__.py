"""The `fit` callbacks of a training run, each usable alone with `model.fit` (`state`: the run's state and
its stop; `reporting`: what it writes and shows):

- `Backup`: the run's state (`keras_vit.backups`) every epoch, every few steps or minutes, and at a stop.
- `StopOnSignal`: SIGTERM or SIGINT end `fit` after the step in flight, with a backup and without validating.
- `EMAWeights`: the moving average of the weights where `fit` validates and at each epoch's end.
- `AtomicModelCheckpoint`: `ModelCheckpoint` that writes each file whole or not at all.
- `CSVLog`: the epochs' metrics as CSV on any file system, across restarts.
- `TensorBoard`: Keras' `TensorBoard` without its per-step calls that record nothing.
- `TensorBoardFigures`: the validation confusion matrix and attention rollouts in TensorBoard.
- `Progress`: Keras' progress bar and epoch lines, for a run that may resume mid-epoch.
- `Throughput`: images per second of the training steps.

A run stopped mid-epoch and resumed runs as the uninterrupted run (what `experiments.train` does): `fit` once
for the rest of the interrupted epoch, with `Backup(resumed=...)`, which puts the epoch's metrics back, then
`fit` for the epochs after it, both with one `RunCallbacks` (a `CallbackList` made with the run's `epochs` and
`steps` per epoch, whose training begins with the first `fit` and ends at its `end()`), so that every callback
sees one run and its epochs, not each `fit`'s.
"""

import keras

from keras_vit.callbacks.reporting import (
    AtomicModelCheckpoint,
    CSVLog,
    EMAWeights,
    Progress,
    TensorBoard,
    TensorBoardFigures,
    Throughput,
)
from keras_vit.callbacks.state import Backup, StopOnSignal, StoppedBySignal, any_process
from keras_vit.training import keeps_moving_average

__all__ = [
    "AtomicModelCheckpoint",
    "Backup",
    "CSVLog",
    "EMAWeights",
    "Progress",
    "RunCallbacks",
    "StopOnSignal",
    "StoppedBySignal",
    "TensorBoard",
    "TensorBoardFigures",
    "Throughput",
    "any_process",
]


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
        if epoch == self.goes_on_after and keeps_moving_average(getattr(self.model, "optimizer", None)):
            self._trained = [keras.ops.copy(v.value) for v in self.model.trainable_variables]

    def on_train_end(self, logs=None):
        self._logs = logs

    def end(self):
        """The callbacks' `on_train_end`, once."""
        if self._begun and not self._ended:
            self._ended = True
            super().on_train_end(self._logs)
