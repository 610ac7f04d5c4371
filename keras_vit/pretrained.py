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

Here the files are found (a hub id through huggingface_hub's cache, a folder, a file) and the layout told
from the config; each layout's reader (`keras_vit.checkpoints.readers`) returns the `keras_vit.ViTSpec` the
files describe and their arrays; the caller's choices (image size, head, class names, dropout) change the
spec, and the model is built from it and loaded.  The model, a `keras_vit.ViT`, carries what it needs to be
used like the weights' own library, in its spec and so in every `.keras` file it is saved to:
`model.preprocessing` (a `keras_vit.Preprocessing`: the evaluation resize and crop; the model itself applies
the mean and std) and `model.class_names` (from `id2label` or timm's `label_names`; None when the config has
none).
"""

import json
import os
import re

from keras_vit.checkpoints import model_io
from keras_vit.checkpoints.base import PretrainedError
from keras_vit.checkpoints.readers import READERS
from keras_vit.model import ViT
from keras_vit.variants import to_pair

LAYOUTS = (
    "timm (config.json with 'architecture' + model.safetensors)",
    "transformers (config.json with model_type 'vit', 'deit', 'dinov2' or 'dinov2_with_registers' + model.safetensors)",
    "original (.npz)",
)
WEIGHTS = "model.safetensors"
# Large models' weights, sharded: the index (array name -> shard) and the shards beside it.
SHARD_INDEX = "model.safetensors.index.json"
SHARDS = "model-*-of-*.safetensors"
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
            repo_id, revision=revision, cache_dir=cache_dir,
            allow_patterns=[CONFIG, PREPROCESSOR, WEIGHTS, SHARD_INDEX, SHARDS],
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
        elif _is_keras_file(name):
            return "keras", name, None, None, name
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
    if not gfile.exists(weights) and gfile.exists(gfile.join(folder, SHARD_INDEX)):
        weights = gfile.join(folder, SHARD_INDEX)
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


def _is_keras_file(path):
    """Whether `path` is a Keras model file (`model.save`'s `.keras`: a zip holding `config.json`,
    `metadata.json` and the weights), which an `.npz` (a zip too) is not."""
    import zipfile

    if str(path).endswith(".keras"):
        return True
    try:
        with _gfile().GFile(path, "rb") as f, zipfile.ZipFile(f) as archive:
            names = set(archive.namelist())
    except (zipfile.BadZipFile, OSError, ValueError):
        return False
    return {"config.json", "metadata.json"} <= names


def _load_keras(path, label):
    """The `keras_vit.ViT` a `.keras` file holds, loaded by Keras in safe mode (no code in the file runs); any
    other Keras model is refused naming what it is."""
    import tempfile

    import keras

    with tempfile.TemporaryDirectory() as folder:
        if not str(path).endswith(".keras"):  # Keras reads `.keras` files by their name: a local copy by that name.
            local = os.path.join(folder, "model.keras")
            _gfile().copy(str(path), local)
            path = local
        return _load_keras_file(keras, path, label)


def _load_keras_file(keras, path, label):
    try:
        model = keras.saving.load_model(path, safe_mode=True)
    except Exception as error:  # Keras raises many kinds for files it cannot read.
        raise PretrainedError(
            f"{label!r} is a Keras model file that keras.saving.load_model cannot load: {error}"
        ) from error
    if not isinstance(model, ViT):
        raise PretrainedError(
            f"{label!r} is a Keras model file holding a {type(model).__name__!r}, not a keras_vit.ViT; load it with "
            "keras.saving.load_model."
        )
    return model


# transformers' model types read: ViT, DeiT (with its distillation token) and DINOv2 (layer scale, registers).
TRANSFORMERS_TYPES = ("vit", "deit", "dinov2", "dinov2_with_registers")


def _config_layout(config, path):
    if "architecture" in config:
        return "timm"
    if config.get("model_type") in TRANSFORMERS_TYPES or "hidden_size" in config:
        if config.get("model_type", "vit") not in TRANSFORMERS_TYPES:
            raise PretrainedError(
                f"{path!r} describes a transformers {config['model_type']!r} model; the model types read are "
                f"{list(TRANSFORMERS_TYPES)}."
            )
        return "transformers"
    raise PretrainedError(
        f"{path!r} is neither timm's config (no 'architecture') nor transformers' ViT config (no 'model_type' "
        f"'vit'). Layouts read: {'; '.join(LAYOUTS)}."
    )


# === The model ===


def from_pretrained(name_or_path, *, image_size=None, num_classes="file", class_names=None, interpolation=None,
                    num_heads=None, cache_dir=None, **build_options):
    """A `keras_vit.ViT` with pretrained weights, its architecture read from the files.

    Args:
        name_or_path: a Hugging Face hub id ("timm/vit_base_patch16_224.augreg2_in21k_ft_in1k",
            "google/vit-base-patch16-224", optionally "@revision"; a bare timm model name stands for its
            "timm/" repository), a local or gs:// folder holding one of the hub layouts, or a file
            (`.npz`; a `.safetensors` is read with the `config.json` beside it, or alone as an original
            checkpoint would be; a `.keras` file of a `keras_vit.ViT`, loaded by Keras in safe mode).  A
            folder's weights may be sharded (`model.safetensors.index.json` and its shards).  Hub downloads
            go through `huggingface_hub` and its cache (`HF_HUB_OFFLINE=1`: the cache only).
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
    dynamic = image_size == "dynamic"
    if layout == "keras":
        saved = _load_keras(weights_path, label)
        unchanged = image_size is None and num_classes == "file" and class_names is None and not build_options
        if unchanged:
            return saved
        if any(getattr(layer, "quantization_mode", None) for layer in saved._flatten_layers()):
            raise PretrainedError(
                f"{label!r} holds a quantized model: its weights are not the float ones another size or head needs. "
                "Load it with keras.saving.load_model as it is, or pass the float model's file."
            )
        spec, arrays = saved.spec, model_io.model_checkpoint(saved)
        if image_size is not None and not dynamic:
            size = to_pair(image_size, "image_size")
            spec = spec.replace(image_size=size, preprocessing=None if spec.preprocessing is None else
                                spec.preprocessing.at_size(size))  # fmt: skip
    else:
        spec, arrays = READERS[layout](
            weights_path, config, preprocessor, label, num_heads=num_heads, image_size=None if dynamic else image_size
        )
    new_head = num_classes != "file" and (num_classes or None) != spec.num_classes
    changes = {key: value for key, value in build_options.items() if key != "name"}
    if dynamic:
        changes["dynamic_image_size"] = True
    if new_head:
        changes.update(num_classes=num_classes or None, class_names=None)
        if not num_classes and spec.distillation == "head":  # A backbone keeps the token, not its head.
            changes["distillation"] = "token"
    if class_names is not None:
        changes["class_names"] = [str(n) for n in class_names]  # Checked against the head by the spec.
    model = ViT(spec.replace(**changes), name=build_options.get("name") or _model_name(label))
    model_io.load_params(model, arrays, interpolation=interpolation, skip_mismatched_head=new_head, label=label)
    return model


def _check_build_options(build_options):
    """A ValueError naming the options of `build_options` that the files decide, not the caller."""
    unknown = sorted(set(build_options) - set(BUILD_OPTIONS))
    if unknown:
        raise ValueError(
            f"from_pretrained reads the architecture from the files; {unknown} cannot be set. Options: "
            f"image_size, num_classes, class_names, interpolation, num_heads, cache_dir, {', '.join(BUILD_OPTIONS)}."
        )


def _model_name(label):
    base = re.sub(r"\.(npz|safetensors)$", "", os.path.basename(str(label).rstrip("/")) or "vit")
    return re.sub(r"[^0-9A-Za-z_]+", "_", base).strip("_") or "vit"
