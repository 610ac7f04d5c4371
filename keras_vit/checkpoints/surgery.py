"""Model surgery for transfer learning: another resolution (`set_image_size`), another patch size
(`set_patch_size`, FlexiViT's resize), a new head (`replace_head`), a frozen backbone (`freeze_backbone`).
Weights move from model to model here; no file is read."""

import keras

from keras_vit.checkpoints.base import check_interpolation
from keras_vit.checkpoints.resample import resample_position_embeddings, resize_patch_kernel
from keras_vit.layers import PatchEncoder
from keras_vit.model import ViT
from keras_vit.resnet import ResNetStem
from keras_vit.variants import to_pair

# === Resolution ===


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


def _rebuild(model, image_size=None):
    """Rebuilds a chain-shaped model from its layers' configs, optionally at another size.  A model taking any
    image size (`dynamic_image_size`) still does; its weights are then made for `image_size`."""
    layers = model.layers
    if not _is_chain(model):
        raise ValueError(f"Expected a model from build_vit (a chain of layers); got {model.name!r}.")
    height, width, channels = model.input_shape[1:]
    dynamic = height is None or width is None
    if image_size is not None:
        height, width = to_pair(image_size, "image_size")
    input_size = (None, None) if dynamic else (height, width)
    inputs = keras.Input((*input_size, channels), dtype=model.inputs[0].dtype, name=layers[0].name)
    x, clones = inputs, []
    for layer in layers[1:]:
        config = layer.get_config()
        if dynamic and image_size is not None and config.get("base_image_size") is not None:
            stride = next((ResNetStem.stride(stem.num_layers) for stem in layers if isinstance(stem, ResNetStem)), 1)
            config["base_image_size"] = (height // stride, width // stride)
        clone = layer.__class__.from_config(config)
        x = clone(x)
        clones.append(clone)
    return keras.Model(inputs, x, name=model.name), list(zip(layers[1:], clones))


def set_image_size(model, image_size, interpolation="bicubic"):
    """A new model at another resolution with the same weights.

    Learned position embeddings are resampled to the new patch grid (see
    `resample_position_embeddings`), fixed sin-cos ones are computed for it;
    every other weight is copied.  Fine-tune at the new size: resampling alone
    costs accuracy (about 9.5% top-1 from 384 to 224 px,
    google-research/vision_transformer issue 6).  A `keras_vit.ViT` keeps its
    spec: its class names, and its preprocessing scaled to the new size.
    """
    check_interpolation(interpolation)
    if isinstance(model, ViT):
        size = to_pair(image_size, "image_size")
        preprocessing = model.preprocessing
        spec = model.spec.replace(
            image_size=size, preprocessing=None if preprocessing is None else preprocessing.at_size(size)
        )
        # The name, frozen layers, dtype policy and quantized layers as the model's config has them.
        new_model = ViT(**{**model.get_config(), "spec": spec})
        pairs = [(layer, new_model.get_layer(layer.name)) for layer in model.layers[1:]]
    else:
        new_model, pairs = _rebuild(model, image_size)
    for old, new in pairs:
        values = old.get_weights()
        if isinstance(old, PatchEncoder) and old.position_embedding_type == "learned":
            index = next(i for i, w in enumerate(old.weights) if w is old.position_embedding)
            values[index] = resample_position_embeddings(
                values[index], new.grid_size, interpolation,
                old_grid=old.grid_size, num_prefix_tokens=old.num_positioned_prefix,
            )
        new.set_weights(values)
    return new_model


def set_patch_size(model, patch_size, *, image_size=None, interpolation="bicubic_antialias",
                   position_interpolation="bicubic"):  # fmt: skip
    """A `keras_vit.ViT` cutting images into patches of `patch_size` instead, with FlexiViT's resize of the patch
    embedding (Beyer et al. 2023, "FlexiViT: One Model for All Patch Sizes"): the kernel by the pseudo-inverse
    of the patch resize (`resize_patch_kernel`, `interpolation`), learned position embeddings resampled to the
    new patch grid (`position_interpolation`, as `set_image_size`), every other weight copied.

    `image_size`: the new model's (default: the same, so the grid changes with the patch); the preprocessing is
    scaled to it.  A hybrid's patches are cells of its ResNet features: refused.  Fine-tune after a large change,
    as FlexiViT's own models were trained across patch sizes and others were not.
    """
    if not isinstance(model, ViT):
        raise ValueError(f"set_patch_size takes a keras_vit.ViT. Received: {type(model).__name__}")
    if model.spec.resnet_layers is not None:
        raise ValueError("A hybrid's patches are cells of its ResNet features, not of the image: not resized here.")
    check_interpolation(position_interpolation)
    patch = to_pair(patch_size, "patch_size")
    size = to_pair(image_size, "image_size") if image_size is not None else model.spec.image_size
    preprocessing = model.preprocessing
    spec = model.spec.replace(
        patch_size=patch, image_size=size, preprocessing=None if preprocessing is None else preprocessing.at_size(size)
    )
    new_model = ViT(**{**model.get_config(), "spec": spec})
    for old in model.layers[1:]:
        new = new_model.get_layer(old.name)
        values = old.get_weights()
        if isinstance(old, PatchEncoder):
            for index, weight in enumerate(old.weights):
                if weight is old.kernel:
                    values[index] = resize_patch_kernel(values[index], patch, interpolation)
                elif old.position_embedding_type == "learned" and weight is old.position_embedding:
                    values[index] = resample_position_embeddings(
                        values[index], new.grid_size, position_interpolation, old_grid=old.grid_size,
                        num_prefix_tokens=old.num_positioned_prefix,
                    )
        new.set_weights(values)
    return new_model


# === Transfer learning ===

# The layers of a model's head: `head`, and a distilled model's second head and the mean of the two.
HEADS = ("head", "head_distillation", "distilled_logits")


def replace_head(model, num_classes, *, name=None):
    """The same backbone (shared layers and weights) with a new zero-initialised head.

    `num_classes=None` returns the backbone: the pooled (or pre-logits) features.  A `keras_vit.ViT` keeps its
    spec but for the head: the preprocessing stays, the class names go with the old head.
    """
    if isinstance(model, ViT):
        changes = dict(num_classes=num_classes or None, class_names=None, head_kernel_initializer="zeros")
        if model.spec.distillation == "head" and not num_classes:  # A backbone keeps the token, not its head.
            changes["distillation"] = "token"
        spec = model.spec.replace(**changes)
        # The heads are new (a distilled model's two, and the mean of their logits).
        shared = [layer for layer in model.layers[1:] if layer.name not in HEADS]
        return ViT(spec, name=name or model.name, shared_layers=shared, dtype=model.get_config()["dtype"])
    features = model.get_layer("head").input if "head" in [layer.name for layer in model.layers] else model.output
    outputs = features
    if num_classes:
        outputs = keras.layers.Dense(num_classes, kernel_initializer="zeros", dtype="float32", name="head")(
            features
        )
    return keras.Model(model.inputs, outputs, name=name or model.name)


def freeze_backbone(model, trainable=False):
    """Freezes (or unfreezes) every layer but the head (a distilled model's two heads): a linear probe.

    The frozen layers also run in inference mode, in `fit` as in `predict`:
    no dropout, no stochastic depth (as Keras' transfer-learning guide runs
    a frozen base with `training=False`), so the head trains on the
    features it will be evaluated on.  Recompile the model after calling
    this for the change to take effect.
    """
    for layer in model.layers:
        if layer.name not in HEADS:
            layer.trainable = trainable
    return model
