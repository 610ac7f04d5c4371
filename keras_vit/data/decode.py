"""Encoded images to uint8 RGB arrays, and the examples that fail to decode skipped and named.

`decode_image` reads every format a folder of photos holds, within `ImageLimits` (`keras_vit.data.header`);
`decode_skipping_failures` runs it over a pass of records inside tf.data, leaves out those that fail and
names them in a `DecodeFailures`.
"""

import re
import threading

import tensorflow as tf
from absl import logging

from keras_vit.data.header import check_image


@tf.autograph.experimental.do_not_convert  # TensorFlow ops as written: no AutoGraph rewrite at each pipeline's trace
def decode_image(encoded, limits=None, *, messages=True):
    """Encoded JPEG, PNG, GIF, BMP or WebP bytes -> uint8 (H, W, 3), within `limits`.

    The size is read from the header first and checked against `limits`
    (an `ImageLimits`; None: the defaults), so an image too large to afford
    is refused before it is decoded.  Grey-scale and palette images are
    expanded to RGB, an alpha channel is dropped, CMYK JPEGs are converted,
    16-bit PNGs are scaled to 8 bits (`value >> 8`) and a GIF gives its
    first frame, the only one decoded.  Data it cannot decode or refuses
    raises `tf.errors.InvalidArgumentError` (`messages`: see `check_image`).
    """
    return decode_checked(check_image(encoded, limits, messages=messages)[0])


def decode_checked(data):
    """`decode_image` of bytes that `check_image` has passed (and cut, for a GIF)."""
    image = tf.io.decode_image(data, channels=3, dtype=tf.uint8, expand_animations=False)
    image.set_shape([None, None, 3])
    return image


class DecodeFailures:
    """The examples of an `ImageSource` that could not be read or decoded: skipped, and named here.

    Filled by the input pipelines as they meet each failure; each one is
    logged once (an absl warning with its name and the error) when first met.
    `count` and `paths` (in the order met) are what a job reports at its end.
    In a run over several hosts each host holds the failures of the files it
    read itself.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._errors = {}
        self._unnamed = {}

    def record(self, name, error):
        """Adds one failure; returns whether `name` was new."""
        with self._lock:
            new = name not in self._errors
            if new:
                self._errors[name] = error
        if new:
            logging.warning("Skipped %s: it could not be read or decoded as an image: %s", name, error)
        return new

    def record_unnamed(self, count, before):
        """Adds `count` failures in a row whose names were not kept, met just before `before`."""
        with self._lock:
            new = before not in self._unnamed
            self._unnamed[before] = count
        if new:
            logging.warning("Skipped %d more examples that failed in a row before %s (not named).", count, before)

    @property
    def count(self):
        """The number of distinct examples skipped."""
        with self._lock:
            return len(self._errors) + sum(self._unnamed.values())

    @property
    def paths(self):
        """The names (paths, TFDS ids) of the examples skipped, in the order met."""
        with self._lock:
            return list(self._errors)

    @property
    def errors(self):
        """{name: the error's message}."""
        with self._lock:
            return dict(self._errors)

    def __len__(self):
        return self.count

    def __contains__(self, name):
        with self._lock:
            return name in self._errors

    def __repr__(self):
        paths = self.paths
        return f"DecodeFailures(count={self.count}, paths={paths[:3]}{'...' if len(paths) > 3 else ''})"


def error_message(error):
    """The useful part of an eager op's error: no function-node prefix, no op suffix."""
    message = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", error.message).split(" [Op:")[0]
    return message.strip() or type(error).__name__


# A 1x1 PNG: the record that ends each pass of `mark_failures`.
ONE_PIXEL_PNG = (
    b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x02\x00\x00\x00\x90wS\xde"
    b"\x00\x00\x00\x0cIDAT\x08\xd7c```\x00\x00\x00\x04\x00\x01'4'\n\x00\x00\x00\x00IEND\xaeB`\x82"
)
# The names of up to this many failures in a row are kept; more are counted.
NAMED_IN_A_ROW = 64
# Between the names of failures in a row, in one string: no path or TFDS id holds a NUL.
_NAME_SEPARATOR = "\x00"


def mark_failures(records, transform, end, first_index=0):
    """One pass of (inputs, label, name) records -> (outputs, label, missing, nothing_yet, names).

    `transform(inputs, is_end)` maps a record's inputs to its outputs (load,
    decode, augment) and may fail; `end` is the inputs of a record it never
    fails on (given `is_end`), added after the last record so that failures
    at the end of a pass are seen too; its label is -1.

    The records are numbered, each carrying the names of the
    `NAMED_IN_A_ROW` records before it, and transformed by a parallel map in
    order; `ignore_errors` drops a record that fails.  A gap in the numbers
    that come out is the failures just before a record: `missing` counts
    them and `names` joins (NUL-separated) those of them whose names were
    kept; `nothing_yet` says that no record of the pass came out before.
    All of it is graph-only: no Python, no GIL, no dataset per record (the
    two other ways to catch one record's error, both slower), so it can run
    on tf.data service workers.  `note_failures` or `carry_failures` then
    reports the failures and drops the end record.

    first_index: the index in its pass of the first record, for the rest of
    a pass that starts part way through (a resumed run); `nothing_yet` is then
    never true, as the records before may have decoded.
    """
    end = tf.data.Dataset.from_tensors((end, tf.constant(-1, tf.int32), tf.constant("")))

    def number(state, record):
        index, previous = state
        inputs, label, name = record
        return (index + 1, tf.concat([previous[1:], [name]], 0)), (index, inputs, label, previous)

    def apply(index, inputs, label, previous):
        return index, transform(inputs, label < 0), label, previous

    def measure_gap(last, element):
        index, outputs, label, previous = element
        missing = index - last - 1
        named = previous[NAMED_IN_A_ROW - tf.minimum(missing, NAMED_IN_A_ROW):]
        names = tf.strings.reduce_join(named, separator=_NAME_SEPARATOR)
        return index, (outputs, label, missing, last < 0, names)

    names = tf.fill([NAMED_IN_A_ROW], "")
    first_index = tf.cast(first_index, tf.int64)
    ds = records.concatenate(end).scan((first_index, names), number)
    # In order, whatever the options say: the numbers must come out as they went in.
    ds = ds.map(apply, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).ignore_errors()
    return ds.scan(first_index - 1, measure_gap)


def load_or_end(load, reference, is_end):
    """The encoded bytes `load(reference)` gives, or a valid one-pixel image for the end record of a pass
    (`mark_failures`), whose reference is empty."""
    return tf.cond(is_end, lambda: tf.constant(ONE_PIXEL_PNG), lambda: load(reference))


def _all_failed(missing, what, example, error=None):
    because = f": {error}" if error else ""
    return (
        f"All {missing} examples of {what} failed to read or decode (e.g. {example}{because}). "
        "Expected JPEG, PNG, GIF, BMP or WebP images."
    )


def record_failures(failures, missing, names, reload, limits=None):
    """Adds to `failures` (a `DecodeFailures`) `missing` failures, `names` (bytes, NUL-separated) the names
    of the last of them; each new name is tried once more with `reload` (and the `limits` the pipeline
    decodes within) for its error's message."""
    missing = int(missing)
    names = [name.decode("utf-8", errors="replace") for name in names.split(_NAME_SEPARATOR.encode()) if name]
    for name in names:
        if name in failures:  # Met in an earlier pass.
            continue
        try:  # Once more, eagerly, for the error's message.
            decode_image(reload(name), limits)
            error = "failed in the input pipeline, decoded when tried again (a transient read error?)"
        except tf.errors.OpError as e:
            error = error_message(e)
        failures.record(name, error)
    if missing > len(names):
        failures.record_unnamed(missing - len(names), names[0] if names else "the end of a pass")
    return names


def note_failures(marked, failures, what, reload, limits=None):
    """`mark_failures`' elements -> (outputs, label), the failures recorded in `failures` as they are met
    (Python, in this process), the end record dropped.  When every record of the pass failed, iterating
    raises an error naming `what`: there is nothing to train on, and a repeated pipeline would otherwise
    spin forever."""

    def note(missing, nothing_yet, label, names):
        names = record_failures(failures, missing, names.numpy(), reload, limits)
        if label < 0 and nothing_yet:
            example = names[-1] if names else "?"
            raise ValueError(_all_failed(int(missing), what, example, failures.errors.get(example)))
        return True

    def keep(outputs, label, missing, nothing_yet, names):
        noted = tf.cond(
            missing > 0,
            lambda: tf.reshape(tf.py_function(note, [missing, nothing_yet, label, names], tf.bool), []),
            lambda: tf.constant(True),
        )
        return tf.logical_and(noted, label >= 0)

    return marked.filter(keep).map(lambda outputs, label, missing, nothing_yet, names: (outputs, label))


def carry_failures(marked, what):
    """Repeated passes of `mark_failures`' elements -> (outputs, label, missing, names), graph-only.

    The failures met at the end of a pass (before its end record, which is
    dropped) are carried to the next record that comes out, so that every
    failure travels with a record: batched, they reach the process that
    reads the batches (`record_failures`), even from tf.data service
    workers, where Python cannot run.  A pass in which every record failed
    raises `InvalidArgumentError` naming `what`.
    """

    def carry(pending, element):
        pending_missing, pending_names = pending
        outputs, label, missing, nothing_yet, names = element
        check = tf.debugging.Assert(
            tf.logical_not(tf.logical_and(label < 0, nothing_yet)),
            [tf.strings.format(_all_failed("{}", what, "{}"), [missing, names])],
        )
        with tf.control_dependencies([check]):
            missing = missing + pending_missing
        names = tf.strings.reduce_join(
            tf.boolean_mask(tf.stack([pending_names, names]), tf.stack([pending_names != "", names != ""])),
            separator=_NAME_SEPARATOR,
        )
        end = label < 0
        carried = (tf.where(end, missing, 0), tf.where(end, names, ""))
        return carried, (outputs, label, missing, names)

    ds = marked.scan((tf.constant(0, tf.int64), tf.constant("")), carry)
    return ds.filter(lambda outputs, label, missing, names: label >= 0)


def decode_skipping_failures(records, load, failures, what, reload, limits=None):
    """One pass of (reference, label, name) records -> (uint8 (H, W, 3) image, label), failures left out.

    `load` maps a reference to encoded bytes in the graph (`tf.io.read_file`
    for paths, the identity for bytes); `reload(name)` gives them again,
    eagerly, for the message of an error; `limits` (an `ImageLimits`) are
    those `decode_image` refuses images past.  Failures are found by
    `mark_failures` and recorded in `failures` (a `DecodeFailures`) by
    `note_failures`; good records never leave the graph.  When every record
    of the pass fails, iterating raises an error naming `what`.
    """

    def transform(reference, is_end):
        # The failures are named from a second, eager, decoding (`record_failures`): the fast checks suffice.
        return decode_image(load_or_end(load, reference, is_end), limits, messages=False)

    marked = mark_failures(records, transform, tf.constant(""))
    return note_failures(marked, failures, what, reload, limits)
