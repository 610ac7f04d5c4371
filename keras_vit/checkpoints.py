"""The original ViT checkpoints (.npz): loading, saving, resolution change, transfer learning.

An original checkpoint is a flat dict of arrays keyed like
`Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel` (the naming of
google-research/vision_transformer, "vit_jax").  Layouts met in the wild, all
read here:

- vit_jax names, possibly under a `params/` or `opt/target/` prefix;
- big_vision names: `pos_embedding` at the top level without a class-token
  row (big_vision prepends the class token after adding the position
  embeddings), `MultiHeadDotProductAttention_0`, `LayerNorm_1`, `MlpBlock_0`;
  no position embeddings at all for fixed 2-D sin-cos ones (a model built
  with position_embedding="sincos2d"); the MAP head `MAPHead_0/{probe,
  MultiHeadDotProductAttention_0, LayerNorm_0, MlpBlock_0}` (classifier "map");
- the "scan" layout: every block stacked on a leading axis under
  `Transformer/encoderblock/`;
- hybrids: `conv_root`, `gn_root`, `block{s}/unit{u}/{conv,gn}{1,2,3,_proj}`.

timm's state dicts (Hugging Face hub `model.safetensors`, or the same arrays
in an .npz) are converted to these names by `keras_vit.timm_weights`.

The conversion is pure functions on dicts of NumPy arrays
(`canonicalize`, `convert_checkpoint`, `to_checkpoint`); `load_pretrained` and
`save_npz` only add the file and the model around them.
"""

import difflib
import io
import logging
import re
import zipfile

import keras
import numpy as np

INTERPOLATIONS = ("bicubic", "bicubic_antialias", "bilinear", "zoom")

log = logging.getLogger("keras_vit")

# === Key names ===

_TOP_LEVEL = {
    "embedding/kernel": "patch_encoder/kernel",
    "embedding/bias": "patch_encoder/bias",
    "cls": "patch_encoder/class_token",
    "Transformer/posembed_input/pos_embedding": "patch_encoder/position_embedding",
    "Transformer/encoder_norm/scale": "encoder_norm/gamma",
    "Transformer/encoder_norm/bias": "encoder_norm/beta",
    "pre_logits/kernel": "pre_logits/kernel",
    "pre_logits/bias": "pre_logits/bias",
    "head/kernel": "head/kernel",
    "head/bias": "head/bias",
    # LayerNorms no original checkpoint has: timm's norm_pre and fc_norm (build_vit's pre_norm, pooled_norm).
    "pre_norm/scale": "pre_norm/gamma",
    "pre_norm/bias": "pre_norm/beta",
    "pooled_norm/scale": "pooled_norm/gamma",
    "pooled_norm/bias": "pooled_norm/beta",
    # big_vision's MAP head (classifier "map"); its attention kernels are read by `_read_attention`.
    "MAPHead_0/probe": "pooling/probe",
    "MAPHead_0/MultiHeadDotProductAttention_0/out/bias": "pooling/output_bias",
    "MAPHead_0/LayerNorm_0/scale": "pooling/norm/gamma",
    "MAPHead_0/LayerNorm_0/bias": "pooling/norm/beta",
    "MAPHead_0/MlpBlock_0/Dense_0/kernel": "pooling/mlp_dense_1/kernel",
    "MAPHead_0/MlpBlock_0/Dense_0/bias": "pooling/mlp_dense_1/bias",
    "MAPHead_0/MlpBlock_0/Dense_1/kernel": "pooling/mlp_dense_2/kernel",
    "MAPHead_0/MlpBlock_0/Dense_1/bias": "pooling/mlp_dense_2/bias",
}
_POSEMB = "Transformer/posembed_input/pos_embedding"
_MAP_ATTENTION = "MAPHead_0/MultiHeadDotProductAttention_0"
_BLOCK = {
    "LayerNorm_0/scale": "attention_norm/gamma",
    "LayerNorm_0/bias": "attention_norm/beta",
    "LayerNorm_2/scale": "mlp_norm/gamma",
    "LayerNorm_2/bias": "mlp_norm/beta",
    "MlpBlock_3/Dense_0/kernel": "mlp_dense_1/kernel",
    "MlpBlock_3/Dense_0/bias": "mlp_dense_1/bias",
    "MlpBlock_3/Dense_1/kernel": "mlp_dense_2/kernel",
    "MlpBlock_3/Dense_1/bias": "mlp_dense_2/bias",
    "MultiHeadDotProductAttention_1/out/bias": "attention/output_bias",
}
_ATTENTION = "MultiHeadDotProductAttention_1"
_QKV = ("query", "key", "value")
# The attention layers' fused projections (`<name>_kernel`, `<name>_bias`) -> the checkpoint's
# projections they stack, in order on the axis before the last.
_PROJECTIONS = {"qkv": _QKV, "query": ("query",), "key_value": ("key", "value")}
_ATTENTION_WEIGHT = re.compile(r"^(?:(qkv|query|key_value)_(kernel|bias)|output_kernel)$")
# big_vision numbers the sublayers of a block differently.
_BIG_VISION_BLOCK = {
    "MultiHeadDotProductAttention_0/": "MultiHeadDotProductAttention_1/",
    "LayerNorm_1/": "LayerNorm_2/",
    "MlpBlock_0/": "MlpBlock_3/",
}
_RESNET_KEY = re.compile(r"^(conv_root|gn_root|block\d+/unit\d+/(conv|gn)(\d|_proj))/(kernel|scale|bias)$")
_NORM_PARAM = {"scale": "gamma", "bias": "beta"}
# The same tables read from our side: model weight path -> checkpoint key.
_TOP_LEVEL_BY_PATH = {ours: theirs for theirs, ours in _TOP_LEVEL.items()}
_BLOCK_BY_PATH = {ours: theirs for theirs, ours in _BLOCK.items()}
_NORM_PARAM_BY_PATH = {ours: theirs for theirs, ours in _NORM_PARAM.items()}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit the model."""


# === Reading and writing files ===


def read_checkpoint(path):
    """Reads an .npz or .safetensors checkpoint (local or gs:// path, told apart by their contents)
    as a dict of arrays; nothing is unpickled."""
    from keras_vit import timm_weights

    data = _read_bytes(path)
    if timm_weights.is_safetensors(data):
        return timm_weights.read_safetensors(data, path)
    return _read_npz_bytes(data, path, "nor a .safetensors file (a JSON header, then the arrays)")


def read_npz(path):
    """Reads an .npz checkpoint (local or gs:// path) as a dict of arrays, pickling disabled."""
    return _read_npz_bytes(_read_bytes(path), path)


def _read_bytes(path):
    import tensorflow as tf

    if not tf.io.gfile.exists(path):
        raise FileNotFoundError(f"No checkpoint at {path!r}.")
    with tf.io.gfile.GFile(path, "rb") as f:
        return f.read()


def _read_npz_bytes(data, path, other_format=None):
    if not zipfile.is_zipfile(io.BytesIO(data)):
        raise CheckpointError(
            f"{path!r} is not an .npz checkpoint (a zip archive of .npy arrays)"
            + (f" {other_format}" if other_format else "")
            + f"; read {len(data)} bytes starting {data[:8]!r}. A truncated download looks like this too."
        )
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}
    except ValueError as error:
        if "allow_pickle" in str(error):
            raise CheckpointError(
                f"{path!r} holds a pickled Python object; checkpoints are read with pickling "
                "disabled, so it was refused (it was not executed)."
            ) from None
        raise CheckpointError(f"{path!r} is not a readable .npz checkpoint: {error}") from None
    except (zipfile.BadZipFile, EOFError, OSError) as error:
        raise CheckpointError(f"{path!r} is truncated or corrupt: {error}") from None


def write_npz(params, path):
    """Writes a dict of arrays as an .npz file (local or gs:// path)."""
    import tensorflow as tf

    buffer = io.BytesIO()
    np.savez(buffer, **params)
    with tf.io.gfile.GFile(path, "wb") as f:
        f.write(buffer.getvalue())


# === Layouts ===


def canonicalize(params):
    """Any supported layout -> vit_jax names, one entry per block, float arrays.

    Strips `params/` and `opt/target/` prefixes, renames big_vision keys (and
    gives its position embeddings the class-token row it lacks: zeros, since
    big_vision adds no position to the class token), and unstacks the "scan"
    layout.
    """
    params = dict(params)
    for prefix in ("opt/target/", "params/"):
        if params and all(key.startswith(prefix) for key in params):
            params = {key[len(prefix) :]: value for key, value in params.items()}
        elif any(key.startswith(prefix) for key in params):
            params = {key[len(prefix) :]: v for key, v in params.items() if key.startswith(prefix)}
    # Scan layout: Transformer/encoderblock/<rest> with the blocks on axis 0.
    stacked = {k: v for k, v in params.items() if k.startswith("Transformer/encoderblock/")}
    if stacked:
        depth = {v.shape[0] for v in stacked.values()}
        if len(depth) != 1:
            raise CheckpointError(f"Stacked encoder blocks disagree on their number: {sorted(depth)}.")
        for key, value in stacked.items():
            del params[key]
            rest = key[len("Transformer/encoderblock/") :]
            for i in range(value.shape[0]):
                params[f"Transformer/encoderblock_{i}/{rest}"] = value[i]

    # big_vision names (its blocks' sublayers; the MAP head keeps big_vision's names).
    in_blocks = lambda key: key.startswith("Transformer/encoderblock_")  # noqa: E731
    if "pos_embedding" in params or any(in_blocks(key) and "MlpBlock_0/" in key for key in params):
        renamed = {}
        for key, value in params.items():
            for theirs, ours in _BIG_VISION_BLOCK.items():
                key = key.replace(theirs, ours) if in_blocks(key) else key
            renamed[key] = value
        params = renamed
        if "pos_embedding" in params:
            posemb = params.pop("pos_embedding")
            if "cls" in params:
                posemb = np.concatenate([np.zeros_like(posemb[:, :1]), posemb], axis=1)
            params[_POSEMB] = posemb
    return params


# === Position embeddings ===


def _keys_cubic(t, a):
    """The cubic convolution kernel of Keys (1981) with parameter `a`."""
    t = np.abs(t)
    return np.where(
        t <= 1,
        ((a + 2) * t - (a + 3)) * t * t + 1,
        np.where(t < 2, ((a * t - 5 * a) * t + 8 * a) * t - 4 * a, 0.0),
    )


def _antialiased_bicubic_matrix(old, new):
    """(new, old) matrix of PyTorch's bicubic resize with antialias=True (Pillow's resampling):
    Keys' kernel with a = -0.5, stretched by the scale old / new when shrinking (a low-pass
    filter), output i centred at (i + 0.5) * scale in input pixels, taps outside the input left
    out and each row's weights normalised to sum to 1. What timm's `resample_abs_pos_embed`
    computes (`F.interpolate(mode="bicubic", antialias=True, align_corners=False)`)."""
    scale = old / new
    stretch = max(scale, 1.0)
    support = 2.0 * stretch
    matrix = np.zeros((new, old))
    for i in range(new):
        center = scale * (i + 0.5)
        # int() truncates towards zero, as the C code's casts do.
        start = max(int(center - support + 0.5), 0)
        stop = min(int(center + support + 0.5), old)
        taps = np.arange(start, stop)
        weights = _keys_cubic((taps - center + 0.5) / stretch, -0.5)
        matrix[i, taps] = weights / weights.sum()
    return matrix


def _interpolation_matrix(old, new, interpolation):
    """(new, old) matrix resampling a 1-D signal by `interpolation` (see `resample_position_embeddings`):
    half-pixel centres; edges clamped, or (antialiased) taps outside left out."""
    if interpolation == "bicubic_antialias":
        return _antialiased_bicubic_matrix(old, new)
    matrix = np.zeros((new, old))
    source = (np.arange(new) + 0.5) * old / new - 0.5
    if interpolation == "bilinear":
        source = np.clip(source, 0, old - 1)
        low = np.floor(source).astype(int)
        high = np.minimum(low + 1, old - 1)
        frac = source - low
        matrix[np.arange(new), low] += 1 - frac
        matrix[np.arange(new), high] += frac
        return matrix
    # Bicubic convolution (Keys 1981) with a = -0.75, edge samples repeated: the
    # kernel of PyTorch's (without antialias) and OpenCV's bicubic resize.
    base = np.floor(source).astype(int)
    for offset in (-1, 0, 1, 2):
        taps = base + offset
        np.add.at(matrix, (np.arange(new), np.clip(taps, 0, old - 1)), _keys_cubic(source - taps, -0.75))
    return matrix


def resample_position_embeddings(
    posemb, new_grid, interpolation="bicubic", *, old_grid=None, num_prefix_tokens=None
):
    """Resamples position embeddings to another patch grid.

    Args:
        posemb: (1, tokens, D) or (tokens, D): the class-token row (if any)
            followed by the patch rows in row-major order.
        new_grid: (height, width) of the new patch grid.
        interpolation: "bicubic" (Keys, a = -0.75, as PyTorch without
            antialias), "bicubic_antialias" (PyTorch's bicubic with
            antialias=True, as timm resamples a checkpoint's position
            embeddings; Pillow's bicubic resize), "bilinear" (half-pixel
            centres, no antialias: timm's .npz loader) or "zoom"
            (`scipy.ndimage.zoom`, order 1: the original implementation).
        old_grid: the checkpoint's grid; by default the square grid that fits.
        num_prefix_tokens: rows kept apart (1 for a class token); by default 1
            if tokens - 1 is a square number and tokens is not, else 0.

    Returns:
        An array of the same rank with the prefix rows unchanged.
    """
    if interpolation not in INTERPOLATIONS:
        raise ValueError(
            f"`interpolation` must be one of {INTERPOLATIONS}. Received: interpolation={interpolation!r}"
        )
    posemb = np.asarray(posemb)
    squeeze = posemb.ndim == 2
    if squeeze:
        posemb = posemb[None]
    if posemb.ndim != 3 or posemb.shape[0] != 1:
        raise ValueError(
            f"Expected position embeddings of shape (1, tokens, D) or (tokens, D). Received: shape {posemb.shape}"
        )
    tokens = posemb.shape[1]
    if num_prefix_tokens is None:
        is_square = lambda n: n >= 0 and int(round(n**0.5)) ** 2 == n  # noqa: E731
        num_prefix_tokens = 1 if (is_square(tokens - 1) and not is_square(tokens)) else 0
    patches = tokens - num_prefix_tokens
    if old_grid is None:
        side = int(round(patches**0.5))
        if side * side != patches:
            raise ValueError(
                f"{patches} patch rows do not form a square grid; pass `old_grid`. Received: "
                f"shape {posemb.shape}, num_prefix_tokens={num_prefix_tokens}"
            )
        old_grid = (side, side)
    old_grid, new_grid = tuple(old_grid), tuple(new_grid)
    if old_grid[0] * old_grid[1] != patches:
        raise ValueError(f"old_grid={old_grid} does not match {patches} patch rows.")
    prefix, grid = posemb[:, :num_prefix_tokens], posemb[0, num_prefix_tokens:]
    grid = grid.reshape(*old_grid, -1)
    if old_grid == new_grid:
        resampled = grid
    elif interpolation == "zoom":
        from scipy import ndimage

        factors = (new_grid[0] / old_grid[0], new_grid[1] / old_grid[1], 1)
        resampled = ndimage.zoom(grid.astype(np.float64), factors, order=1)
    else:
        rows = _interpolation_matrix(old_grid[0], new_grid[0], interpolation)
        cols = _interpolation_matrix(old_grid[1], new_grid[1], interpolation)
        resampled = np.einsum("ij,jkd,lk->ild", rows, grid.astype(np.float64), cols)
    resampled = resampled.reshape(1, new_grid[0] * new_grid[1], -1).astype(posemb.dtype)
    out = np.concatenate([prefix, resampled], axis=1)
    return out[0] if squeeze else out


# === Conversion ===


def _missing(key, params, key_name=str):
    close = difflib.get_close_matches(key, list(params), n=3, cutoff=0.5)
    close = list(dict.fromkeys(map(key_name, close)))
    return CheckpointError(
        f"The checkpoint has no key {key_name(key)!r}" + (f"; closest keys present: {close}" if close else "") + "."
    )


def _resnet_path(key):
    """`block1/unit2/gn1/scale` -> `resnet/block1_unit2/gn1/gamma` (None if not a ResNet key)."""
    match = _RESNET_KEY.match(key)
    if not match:
        return None
    layer, param = match.group(1), match.group(4)
    if layer.split("/")[-1].startswith("gn"):
        param = _NORM_PARAM[param]
    return "resnet/" + layer.replace("/unit", "_unit") + "/" + param


def _attention_source(path):
    """(checkpoint prefix, weight name) of an attention's fused projection weight
    (`encoderblock_{i}/attention/qkv_kernel`, `pooling/key_value_bias`, ...); None for any other path."""
    block = re.match(r"^encoderblock_(\d+)/attention/(\w+)$", path)
    pooling = re.match(r"^pooling/(\w+)$", path)
    if block and _ATTENTION_WEIGHT.match(block.group(2)):
        return f"Transformer/encoderblock_{block.group(1)}/{_ATTENTION}", block.group(2)
    if pooling and _ATTENTION_WEIGHT.match(pooling.group(1)):
        return _MAP_ATTENTION, pooling.group(1)
    return None


def _read_attention(take, prefix, weight):
    """An attention weight from the checkpoint's per-projection arrays.

    Kernels (D, heads, head_dim) are reshaped to (D, D) and stacked on the
    middle axis ((D, 3, D) for `qkv_kernel`, (D, 2, D) for `key_value_kernel`,
    (D, D) alone for `query_kernel`), biases (heads, head_dim) likewise; the
    output kernel (heads, head_dim, D) becomes (D, D).
    """
    if weight == "output_kernel":
        kernel = take(f"{prefix}/out/kernel")
        return kernel.reshape(-1, kernel.shape[-1])
    projection, kind = weight.rsplit("_", 1)
    if kind == "kernel":
        parts = [take(f"{prefix}/{name}/kernel") for name in _PROJECTIONS[projection]]
        parts = [part.reshape(part.shape[0], -1) for part in parts]
        return np.stack(parts, axis=1) if len(parts) > 1 else parts[0]
    parts = [take(f"{prefix}/{name}/bias").reshape(-1) for name in _PROJECTIONS[projection]]
    return np.stack(parts) if len(parts) > 1 else parts[0]


def _write_attention(params, prefix, weight, value, num_heads):
    """The inverse of `_read_attention`: an attention weight into `params` as per-projection arrays.
    The flat (D, 3D) and (3D,) query-key-value weights of older models hold the same numbers in the
    same order and are read too."""
    if weight == "output_kernel":
        params[f"{prefix}/out/kernel"] = value.reshape(num_heads, -1, value.shape[-1])
        return
    projection, kind = weight.rsplit("_", 1)
    names = _PROJECTIONS[projection]
    if kind == "kernel":
        dim = value.shape[0]
        for name, part in zip(names, np.moveaxis(value.reshape(dim, len(names), -1), 1, 0)):
            params[f"{prefix}/{name}/kernel"] = part.reshape(dim, num_heads, dim // num_heads)
    else:
        for name, part in zip(names, value.reshape(len(names), -1)):
            params[f"{prefix}/{name}/bias"] = part.reshape(num_heads, -1)


# Parts of a model that build_vit options add or remove: (checkpoint key prefix, model weight path
# prefix, the part, the option that builds it, the option that builds without it).
_OPTIONAL_PARTS = (
    (_POSEMB, "patch_encoder/position_embedding", "learned position embeddings", "position_embedding='learned'",
     "position_embedding='sincos2d' (a checkpoint without them was trained with fixed 2-D sin-cos ones)"),
    ("MAPHead_0/", "pooling/", "a MAP head", "classifier='map'", "classifier='token' or 'gap'"),
    ("pre_norm/", "pre_norm/", "a LayerNorm before the blocks (timm's norm_pre)", "pre_norm=True", "pre_norm=False"),
    ("Transformer/encoder_norm/", "encoder_norm/", "a LayerNorm on the tokens before the pooling",
     "pooled_norm=False", "pooled_norm=True"),
    ("pooled_norm/", "pooled_norm/", "a LayerNorm after the pooling (timm's fc_norm)", "pooled_norm=True",
     "pooled_norm=False"),
)


def _check_options(params, target_shapes, key_name):
    """A CheckpointError naming the build_vit option where the checkpoint has a part the model lacks,
    or lacks one the model has."""
    for prefix, path_prefix, part, with_it, without_it in _OPTIONAL_PARTS:
        in_file = [key_name(k) for k in params if k.startswith(prefix)]
        in_model = [p for p in target_shapes if p.startswith(path_prefix)]
        if in_file and not in_model:
            raise CheckpointError(
                f"The checkpoint has {part}: {list(dict.fromkeys(in_file))[:3]}, which the model lacks. Build it "
                f"with {with_it}."
            )
        if in_model and not in_file:
            wanted = next(_TOP_LEVEL_BY_PATH[p] for p in in_model if p in _TOP_LEVEL_BY_PATH)
            raise CheckpointError(
                f"The checkpoint has no key {key_name(wanted)!r}: the model has {part}, the checkpoint has none. "
                f"Build it with {without_it}."
            )


def convert_checkpoint(
    params, target_shapes, grid_size, *, interpolation="bicubic", skip_mismatched_head=True, key_name=str
):
    """Maps a canonical checkpoint onto a model's weights.

    Args:
        params: the output of `canonicalize`.
        target_shapes: the model's weights, {path: shape} (e.g.
            "encoderblock_0/attention/qkv_kernel": (D, 3, D)).
        grid_size: the model's patch grid, for resampling the position embeddings.
        interpolation, skip_mismatched_head: as for `load_pretrained`.
        key_name: the name of a canonical key in the file, for messages
            (e.g. `keras_vit.timm_weights.timm_key`).

    Returns:
        (weights, notes): {path: array} for every weight to set, and messages
        about what was resampled, dropped or left as initialised.

    Raises:
        CheckpointError naming the key for a missing key, a shape mismatch or a
        key the model has no place for.
    """
    _check_options(params, target_shapes, key_name)
    weights, notes, used = {}, [], set()
    has_class_token = "patch_encoder/class_token" in target_shapes

    def take(key):
        if key not in params:
            raise _missing(key, params, key_name)
        used.add(key)
        return np.asarray(params[key])

    for path, shape in target_shapes.items():
        shape = tuple(shape)
        block = re.match(r"^encoderblock_(\d+)/(.+)$", path)
        attention = _attention_source(path)
        if path.startswith("resnet/"):
            key = next((k for k in params if _resnet_path(k) == path), None)
            if key is None:
                wanted = path[len("resnet/") :].replace("_unit", "/unit")
                wanted = re.sub(r"/(gn[^/]*)/gamma$", r"/\1/scale", wanted)
                wanted = re.sub(r"/(gn[^/]*)/beta$", r"/\1/bias", wanted)
                raise _missing(wanted, params, key_name)
            value = take(key)
        elif attention:
            value = _read_attention(take, *attention)
        elif block:
            prefix, rest = f"Transformer/encoderblock_{block.group(1)}/", block.group(2)
            theirs = _BLOCK_BY_PATH.get(rest)
            if theirs is None:
                raise CheckpointError(f"No checkpoint key is known for the model weight {path!r}.")
            value = take(prefix + theirs)
        else:
            theirs = _TOP_LEVEL_BY_PATH.get(path)
            if theirs is None:
                raise CheckpointError(f"No checkpoint key is known for the model weight {path!r}.")
            if path.startswith("head/") and theirs not in params:
                notes.append(f"The checkpoint has no head: {path} left as initialised.")
                continue
            value = take(theirs)
            if path == "patch_encoder/position_embedding":
                if "cls" in params and not has_class_token:
                    value = value[:, 1:]
                patches = grid_size[0] * grid_size[1]
                if value.shape[1] - has_class_token != patches and value.shape[-1] == shape[-1]:
                    notes.append(
                        f"Position embeddings resampled from {value.shape[1] - has_class_token} to "
                        f"{grid_size[0]}x{grid_size[1]} patches ({interpolation})."
                    )
                    value = resample_position_embeddings(
                        value, grid_size, interpolation, num_prefix_tokens=int(has_class_token)
                    )
            if path.startswith("head/") and value.shape != shape:
                if not skip_mismatched_head:
                    raise CheckpointError(
                        f"The checkpoint's {theirs!r} has shape {value.shape}, the model's head "
                        f"{path!r} has shape {shape}; pass skip_mismatched_head=True to keep the "
                        "model's head for a new task."
                    )
                notes.append(
                    f"Head not loaded: checkpoint {theirs} {value.shape} vs model {shape}; "
                    "the model's head is left as initialised for the new task."
                )
                continue
        if value.shape != shape:
            raise CheckpointError(
                f"Shape mismatch for {path!r}: the checkpoint gives {value.shape}, the model expects {shape}."
            )
        weights[path] = value

    if "cls" in params and not has_class_token:
        used.add("cls")
        notes.append("The checkpoint's class token (and its position) dropped: the model has none (classifier 'gap' or 'map').")
    unused = sorted(set(params) - used)
    dropped = [k for k in unused if k.startswith(("pre_logits/", "head/"))]
    if dropped:
        notes.append(f"Not in the model, dropped: {dropped}.")
    unexpected = [k for k in unused if k not in dropped]
    if unexpected:
        raise CheckpointError(
            f"The checkpoint has {len(unexpected)} key(s) the model has no place for, e.g. "
            f"{list(dict.fromkeys(map(key_name, unexpected)))[:5]}; is it another variant (depth, hybrid, classifier)?"
        )
    return weights, notes


def to_checkpoint(weights, num_heads):
    """The inverse of `convert_checkpoint`: {path: array} -> vit_jax names (the MAP head's: big_vision's).

    `num_heads` splits the fused attention kernels into (D, heads, head_dim).
    """
    params = {}
    for path, value in weights.items():
        block = re.match(r"^encoderblock_(\d+)/(.+)$", path)
        attention = _attention_source(path)
        if path.startswith("resnet/"):
            layer, param = path[len("resnet/") :].rsplit("/", 1)
            if layer.split("/")[-1].startswith("gn"):
                param = _NORM_PARAM_BY_PATH[param]
            params[layer.replace("_unit", "/unit") + "/" + param] = value
        elif attention:
            _write_attention(params, *attention, value, num_heads)
        elif block:
            params[f"Transformer/encoderblock_{block.group(1)}/" + _BLOCK_BY_PATH[block.group(2)]] = value
        else:
            params[_TOP_LEVEL_BY_PATH[path]] = value
    return params


# === Models ===


def _encoder(model):
    from keras_vit.layers import PatchEncoder

    encoders = [layer for layer in model.layers if isinstance(layer, PatchEncoder)]
    if len(encoders) != 1:
        raise ValueError(f"Expected a model from build_vit with one PatchEncoder; {model.name!r} has {len(encoders)}.")
    return encoders[0]


def load_pretrained(model, path, *, interpolation=None, skip_mismatched_head=True):
    """Loads a ViT checkpoint into a model from `build_vit`: an original one (.npz,
    local or gs://) or timm's (`model.safetensors` from the Hugging Face hub, or
    its state dict in an .npz).

    All of the checkpoint is read, converted and checked against the model
    before any weight is assigned: on any error the model is unchanged.

    Args:
        model: a model from `build_vit` (any resolution, classifier, head).
        path: the .npz or .safetensors file (told apart by their contents).
        interpolation: how position embeddings are resampled when the patch
            grid differs, see `resample_position_embeddings`; by default as
            the file's own code does: "bicubic_antialias" (timm's) for timm
            files, "bicubic" for others.
        skip_mismatched_head: a head of another shape (another number of
            classes) is left as initialised (zeros) instead of raising.

    Returns:
        The notes of the conversion (also logged): resampling, dropped keys,
        skipped head.
    """
    from keras_vit import timm_weights

    if interpolation is not None and interpolation not in INTERPOLATIONS:
        raise ValueError(
            f"`interpolation` must be one of {INTERPOLATIONS}. Received: interpolation={interpolation!r}"
        )
    params, grid_size = read_checkpoint(path), _encoder(model).grid_size
    if timm_weights.MARKER in params:
        params, notes = timm_weights.from_timm(params, _num_heads(model), grid_size)
        key_name, interpolation = timm_weights.timm_key, interpolation or "bicubic_antialias"
    else:
        params, notes = canonicalize(params), []
        key_name, interpolation = str, interpolation or "bicubic"
    variables = _variables(model)
    weights, conversion_notes = convert_checkpoint(
        params,
        {p: tuple(v.shape) for p, v in variables.items()},
        grid_size,
        interpolation=interpolation,
        skip_mismatched_head=skip_mismatched_head,
        key_name=key_name,
    )
    for path_, value in weights.items():
        variables[path_].assign(value.astype(variables[path_].dtype))
    notes += conversion_notes
    for note in notes:
        log.warning("load_pretrained(%s): %s", path, note)
    return notes


def _variables(model):
    """The model's weights by path (random-generator states are not weights)."""
    return {v.path: v for v in model.weights if "seed_generator" not in v.path}


def _num_heads(model):
    """The attention heads of a model from `build_vit` (1 for one without blocks)."""
    from keras_vit.layers import TransformerBlock

    heads = {layer.num_heads for layer in model.layers if isinstance(layer, TransformerBlock)}
    return heads.pop() if heads else 1


def model_checkpoint(model):
    """A model's weights in the original checkpoints' names and layouts (what `save_npz` writes)."""
    weights = {p: keras.ops.convert_to_numpy(v) for p, v in _variables(model).items()}
    return to_checkpoint(weights, _num_heads(model))


def save_npz(model, path):
    """Writes a model from `build_vit` as an original (vit_jax) .npz checkpoint."""
    write_npz(model_checkpoint(model), path)


def _is_chain(model):
    """Whether `model` is a functional chain: an input, then layers each called once on the previous one's output.

    Read from the model's functional config, which lists each layer's calls
    within the model and the layer every input tensor comes from.
    """
    layers = model.layers
    if not layers or not isinstance(layers[0], keras.layers.InputLayer):
        return False
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        return False
    configs = model.get_config().get("layers", [])
    if [config.get("name") for config in configs] != [layer.name for layer in layers]:
        return False
    for previous, config in zip(layers, configs[1:]):
        nodes = config.get("inbound_nodes", [])
        if len(nodes) != 1 or _source_layers(nodes[0]) != [previous.name]:
            return False
    return True


def _source_layers(serialized):
    """The names of the layers that produced the tensors in a serialized call (config["inbound_nodes"][i])."""
    if isinstance(serialized, dict):
        if serialized.get("class_name") == "__keras_tensor__":
            return [serialized["config"]["keras_history"][0]]
        return [name for value in serialized.values() for name in _source_layers(value)]
    if isinstance(serialized, (list, tuple)):
        return [name for value in serialized for name in _source_layers(value)]
    return []


def _rebuild(model, image_size=None, head=None):
    """Rebuilds a chain-shaped model from its layers' configs, optionally at another size."""
    from keras_vit.variants import to_pair

    layers = model.layers
    if not _is_chain(model):
        raise ValueError(f"Expected a model from build_vit (a chain of layers); got {model.name!r}.")
    height, width, channels = model.input_shape[1:]
    if image_size is not None:
        height, width = to_pair(image_size, "image_size")
    inputs = keras.Input((height, width, channels), dtype=model.inputs[0].dtype, name=layers[0].name)
    x, clones = inputs, []
    for layer in layers[1:]:
        clone = layer.__class__.from_config(layer.get_config())
        x = clone(x)
        clones.append(clone)
    return keras.Model(inputs, x, name=model.name), list(zip(layers[1:], clones))


def set_image_size(model, image_size, interpolation="bicubic"):
    """A new model at another resolution with the same weights.

    Learned position embeddings are resampled to the new patch grid (see
    `resample_position_embeddings`), fixed sin-cos ones are computed for it;
    every other weight is copied.  Fine-tune at the new size: resampling alone
    costs accuracy (about 9.5% top-1 from 384 to 224 px,
    google-research/vision_transformer issue 6).
    """
    from keras_vit.layers import PatchEncoder

    if interpolation not in INTERPOLATIONS:
        raise ValueError(
            f"`interpolation` must be one of {INTERPOLATIONS}. Received: interpolation={interpolation!r}"
        )
    new_model, pairs = _rebuild(model, image_size)
    for old, new in pairs:
        values = old.get_weights()
        if isinstance(old, PatchEncoder) and old.position_embedding_type == "learned":
            index = next(i for i, w in enumerate(old.weights) if w is old.position_embedding)
            values[index] = resample_position_embeddings(
                values[index], new.grid_size, interpolation,
                old_grid=old.grid_size, num_prefix_tokens=int(old.use_class_token),
            )
        new.set_weights(values)
    return new_model


# === Transfer learning ===


def replace_head(model, num_classes, *, name=None):
    """The same backbone (shared layers and weights) with a new zero-initialised head.

    `num_classes=None` returns the backbone: the pooled (or pre-logits) features.
    """
    features = model.get_layer("head").input if "head" in [l.name for l in model.layers] else model.output
    outputs = features
    if num_classes:
        outputs = keras.layers.Dense(num_classes, kernel_initializer="zeros", dtype="float32", name="head")(
            features
        )
    return keras.Model(model.inputs, outputs, name=name or model.name)


def freeze_backbone(model, trainable=False):
    """Freezes (or unfreezes) every layer but the head: a linear probe.

    Recompile the model after calling this for the change to take effect.
    """
    for layer in model.layers:
        if layer.name != "head":
            layer.trainable = trainable
    return model
