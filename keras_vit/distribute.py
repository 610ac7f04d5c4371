"""Distribution strategies for `model.fit`: TPU, GPUs, several hosts, one device.

`get_strategy("auto")` picks the best available: a TPU when one resolves
(`tpu=`, TPU_NAME, or the TPU of a Cloud TPU VM), several workers when
TF_CONFIG names a cluster, several GPUs, one GPU, else no distribution
(TensorFlow's default strategy, `no_distribution()`, on this host's CPU); it
logs which and how many replicas.  Call it before anything is traced or placed: a TPU must be
connected first.  Build the model and optimizer under `strategy.scope()`;
`fit` then splits each global batch across the replicas.
"""

import json
import os

from absl import logging

from keras_vit import compat
from keras_vit.requirements import import_tensorflow

tf = import_tensorflow("keras_vit.distribute")

STRATEGIES = ("auto", "tpu", "mirrored", "multi_worker", "one_device")


def _tpu_strategy(tpu):
    """TPUStrategy over the TPU named `tpu` (a name or grpc:// address; "local" or nothing
    named, neither here nor in TPU_NAME: the TPU of this Cloud TPU VM), connected and
    initialised."""
    tpu = tpu or os.environ.get("TPU_NAME") or "local"
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
        if tpu != "local":
            tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, RuntimeError, OSError, tf.errors.OpError) as error:  # OSError: URLError
        raise ValueError(
            f"Could not resolve or initialise the TPU {tpu!r}: {error}. Expected a TPU name or "
            "grpc:// address reachable from this host, or 'local' on a Cloud TPU VM (--tpu or "
            "TPU_NAME); --strategy=one_device trains on this host's CPU or GPU instead."
        ) from None
    return tf.distribute.TPUStrategy(resolver)


def local_tpu_devices():
    """The TPU chips' devices TensorFlow sees on this host (a Cloud TPU VM); [] elsewhere.

    A TPU VM's TensorFlow lists its TPUs among the physical devices before
    the TPU system is initialised; listing physical devices leaves the
    runtime unconfigured (logical devices can still be set up afterwards).
    """
    return tf.config.list_physical_devices("TPU")


def _workers_in_tf_config():
    config = json.loads(os.environ.get("TF_CONFIG", "{}") or "{}")
    return len(config.get("cluster", {}).get("worker", []))


def get_strategy(name="auto", tpu=None):
    """Returns a `tf.distribute.Strategy` by name.

    Args:
        name: "auto", "tpu", "mirrored" (all local GPUs, or the CPU),
            "multi_worker" (MultiWorkerMirroredStrategy from TF_CONFIG) or
            "one_device".
        tpu: for "tpu": a TPU name, a grpc:// address or "local".
    """
    if name not in STRATEGIES:
        raise ValueError(f"`strategy` must be one of {STRATEGIES}. Received: strategy={name!r}")
    if name == "auto":
        strategy, reason = _auto_strategy(tpu)
    else:
        strategy, reason = _named_strategy(name, tpu), "asked for"
    logging.info(
        "Strategy: %s with %d replica(s) (%s: %s)",
        strategy_name(strategy), strategy.num_replicas_in_sync, name, reason,
    )
    return strategy


def _named_strategy(name, tpu):
    if name == "tpu":
        return _tpu_strategy(tpu)
    if name == "mirrored":
        devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
        return tf.distribute.MirroredStrategy([d.name for d in devices])
    if name == "multi_worker":
        if _workers_in_tf_config() < 1:
            raise ValueError(
                "strategy='multi_worker' needs TF_CONFIG describing the cluster "
                '({"cluster": {"worker": [...]}, "task": {"type": "worker", "index": i}}). '
                f"Received: TF_CONFIG={os.environ.get('TF_CONFIG')!r}"
            )
        return multi_worker_strategy()
    gpus = tf.config.list_logical_devices("GPU")
    return tf.distribute.OneDeviceStrategy(gpus[0].name if gpus else "/cpu:0")


def _auto_strategy(tpu):
    """(strategy, why it was chosen) for get_strategy("auto")."""
    if tpu or os.environ.get("TPU_NAME"):
        return _tpu_strategy(tpu), f"TPU {tpu or os.environ['TPU_NAME']!r} asked for"
    tpus = local_tpu_devices()
    if tpus:
        # A Cloud TPU VM: its TPU is attached to this host. Failing to initialise it is an
        # error, not a reason to train on the host's CPU instead.
        return _tpu_strategy("local"), f"{len(tpus)} local TPU device(s) found"
    workers = _workers_in_tf_config()
    if workers > 1:
        return multi_worker_strategy(), f"TF_CONFIG names {workers} workers"
    gpus = len(tf.config.list_logical_devices("GPU"))
    if gpus > 1:
        return _named_strategy("mirrored", tpu), f"{gpus} GPUs found"
    if gpus == 1:
        strategy = _named_strategy("one_device", tpu)
        return strategy, f"no TPU, no cluster, one GPU: {strategy.extended.worker_devices[0]}"
    # On the CPU a OneDeviceStrategy has no device to copy batches to: its distributed iterator (a
    # MultiDeviceIterator) only adds a thread and a copy per batch, and deleting it at fit's end has been
    # seen to wait up to a minute for that thread. Without a strategy, Keras iterates the dataset itself.
    return no_distribution(), "no TPU, no cluster, no GPU: this host's CPU, no distribution"


def no_distribution():
    """TensorFlow's default strategy: no distribution, what `tf.distribute.get_strategy()` is outside every
    strategy's scope (one replica on the default device; `fit` iterates datasets as they are)."""
    with tf.Graph().as_default():  # A new graph has no strategy's scope entered.
        return tf.distribute.get_strategy()


def strategy_name(strategy):
    """The class name of `strategy`, "none (TensorFlow's default strategy)" for `no_distribution()`."""
    return "none (TensorFlow's default strategy)" if strategy is no_distribution() else type(strategy).__name__


def on_one_device(strategy):
    """Whether `strategy` runs one replica on one device, as without a strategy: None, `no_distribution()` or a
    `tf.distribute.OneDeviceStrategy`."""
    return strategy is None or strategy is no_distribution() or isinstance(strategy, tf.distribute.OneDeviceStrategy)


def multi_worker_strategy():
    """MultiWorkerMirroredStrategy from TF_CONFIG, with `fit` made to work under it."""
    patch_keras_for_multi_worker_fit()
    return tf.distribute.MultiWorkerMirroredStrategy()


def is_chief(strategy):
    """Whether this process writes the job's outputs (the chief, or worker 0 without one)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.task_type:
        return True
    if resolver.task_type == "chief":
        return True
    has_chief = "chief" in resolver.cluster_spec().as_dict()
    return resolver.task_type == "worker" and resolver.task_id == 0 and not has_chief


def num_workers(strategy):
    """How many worker processes train under `strategy`: its cluster's chief and workers (1 without one)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 1
    cluster = resolver.cluster_spec().as_dict()
    return max(1, sum(len(cluster.get(job, ())) for job in ("chief", "worker")))


def any_replica(strategy):
    """A function `agree(flag)` that every worker of `strategy` calls together (the same number of times, as
    `fit`'s callbacks run): True on all of them when `flag` is True on any.  One all-reduce of one integer
    across the replicas (`keras_vit.callbacks.StopOnSignal`'s agreement under MultiWorkerMirroredStrategy and
    TPUStrategy)."""

    def agree(flag):
        # Each replica holds the flag of its worker; their sum crosses every worker (a collective).
        value = strategy.run(lambda: tf.constant(int(bool(flag)), tf.int32))
        return int(strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)) > 0

    return agree


def patch_keras_for_multi_worker_fit():
    """Makes `model.fit` work under MultiWorkerMirroredStrategy (Keras 3, TensorFlow backend).

    Keras fails there in two places (keras-team/keras issue 20585,
    tensorflow/tensorflow issue 72388): building the model from a batch
    MEAN-reduced across workers, and MEAN-reducing the scalar metrics with
    `axis=0`.  The fix replaces two functions of Keras' TensorFlow trainer,
    private APIs kept in `keras_vit.compat.patch_keras_for_multi_worker_fit`
    (see there); everywhere but under multi-worker collective strategies the
    original code runs.  Idempotent.
    """
    compat.patch_keras_for_multi_worker_fit()
