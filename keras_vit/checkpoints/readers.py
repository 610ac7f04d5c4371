"""Readers of the pretrained layouts: each returns (spec, arrays), the `keras_vit.ViTSpec` that the files
describe and the arrays to load into a model built from it.

- `read_timm(weights, config, preprocessor, label)`: timm's `config.json` and state dict;
- `read_transformers(...)`: transformers' `config.json`, `preprocessor_config.json` and state dict;
- `read_original(...)`: an original `.npz` (or a lone `.safetensors` in any layout `load_pretrained` reads).

Widths, depth, MLP width, patch size, channels, class token, MAP head, `norm_pre`, `fc_norm`, the
representation layer and the head come from the arrays (`architecture`); what the arrays cannot say (the number
of attention heads of a timm file, the GELU, LayerNorm's epsilon, the image size of a non-square grid, the
preprocessing, the class names) from the configs.  The spec is at the files' own image size unless
`image_size` asks for another, with the preprocessing the files' library would use at that size.
"""

import logging
import re

import numpy as np

from keras_vit.checkpoints import model_io, timm, transformers
from keras_vit.checkpoints.base import BLOCK_ATTENTION, POSEMB, CheckpointError, PretrainedError, square_side
from keras_vit.checkpoints.formats import SHARD_INDEX_SUFFIX, read_checkpoint
from keras_vit.checkpoints.timm_architectures import FEATURES as TIMM_FEATURES
from keras_vit.checkpoints.timm_architectures import TIMM_ARCHITECTURES
from keras_vit.layers.core import MLP_ACTIVATIONS
from keras_vit.preprocessing import PILLOW_FILTERS, RESIZE_METHODS, Preprocessing
from keras_vit.spec import ViTSpec
from keras_vit.variants import HYBRIDS, MODEL_SIZES, to_pair

log = logging.getLogger("keras_vit")

# transformers' `hidden_act` and timm's `act_layer` values this model computes, to its `activation`.
TRANSFORMERS_ACTIVATIONS = {
    "gelu": "gelu", "gelu_python": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh", "quick_gelu": "quick_gelu", "silu": "silu", "swish": "silu",
}
TIMM_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                    "quick_gelu": "quick_gelu", "silu": "silu", "swish": "silu"}  # fmt: skip
# The parts of a row of `TIMM_ARCHITECTURES` (its `FEATURES`) that this library builds: the spec's
# `layer_scale`, `num_registers`, `qkv_bias`, `distillation`, `mlp`, `norm`, `patch_norm`, `sub_norms`, `parallel`
# and `class_token`, each read from the arrays (the last with the config's global pool).
TIMM_FEATURES_BUILT = frozenset({"layer_scale", "registers", "no_qkv_bias", "distillation", "swiglu", "rms_norm",
                                 "patch_norm", "unpooled_class_token", "norms_inside", "parallel_blocks"})


def timm_refusals(row):
    """What this library does not build of a `TIMM_ARCHITECTURES` row, in words (empty: it opens)."""
    _, activation, _, _, features = row
    refused = [TIMM_FEATURES[f] for f in features if f not in TIMM_FEATURES_BUILT]
    if activation not in MLP_ACTIVATIONS and "swiglu" not in features:  # A gated MLP's is SiLU, by its definition.
        refused.append(f"the {activation} activation")
    return refused


# === The readers ===


def read_timm(weights_path, config, preprocessor, label, *, num_heads=None, image_size=None):
    """(spec, arrays) of a timm folder: `config.json` (read as `config`) and its state dict at `weights_path`."""
    heads, options, preprocessing, names, pool, dynamic = _timm_options(config, label)
    model_args = config.get("model_args") or {}
    stated = {"hidden_dim": "embed_dim", "num_layers": "depth", "patch_size": "patch_size", "num_channels": "in_chans",
              "image_size": "img_size", "num_heads": "num_heads"}  # fmt: skip
    stated = {field: (f"model_args.{key}", model_args[key]) for field, key in stated.items() if key in model_args}
    if "num_classes" in config:
        stated["num_classes"] = ("num_classes", config["num_classes"])
    return _read(weights_path, label, num_heads or heads, options, preprocessing, names, pool, dynamic, image_size,
                 architecture_name=config.get("architecture"), stated=stated)  # fmt: skip


def read_transformers(weights_path, config, preprocessor, label, *, num_heads=None, image_size=None):
    """(spec, arrays) of a transformers ViT folder: `config.json`, `preprocessor_config.json` (or None) and the
    state dict at `weights_path`."""
    heads, options, preprocessing, names = _transformers_options(config, preprocessor, label)
    stated = {"hidden_dim": "hidden_size", "num_layers": "num_hidden_layers", "mlp_dim": "intermediate_size",
              "patch_size": "patch_size", "num_channels": "num_channels", "image_size": "image_size",
              "num_heads": "num_attention_heads"}  # fmt: skip
    stated = {field: (key, config[key]) for field, key in stated.items() if key in config}
    if "num_register_tokens" in config:
        stated["num_registers"] = ("num_register_tokens", config["num_register_tokens"])
    return _read(weights_path, label, num_heads or heads, options, preprocessing, names, None, False, image_size,
                 stated=stated)  # fmt: skip


def read_original(weights_path, config, preprocessor, label, *, num_heads=None, image_size=None):
    """(spec, arrays) of a file without a config: an original `.npz` (tanh GELU, as they were trained; pixels
    squashed to the model's size), or a lone `.safetensors` (`num_heads` needed for timm's layout)."""
    return _read(weights_path, label, num_heads, {"activation": "gelu_tanh"}, None, None, None, False, image_size)


READERS = {"timm": read_timm, "transformers": read_transformers, "file": read_original}


def _read(weights_path, label, heads, options, preprocessing, names, pool, dynamic, image_size,
          architecture_name=None, stated=None):  # fmt: skip
    """What the readers share: the arrays read and checked against the config, and the spec they make.
    `stated`: {build argument: (config.json field, its value)}, each checked against the arrays."""
    raw, params = _read_weights(weights_path, heads, label, architecture_name, (stated or {}).get("num_heads"))
    arguments = architecture(params)
    if pool == "avg" and arguments["classifier"] == "token":  # A class token beside a mean that leaves it out.
        arguments.update(classifier="gap", class_token=True)
    _check_stated(stated or {}, arguments, params, label)
    _check_pool(pool, arguments["classifier"], label)
    options = dict(options)
    layer_scale = options.pop("layer_scale", None)  # The config's initial value, where the arrays have scales.
    if layer_scale is not None and "layer_scale" in arguments:
        arguments["layer_scale"] = layer_scale
    own_size = options.pop("image_size", None) or _size_from_grid(params, arguments, label)
    size = to_pair(image_size or own_size, "image_size")
    variant = arguments.pop("variant", None) or _variant_name(arguments)
    spec = ViTSpec.from_variant(
        variant,
        image_size=size,
        dynamic_image_size=dynamic,
        pixel_mean=_statistic(preprocessing, "mean"),
        pixel_std=_statistic(preprocessing, "std"),
        preprocessing=_preprocessing(preprocessing, size),
        class_names=names or None,
        **arguments,
        **options,
    )
    return spec, raw


# === The architecture ===


def _block_count(params):
    blocks = {int(m[1]) for key in params if (m := re.match(r"^Transformer/encoderblock_(\d+)/", key))}
    if blocks != set(range(len(blocks))):
        raise CheckpointError(f"The encoder blocks are numbered {sorted(blocks)}; expected 0 .. {len(blocks) - 1}.")
    return len(blocks)


def _require(params, key, what):
    if key not in params:
        raise CheckpointError(f"The checkpoint has no {key!r} ({what}): not a ViT this library builds.")
    return params[key]


def architecture(params):
    """build_vit's keyword arguments read from a checkpoint in the original layout (after `to_original_layout`)."""
    kernel = _require(params, "embedding/kernel", "the patch embedding")
    if kernel.ndim != 4:
        raise CheckpointError(f"'embedding/kernel' has shape {kernel.shape}; expected (patch_h, patch_w, C, D).")
    patch_h, patch_w, channels, hidden = kernel.shape
    depth = _block_count(params)
    if depth == 0:
        raise CheckpointError("The checkpoint has no encoder block ('Transformer/encoderblock_0/...').")
    block = "Transformer/encoderblock_0/"
    query = _require(params, block + BLOCK_ATTENTION + "/query/kernel", "the attention's query")
    mlp = _require(params, block + "MlpBlock_3/Dense_0/kernel", "the MLP")
    arguments = {
        "hidden_dim": int(hidden),
        "num_layers": depth,
        "num_heads": int(query.shape[1]),
        "mlp_dim": int(mlp.shape[1]),
        "patch_size": (int(patch_h), int(patch_w)),
        "num_channels": int(channels),
        "pre_norm": "pre_norm/scale" in params,
        "pooled_norm": "pooled_norm/scale" in params,
        "position_embedding": "learned" if POSEMB in params else "sincos2d",
        "qkv_bias": block + BLOCK_ATTENTION + "/query/bias" in params,
        "norm": "layer" if block + "LayerNorm_0/bias" in params else "rms",
        "patch_norm": "embedding_norm/scale" in params,
        "mlp": "swiglu" if block + "MlpBlock_3/Gate_0/kernel" in params else "plain",
        "sub_norms": block + BLOCK_ATTENTION + "/SubNorm/scale" in params,
        "parallel": 1 + max(_branches(params), default=0),
    }
    if "reg" in params:
        arguments["num_registers"] = int(params["reg"].shape[1])
    if "dist" in params:
        arguments["distillation"] = "head" if "head_dist/kernel" in params else "token"
    if block + "LayerScale_0/scale" in params:
        # The initial value matters for training from scratch only; the file's scales are loaded. timm's and
        # DINOv2's usual value, unless the config says another (`_timm_options`).
        arguments["layer_scale"] = 1e-5
    if "cls" in params:
        head = params.get("head/kernel")
        # DINOv2's linear classifier reads the class token and the patches' mean: twice the width.
        two = head is not None and "pre_logits/kernel" not in params and head.shape[0] == 2 * hidden
        arguments["classifier"] = "token_gap" if two else "token"
    elif any(key.startswith("MAPHead_0/") for key in params):
        arguments["classifier"] = "map"
    else:
        arguments["classifier"] = "gap"
    if "pre_logits/kernel" in params:
        arguments["representation_size"] = int(params["pre_logits/kernel"].shape[1])
    arguments["num_classes"] = int(params["head/kernel"].shape[1]) if "head/kernel" in params else None
    units = {}
    for key in params:
        if m := re.match(r"^block(\d+)/unit(\d+)/", key):
            units[int(m[1])] = max(units.get(int(m[1]), 0), int(m[2]))
    if "conv_root/kernel" in params:
        layers = tuple(units[s] for s in sorted(units))
        # The hybrid with these ResNet stages (the widths and depth are overridden by the arrays' own).
        matches = [name for name, (_, stages, _) in HYBRIDS.items() if stages == layers]
        if not matches:
            raise CheckpointError(f"A hybrid of ResNet stages {layers} is none of {list(HYBRIDS)}.")
        arguments["variant"] = matches[0]
        arguments["num_channels"] = int(params["conv_root/kernel"].shape[2])  # the image's, not the features'
    return arguments


def _branches(params):
    """The branch numbers (1 ..) of the first block's parallel branches (`Transformer/encoderblock_0_{j}/`)."""
    return {int(m[1]) for key in params if (m := re.match(r"^Transformer/encoderblock_0_(\d+)/", key))}


def _variant_name(arguments):
    """The variant to build with the architecture's overrides: the table's name when the sizes are a row of
    it ("B/16", also the model's default name), else "B/16" with every size overridden."""
    if "variant" in arguments:
        return arguments["variant"]
    size = (arguments["hidden_dim"], arguments["num_layers"], arguments["num_heads"], arguments["mlp_dim"])
    names = [name for name, row in MODEL_SIZES.items() if row == size]
    patch = arguments["patch_size"]
    return f"{names[0]}/{patch[0]}" if names and patch[0] == patch[1] else "B/16"



# === Each layout's config ===


def _timm_options(config, path):
    """(num_heads, build options, preprocessing arguments, class names, global pool, dynamic size) from timm's
    config.json and the architecture's row of `TIMM_ARCHITECTURES`."""
    architecture = str(config.get("architecture", ""))
    model_args = config.get("model_args") or {}
    pretrained = config.get("pretrained_cfg") or {}
    row = TIMM_ARCHITECTURES.get(architecture)
    if row is None:
        num_heads, activation, epsilon, dynamic, features = None, "gelu", 1e-6, False, ()
        log.warning(
            "from_pretrained(%s): timm architecture %r is not in keras_vit's table of timm ViTs: read with the "
            "exact GELU and LayerNorm epsilon 1e-6 (timm's VisionTransformer defaults).", path, architecture
        )
    else:
        num_heads, activation, epsilon, dynamic, features = row
    refused = timm_refusals(row) if row is not None else []
    if refused:
        raise PretrainedError(
            f"{path!r}: timm's {architecture!r} has {' and '.join(refused)}, which this library does not build."
        )
    if "swiglu" in (row[4] if row is not None else ()):  # Its SiLU is the gate's: the MLP's activation is unused.
        activation = "gelu"
    act = model_args.get("act_layer")
    if act is not None:
        if act not in TIMM_ACTIVATIONS:
            raise PretrainedError(
                f"{path!r}: model_args act_layer={act!r}; this library computes {sorted(TIMM_ACTIVATIONS)}."
            )
        activation = TIMM_ACTIVATIONS[act]
    num_heads = model_args.get("num_heads", num_heads)
    dynamic = bool(model_args.get("dynamic_img_size", dynamic))
    options = {"activation": activation, "layer_norm_epsilon": epsilon}
    if isinstance(model_args.get("init_values"), (int, float)) and model_args["init_values"] > 0:
        options["layer_scale"] = float(model_args["init_values"])  # Where the arrays have LayerScale weights.
    if model_args.get("img_size") is not None:
        options["image_size"] = to_pair(_pair_or_int(model_args["img_size"]), "img_size")
    elif pretrained.get("input_size"):
        options["image_size"] = tuple(int(v) for v in pretrained["input_size"][1:])
    crop_mode = pretrained.get("crop_mode", "center")
    if crop_mode not in ("center", "squash"):
        raise PretrainedError(f"{path!r}: pretrained_cfg crop_mode={crop_mode!r}; read: 'center', 'squash'.")
    interpolation = pretrained.get("interpolation", "bicubic")
    # Where the config leaves them out, the defaults of timm's `_cfg` in deit.py (ImageNet's statistics, crop
    # 0.875) and vision_transformer.py (0.5 and 0.5, crop 0.9).
    deit = architecture.startswith("deit")
    mean, std = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)) if deit else ((0.5,) * 3, (0.5,) * 3)
    preprocessing = {
        "crop_fraction": float(pretrained.get("crop_pct", 0.875 if deit else 0.9)),
        # timm's "random" (training only) evaluates as bilinear.
        "interpolation": interpolation if interpolation in RESIZE_METHODS else "bilinear",
        "keep_aspect_ratio": crop_mode == "center",
        "mean": tuple(pretrained.get("mean", mean)),
        "std": tuple(pretrained.get("std", std)),
    }
    names = config.get("label_names")
    if isinstance(names, dict):
        names = [names[k] for k in sorted(names, key=int)]
    pool = model_args.get("global_pool", config.get("global_pool", "token"))
    return num_heads, options, preprocessing, names, pool, dynamic


def _pair_or_int(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _transformers_options(config, preprocessor, path):
    """(num_heads, build options, preprocessing arguments, class names) from transformers' configs."""
    act = config.get("hidden_act", "gelu")
    if act not in TRANSFORMERS_ACTIVATIONS:
        raise PretrainedError(
            f"{path!r}: hidden_act={act!r}; this library computes {sorted(TRANSFORMERS_ACTIVATIONS)}."
        )
    dinov2 = str(config.get("model_type")).startswith("dinov2")
    options = {
        "activation": TRANSFORMERS_ACTIVATIONS[act],
        # transformers' defaults: 1e-12 for ViT and DeiT, 1e-6 for DINOv2.
        "layer_norm_epsilon": float(config.get("layer_norm_eps", 1e-6 if dinov2 else 1e-12)),
        "image_size": to_pair(_pair_or_int(config.get("image_size", 224)), "image_size"),
    }
    if isinstance(config.get("layerscale_value"), (int, float)) and config["layerscale_value"] > 0:
        options["layer_scale"] = float(config["layerscale_value"])  # DINOv2's initial value, where it has scales.
    preprocessor = preprocessor or {}
    mean = preprocessor.get("image_mean", (0.5, 0.5, 0.5)) if preprocessor.get("do_normalize", True) else (0.0,) * 3
    std = preprocessor.get("image_std", (0.5, 0.5, 0.5)) if preprocessor.get("do_normalize", True) else (1.0,) * 3
    rescale = float(preprocessor.get("rescale_factor", 1 / 255)) if preprocessor.get("do_rescale", True) else 1.0
    if abs(rescale - 1 / 255) > 1e-9:
        raise PretrainedError(f"{path!r}: the image processor does not scale pixels by 1/255; not read here.")
    resample = preprocessor.get("resample", 2)
    if resample not in PILLOW_FILTERS:
        raise PretrainedError(f"{path!r}: resample={resample!r}; read: {PILLOW_FILTERS} (Pillow's filter codes).")
    size = preprocessor.get("size", {"height": options["image_size"][0], "width": options["image_size"][1]})
    if isinstance(size, int):
        size = {"shortest_edge": size}
    crop = preprocessor.get("crop_size") if preprocessor.get("do_center_crop", False) else None
    if isinstance(crop, int):
        crop = {"height": crop, "width": crop}
    target = (crop["height"], crop["width"]) if crop else None
    if "shortest_edge" in size:
        edge = int(size["shortest_edge"])
        resize, keep = (edge, edge), True
    else:
        resize, keep = (int(size["height"]), int(size["width"])), False
    preprocessing = {
        "image_size": target or resize,
        "resize_size": resize,
        "keep_aspect_ratio": keep,
        "interpolation": PILLOW_FILTERS[resample],
        "crop_offset": "floor",
        "mean": tuple(mean),
        "std": tuple(std),
    }
    labels = config.get("id2label")
    names = [labels[k] for k in sorted(labels, key=int)] if isinstance(labels, dict) and labels else None
    if names and all(re.fullmatch(r"LABEL_\d+", str(n)) for n in names):
        names = None  # transformers' placeholders: no names.
    return config.get("num_attention_heads"), options, preprocessing, names


# === From the configs to the spec ===


def _read_weights(weights_path, heads, label, architecture_name=None, stated_heads=None):
    """(the file's arrays, the same in the original layout): read once, with room for the arrays of any float
    type (an .npz declaring more is refused unread); `heads` splits a timm or transformers file's attention,
    refused first where it does not divide the width (`stated_heads`: (config field, value), for the message)."""
    import tensorflow as tf

    sharded = str(weights_path).endswith(SHARD_INDEX_SUFFIX)  # Its shards are .safetensors: nothing inflates.
    bound = None if sharded else 8 * tf.io.gfile.stat(weights_path).length + 2**20
    raw = read_checkpoint(weights_path, max_bytes=bound)
    torch_layout = timm.MARKER in raw or transformers.is_transformers(raw)
    if torch_layout and heads is None:
        raise PretrainedError(
            f"{label!r}: the number of attention heads is in no config (timm architecture "
            f"{architecture_name!r}); pass num_heads=."
        )
    patches = next((raw[k] for k in raw if k.endswith(timm.MARKER) or k.endswith(transformers.MARKER)), None)
    width = np.shape(patches)[0] if patches is not None and np.ndim(patches) == 4 else None
    if torch_layout and width and (not isinstance(heads, int) or heads < 1 or width % heads):
        # Named as the config says it, unless the caller's num_heads replaced the config's.
        field, value = stated_heads if stated_heads and stated_heads[1] == heads else ("num_heads", heads)
        raise PretrainedError(
            f"{label!r}: config.json says {field}={value!r}, the arrays hold a width of {width}, which "
            "that many heads do not divide (the config contradicts the weights; which one is wrong cannot be told)."
        )
    params, _, _, _ = model_io.to_original_layout(raw, heads or 1)
    if torch_layout and POSEMB not in params:
        raise PretrainedError(f"{label!r} has no position embeddings (timm's 'pos_embed'): not a ViT built here.")
    return raw, params


def _check_stated(stated, arguments, params, label):
    """A PretrainedError naming `config.json`, the field and both values where the config says another width,
    depth, MLP width, patch, channel count, image size (its patch grid against the position embeddings'),
    number of classes, or a head count that does not divide the width, than the arrays hold."""
    def refuse(field, value, found):
        raise PretrainedError(
            f"{label!r}: config.json says {field}={value!r}, the arrays hold {found} (the config contradicts the "
            "weights; which one is wrong cannot be told)."
        )

    for argument, (field, value) in stated.items():
        if argument == "num_heads":  # Checked as the arrays are split (`_read_weights`).
            continue
        if argument == "image_size":
            if arguments["position_embedding"] != "learned" or value is None:
                continue
            try:
                size = to_pair(_pair_or_int(value), field)
            except ValueError:
                refuse(field, value, "a grid of position embeddings")
            patch, stride = arguments["patch_size"], _stride(arguments)
            rows = params[POSEMB].shape[1] - _positioned_prefix(arguments)
            if size[0] % (patch[0] * stride) or size[1] % (patch[1] * stride) or (
                    (size[0] // (patch[0] * stride)) * (size[1] // (patch[1] * stride)) != rows):  # fmt: skip
                refuse(field, value, f"position embeddings for {rows} patches of {patch[0]}x{patch[1]}")
            continue
        found = arguments.get(argument, 0 if argument == "num_registers" else None)
        expected = to_pair(_pair_or_int(value), field) if argument == "patch_size" and value is not None else value
        if argument == "num_classes" and not value:
            expected = None
        if expected != found:
            what = {"hidden_dim": "a width of {}", "num_layers": "{} blocks", "mlp_dim": "an MLP width of {}",
                    "patch_size": "patches of {}", "num_channels": "{} input channels",
                    "num_classes": "a head of {} classes",
                    "num_registers": "{} register tokens"}[argument].format(found)  # fmt: skip
            refuse(field, value, what)


def _check_pool(pool, classifier, label):
    """A PretrainedError when the config's global pool (None: no config) is not the arrays' `classifier`."""
    if pool is None or classifier == "token_gap":
        return
    expected = {"token": "token", "avg": "gap", "map": "map"}.get(pool)
    if expected != classifier:
        raise PretrainedError(
            f"{label!r}: global_pool={pool!r} with the arrays of a classifier={classifier!r} model; "
            "read: 'token' (with a class token), 'avg' (without one), 'map' (a MAP head)."
        )


def _positioned_prefix(arguments):
    """The rows of the position embeddings before the patches': the class token's and the distillation token's."""
    has_class_token = arguments["classifier"] in ("token", "token_gap") or arguments.get("class_token")
    return int(bool(has_class_token)) + int(arguments.get("distillation") is not None)


def _size_from_grid(params, arguments, label):
    """The image size of a checkpoint's square grid of position embeddings (224 for fixed sin-cos ones)."""
    if arguments["position_embedding"] != "learned":
        return (224, 224)
    side = square_side(params[POSEMB].shape[1] - _positioned_prefix(arguments))
    if side is None:
        raise PretrainedError(
            f"{label!r}: the position embeddings ({params[POSEMB].shape[1]} rows) are not a square grid and no "
            "config gives the image size; pass image_size=."
        )
    return tuple(side * p * _stride(arguments) for p in arguments["patch_size"])


def _stride(arguments):
    """Pixels per step of the patch grid's input: a hybrid's ResNet stride, 1 without a stem."""
    if "variant" not in arguments:
        return 1
    from keras_vit.resnet import ResNetStem

    return ResNetStem.stride(HYBRIDS[arguments["variant"]][1])


def _statistic(preprocessing, key):
    """The model's pixel mean or std: None for 0.5 (the [-1, 1] rescaling of the original weights)."""
    if preprocessing is None or np.allclose(preprocessing[key], 0.5):
        return None
    return tuple(float(v) for v in preprocessing[key])


def _preprocessing(arguments, size):
    """The model's `Preprocessing`: the file's, at the model's size where that was changed."""
    if arguments is None:  # The original checkpoints: squashed to the model's size, bilinear.
        return Preprocessing(size, size, keep_aspect_ratio=False, interpolation="bilinear")
    arguments = dict(arguments)
    if "crop_fraction" in arguments:
        return Preprocessing.center_crop(size, arguments.pop("crop_fraction"), **arguments)
    crop, resize = arguments.pop("image_size"), arguments.pop("resize_size")
    return Preprocessing(crop, resize, **arguments).at_size(size)  # Scaled with the model.
