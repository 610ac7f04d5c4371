"""`from_pretrained`: a ready model from pretrained ViT weights by hub id, folder or file.

Three layouts are read, the architecture taken from the files themselves:

- **timm** (`timm/vit_base_patch16_224.augreg2_in21k_ft_in1k`): `config.json` with `architecture`,
  `num_classes`, `global_pool`, `model_args` and `pretrained_cfg` (mean, std, crop_pct, interpolation),
  beside `model.safetensors` (timm's state dict);
- **transformers** (`google/vit-base-patch16-224`): `config.json` with `model_type` "vit", `hidden_size`,
  `num_hidden_layers`, `num_attention_heads`, `intermediate_size`, `image_size`, `patch_size`, `hidden_act`,
  `layer_norm_eps`, `id2label`, beside `model.safetensors` (`ViTForImageClassification`'s or `ViTModel`'s
  state dict) and, where present, `preprocessor_config.json` (the image processor's resize, crop, mean, std);
- **the original checkpoints** (`.npz`, local or gs://, e.g. `gs://vit_models/imagenet21k/ViT-B_16.npz`):
  widths, depth, heads, classifier and grid read from the arrays' shapes.

Widths, depth, MLP width, patch size, channels, class token, MAP head, `norm_pre`, `fc_norm`, the
representation layer and the head are read from the arrays; what the arrays cannot say (the number of
attention heads of a timm file, the GELU, LayerNorm's epsilon, the image size of a non-square grid) from the
config.  The model, a `keras_vit.ViT`, carries what it needs to be used like the weights' own library, in its
spec and so in every `.keras` file it is saved to: `model.preprocessing` (a `keras_vit.Preprocessing`: the
evaluation resize and crop; the model itself applies the mean and std) and `model.class_names` (from
`id2label` or timm's `label_names`; None when the config has none).
"""

import json
import logging
import os
import re

import numpy as np

from keras_vit.checkpoints import model_io, timm, transformers
from keras_vit.checkpoints.base import BLOCK_ATTENTION, POSEMB, CheckpointError, square_side
from keras_vit.checkpoints.formats import read_checkpoint
from keras_vit.checkpoints.timm_architectures import TIMM_ARCHITECTURES
from keras_vit.model import build_vit
from keras_vit.preprocessing import PILLOW_FILTERS, RESIZE_METHODS, Preprocessing
from keras_vit.variants import HYBRIDS, MODEL_SIZES, to_pair

log = logging.getLogger("keras_vit")

LAYOUTS = (
    "timm (config.json with 'architecture' + model.safetensors)",
    "transformers (config.json with model_type 'vit' + model.safetensors)",
    "original (.npz)",
)
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
PREPROCESSOR = "preprocessor_config.json"
# Options of `build_vit` a user may set: the rest is read from the files.
BUILD_OPTIONS = (
    "dropout_rate",
    "attention_dropout_rate",
    "stochastic_depth_rate",
    "patch_projection",
    "head_kernel_initializer",
    "name",
)
# transformers' `hidden_act` values this model computes.
TRANSFORMERS_GELU = {
    "gelu": "exact", "gelu_python": "exact", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"
}
TIMM_GELU = {"gelu": "exact", "gelu_tanh": "tanh", "gelu_pytorch_tanh": "tanh"}


class PretrainedError(ValueError):
    """Pretrained weights that cannot be found or read into a model of this library."""


# === Finding the files ===


def _gfile():
    import tensorflow as tf

    return tf.io.gfile


def _hub_id(name):
    """The Hugging Face hub repository of `name` ("hf-hub:owner/name", "owner/name", or a timm model name
    "vit_base_patch16_224.augreg2_in21k_ft_in1k", which timm publishes under "timm/"), and its revision
    ("owner/name@revision"); None when `name` is not one."""
    name = name[len("hf-hub:"):] if name.startswith("hf-hub:") else name
    name, _, revision = name.partition("@")
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name):
        return name, revision or None
    if re.fullmatch(r"[A-Za-z0-9][\w-]*\.[\w.-]+", name) and not name.endswith((".npz", ".safetensors", ".json")):
        return "timm/" + name, revision or None
    return None


def _download(repo_id, revision, cache_dir):
    """The local folder holding the hub repository's config and weights (from huggingface_hub's cache, or
    downloaded: HF_HUB_OFFLINE=1 reads the cache only)."""
    try:
        import huggingface_hub
    except ImportError as error:  # A dependency; reached only where it was removed.
        raise PretrainedError(f"Loading {repo_id!r} needs huggingface_hub: pip install huggingface_hub") from error
    try:
        return huggingface_hub.snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=[CONFIG, PREPROCESSOR, WEIGHTS]
        )
    except Exception as error:  # Offline, missing, private, gated: all mean the same here.
        raise PretrainedError(
            f"Could not get {repo_id!r} from the Hugging Face hub or its local cache, and no file or folder here has "
            f"that name ({type(error).__name__}: {error}). Layouts read: {'; '.join(LAYOUTS)}."
        ) from error


def _read_json(path):
    with _gfile().GFile(path, "rb") as f:
        text = f.read()
    try:
        value = json.loads(text)
    except ValueError as error:
        raise PretrainedError(f"{path!r} is not valid JSON: {error}") from error
    if not isinstance(value, dict):
        raise PretrainedError(f"{path!r} holds a JSON {type(value).__name__}; expected an object.")
    return value


def _resolve(name_or_path, cache_dir=None):
    """(layout, weights path, config, preprocessor config, label) of a folder, file or hub id."""
    name = os.fspath(name_or_path)
    if not isinstance(name, str) or not name:
        raise PretrainedError(f"Expected a hub id, folder or file. Received: {name_or_path!r}")
    gfile = _gfile()
    folder = None
    if gfile.isdir(name):
        folder = name
    elif gfile.exists(name):
        if name.endswith(".json"):
            folder = os.path.dirname(name) or "."
        else:
            sibling = gfile.join(os.path.dirname(name) or ".", CONFIG)
            config = _read_json(sibling) if name.endswith(".safetensors") and gfile.exists(sibling) else None
            return ("file" if config is None else _config_layout(config, sibling)), name, config, None, name
    else:
        hub = _hub_id(name)
        if hub is None:
            raise PretrainedError(
                f"{name!r} is neither a file, a folder nor a Hugging Face hub id ('owner/name' or a timm model name "
                f"such as 'vit_base_patch16_224.augreg2_in21k_ft_in1k'). Layouts read: {'; '.join(LAYOUTS)}."
            )
        folder = _download(*hub, cache_dir)
    config_path, weights = gfile.join(folder, CONFIG), gfile.join(folder, WEIGHTS)
    if gfile.exists(config_path) and gfile.exists(weights):
        config = _read_json(config_path)
        preprocessor_path = gfile.join(folder, PREPROCESSOR)
        preprocessor = _read_json(preprocessor_path) if gfile.exists(preprocessor_path) else None
        return _config_layout(config, config_path), weights, config, preprocessor, name
    npz = sorted(f for f in gfile.listdir(folder) if f.endswith(".npz"))
    if len(npz) == 1 and not gfile.exists(config_path):
        return "file", gfile.join(folder, npz[0]), None, None, name
    found = sorted(gfile.listdir(folder))[:10]
    other = [f for f in found if f in ("pytorch_model.bin", "tf_model.h5", "open_clip_pytorch_model.bin")]
    unread = f"; {other}: pickled or framework-specific weights, not read (use a model.safetensors)" if other else ""
    raise PretrainedError(f"{name!r} holds {found}: none of the layouts read ({'; '.join(LAYOUTS)}){unread}.")


def _config_layout(config, path):
    if "architecture" in config:
        return "timm"
    if config.get("model_type") == "vit" or "hidden_size" in config:
        if config.get("model_type", "vit") != "vit":
            raise PretrainedError(
                f"{path!r} describes a transformers {config['model_type']!r} model; only model_type 'vit' "
                "(ViTModel, ViTForImageClassification) is read."
            )
        return "transformers"
    raise PretrainedError(
        f"{path!r} is neither timm's config (no 'architecture') nor transformers' ViT config (no 'model_type' "
        f"'vit'). Layouts read: {'; '.join(LAYOUTS)}."
    )


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


def _architecture(params):
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
    }
    if "cls" in params:
        arguments["classifier"] = "token"
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
        num_heads, gelu, epsilon, dynamic, reason = None, "exact", 1e-6, False, None
        log.warning(
            "from_pretrained(%s): timm architecture %r is not in keras_vit's table of timm ViTs: read with the "
            "exact GELU and LayerNorm epsilon 1e-6 (timm's VisionTransformer defaults).", path, architecture
        )
    else:
        num_heads, gelu, epsilon, dynamic, reason = row
    if reason:
        raise PretrainedError(f"{path!r}: timm's {architecture!r} has {reason}, which this library does not build.")
    act = model_args.get("act_layer")
    if act is not None:
        if act not in TIMM_GELU:
            raise PretrainedError(f"{path!r}: model_args act_layer={act!r}; this library computes {sorted(TIMM_GELU)}.")
        gelu = TIMM_GELU[act]
    num_heads = model_args.get("num_heads", num_heads)
    dynamic = bool(model_args.get("dynamic_img_size", dynamic))
    options = {"gelu": gelu, "layer_norm_epsilon": epsilon}
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
    if act not in TRANSFORMERS_GELU:
        raise PretrainedError(
            f"{path!r}: hidden_act={act!r}; this library computes {sorted(TRANSFORMERS_GELU)} (exact or tanh GELU)."
        )
    if config.get("qkv_bias", True) is False:
        raise PretrainedError(f"{path!r}: qkv_bias=false; this library's attention has query, key and value biases.")
    options = {
        "gelu": TRANSFORMERS_GELU[act],
        "layer_norm_epsilon": float(config.get("layer_norm_eps", 1e-12)),
        "image_size": to_pair(_pair_or_int(config.get("image_size", 224)), "image_size"),
    }
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


# === The model ===


def from_pretrained(name_or_path, *, image_size=None, num_classes="file", class_names=None, interpolation=None,
                    num_heads=None, cache_dir=None, **build_options):
    """A `keras_vit.ViT` with pretrained weights, its architecture read from the files.

    Args:
        name_or_path: a Hugging Face hub id ("timm/vit_base_patch16_224.augreg2_in21k_ft_in1k",
            "google/vit-base-patch16-224", optionally "@revision"; a bare timm model name stands for its
            "timm/" repository), a local or gs:// folder holding one of the hub layouts, or a file
            (`.npz`; a `.safetensors` is read with the `config.json` beside it, or alone as an original
            checkpoint would be).  Hub downloads go through `huggingface_hub` and its cache
            (`HF_HUB_OFFLINE=1`: the cache only).
        image_size: another (height, width), or "dynamic": any size whose
            sides divide by the patch size, the position embeddings resampled
            in the graph (timm's `dynamic_img_size`).  Default: the weights'
            own size (also "dynamic" where timm's `model_args` say so).
        num_classes: another number of classes: a new, zero-initialised head
            (the file's head is left out); None or 0: no head (the pooled
            features).  Default: the file's head.
        class_names: names of the classes; default: the config's labels
            (kept when the head is).
        interpolation: how learned position embeddings are resampled to
            another `image_size` (`load_pretrained`'s; default the file's
            own library's).
        num_heads: attention heads, for a timm file whose config cannot tell
            (an architecture not in `TIMM_ARCHITECTURES`, a lone
            `.safetensors`).
        cache_dir: huggingface_hub's cache folder (default its own,
            `HF_HUB_CACHE`).
        **build_options: `build_vit` options that leave the weights unchanged:
            `dropout_rate`, `attention_dropout_rate`, `stochastic_depth_rate`,
            `patch_projection`, `head_kernel_initializer`, `name`.

    Returns:
        A `keras_vit.ViT` taking raw pixels (uint8 or float in [0, 255]) at
        its size, whose spec holds `preprocessing` (a `Preprocessing`: the
        resize and crop of photos for evaluation, what `export_saved_model`
        bakes into `serving_bytes`) and `class_names` (a tuple, or None);
        `model.save` keeps both.

    Raises:
        PretrainedError naming the id or path and the layouts read when
        nothing fits; `CheckpointError` for arrays that do not make a ViT
        of this library (naming the file's keys).
    """
    _check_build_options(build_options)
    layout, weights_path, config, preprocessor, label = _resolve(name_or_path, cache_dir)
    heads, options, preprocessing, names, pool, dynamic = _layout_options(layout, config, preprocessor, label)
    raw, params = _read_weights(weights_path, num_heads or heads, config, label)
    arguments = _architecture(params)
    _check_pool(pool, arguments["classifier"], label)
    own_size = options.pop("image_size", None) or _size_from_grid(params, arguments, label)
    if image_size == "dynamic":
        dynamic, image_size = True, None
    file_classes = arguments.pop("num_classes")
    if num_classes == "file":
        num_classes = file_classes
    elif (num_classes or None) != file_classes:
        names = None
    if class_names is not None:
        names = [str(n) for n in class_names]  # Checked against the head by the model's spec.
    variant = arguments.pop("variant", None) or _variant_name(arguments)
    size = to_pair(image_size or own_size, "image_size")
    model = build_vit(
        variant,
        image_size=size,
        dynamic_image_size=dynamic,
        num_classes=num_classes,
        pixel_mean=_statistic(preprocessing, "mean"),
        pixel_std=_statistic(preprocessing, "std"),
        preprocessing=_preprocessing(preprocessing, size),
        class_names=names or None,
        name=build_options.pop("name", None) or _model_name(label),
        **arguments,
        **options,
        **build_options,
    )
    new_head = (num_classes or None) != file_classes
    model_io.load_params(model, raw, interpolation=interpolation, skip_mismatched_head=new_head, label=label)
    return model


def _check_build_options(build_options):
    """A ValueError naming the options of `build_options` that the files decide, not the caller."""
    unknown = sorted(set(build_options) - set(BUILD_OPTIONS))
    if unknown:
        raise ValueError(
            f"from_pretrained reads the architecture from the files; {unknown} cannot be set. Options: "
            f"image_size, num_classes, class_names, interpolation, num_heads, cache_dir, {', '.join(BUILD_OPTIONS)}."
        )


def _layout_options(layout, config, preprocessor, label):
    """(num_heads, build options, preprocessing arguments, class names, global pool, dynamic size) from the
    configs of `layout`; for the original checkpoints, which have none, the tanh GELU they were trained with
    and nothing else."""
    if layout == "timm":
        return _timm_options(config, label)
    if layout == "transformers":
        return (*_transformers_options(config, preprocessor, label), "token", False)
    return None, {"gelu": "tanh"}, None, None, None, False


def _read_weights(weights_path, heads, config, label):
    """(the file's arrays, the same in the original layout): read once, with room for the arrays of any float
    type (an .npz declaring more is refused unread); `heads` splits a timm or transformers file's attention."""
    raw = read_checkpoint(weights_path, max_bytes=8 * _gfile().stat(weights_path).length + 2**20)
    torch_layout = timm.MARKER in raw or transformers.is_transformers(raw)
    if torch_layout and heads is None:
        raise PretrainedError(
            f"{label!r}: the number of attention heads is in no config (timm architecture "
            f"{(config or {}).get('architecture')!r}); pass num_heads=."
        )
    params, _, _, _ = model_io.to_original_layout(raw, heads or 1)
    if torch_layout and POSEMB not in params:
        raise PretrainedError(f"{label!r} has no position embeddings (timm's 'pos_embed'): not a ViT built here.")
    return raw, params


def _check_pool(pool, classifier, label):
    """A PretrainedError when the config's global pool (None: no config) is not the arrays' `classifier`."""
    if pool is None:
        return
    expected = {"token": "token", "avg": "gap", "map": "map"}.get(pool)
    if expected != classifier:
        raise PretrainedError(
            f"{label!r}: global_pool={pool!r} with the arrays of a classifier={classifier!r} model; "
            "read: 'token' (with a class token), 'avg' (without one), 'map' (a MAP head)."
        )


def _size_from_grid(params, arguments, label):
    """The image size of a checkpoint's square grid of position embeddings (224 for fixed sin-cos ones)."""
    if arguments["position_embedding"] != "learned":
        return (224, 224)
    side = square_side(params[POSEMB].shape[1] - (arguments["classifier"] == "token"))
    if side is None:
        raise PretrainedError(
            f"{label!r}: the position embeddings ({params[POSEMB].shape[1]} rows) are not a square grid and no "
            "config gives the image size; pass image_size=."
        )
    stride = 1
    if "variant" in arguments:
        from keras_vit.resnet import ResNetStem

        stride = ResNetStem.stride(HYBRIDS[arguments["variant"]][1])
    return tuple(side * p * stride for p in arguments["patch_size"])


def _model_name(label):
    base = re.sub(r"\.(npz|safetensors)$", "", os.path.basename(str(label).rstrip("/")) or "vit")
    return re.sub(r"[^0-9A-Za-z_]+", "_", base).strip("_") or "vit"


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
