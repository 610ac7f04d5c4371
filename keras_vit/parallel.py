"""Training over a device mesh with `keras.distribution`: data parallel, and tensor parallel by heads.

Keras' JAX backend distributes a model by the layout of each variable on a
`keras.distribution.DeviceMesh`; XLA partitions the compiled step to match.
`get_layout_map` lays a ViT out Megatron-style (Shoeybi et al. 2019) on the
mesh's model axis: each block's communication is two all-reduces of
(batch x tokens x hidden) partial sums forward (after the attention's output
projection and the MLP's second dense) and two backward (the gradients of the
inputs of the two column-parallel projections); a batch axis adds one
reduction of the gradients over it.

| variable | layout | each device holds |
|---|---|---|
| `attention/qkv_kernel` (D, 3, D) | (None, None, model) | q, k, v of whole heads (column parallel) |
| `attention/qkv_bias` (3, D) | (None, model) | their biases |
| `attention/output_kernel` (D, D) | (model, None) | the rows of those heads (row parallel: partial sums) |
| `mlp_dense_1/kernel` (D, mlp) | (None, model) | a share of the MLP's hidden units (column parallel) |
| `mlp_dense_1/bias` (mlp,) | (model,) | their biases |
| `mlp_dense_2/kernel` (mlp, D) | (model, None) | the rows of those units (row parallel: partial sums) |

Everything else (patch embedding, class token, position embeddings, layer
norms, output biases, pre-logits, head, a hybrid's ResNet) is replicated. The
attention needs no communication: the heads a device holds are the heads it
attends with. The last axis of `qkv_kernel` is heads x head_dim, so a model
axis of size N gives each device whole heads when N divides the heads, and
whole MLP units when N divides mlp_dim (`check_model_parallel`).

`make_distribution("data_parallel" | "model_parallel", mesh_shape)` builds the
distribution on a ("batch", "model") mesh over all devices; set it with
`keras.distribution.set_distribution` (or use its `scope()`) before building
the model. TensorFlow's own strategies are `keras_vit.distribute`'s.
"""

import math

import keras

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


# === Helpers ===


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
