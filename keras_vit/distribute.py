"""Distribution strategies for `model.fit`: TPU, GPUs, several hosts, one device.

`get_strategy("auto")` picks the best available: a TPU when one resolves
(TPU_NAME or a local TPU VM), several workers when TF_CONFIG names a cluster,
several GPUs, else one device.  Build the model and optimizer under
`strategy.scope()`; `fit` then splits each global batch across the replicas.
"""

import json
import os

import tensorflow as tf

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


_PATCHED = False


def patch_keras_for_multi_worker_fit():
    """Makes `model.fit` work under MultiWorkerMirroredStrategy (Keras 3, TensorFlow backend).

    Keras 3.15 fails there in two places (keras-team/keras issue 20585,
    tensorflow/tensorflow issue 72388):

    1. `_maybe_symbolic_build` builds the model from one batch, which it first
       MEAN-reduces across replicas; under MultiWorkerMirroredStrategy that
       reduction is a collective op on the (uint8) image batch and fails.  The
       batch is only needed for its shapes and dtypes, so this takes the local
       replica's value instead.
    2. `reduce_per_replica` MEAN-reduces the step's metrics with `axis=0`;
       they are scalars, so the collective reduction fails.  Scalars are
       reduced with `axis=None` here.

    Both changes are local to multi-worker collective strategies; everything
    else calls the original code.  Idempotent.
    """
    global _PATCHED
    if _PATCHED:
        return
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer

    is_multi_worker = trainer._collective_all_reduce_multi_worker
    original_build = trainer.TensorFlowTrainer._maybe_symbolic_build
    original_reduce = trainer.reduce_per_replica

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if strategy is None or iterator is None or not is_multi_worker(strategy):
            return original_build(self, iterator=iterator, data_batch=data_batch)
        for _, _, it in iterator:
            data_batch = tree.map_structure(
                lambda x: strategy.experimental_local_results(x)[0]
                if isinstance(x, tf.distribute.DistributedValues)
                else x,
                next(it),
            )
            break
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    def reduce_per_replica(values, strategy, reduction):
        if not (is_multi_worker(strategy) and reduction in ("auto", "mean")):
            return original_reduce(values, strategy, reduction)

        def reduce(value):
            if not (trainer._is_per_replica_instance(value) or isinstance(value, tf.Tensor)):
                return value
            local = strategy.experimental_local_results(value)[0]
            return strategy.reduce("MEAN", value, axis=0 if local.shape.rank else None)

        return tree.map_structure(reduce, values)

    trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    trainer.reduce_per_replica = reduce_per_replica
    _PATCHED = True
