"""The state of an interrupted run on disk, written whole and restored whole: `write_state` and `restore_state`.
When a run writes one is `keras_vit.callbacks.Backup`'s choice (a `fit` callback).

A backup is a pair of files in its folder (local or gs://), numbered in the order they were written:
`state-NNNNNNNN.npz` (the values of the model's weights and of the optimizer's variables, in their order, with
their paths: NumPy's uncompressed archive, written in one pass, where Keras' `save_weights` walks the model's
layers into HDF5 groups at several times the cost, which a run of short epochs pays at every epoch) and
`state-NNNNNNNN.json` (the epoch and the step, counted in batches, to resume from, the random generators'
states, where the input pipelines were, and, for a backup written mid-epoch, the epoch's metrics so far;
written after the weights: a backup without its JSON is incomplete and is never used). Both are written through
`keras_vit.files`, so a failed write leaves no partial file, and the last two backups are kept.  A backup whose
JSON names a `.weights.h5` file (`model.save_weights`'s, as earlier versions wrote them) restores too.

`restore_state(model, folder)` loads the newest usable backup before `fit` and returns where the run resumes
(`Resumed`): weights and position come from the same backup or not at all. A damaged newest backup (a truncated
weights file, a JSON that does not parse) is named in a warning and the previous one is used; with none usable,
`BackupError` names the files and how to start over. Unlike `keras.callbacks.BackupAndRestore` (one pair of
files written in place, the epoch restored through the model's private state), a crash while saving or a
damaged file never blocks the next restart.
"""

import json
import logging
import re
import typing
import warnings
import weakref
import zipfile

import keras
import numpy as np

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


def _stem(folder, serial):
    """A backup's files, less their endings."""
    return f"{folder}/state-{serial:08d}"


def _paths(folder, serial):
    stem = _stem(folder, serial)
    return f"{stem}.npz", f"{stem}.json"


def _saved_variables(model):
    """What a backup holds the values of, in order: the model's weights, then its optimizer's variables (the
    moving average and the gradient accumulators among them)."""
    optimizer = model.optimizer
    return [*model.weights, *(optimizer.variables if optimizer is not None else ())]


_READ_BYTES = 64 * 2**20  # At most this much of the variables' values in host memory at a time.
_readers = weakref.WeakKeyDictionary()  # model -> (its variables' ids, one reader per group of them)


def _values(model, variables):
    """The values of `variables` as NumPy arrays, in order. On TensorFlow they are read in groups of at most
    `_READ_BYTES` (a variable larger than that alone), each group by one compiled function, traced once per
    model: one eager read per variable costs a small model's backup more than its writing, at every epoch of a
    run of short epochs. Elsewhere one variable at a time."""
    if keras.backend.backend() != "tensorflow":
        yield from (keras.ops.convert_to_numpy(variable) for variable in variables)
        return
    key = tuple(id(variable) for variable in variables)
    known = _readers.get(model)
    if known is None or known[0] != key:
        known = _readers[model] = (key, [_reader(group) for group in _groups(variables)])
    for read in known[1]:
        yield from (value.numpy() for value in read())


def _groups(variables):
    """`variables` in order, cut into lists whose values take at most `_READ_BYTES` (a larger variable alone)."""
    groups, size = [[]], 0
    for variable in variables:
        nbytes = int(np.prod(variable.shape)) * _numpy_dtype(variable.dtype).itemsize
        if groups[-1] and size + nbytes > _READ_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(variable)
        size += nbytes
    return groups


def _reader(group):
    import tensorflow as tf

    return tf.function(lambda: [tf.identity(variable.value) for variable in group], autograph=False)


def _write_variables(model, path):
    """The values of `_saved_variables(model)` into the NumPy archive `path` (a local file, as `np.savez`
    writes one): "0", "1", ... in order, and "paths", their paths; `_values` reads them a group at a time. A
    dtype that is not NumPy's own (bfloat16) is kept as its bits."""
    variables = _saved_variables(model)

    def write(name, value):
        if value.dtype.isbuiltin == 2:  # Not one of NumPy's own (ml_dtypes' bfloat16).
            value = value.view(f"u{value.dtype.itemsize}")
        with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array(member, value, allow_pickle=False)

    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        write("paths", np.array([variable.path for variable in variables], dtype=str))
        for i, value in enumerate(_values(model, variables)):
            write(str(i), value)


def _read_variables(model, path):
    """Assigns the values of the NumPy archive `path` (local or gs://) to `_saved_variables(model)`, after
    checking that they are as many and each of the variable's shape: ValueError naming the first that is not."""
    variables, values = _saved_variables(model), []
    with _gfile().GFile(path, "rb") as f, np.load(f, allow_pickle=False) as archive:
        paths = list(archive["paths"])
        if len(paths) != len(variables):
            raise ValueError(
                f"it holds {len(paths)} variables; the model and its optimizer have {len(variables)}: it is not "
                "this run's (another model or optimizer)"
            )
        for i, (variable, saved_path) in enumerate(zip(variables, paths)):
            value, dtype = archive[str(i)], _numpy_dtype(variable.dtype)
            if value.dtype != dtype and not (dtype.isbuiltin == 2 and value.dtype.itemsize == dtype.itemsize):
                raise ValueError(f"its {saved_path} is {value.dtype}; the model's {variable.path} is {dtype}")
            if tuple(value.shape) != tuple(variable.shape):
                raise ValueError(
                    f"its {saved_path} has the shape {tuple(value.shape)}; the model's {variable.path} has "
                    f"{tuple(variable.shape)}: it is not this run's"
                )
            values.append(value.view(dtype))
    for variable, value in zip(variables, values):
        variable.assign(value)


def _numpy_dtype(dtype):
    """NumPy's dtype for a variable's dtype; bfloat16's is ml_dtypes' (which Keras imports, so NumPy knows the
    name)."""
    return np.dtype(keras.backend.standardize_dtype(dtype))


def _load_keras_weights(model, path):
    """A `.weights.h5` backup (`model.save_weights`'s) into `model`. Keras only warns when a saved layer or
    optimizer does not fit the model's: here, that backup is not this run's (weights restored without their
    optimizer state would resume another run)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.load_weights(path)
    skipped = [str(w.message) for w in caught if "Skipping variable loading" in str(w.message)]
    if skipped:
        raise ValueError(skipped[0])


def write_state(model, folder, record, keep=2):
    """Writes the next backup of `model` into `folder`: the weights (model and optimizer), then the JSON that
    completes it, `record` (the epoch, the step and what else the run saves) with the model's random generators'
    states added; removes the oldest past `keep`. Returns the JSON's path."""
    gfile = _gfile()
    folder = str(folder).rstrip("/")
    gfile.makedirs(folder)
    states = _states(folder)
    serial = states[0] + 1 if states else 0
    weights, metadata = _paths(folder, serial)
    with atomic_path(weights, suffix=".npz") as temporary:
        _write_variables(model, temporary)
    record = {
        **record, "weights": weights.rsplit("/", 1)[1],
        "random_states": [keras.ops.convert_to_numpy(v).tolist() for v in _random_states(model)],
    }
    write_text_atomically(metadata, json.dumps(record))
    for old in [serial, *states][keep:]:
        archive, record_path = _paths(folder, old)
        # The JSON first (without it the rest is never used), and an earlier version's weights file if any.
        for path in (record_path, archive, f"{_stem(folder, old)}.weights.h5"):
            if gfile.exists(path):
                gfile.remove(path)
    return metadata


def remove_backups(folder):
    """Removes the backup folder of a run that is complete."""
    gfile = _gfile()
    if gfile.isdir(folder):
        gfile.rmtree(folder)


def _random_states(model):
    """The model's random generators' states (dropout, stochastic depth), in the model's order: `model.weights`
    (what the archive holds) leaves them out, and a resumed run draws what the uninterrupted run would have
    drawn only with them restored. (Their names carry a counter of the process, so they are matched by order.)"""
    return [v for v in model.non_trainable_variables if v.path.endswith("seed_generator_state")]


def restore_backup(model, folder):
    """Loads the newest usable backup in `folder` into `model` (compiled, with its optimizer) and returns the
    epoch to resume from; 0 when there is none.  See `restore_position`."""
    return restore_position(model, folder)[0]


def restore_position(model, folder):
    """Loads the newest usable backup in `folder` into `model` (compiled, with its optimizer) and returns
    (epoch, step): the epoch in progress or next when it was written, and the batches trained (None for a
    backup that did not record them); (0, 0) when there is none.  See `restore_state`."""
    resumed = restore_state(model, folder)
    return resumed.epoch, resumed.step


class Resumed(typing.NamedTuple):
    """Where a run resumes: `restore_state`'s answer."""

    epoch: int  # the epoch in progress or next when the backup was written
    step: int | None  # the batches trained (None for a backup that did not record them)
    input: dict | None  # where the input pipelines were (`Backup.input_position`'s), None if not saved
    metrics: list | None = None  # the epoch's metric variables at `step` (mid-epoch): `model.metrics_variables`


def restore_state(model, folder):
    """Loads the newest usable backup in `folder` into `model` (compiled, with its optimizer) and returns
    a `Resumed` (epoch, step, input position); Resumed(0, 0, None) when there is none.

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
                position = json.loads(f.read())
            epoch, step = position["epoch"], position.get("step")
            if not isinstance(epoch, int) or epoch < 0:
                raise ValueError(f"'epoch' is {epoch!r}; expected an integer >= 0")
            if step is not None and (not isinstance(step, int) or step < 0):
                raise ValueError(f"'step' is {step!r}; expected an integer >= 0")
            if position.get("weights"):  # The file it completes: an archive, or an earlier version's .weights.h5.
                weights = f"{folder}/{position['weights']}"
            (_load_keras_weights if weights.endswith(".weights.h5") else _read_variables)(model, weights)
            states, saved = _random_states(model), position.get("random_states")
            if saved is not None and len(saved) != len(states):
                raise ValueError(f"it holds {len(saved)} random generators' states; the model has {len(states)}")
            for variable, state in zip(states, saved or ()):
                variable.assign(np.asarray(state, dtype=variable.dtype))
        except Exception as error:  # Any failure to read one backup means: try the one before it.
            problems.append(f"{metadata} / {weights}: {type(error).__name__}: {error}")
            log.warning("Backup %s is damaged or incomplete (%s); trying the one before it.", metadata, error)
            continue
        if problems:
            log.warning("Resumed from the older backup %s (epoch %d).", metadata, epoch)
        return Resumed(epoch, step, position.get("input"), position.get("metrics"))
    if problems:
        raise BackupError(
            f"No usable backup in {folder}: " + "; ".join(problems)
            + f". Delete {folder} to start the run over (its other outputs stay)."
        )
    return Resumed(0, 0, None)
