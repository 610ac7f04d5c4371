"""Distribution strategies for `model.fit`: TPU, GPUs, several hosts, one device.

`get_strategy("auto")` picks the best available: a TPU when one resolves
(TPU_NAME or a local TPU VM), several workers when TF_CONFIG names a cluster,
several GPUs, else one device.  Build the model and optimizer under
`strategy.scope()`; `fit` then splits each global batch across the replicas.
"""

import json
import os

import tensorflow as tf

from keras_vit import compat

STRATEGIES = ("auto", "tpu", "mirrored", "multi_worker", "one_device")


def _tpu_strategy(tpu):
    try:
        if tpu in (None, "", "local"):
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="local" if tpu == "local" else None)
        else:
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
        if tpu not in (None, "", "local"):
            tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, RuntimeError, OSError, tf.errors.OpError) as error:  # OSError: URLError
        raise ValueError(
            f"Could not resolve or initialise the TPU {tpu!r}: {error}. Expected a TPU name or "
            "grpc:// address reachable from this host, 'local' on a TPU VM, or TPU_NAME set."
        ) from None
    return tf.distribute.TPUStrategy(resolver)


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
        if tpu or os.environ.get("TPU_NAME"):
            return _tpu_strategy(tpu)
        if _workers_in_tf_config() > 1:
            return multi_worker_strategy()
        if len(tf.config.list_logical_devices("GPU")) > 1:
            return tf.distribute.MirroredStrategy()
        name = "one_device"
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
