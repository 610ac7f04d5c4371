"""The original ViT checkpoints' key layouts: any of them to one canonical naming, and that naming to and from
a model's weights.

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

timm's state dicts are converted to these names by `keras_vit.checkpoints.timm`.

The conversion is pure functions on dicts of NumPy arrays: `canonicalize` (any layout to the vit_jax names),
`convert_checkpoint` (those names to a model's weights, resampling the position embeddings with
`keras_vit.checkpoints.resample`) and `to_checkpoint` (back); `keras_vit.checkpoints.model_io` adds the files
and the model around them.
"""

import difflib
import re

import numpy as np

from keras_vit.checkpoints.base import BLOCK_ATTENTION, MAP_ATTENTION, POSEMB, CheckpointError, check_array, square_side
from keras_vit.checkpoints.resample import resample_position_embeddings

# === Key names ===

_TOP_LEVEL = {
    "embedding/kernel": "patch_encoder/kernel",
    "embedding/bias": "patch_encoder/bias",
    "cls": "patch_encoder/class_token",
    # Names no original checkpoint has: register tokens (timm's reg_token) and LayerScale (the blocks' below).
    "reg": "patch_encoder/register_tokens",
    "dist": "patch_encoder/distillation_token",
    "embedding_norm/scale": "patch_encoder/norm/gamma",  # timm's patch_embed.norm (build_vit patch_norm)
    "embedding_norm/bias": "patch_encoder/norm/beta",
    "head_dist/kernel": "head_distillation/kernel",
    "head_dist/bias": "head_distillation/bias",
    POSEMB: "patch_encoder/position_embedding",
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
    f"{MAP_ATTENTION}/out/bias": "pooling/output_bias",
    "MAPHead_0/LayerNorm_0/scale": "pooling/norm/gamma",
    "MAPHead_0/LayerNorm_0/bias": "pooling/norm/beta",
    "MAPHead_0/MlpBlock_0/Dense_0/kernel": "pooling/mlp_dense_1/kernel",
    "MAPHead_0/MlpBlock_0/Dense_0/bias": "pooling/mlp_dense_1/bias",
    "MAPHead_0/MlpBlock_0/Dense_1/kernel": "pooling/mlp_dense_2/kernel",
    "MAPHead_0/MlpBlock_0/Dense_1/bias": "pooling/mlp_dense_2/bias",
}
_BLOCK = {
    "LayerNorm_0/scale": "attention_norm/gamma",
    "LayerNorm_0/bias": "attention_norm/beta",
    "LayerNorm_2/scale": "mlp_norm/gamma",
    "LayerNorm_2/bias": "mlp_norm/beta",
    "MlpBlock_3/Dense_0/kernel": "mlp_dense_1/kernel",
    "MlpBlock_3/Dense_0/bias": "mlp_dense_1/bias",
    "MlpBlock_3/Dense_1/kernel": "mlp_dense_2/kernel",
    "MlpBlock_3/Dense_1/bias": "mlp_dense_2/bias",
    f"{BLOCK_ATTENTION}/out/bias": "attention/output_bias",
    "LayerScale_0/scale": "attention_scale",
    "LayerScale_1/scale": "mlp_scale",
    # A gated MLP's gate (build_vit mlp="swiglu"), beside Dense_0, the gated values.
    "MlpBlock_3/Gate_0/kernel": "mlp_gate/kernel",
    "MlpBlock_3/Gate_0/bias": "mlp_gate/bias",
    # BEiT-3's sub-LN (build_vit sub_norms): the attention's output and the MLP's hidden units normed.
    f"{BLOCK_ATTENTION}/SubNorm/scale": "attention/norm/gamma",
    f"{BLOCK_ATTENTION}/SubNorm/bias": "attention/norm/beta",
    "MlpBlock_3/SubNorm/scale": "mlp_sub_norm/gamma",
    "MlpBlock_3/SubNorm/bias": "mlp_sub_norm/beta",
}
# A parallel block's branch j >= 1 (build_vit parallel): its weights `encoderblock_{i}/branch{j}_<path>` are the
# keys of a block of its own, `Transformer/encoderblock_{i}_{j}/`, under the same names.
_BRANCH = re.compile(r"^encoderblock_(\d+)/branch(\d+)_(.+)$")
_QKV = ("query", "key", "value")
# The attention layers' fused projections (`<name>_kernel`, `<name>_bias`) -> the checkpoint's
# projections they stack, in order on the axis before the last.
_PROJECTIONS = {"qkv": _QKV, "query": ("query",), "key_value": ("key", "value")}
_ATTENTION_WEIGHT = re.compile(r"^(?:(qkv|query|key_value)_(kernel|bias)|output_kernel)$")
# big_vision numbers the sublayers of a block differently.
_BIG_VISION_BLOCK = {
    "MultiHeadDotProductAttention_0/": f"{BLOCK_ATTENTION}/",
    "LayerNorm_1/": "LayerNorm_2/",
    "MlpBlock_0/": "MlpBlock_3/",
}
_RESNET_KEY = re.compile(r"^(conv_root|gn_root|block\d+/unit\d+/(conv|gn)(\d|_proj))/(kernel|scale|bias)$")
_NORM_PARAM = {"scale": "gamma", "bias": "beta"}
# The same tables read from our side: model weight path -> checkpoint key.
_TOP_LEVEL_BY_PATH = {ours: theirs for theirs, ours in _TOP_LEVEL.items()}
_BLOCK_BY_PATH = {ours: theirs for theirs, ours in _BLOCK.items()}
_NORM_PARAM_BY_PATH = {ours: theirs for theirs, ours in _NORM_PARAM.items()}
# An RMSNorm (build_vit norm="rms") keeps its scale as `scale`, not `gamma`, and has no bias: the same key.
for _table in (_TOP_LEVEL_BY_PATH, _BLOCK_BY_PATH):
    _table.update({ours[: -len("gamma")] + "scale": theirs for ours, theirs in list(_table.items())
                   if ours.endswith("/gamma")})  # fmt: skip


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
            params[POSEMB] = posemb
    return params


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
    branch = _BRANCH.match(path)
    if branch:
        inner = _attention_source(f"encoderblock_{branch.group(1)}/{branch.group(3)}")
        if inner is None:
            return None
        block, own = f"encoderblock_{branch.group(1)}", f"encoderblock_{branch.group(1)}_{branch.group(2)}"
        return inner[0].replace(block + "/", own + "/"), inner[1]
    block = re.match(r"^encoderblock_(\d+)/attention/(\w+)$", path)
    pooling = re.match(r"^pooling/(\w+)$", path)
    if block and _ATTENTION_WEIGHT.match(block.group(2)):
        return f"Transformer/encoderblock_{block.group(1)}/{BLOCK_ATTENTION}", block.group(2)
    if pooling and _ATTENTION_WEIGHT.match(pooling.group(1)):
        return MAP_ATTENTION, pooling.group(1)
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


def _block_key(path):
    """(checkpoint key within the block, the block's prefix) of a block's weight `path`, a branch's too; the key
    None where there is none."""
    branch = _BRANCH.match(path)
    if branch:
        return _BLOCK_BY_PATH.get(branch.group(3)), f"Transformer/encoderblock_{branch.group(1)}_{branch.group(2)}/"
    block = re.match(r"^encoderblock_(\d+)/(.+)$", path)
    return _BLOCK_BY_PATH.get(block.group(2)), f"Transformer/encoderblock_{block.group(1)}/"


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


_IN_BLOCK = r"Transformer/encoderblock_\d+/"
# Parts of a model that build_vit options add or remove: (checkpoint keys, model weight paths (each a regular
# expression matched at the start), the part, the option that builds it, the option that builds without it).
_OPTIONAL_PARTS = (
    (re.escape(POSEMB), "patch_encoder/position_embedding", "learned position embeddings",
     "position_embedding='learned'",
     "position_embedding='sincos2d' (a checkpoint without them was trained with fixed 2-D sin-cos ones)"),
    ("MAPHead_0/", "pooling/", "a MAP head", "classifier='map'", "classifier='token' or 'gap'"),
    ("pre_norm/", "pre_norm/", "a LayerNorm before the blocks (timm's norm_pre)", "pre_norm=True", "pre_norm=False"),
    ("Transformer/encoder_norm/", "encoder_norm/", "a LayerNorm on the tokens before the pooling",
     "pooled_norm=False", "pooled_norm=True"),
    ("pooled_norm/", "pooled_norm/", "a LayerNorm after the pooling (timm's fc_norm)", "pooled_norm=True",
     "pooled_norm=False"),
    ("dist$", "patch_encoder/distillation_token", "DeiT's distillation token", "distillation='token' or 'head'",
     "distillation=None"),
    ("reg$", "patch_encoder/register_tokens", "register tokens", "num_registers=N (N: the file's count)",
     "num_registers=0"),
    (_IN_BLOCK + "LayerScale_", r"encoderblock_\d+/(attention|mlp)_scale", "layer scale (LayerScale)",
     "layer_scale=1e-5 (the initial value; the file's scales are loaded)", "layer_scale=None"),
    (_IN_BLOCK + BLOCK_ATTENTION + "/(query|key|value)/bias", r"encoderblock_\d+/attention/qkv_bias",
     "query, key and value biases", "qkv_bias=True", "qkv_bias=False"),
    (_IN_BLOCK + "LayerNorm_0/bias", r"encoderblock_\d+/attention_norm/beta",
     "LayerNorm biases (LayerNorms, not RMSNorms)", "norm='layer'", "norm='rms'"),
    ("embedding_norm/", "patch_encoder/norm/", "a norm of the patch embeddings", "patch_norm=True",
     "patch_norm=False"),
    (_IN_BLOCK + "MlpBlock_3/Gate_0/", r"encoderblock_\d+/mlp_gate/", "a gated (SwiGLU) MLP", "mlp='swiglu'",
     "mlp='plain'"),
    (_IN_BLOCK + BLOCK_ATTENTION + "/SubNorm/", r"encoderblock_\d+/attention/norm/",
     "norms inside the attention and the MLP (sub-LN)", "sub_norms=True", "sub_norms=False"),
    (r"Transformer/encoderblock_\d+_\d+/", r"encoderblock_\d+/branch\d+_", "parallel blocks", "parallel=N (N: the "
     "file's branches per block)", "parallel=1"),
)


def _check_options(params, target_shapes, key_name):
    """A CheckpointError naming the build_vit option where the checkpoint has a part the model lacks,
    or lacks one the model has."""
    for file_keys, model_paths, part, with_it, without_it in _OPTIONAL_PARTS:
        in_file = [key_name(k) for k in params if re.match(file_keys, k)]
        in_model = [p for p in target_shapes if re.match(model_paths, p)]
        if in_file and not in_model:
            raise CheckpointError(
                f"The checkpoint has {part}: {sorted(set(in_file))[:3]}, which the model lacks. Build it "
                f"with {with_it}."
            )
        if in_model and not in_file:
            raise CheckpointError(
                f"The checkpoint has no key {_expected_key(in_model[0], key_name)!r}: the model has {part}, the "
                f"checkpoint has none. Build it with {without_it}."
            )


def _expected_key(path, key_name):
    """The checkpoint key (as the file names it) of the model weight `path`, for messages."""
    attention = _attention_source(path)
    if attention:  # The first projection's: `qkv_bias` -> `.../query/bias`.
        prefix, weight = attention
        if weight == "output_kernel":
            return key_name(f"{prefix}/out/kernel")
        projection, kind = weight.rsplit("_", 1)
        return key_name(f"{prefix}/{_PROJECTIONS[projection][0]}/{kind}")
    if re.match(r"^encoderblock_\d+/", path):
        key, prefix = _block_key(path)
        return key_name(prefix + key) if key is not None else path
    return key_name(_TOP_LEVEL_BY_PATH.get(path, path))


def _check_head_count(key, value, num_heads, key_name):
    """A CheckpointError when the attention kernel `key` ((D, heads, head_dim), or (heads, head_dim, D) for
    `out`) has another head count than the model's `num_heads` (None: not checked)."""
    attention_kernel = re.search(rf"(?:{BLOCK_ATTENTION}|{MAP_ATTENTION})/(query|key|value|out)/kernel$", key)
    if num_heads and attention_kernel and value.ndim == 3:
        # The one place a file says its head count, which a model of the same width and another count would
        # otherwise take silently.
        heads = value.shape[0] if attention_kernel.group(1) == "out" else value.shape[1]
        if heads != num_heads:
            raise CheckpointError(
                f"The checkpoint's {key_name(key)!r} has shape {value.shape}: {heads} attention heads; the model "
                f"has {num_heads}. Build it with num_heads={heads}."
            )


def _resnet_key(path, params, key_name):
    """The checkpoint key of the ResNet stem's weight `path` (`resnet/block1_unit2/gn1/gamma`)."""
    key = next((k for k in params if _resnet_path(k) == path), None)
    if key is None:
        wanted = path[len("resnet/") :].replace("_unit", "/unit")
        wanted = re.sub(r"/(gn[^/]*)/gamma$", r"/\1/scale", wanted)
        wanted = re.sub(r"/(gn[^/]*)/beta$", r"/\1/bias", wanted)
        raise _missing(wanted, params, key_name)
    return key


def _fit_position_embeddings(value, grid_size, prefix, drop_class_row, width, interpolation, name):
    """(position embeddings for the model, a note or None): the checkpoint's `value` without its class-token
    row when `drop_class_row`, its patch rows (after `prefix` rows: the class and distillation tokens')
    resampled to `grid_size` when their number differs and the model's `width` agrees (a width that does not
    is the caller's shape mismatch)."""
    if drop_class_row:
        value = value[:, 1:]
    patches = value.shape[1] - prefix
    if patches == grid_size[0] * grid_size[1] or value.shape[-1] != width:
        return value, None
    if square_side(patches) is None:
        raise CheckpointError(
            f"The checkpoint's {name!r} has {patches} patch rows, not a square grid, and the model's grid is "
            f"{grid_size[0]}x{grid_size[1]}: build the model at the checkpoint's own image size, or resample them "
            "with keras_vit.resample_position_embeddings(..., old_grid=...) first."
        )
    note = f"Position embeddings resampled from {patches} to {grid_size[0]}x{grid_size[1]} patches ({interpolation})."
    return resample_position_embeddings(value, grid_size, interpolation, num_prefix_tokens=prefix), note


def _head_mismatch(path, theirs, value_shape, shape, skip_mismatched_head):
    """The note that the model's head `path` is left as initialised, its shape not the checkpoint's; a
    CheckpointError instead unless `skip_mismatched_head`."""
    if not skip_mismatched_head:
        raise CheckpointError(
            f"The checkpoint's {theirs!r} has shape {value_shape}, the model's head "
            f"{path!r} has shape {shape}; pass skip_mismatched_head=True to keep the "
            "model's head for a new task."
        )
    return (
        f"Head not loaded: checkpoint {theirs} {value_shape} vs model {shape}; "
        "the model's head is left as initialised for the new task."
    )


def _unused_notes(params, used, key_name):
    """Notes on the checkpoint's keys the model did not take (a head or pre-logits, dropped); a
    CheckpointError when any other key is left over."""
    unused = sorted(set(params) - used)
    dropped = [k for k in unused if k.startswith(("pre_logits/", "head/", "head_dist/"))]
    unexpected = [k for k in unused if k not in dropped]
    if unexpected:
        raise CheckpointError(
            f"The checkpoint has {len(unexpected)} key(s) the model has no place for, e.g. "
            f"{list(dict.fromkeys(map(key_name, unexpected)))[:5]}; is it another variant (depth, hybrid, classifier)?"
        )
    return [f"Not in the model, dropped: {dropped}."] if dropped else []


class _CheckedReader:
    """Reads a canonical checkpoint's arrays by key, each checked (floating-point, finite, head count) and
    recorded in `used`."""

    def __init__(self, params, key_name, num_heads):
        self.params, self.key_name, self.num_heads = params, key_name, num_heads
        self.used = set()

    def __call__(self, key):
        if key not in self.params:
            raise _missing(key, self.params, self.key_name)
        self.used.add(key)
        value = check_array(self.params[key], self.key_name(key))
        _check_head_count(key, value, self.num_heads, self.key_name)
        return value

    def weight(self, path):
        """The checkpoint's array for the model weight `path`: the ResNet stem's, an attention's fused
        projections, a block's or a top-level one."""
        block = re.match(r"^encoderblock_(\d+)/(.+)$", path)
        attention = _attention_source(path)
        if path.startswith("resnet/"):
            return self(_resnet_key(path, self.params, self.key_name))
        if attention:
            return _read_attention(self, *attention)
        if block:
            theirs, prefix = _block_key(path)
        else:
            theirs, prefix = _TOP_LEVEL_BY_PATH.get(path), ""
        if theirs is None:
            raise CheckpointError(f"No checkpoint key is known for the model weight {path!r}.")
        return self(prefix + theirs)


def convert_checkpoint(
    params, target_shapes, grid_size, *, interpolation="bicubic", skip_mismatched_head=True, key_name=str,
    num_heads=None,
):
    """Maps a canonical checkpoint onto a model's weights.

    Args:
        params: the output of `canonicalize`.
        target_shapes: the model's weights, {path: shape} (e.g.
            "encoderblock_0/attention/qkv_kernel": (D, 3, D)).
        grid_size: the model's patch grid, for resampling the position embeddings.
        interpolation, skip_mismatched_head: as for `load_pretrained`.
        key_name: the name of a canonical key in the file, for messages
            (e.g. `keras_vit.checkpoints.timm.timm_key`).
        num_heads: the model's attention heads, checked against the
            (D, heads, head_dim) attention kernels of the original layout.

    Returns:
        (weights, notes): {path: array} for every weight to set, and messages
        about what was resampled, dropped or left as initialised.

    Raises:
        CheckpointError naming the key for a missing key, a shape mismatch, a
        key the model has no place for, an array that is not floating-point
        or not finite, or another head count.
    """
    _check_options(params, target_shapes, key_name)
    read = _CheckedReader(params, key_name, num_heads)
    weights, notes = {}, []
    has_class_token = "patch_encoder/class_token" in target_shapes
    drop_class_row = "cls" in params and not has_class_token
    prefix = int(has_class_token) + int("patch_encoder/distillation_token" in target_shapes)
    for path, shape in target_shapes.items():
        shape = tuple(shape)
        theirs = _TOP_LEVEL_BY_PATH.get(path)
        is_head = path.startswith(("head/", "head_distillation/")) and theirs is not None
        if is_head and theirs not in params:
            notes.append(f"The checkpoint has no head: {path} left as initialised.")
            continue
        value = read.weight(path)
        if path == "patch_encoder/position_embedding":
            value, note = _fit_position_embeddings(
                value, grid_size, prefix, drop_class_row, shape[-1], interpolation, key_name(theirs)
            )
            notes += [note] if note else []
        if is_head and value.shape != shape:
            notes.append(_head_mismatch(path, theirs, value.shape, shape, skip_mismatched_head))
            continue
        if value.shape != shape:
            raise CheckpointError(
                f"Shape mismatch for {path!r}: the checkpoint gives {value.shape}, the model expects {shape}."
            )
        weights[path] = value
    if drop_class_row:
        read.used.add("cls")
        notes.append(
            "The checkpoint's class token (and its position) dropped: the model has none (classifier 'gap' or 'map')."
        )
    return weights, notes + _unused_notes(params, read.used, key_name)


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
            key, prefix = _block_key(path)
            params[prefix + key] = value
        else:
            params[_TOP_LEVEL_BY_PATH[path]] = value
    return params
