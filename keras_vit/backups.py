"""The state of an interrupted run, saved whole and restored whole: `Backup` (a callback) and `restore_backup`.

A backup is a pair of files in its folder (local or gs://), numbered in the order they were written:
`state-NNNNNNNN.weights.h5` (the model's and the optimizer's variables, as `model.save_weights` writes them)
and `state-NNNNNNNN.json` (the epoch to resume from, written after the weights: a backup without its JSON is
incomplete and is never used). Both are written through `keras_vit.files`, so a failed write leaves no
partial file, and the last two backups are kept.

`restore_backup(model, folder)` loads the newest usable backup before `fit` and returns the epoch to pass as
`fit(initial_epoch=...)`: weights and epoch come from the same backup or not at all. A damaged newest backup
(a truncated weights file, a JSON that does not parse) is named in a warning and the previous one is used;
with none usable, `BackupError` names the files and how to start over. Unlike `keras.callbacks.BackupAndRestore`
(one pair of files written in place, the epoch restored through the model's private state), a crash while
saving or a damaged file never blocks the next restart.
"""

import json
import logging
import re
import warnings

import keras

from keras_vit.files import atomic_path, write_text_atomically

log = logging.getLogger("keras_vit")

_STATE = re.compile(r"^state-(\d{8})\.json$")


class BackupError(RuntimeError):
    """No usable backup among the ones a run's folder holds."""


def _gfile():
    import tensorflow as tf  # tf.io.gfile lists and reads local and gs:// folders alike.

    return tf.io.gfile


def _states(folder):
    """The serial numbers of the backups whose JSON is in `folder`, newest first."""
    gfile = _gfile()
    if not gfile.isdir(folder):
        return []
    serials = [int(match[1]) for name in gfile.listdir(folder) if (match := _STATE.match(name.rstrip("/")))]
    return sorted(serials, reverse=True)


def _paths(folder, serial):
    stem = f"{folder}/state-{serial:08d}"
    return f"{stem}.weights.h5", f"{stem}.json"


class Backup(keras.callbacks.Callback):
    """Saves the run's state into `folder` every epoch (`save_freq="epoch"`) or every `save_freq` steps,
    keeping the last `keep` backups; removes the folder when training ends (the run is complete).

    Pair it with `restore_backup(model, folder)` before `fit`, passing what it returns as `initial_epoch`.
    """

    def __init__(self, folder, save_freq="epoch", keep=2):
        super().__init__()
        if save_freq != "epoch" and (not isinstance(save_freq, int) or isinstance(save_freq, bool) or save_freq < 1):
            raise ValueError(f"`save_freq` must be 'epoch' or a positive integer. Received: save_freq={save_freq!r}")
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"`keep` must be a positive integer. Received: keep={keep!r}")
        self.folder, self.save_freq, self.keep = str(folder).rstrip("/"), save_freq, keep
        self._epoch = 0
        self._steps = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch  # Saved mid-epoch, the run resumes at this epoch's start with the weights so far.

    def on_epoch_end(self, epoch, logs=None):
        self._epoch = epoch + 1
        if self.save_freq == "epoch":
            self.save()

    def on_train_batch_end(self, batch, logs=None):
        if self.save_freq != "epoch":
            self._steps += 1
            if self._steps % self.save_freq == 0:
                self.save()

    def on_train_end(self, logs=None):
        gfile = _gfile()
        if gfile.isdir(self.folder):
            gfile.rmtree(self.folder)

    def save(self):
        """Writes the next backup (weights, then the JSON that completes it) and removes the oldest past `keep`."""
        gfile = _gfile()
        gfile.makedirs(self.folder)
        states = _states(self.folder)
        serial = states[0] + 1 if states else 0
        weights, metadata = _paths(self.folder, serial)
        with atomic_path(weights, suffix=".weights.h5") as temporary:
            self.model.save_weights(temporary)
        write_text_atomically(metadata, json.dumps({"epoch": self._epoch, "weights": weights.rsplit("/", 1)[1]}))
        for old in [serial, *states][self.keep :]:
            for path in _paths(self.folder, old):
                if gfile.exists(path):
                    gfile.remove(path)


def restore_backup(model, folder):
    """Loads the newest usable backup in `folder` into `model` (compiled, with its optimizer) and returns the
    epoch to resume from; 0 when there is none.

    A backup is usable when its JSON parses and names an epoch and its weights file loads. A damaged one is
    named in a warning and the one before it is tried. Raises `BackupError` naming the files when backups are
    there but none is usable.
    """
    folder = str(folder).rstrip("/")
    gfile = _gfile()
    states = _states(folder)
    if states and model.optimizer is not None and not model.optimizer.built:
        # Its variables are in the weights file too (under a strategy, call this inside its scope).
        model.optimizer.build(model.trainable_variables)
    problems = []
    for serial in states:
        weights, metadata = _paths(folder, serial)
        try:
            with gfile.GFile(metadata, "r") as f:
                epoch = json.loads(f.read())["epoch"]
            if not isinstance(epoch, int) or epoch < 0:
                raise ValueError(f"'epoch' is {epoch!r}; expected an integer >= 0")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model.load_weights(weights)
            # Keras only warns when a saved layer or optimizer does not fit the model's: here, that backup is
            # not this run's (weights restored without their optimizer state would resume another run).
            skipped = [str(w.message) for w in caught if "Skipping variable loading" in str(w.message)]
            if skipped:
                raise ValueError(skipped[0])
        except Exception as error:  # Any failure to read one backup means: try the one before it.
            problems.append(f"{metadata} / {weights}: {type(error).__name__}: {error}")
            log.warning("Backup %s is damaged or incomplete (%s); trying the one before it.", metadata, error)
            continue
        if problems:
            log.warning("Resumed from the older backup %s (epoch %d).", metadata, epoch)
        return epoch
    if problems:
        raise BackupError(
            f"No usable backup in {folder}: " + "; ".join(problems)
            + f". Delete {folder} to start the run over (its other outputs stay)."
        )
    return 0
