"""Training over several devices: TensorFlow's distribution strategies for `model.fit`, and
`keras.distribution` meshes (data parallel, and tensor parallel by heads) for Keras' JAX backend.

`get_strategy("auto")` picks the best available strategy: a TPU when one resolves (`tpu=`, TPU_NAME, or the
TPU of a Cloud TPU VM), several workers when TF_CONFIG names a cluster, several GPUs, one GPU, else no
distribution (TensorFlow's default strategy, `no_distribution()`, on this host's CPU); it logs which and how
many replicas.  Call it before anything is traced or placed: a TPU must be connected first.  Build the model
and optimizer under `strategy.scope()`; `fit` then splits each global batch across the replicas.

`make_distribution("data_parallel" | "model_parallel", mesh_shape)` builds a `keras.distribution` on a
("batch", "model") mesh over all devices; set it with `keras.distribution.set_distribution` (or use its
`scope()`) before building the model.  Keras' JAX backend lays each variable out on the mesh and XLA partitions
the compiled step to match; `get_layout_map` splits each block Megatron-style (Shoeybi et al. 2019) on the
model axis: the attention's query, key and value by whole heads and the MLP's first layer by units (column
parallel), their output projections by the same rows (row parallel), everything else replicated (the table and
the communication it costs: docs/model.md).  The model axis must divide the heads and the MLP width
(`check_model_parallel`).

The strategies need TensorFlow (imported when first used); the meshes need Keras only.
"""

import json
import math
import os

import keras
from absl import logging

from keras_vit import compat
from keras_vit.requirements import import_tensorflow


def _tf():
    return import_tensorflow("keras_vit.distribute's strategies")


# === TensorFlow's strategies ===


STRATEGIES = ("auto", "tpu", "mirrored", "multi_worker", "one_device")


def _tpu_strategy(tpu):
    """TPUStrategy over the TPU named `tpu` (a name or grpc:// address; "local" or nothing
    named, neither here nor in TPU_NAME: the TPU of this Cloud TPU VM), connected and
    initialised."""
    tf = _tf()
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
    tf = _tf()
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
    tf = _tf()
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
    tf = _tf()
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
    tf = _tf()
    with tf.Graph().as_default():  # A new graph has no strategy's scope entered.
        return tf.distribute.get_strategy()


def strategy_name(strategy):
    """The class name of `strategy`, "none (TensorFlow's default strategy)" for `no_distribution()`."""
    return "none (TensorFlow's default strategy)" if strategy is no_distribution() else type(strategy).__name__


def on_one_device(strategy):
    """Whether `strategy` runs one replica on one device, as without a strategy: None, `no_distribution()` or a
    `tf.distribute.OneDeviceStrategy`."""
    tf = _tf()
    return strategy is None or strategy is no_distribution() or isinstance(strategy, tf.distribute.OneDeviceStrategy)


def multi_worker_strategy():
    """MultiWorkerMirroredStrategy from TF_CONFIG, with `fit` made to work under it."""
    compat.patch_keras_for_multi_worker_fit()
    return _tf().distribute.MultiWorkerMirroredStrategy()


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
    tf = _tf()

    def agree(flag):
        # Each replica holds the flag of its worker; their sum crosses every worker (a collective).
        value = strategy.run(lambda: tf.constant(int(bool(flag)), tf.int32))
        return int(strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)) > 0

    return agree


# === keras.distribution meshes ===


BATCH_AXIS, MODEL_AXIS = "batch", "model"
DISTRIBUTIONS = ("data_parallel", "model_parallel")

# Variable paths inside each encoder block -> their axes, MODEL_AXIS standing for
# the mesh's model axis.
BLOCK_LAYOUTS = {
    "attention/qkv_kernel": (None, None, MODEL_AXIS),
    "attention/qkv_bias": (None, MODEL_AXIS),
    "attention/output_kernel": (MODEL_AXIS, None),
    "mlp_dense_1/kernel": (None, MODEL_AXIS),
    "mlp_dense_1/bias": (MODEL_AXIS,),
    "mlp_dense_2/kernel": (MODEL_AXIS, None),
}


def block_pattern(name):
    """The LayoutMap key (a regex that Keras matches against a whole variable path) of
    `name` in every encoder block, e.g. "encoderblock_11/attention/qkv_kernel"."""
    return r"(.*/)?encoderblock_\d+/" + name


def get_layout_map(device_mesh, model_axis=MODEL_AXIS, *, config=None):
    """A `keras.distribution.LayoutMap` sharding the blocks by heads and MLP units (module docstring).

    Args:
        device_mesh: a `keras.distribution.DeviceMesh` with an axis named `model_axis`.
        model_axis: the mesh axis the attention heads and MLP units are split over.
        config: optional: a `ViTConfig`, a variant name or a model from
            `build_vit`, checked with `check_model_parallel`.

    Raises:
        ValueError: the mesh has no `model_axis`, or `config`'s heads or MLP
            width do not divide evenly over it.
    """
    _axis_size(device_mesh, model_axis)
    if config is not None:
        check_model_parallel(config, device_mesh, model_axis)
    layout_map = keras.distribution.LayoutMap(device_mesh)
    for name, axes in BLOCK_LAYOUTS.items():
        layout_map[block_pattern(name)] = tuple(model_axis if axis == MODEL_AXIS else None for axis in axes)
    return layout_map


def check_model_parallel(model_or_config, device_mesh, model_axis=MODEL_AXIS):
    """Raises a ValueError unless the mesh's model axis divides the heads and the MLP width.

    Args:
        model_or_config: a model from `build_vit`, a `TransformerBlock`, a
            `ViTConfig` or a variant name ("B/16").
        device_mesh: a `keras.distribution.DeviceMesh`.
        model_axis: the name of its model axis.
    """
    size = _axis_size(device_mesh, model_axis)
    for heads, mlp_dim in _heads_and_mlp_dims(model_or_config):
        if not _divides(size, heads, mlp_dim):
            fitting = [n for n in range(1, math.gcd(heads, mlp_dim) + 1) if _divides(n, heads, mlp_dim)]
            raise ValueError(
                f"The mesh axis {model_axis!r} of size {size} (mesh shape {tuple(device_mesh.shape)}) must "
                f"divide the attention heads and the MLP width, so that each device holds whole heads and "
                f"an equal share of the MLP. Received: num_heads={heads}, mlp_dim={mlp_dim}. Expected a "
                f"model axis size in {fitting}."
            )


def make_distribution(kind, mesh_shape=None, *, batch_size=None, config=None, devices=None):
    """A `keras.distribution` over a ("batch", "model") mesh of all devices.

    Args:
        kind: "data_parallel" (`keras.distribution.DataParallel`: the variables
            replicated, the batch split) or "model_parallel"
            (`keras.distribution.ModelParallel` with `get_layout_map`: the batch
            split on "batch", the blocks on "model").
        mesh_shape: data parallel: (devices,) or (devices, 1); model parallel:
            (batch, model), whose product is the device count. By default all
            devices on "batch" for data parallel; for model parallel the
            largest model axis that divides the device count and `config`'s
            heads and MLP width (all devices on "model" without `config`).
        batch_size: optional global batch size, checked to divide over "batch".
        config: optional `ViTConfig`, variant name or model, checked with
            `check_model_parallel` (model parallel only).
        devices: default `keras.distribution.list_devices()`.

    Raises:
        ValueError naming what was received and what was expected.
    """
    if kind not in DISTRIBUTIONS:
        raise ValueError(f"`kind` must be one of {DISTRIBUTIONS}. Received: kind={kind!r}")
    devices = list(devices) if devices is not None else keras.distribution.list_devices()
    count = len(devices)
    if mesh_shape is None:
        if kind == "data_parallel":
            mesh_shape = (count,)
        else:
            model = max(n for n in range(1, count + 1) if count % n == 0 and _fits(config, n))
            mesh_shape = (count // model, model)
    mesh_shape = _check_mesh_shape(kind, mesh_shape, count, devices)
    if batch_size is not None and batch_size % mesh_shape[0]:
        raise ValueError(
            f"The global batch must split evenly over the mesh axis {BATCH_AXIS!r} of size {mesh_shape[0]} "
            f"(mesh shape {mesh_shape}). Received: batch_size={batch_size}. Expected a multiple of "
            f"{mesh_shape[0]}."
        )
    if kind == "data_parallel":
        mesh = keras.distribution.DeviceMesh(mesh_shape[:1], [BATCH_AXIS], devices)
        return keras.distribution.DataParallel(device_mesh=mesh)
    mesh = keras.distribution.DeviceMesh(mesh_shape, [BATCH_AXIS, MODEL_AXIS], devices)
    layout_map = get_layout_map(mesh, MODEL_AXIS, config=config)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name=BATCH_AXIS)


def _axis_size(device_mesh, axis):
    names = list(device_mesh.axis_names)
    if axis not in names:
        raise ValueError(
            f"The device mesh has no axis {axis!r} to split the heads and MLP units over. Received: "
            f"axis_names={names}, shape={tuple(device_mesh.shape)}."
        )
    return device_mesh.shape[names.index(axis)]


def _heads_and_mlp_dims(model_or_config):
    """[(num_heads, mlp_dim)] of every encoder block described by the argument."""
    from keras_vit.layers import TransformerBlock
    from keras_vit.variants import ViTConfig, parse_variant

    if isinstance(model_or_config, str):
        model_or_config = parse_variant(model_or_config)
    if isinstance(model_or_config, ViTConfig):
        return [(model_or_config.num_heads, model_or_config.mlp_dim)]
    if isinstance(model_or_config, TransformerBlock):
        return [(model_or_config.num_heads, model_or_config.mlp_dim)]
    if isinstance(model_or_config, keras.Model):
        blocks = [layer for layer in model_or_config.layers if isinstance(layer, TransformerBlock)]
        if blocks:
            return [(block.num_heads, block.mlp_dim) for block in blocks]
    raise ValueError(
        "Expected a model from build_vit, a TransformerBlock, a ViTConfig or a variant name. Received: "
        f"{model_or_config!r}"
    )


def _fits(config, model_axis_size):
    if config is None:
        return True
    return all(_divides(model_axis_size, heads, mlp) for heads, mlp in _heads_and_mlp_dims(config))


def _divides(model_axis_size, heads, mlp_dim):
    """Whether a model axis of that size gives each device whole heads and an equal share of the MLP."""
    return heads % model_axis_size == 0 and mlp_dim % model_axis_size == 0


def _check_mesh_shape(kind, mesh_shape, count, devices):
    """mesh_shape as a tuple of positive ints, (batch,) for data parallel or (batch, model), over `count` devices."""
    expected = {"data_parallel": "(devices,) or (devices, 1)", "model_parallel": "(batch, model)"}[kind]
    shape = (mesh_shape,) if isinstance(mesh_shape, int) else mesh_shape
    try:
        shape = tuple(shape)
    except TypeError:
        shape = ()
    if kind == "data_parallel" and len(shape) == 2 and shape[1] == 1:
        shape = shape[:1]
    rank = 1 if kind == "data_parallel" else 2
    if len(shape) != rank or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
        raise ValueError(
            f"`mesh_shape` for {kind} must be {expected}, positive ints. Received: mesh_shape={mesh_shape!r}"
        )
    if math.prod(shape) != count:
        shown = f"{devices[:4]}{' ...' if count > 4 else ''}"
        raise ValueError(
            f"`mesh_shape` must hold every device: its product must be the device count, {count} ({shown}). "
            f"Received: mesh_shape={mesh_shape!r} ({math.prod(shape)} devices)."
        )
    return shape
