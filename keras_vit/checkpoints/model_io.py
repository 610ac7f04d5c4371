"""A model from `build_vit` read from and written to checkpoint files: `load_pretrained`, `save_npz`,
`save_timm`, `save_transformers`.

The top of `keras_vit.checkpoints`: it reads a file (`formats`), converts its layout (`transformers`, then
`timm`, then `google`, which resamples the position embeddings) and only then touches the model, so a load
either completes or changes nothing.
"""

import json
import logging
import os

import keras
import numpy as np

from keras_vit.checkpoints import timm, transformers
from keras_vit.checkpoints.base import check_interpolation
from keras_vit.checkpoints.formats import read_checkpoint, write_npz, write_safetensors
from keras_vit.checkpoints.google import canonicalize, convert_checkpoint, to_checkpoint
from keras_vit.files import write_text_atomically
from keras_vit.layers import PatchEncoder, TransformerBlock

log = logging.getLogger("keras_vit")


def _encoder(model):
    encoders = [layer for layer in model.layers if isinstance(layer, PatchEncoder)]
    if len(encoders) != 1:
        raise ValueError(f"Expected a model from build_vit with one PatchEncoder; {model.name!r} has {len(encoders)}.")
    return encoders[0]


def _variables(model):
    """The model's weights by path (random-generator states are not weights)."""
    return {v.path: v for v in model.weights if "seed_generator" not in v.path}


def _num_heads(model):
    """The attention heads of a model from `build_vit` (1 for one without blocks)."""
    heads = {layer.num_heads for layer in model.layers if isinstance(layer, TransformerBlock)}
    return heads.pop() if heads else 1


def checkpoint_bytes_limit(model):
    """The most bytes a checkpoint for `model` may hold or declare: its weights twice over in float64 (room
    for a larger head or position-embedding grid than the model's, in any float type), plus 1 MiB of headers
    and extra keys. What is larger is refused before it is read or decompressed (a zip bomb)."""
    return 16 * sum(int(np.prod(v.shape)) for v in _variables(model).values()) + 2**20


def load_pretrained(model, path, *, interpolation=None, skip_mismatched_head=True):
    """Loads a ViT checkpoint into a model from `build_vit`: an original one (.npz,
    local or gs://), timm's or transformers' (a `model.safetensors` from the
    Hugging Face hub, or its state dict in an .npz).

    All of the checkpoint is read, converted and checked against the model
    before any weight is assigned: every array floating-point and finite,
    of the model's shape and (where the file stores it) head count, and
    nothing read or decompressed past `checkpoint_bytes_limit(model)`; on any
    error (a `CheckpointError` naming the key, what was expected and what was
    found) the model is unchanged.

    Args:
        model: a model from `build_vit` (any resolution, classifier, head).
        path: the .npz or .safetensors file (told apart by their contents).
        interpolation: how position embeddings are resampled when the patch
            grid differs, see `resample_position_embeddings`; by default as
            the file's own code does: "bicubic_antialias" (timm's) for timm
            files, "bicubic" for others (transformers' too).
        skip_mismatched_head: a head of another shape (another number of
            classes) is left as initialised (zeros) instead of raising.

    Returns:
        The notes of the conversion (also logged): resampling, dropped keys,
        skipped head.
    """
    if interpolation is not None:
        check_interpolation(interpolation)
    params = read_checkpoint(path, max_bytes=checkpoint_bytes_limit(model))
    return load_params(
        model, params, interpolation=interpolation, skip_mismatched_head=skip_mismatched_head, label=path
    )


def to_original_layout(params, num_heads, grid_size=None):
    """A checkpoint's arrays in any layout `load_pretrained` reads -> the original checkpoints' names.

    Returns (params, notes, key_name, interpolation): `key_name` maps an
    original key back to the file's own (for messages), `interpolation` is
    how the file's own code resamples its position embeddings.
    """
    if transformers.is_transformers(params):
        params, notes = transformers.from_transformers(params)
        params, timm_notes = timm.from_timm(params, num_heads, grid_size)
        return params, notes + timm_notes, transformers.transformers_key, "bicubic"
    if timm.MARKER in params:
        params, notes = timm.from_timm(params, num_heads, grid_size)
        return params, notes, timm.timm_key, "bicubic_antialias"
    return canonicalize(params), [], str, "bicubic"


def load_params(model, params, *, interpolation=None, skip_mismatched_head=True, label="checkpoint"):
    """`load_pretrained` of arrays already read (a dict in any layout it reads); `label` names them in notes."""
    if interpolation is not None:
        check_interpolation(interpolation)
    grid_size = _encoder(model).grid_size
    params, notes, key_name, default_interpolation = to_original_layout(params, _num_heads(model), grid_size)
    variables = _variables(model)
    weights, conversion_notes = convert_checkpoint(
        params,
        {p: tuple(v.shape) for p, v in variables.items()},
        grid_size,
        interpolation=interpolation or default_interpolation,
        skip_mismatched_head=skip_mismatched_head,
        key_name=key_name,
        num_heads=_num_heads(model),
    )
    for path_, value in weights.items():
        variables[path_].assign(value.astype(variables[path_].dtype))
    notes += conversion_notes
    for note in notes:
        log.warning("load_pretrained(%s): %s", label, note)
    return notes


def model_checkpoint(model):
    """A model's weights in the original checkpoints' names and layouts (what `save_npz` writes)."""
    weights = {p: keras.ops.convert_to_numpy(v) for p, v in _variables(model).items()}
    return to_checkpoint(weights, _num_heads(model))


def save_npz(model, path):
    """Writes a model from `build_vit` as an original (vit_jax) .npz checkpoint."""
    write_npz(model_checkpoint(model), path)


def save_timm(model, path):
    """Writes a model from `build_vit` as a timm ViT state dict: `.safetensors` (or `.npz` by the suffix).

    timm's `VisionTransformer` with the same architecture loads the file
    (`load_state_dict`); `load_pretrained` reads it back exactly. Fixed
    sin-cos position embeddings are no weight and are not written.
    """
    state_dict = timm.to_timm(model_checkpoint(model))
    if str(path).endswith(".npz"):
        write_npz(state_dict, path)
    else:
        write_safetensors(state_dict, path)


def save_transformers(model, folder, *, class_names=None):
    """Writes a model from `build_vit` as transformers' `ViTForImageClassification`: `folder/model.safetensors`
    and `folder/config.json`, what `ViTForImageClassification.from_pretrained(folder)` reads.

    The config says the architecture (widths, depth, heads, image and patch
    size, the GELU, LayerNorm's epsilon) and, with `class_names`, the labels
    (`id2label`, `label2id`).  transformers' ViT has a class token, learned
    position embeddings, a linear classifier on the class token and no
    extra LayerNorm: a model built otherwise is refused with the option to
    change.  `load_pretrained` reads the file back exactly.
    """
    encoder = _encoder(model)
    blocks = [layer for layer in model.layers if isinstance(layer, TransformerBlock)]
    params = model_checkpoint(model)
    options = {
        "classifier='token'": encoder.use_class_token and getattr(model.get_layer("pooling"), "method", "") == "token",
        "num_classes (a head)": "head/kernel" in params,
        "position_embedding='learned'": encoder.position_embedding_type == "learned",
        "representation_size=None": not any(layer.name == "pre_logits" for layer in model.layers),
        "pre_norm=False and pooled_norm=False": not any(
            layer.name in ("pre_norm", "pooled_norm") for layer in model.layers
        ),
        "square patches": encoder.patch_size[0] == encoder.patch_size[1],
        # Parts transformers' ViT layout has no place for (DINOv2's and DeiT's layouts are read, not written).
        "layer_scale=None, num_registers=0 and distillation=None": not (
            blocks and blocks[0].layer_scale is not None) and encoder.num_prefix_tokens == 1,
        "norm='layer', mlp='plain', sub_norms=False, parallel=1 and patch_norm=False": not blocks or (
            blocks[0].norm == "layer" and blocks[0].mlp == "plain" and not blocks[0].sub_norms
            and blocks[0].parallel == 1 and encoder.patch_norm is None),
    }
    missing = [option for option, ok in options.items() if not ok]
    if missing or not blocks:
        raise ValueError(
            f"transformers' ViTForImageClassification cannot hold this model: build it with {', '.join(missing)}"
            + ("" if blocks else " and at least one block") + "."
        )
    state_dict = transformers.to_transformers(timm.to_timm(params))
    num_classes = params["head/kernel"].shape[1]
    if class_names is not None and len(class_names) != num_classes:
        raise ValueError(f"`class_names` has {len(class_names)} names, the model has {num_classes} classes.")
    # transformers' own default names when none are given.
    labels = [str(name) for name in class_names] if class_names else [f"LABEL_{i}" for i in range(num_classes)]
    height, width = (g * p for g, p in zip(encoder.grid_size, encoder.patch_size))
    config = {
        "architectures": ["ViTForImageClassification"],
        "model_type": "vit",
        "hidden_size": int(params["embedding/kernel"].shape[-1]),
        "num_hidden_layers": len(blocks),
        "num_attention_heads": blocks[0].num_heads,
        "intermediate_size": blocks[0].mlp_dim,
        "hidden_act": {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "quick_gelu": "quick_gelu", "silu": "silu"}[
            blocks[0].activation],
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "initializer_range": 0.02,
        "layer_norm_eps": blocks[0].layer_norm_epsilon,
        "image_size": height if height == width else [height, width],
        "patch_size": encoder.patch_size[0],
        "num_channels": int(params["embedding/kernel"].shape[2]),
        "qkv_bias": blocks[0].qkv_bias,
        "encoder_stride": encoder.patch_size[0],
        "id2label": {str(i): name for i, name in enumerate(labels)},
        "label2id": {name: i for i, name in enumerate(labels)},
    }
    folder = os.fspath(folder)
    import tensorflow as tf

    tf.io.gfile.makedirs(folder)
    write_safetensors(state_dict, tf.io.gfile.join(folder, "model.safetensors"))
    write_text_atomically(tf.io.gfile.join(folder, "config.json"), json.dumps(config, indent=2) + "\n")
    return folder
