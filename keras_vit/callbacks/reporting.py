"""What a run writes and shows: `EMAWeights`, `CSVLog`, `AtomicModelCheckpoint`, `TensorBoard`,
`TensorBoardFigures`, `Progress`, `Throughput`."""

import os
import time

import keras
import numpy as np

from keras_vit.compat import swap_moving_average
from keras_vit.evaluation import (
    ConfusionAccuracy,
    confusion_image,
    confusion_matrix,
    predict_with_labels,
    rollout_images,
)
from keras_vit.files import atomic_path, write_text_atomically
from keras_vit.layers.common import check_positive_int


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
        self._read = False

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
        self._read = True
        return self.columns()

    def on_train_begin(self, logs=None):
        if not self._read:  # Read already (the job reads it for best.keras's bar): the rows are in memory.
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
    path (no `{epoch}` placeholders); `saved_epoch` says which epoch's end
    wrote it last.
    """

    def __init__(self, filepath, **kwargs):
        if kwargs.get("save_freq", "epoch") != "epoch":
            raise ValueError(f"AtomicModelCheckpoint saves once per epoch. Received: save_freq={kwargs['save_freq']!r}")
        filepath = str(filepath)
        if "{" in filepath:
            raise ValueError(f"AtomicModelCheckpoint writes one path, without placeholders. Received: {filepath!r}")
        super().__init__(filepath, **kwargs)
        self.destination = filepath
        self.saved_epoch = None  # The epoch whose end wrote the file last, in this process.

    def on_epoch_end(self, epoch, logs=None):
        # Keras reads the format from the name's end (".keras", ".h5", ".weights.h5"): the temporary keeps it.
        suffix = ".weights.h5" if self.destination.endswith(".weights.h5") else "." + self.destination.split(".")[-1]
        try:
            with atomic_path(self.destination, suffix=suffix) as temporary:
                # What `ModelCheckpoint` saves, if anything, goes to the temporary.
                self.filepath = temporary
                super().on_epoch_end(epoch, logs)
                if os.path.lexists(temporary):
                    self.saved_epoch = epoch
        finally:
            self.filepath = self.destination


class TensorBoard(keras.callbacks.TensorBoard):
    """Keras' `TensorBoard`, the same files, without its per-step summary calls where none can record: with
    `update_freq="epoch"` (the default), no steps per second and no profiling, Keras' own makes a summary call
    for each logged value at every step, which records nothing (no summary writer is the default between
    epochs) and costs a run of small steps a share of its time. A writer made the default around `fit` still
    gets them."""

    def on_train_batch_end(self, batch, logs=None):
        import tensorflow as tf

        idle = (self.update_freq == "epoch" and not self.write_steps_per_second
                # Keras' own state, read with the answer that keeps its behaviour when it is not there.
                and not getattr(self, "_should_write_train_graph", True) and not getattr(self, "_should_trace", True)
                and not bool(tf.summary.should_record_summaries()))  # fmt: skip
        if not idle:
            super().on_train_batch_end(batch, logs)


class TensorBoardFigures(keras.callbacks.Callback):
    """Writes, at the end of epochs spread over the run, the validation confusion matrix (`confusion_image`: rows
    are the true classes, in order, columns the predicted ones) and the attention rollout of a few fixed
    validation images as TensorBoard images (`confusion_matrix`, `attention_rollout`), beside Keras' own scalars.

    When the model is compiled with a `keras_vit.evaluation.ConfusionAccuracy` metric, the matrix is the one it
    counted during `fit`'s validation of that epoch (the whole split, nothing predicted again); otherwise the
    callback predicts the first `max_examples` validation examples.

    Args:
        log_dir: the TensorBoard folder (local or gs://); the images go to its
            `validation` run, where Keras' TensorBoard callback writes the
            validation scalars.
        validation_data: a `tf.data.Dataset` of (images, labels) batches,
            labels integer or one-hot.
        num_images: how many of the first validation images get a rollout
            (0: none).
        max_examples: without a `ConfusionAccuracy`, about this many
            validation examples (whole batches of them, the first ones: the
            split is not shuffled) are predicted for the matrix.
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
        self.writer = self.examples = self.rollout_inputs = None

    def writes_at(self, epoch):
        """Whether the images are written at the end of `epoch` (0-based) of the run's `params["epochs"]`: every
        `ceil(epochs / max_figures)`-th epoch and the last, the same epochs in a run resumed part way."""
        epochs = self.params.get("epochs") if self.params else None
        if self.max_figures is None or not epochs:
            return True
        every = -(-epochs // self.max_figures)
        return (epoch + 1) % every == 0 or epoch + 1 == epochs

    def _prepare(self):
        """The writer, the examples and the rollout images: read at the first epoch's end, so that nothing of the
        validation split is read before training starts."""
        import tensorflow as tf

        self.writer = tf.summary.create_file_writer(tf.io.gfile.join(self.log_dir, "validation"))
        batch = self.validation_data.element_spec[0].shape[0]
        # The examples stay a dataset (2,048 ImageNet images are 300 MB); the few rollout images are read once.
        self.examples = self.validation_data.take(-(-self.max_examples // batch) if batch else self.max_examples)
        rollout_batches = self.examples.unbatch().take(self.num_images).batch(max(self.num_images, 1))
        self.rollout_inputs = next(iter(rollout_batches.map(lambda x, y: x).as_numpy_iterator()), np.zeros((0,)))

    def _counted_confusion(self, logs):
        """The matrix of this epoch's validation as the model's `ConfusionAccuracy` counted it during `fit`'s
        validation, or None (no validation this epoch, or no such metric)."""
        if not any(key.startswith("val_") for key in logs or {}):
            return None
        for metric in self.model.metrics:
            for inner in getattr(metric, "metrics", None) or [metric]:  # Compiled metrics sit in a container.
                if isinstance(inner, ConfusionAccuracy):
                    return inner.confusion()
        return None

    def on_epoch_end(self, epoch, logs=None):
        import tensorflow as tf

        if not self.writes_at(epoch):
            return
        if self.writer is None:
            self._prepare()
        confusion = self._counted_confusion(logs)
        if confusion is None:
            # The function the job's evaluations run too: traced once for the run.
            logits, labels = predict_with_labels(self.model, self.examples)
            labels = labels.argmax(-1) if labels.ndim == 2 else labels.astype(np.int64)
            confusion = confusion_matrix(labels, logits.argmax(axis=-1), logits.shape[-1])
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
        verbose, epochs, steps = self._verbose(), self.params.get("epochs"), self.params.get("steps")
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
        if self.bar is not None and self._verbose() == 1:
            self.bar.update(self.seen, list((logs or {}).items()), finalize=False)

    def on_epoch_end(self, epoch, logs=None):
        if self.bar is not None:
            self.bar.update(self.seen, list((logs or {}).items()), finalize=True)

    def _verbose(self):
        """`fit`'s verbose: 0, 1 (a bar) or 2 (a line per epoch); "auto" is 1."""
        verbose = self.params.get("verbose")
        return 1 if verbose == "auto" else verbose


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
