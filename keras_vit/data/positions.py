"""Where a training input pipeline is in its stream, so that a resumed run reads on from there: `InputPositions`.

`training_pipeline` reads its files in passes, pass `p` in an order drawn from (seed, `p`) alone and each
image's random choices from (that order's seed, its index in the pass), so the stream that starts at a
position (pass, index of the next record) is the uninterrupted stream's from there, whatever came before.
"""

import threading

import tensorflow as tf


class InputPositions:
    """Where each input pipeline of this process starts, and where it is after each step of training.

    `training_pipeline(..., positions=this)` starts pipeline `i` at `start_of(i)` and, as the batches of each
    step leave it, records the position after them (pass, index of the next record in that pass); a backup
    saves `after(step)`, and a resumed run passes it back as `starts`, with the step as `start_step`.  The
    positions of the last `keep` steps are kept: the pipeline runs a few batches ahead of training, never
    thousands.  Thread-safe: tf.data records from its own threads.
    """

    def __init__(self, start_step=0, starts=None, keep=4096):
        if not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"`start_step` must be an integer >= 0. Received: start_step={start_step!r}")
        self.start_step = start_step
        self._starts = {}
        for key, value in (starts or {}).items():
            if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(
                    isinstance(v, int) and v >= 0 for v in value)):
                raise ValueError(
                    f"A start must be [pass, index], two integers >= 0. Received: {key!r}: {value!r}"
                )
            self._starts[int(key)] = (value[0], value[1])
        self._keep = keep
        self._after = {}
        self._lock = threading.Lock()

    def start_of(self, pipeline_id):
        """(pass, index) where pipeline `pipeline_id` starts: (0, 0) unless a resumed run says otherwise."""
        return self._starts.get(pipeline_id, (0, 0))

    def record(self, pipeline_id, step, pass_number, index):
        """Pipeline `pipeline_id` has given the batches of the run's steps up to `step` (counted from 1); it
        reads on at record `index` of pass `pass_number`."""
        with self._lock:
            recorded = self._after.setdefault(pipeline_id, {})
            recorded[step] = (pass_number, index)
            for old in [s for s in recorded if s <= step - self._keep]:
                del recorded[old]

    def after(self, step):
        """{pipeline id (a string, as JSON keys are): [pass, index]} after `step` steps, for each pipeline of
        this process; None where one has not recorded that step (nothing to save)."""
        with self._lock:
            if not self._after:
                return None
            found = {}
            for pipeline_id, recorded in self._after.items():
                if step not in recorded:
                    return None
                found[str(pipeline_id)] = list(recorded[step])
            return found


def pass_seed(seed, pass_number):
    """The scalar int64 seed of pass `pass_number` (a tensor) of a pipeline whose seed is `seed`: drawn
    statelessly from the two, so every pass has its own and it is the same in every run."""
    pair = tf.stack([tf.cast(seed, tf.int64), tf.cast(pass_number, tf.int64)])
    return tf.random.stateless_uniform([], pair, minval=None, maxval=None, dtype=tf.int64)


def seeded_shuffle(ds, buffer_size, seed):
    """`ds` shuffled in a buffer of `buffer_size`, as `tf.data.Dataset.shuffle` does, in the one order drawn
    from `seed`, a scalar int64 tensor (a pass's seed, computed in the graph).

    `Dataset.shuffle(seed=tensor)` cannot be traced when TensorFlow's global
    seed is 0 (it compares the seed pair with (0, 0) in Python), so the
    shuffle op is made directly, with the seed pair (seed, 1).
    """
    specs = tf.nest.flatten(ds.element_spec)
    variant = tf.raw_ops.ShuffleDatasetV3(
        input_dataset=tf.data.experimental.to_variant(ds),
        buffer_size=tf.constant(buffer_size, tf.int64),
        seed=tf.cast(seed, tf.int64),
        seed2=tf.constant(1, tf.int64),
        seed_generator=tf.raw_ops.DummySeedGenerator(),
        output_types=[spec.dtype for spec in specs],
        output_shapes=[spec.shape for spec in specs],
        reshuffle_each_iteration=False,
    )
    return tf.data.experimental.from_variant(variant, ds.element_spec)


def permutation(count, seed):
    """A permutation of range(`count`) (int64) drawn from `seed`, a scalar int64 tensor, alone."""
    key = tf.stack([tf.cast(seed, tf.int64), tf.constant(0, tf.int64)])
    indices = tf.range(count, dtype=tf.int64)
    return tf.random.experimental.index_shuffle(indices, key, max(count - 1, 0)) if count > 1 else indices
