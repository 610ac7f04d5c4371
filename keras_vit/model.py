"""`ViT`, the Vision Transformer as a Keras model, and `build_vit`, which makes one from a variant's name.

A `ViT` is a functional `keras.Model` built from a `keras_vit.ViTSpec` (keras-hub's backbone pattern): its
config is the spec, so `model.save` and `keras.models.load_model` restore the architecture, the preprocessing and
the class names with the weights, and `model.preprocessing` and `model.class_names` are the spec's.  Its layer
names are stable, and the checkpoint converters map onto them (the table: docs/model.md, "Structure and layer names").
"""

import re
import warnings

import keras

from keras_vit import compat
from keras_vit import layers as vit_layers
from keras_vit.layers.common import register
from keras_vit.layers.core import Dense, make_norm
from keras_vit.layers.quantization import Int8Kernels
from keras_vit.resnet import ResNetStem
from keras_vit.spec import CLASSIFIERS, POSITION_EMBEDDINGS, ViTSpec, pixel_statistics
from keras_vit.train_step import TrainingSteps

__all__ = ["CLASSIFIERS", "POSITION_EMBEDDINGS", "ViT", "build_vit"]


def _default_name(variant):
    return "vit_" + "".join(c for c in variant.lower() if c.isalnum())


def build_vit(variant, *, name=None, **fields):
    """Builds a Vision Transformer (Dosovitskiy et al. 2020): the `ViT` of `ViTSpec.from_variant(variant,
    **fields)`.

    Args:
        variant: paper notation, e.g. "Ti/16", "S/16", "B/16", "L/32", "H/14", a hybrid ("R50+B/16"), or
            "testing" (a tiny model for tests); see `keras_vit.VARIANTS`.
        name: model name, by default derived from the variant ("vit_b16").
        **fields: the `keras_vit.ViTSpec` fields to set (each documented and checked there), e.g.
            `image_size=384, num_classes=10, classifier="gap"`; `hidden_dim`, `num_layers`, `num_heads`,
            `mlp_dim` and `patch_size` win over the variant's entry.

    Returns:
        A `keras_vit.ViT` mapping (batch, height, width, channels) images to float32 logits (batch,
        num_classes), or to the pooled features when `num_classes` is None.

    >>> model = build_vit("testing", image_size=32, num_classes=10)
    >>> model.output_shape
    (None, 10)
    """
    return ViT(ViTSpec.from_variant(variant, **fields), name=name or _default_name(variant))


@register
class ViT(TrainingSteps, keras.Model):
    """The Vision Transformer: a functional Keras model made from a `keras_vit.ViTSpec`.

    Takes (batch, height, width, channels) raw pixels and returns float32
    logits (or, without a head, the pooled features); the layers are those of
    the table at the top of `keras_vit.model`.  Its config is its spec: saved
    with `model.save`, restored by `keras.models.load_model` with no
    `custom_objects` (once keras_vit is imported), with the frozen layers
    (`keras_vit.freeze_backbone`) and the dtype policy it was built with.
    Its training step mixes batches (`batch_mixer`) and accumulates gradients
    (`gradient_accumulation_steps`): see `keras_vit.TrainingSteps`.

    Args:
        spec: a `ViTSpec` (or its `to_config()` dict).
        frozen_layers: names of layers to build with `trainable=False`.
        quantized: {layer path: {"policy": its quantized dtype policy name,
            "config": its serialized QuantizationConfig or None}} of the layers
            to quantize once built (what `get_config` records after `quantize`).
        dtype: the dtype policy of every layer but the float32 head (default:
            Keras' global policy).
        shared_layers: layers of another model to use, by name, instead of
            new ones (`keras_vit.replace_head`: the same backbone).
        **kwargs: `name`, `trainable`: as for any Keras model.

    Attributes:
        spec: the `ViTSpec`.
        preprocessing: the spec's `keras_vit.Preprocessing`, or None.
        class_names: the spec's class names (a tuple), or None.
    """

    def __init__(self, spec, *, frozen_layers=(), dtype=None, quantized=None, shared_layers=None, **kwargs):
        if isinstance(spec, dict):
            spec = ViTSpec.from_config(spec)
        if not isinstance(spec, ViTSpec):
            raise ValueError(f"`spec` must be a keras_vit.ViTSpec. Received: {type(spec).__name__}")
        images, outputs = _build_network(spec, dtype, {layer.name: layer for layer in shared_layers or ()})
        super().__init__(images, outputs, **kwargs)
        self._spec = spec
        for layer_name in frozen_layers:
            self.get_layer(layer_name).trainable = False
        if quantized:
            self._quantize_as_saved(quantized)

    def _quantize_as_saved(self, quantized):
        layers = {layer.path: layer for layer in _all_layers(self)}
        unknown = sorted(set(quantized) - set(layers))
        if unknown:
            known = sorted(filter(None, layers))
            raise ValueError(f"No layer {unknown[0]!r} to quantize in {self.name!r}. Layers: {known}")
        with warnings.catch_warnings(), compat.one_collection_for_deleted_variables():
            warnings.filterwarnings("ignore", message=_NUMPY_COPY_WARNING)
            for path, saved in quantized.items():
                # As the layer was quantized: its mode and its QuantizationConfig (weight-only, int4 blocks).
                config = keras.saving.deserialize_keras_object(saved["config"]) if saved.get("config") else None
                layers[path].quantize(keras.dtype_policies.get(saved["policy"]).quantization_mode, config=config)

    @property
    def spec(self):
        return self._spec

    @property
    def preprocessing(self):
        return self._spec.preprocessing

    @property
    def class_names(self):
        return self._spec.class_names

    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        """Keras' `Model.save`; later `.keras` saves in the thread skip what this one computed once per type
        (`keras_vit.compat.keep_saving_skipsets`): a run that saves its best model at many epochs pays it once."""
        super().save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)
        compat.keep_saving_skipsets()

    def quantize(self, mode=None, config=None, filters=None, **kwargs):
        """Keras' post-training quantization (`keras.Model.quantize`) of every matmul but the patch
        embedding's: the attention's projections, the MLPs, the MAP head's and the head.

        `mode`, `config` and `filters` (a regex of layer names, a list of them, or a callable on a layer) are
        Keras'. The `Dense` layers take every mode Keras has; the attention's and the MAP head's own
        kernels take "int8" (`keras_vit.layers.quantization`) and stay in float, with a warning, in the others.
        A quantized model saves, reloads and exports as any other.
        """
        def matmul(layer):
            return isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)) and _selected(layer, filters)

        own = [layer for layer in _all_layers(self) if isinstance(layer, Int8Kernels) and _selected(layer, filters)]
        refused = []
        # Keras collects garbage after each kernel it replaces: once here (keras_vit.compat).
        with warnings.catch_warnings(), compat.one_collection_for_deleted_variables():
            warnings.filterwarnings("ignore", message=_NUMPY_COPY_WARNING)
            super().quantize(mode, config=config, filters=matmul, **kwargs)
            for layer in own:
                if layer.quantization_mode is None:
                    try:
                        layer.quantize(config.mode if mode is None and config is not None else mode, config=config)
                    except NotImplementedError as error:
                        refused.append(str(error))
        for message in refused:
            warnings.warn(message, stacklevel=2)
        # Traced before: traced again, with the quantized layers.
        self.train_function = self.test_function = self.predict_function = None

    def get_config(self):
        frozen = [layer.name for layer in self.layers if not layer.trainable]  # A frozen Dropout drops nothing.
        config = {
            "name": self.name,
            "trainable": self.trainable,
            "spec": self._spec.to_config(),
            "frozen_layers": frozen,
            "dtype": self.get_layer("patch_encoder").dtype_policy.name,
        }
        quantized = {
            layer.path: {
                "policy": layer.dtype_policy.name,
                "config": keras.saving.serialize_keras_object(getattr(layer, "quantization_config", None)),
            }
            for layer in _all_layers(self) if layer.quantization_mode
        }  # fmt: skip
        if quantized:
            config["quantized"] = quantized
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        return cls(**config)


# NumPy 2 about TensorFlow variables, as a kernel is read to quantize it: nothing a user can act on.
_NUMPY_COPY_WARNING = "__array__ implementation doesn't accept a copy keyword"


def _all_layers(model):
    """The model's layers and, depth first, the layers they hold (a block's attention, norms, MLP)."""
    found, seen = [], set()

    def visit(layer):
        if id(layer) in seen:
            return
        seen.add(id(layer))
        found.append(layer)
        for value in vars(layer).values():
            if isinstance(value, keras.layers.Layer) and not isinstance(value, keras.Model):
                visit(value)

    for layer in model.layers:
        visit(layer)
    return found


def _selected(layer, filters):
    """Keras' `filters` of `Model.quantize`: None, a regex searched in the layer's name, a list of them, or a
    callable on the layer."""
    if filters is None:
        return True
    if isinstance(filters, str):
        return re.search(filters, layer.name) is not None
    if isinstance(filters, (list, tuple)):
        return any(re.search(pattern, layer.name) for pattern in filters)
    return bool(filters(layer))


def _build_network(spec, dtype=None, shared=None):
    """The model's input and output tensors, each layer with the dtype policy `dtype` but the float32 head;
    a layer named in `shared` ({name: layer}) is that layer, called here too."""
    input_size = (None, None) if spec.dynamic_image_size else spec.image_size
    images = keras.Input((*input_size, spec.num_channels), name="images")
    epsilon, policy, shared = spec.layer_norm_epsilon, {"dtype": dtype} if dtype is not None else {}, shared or {}

    def layer(name, make, *args, **kwargs):
        return shared[name] if name in shared else make(*args, name=name, **kwargs)

    x = images
    if spec.include_rescaling:
        x = layer("rescaling", _rescaling, spec, policy)(x)
    if spec.resnet_layers is not None:
        x = layer("resnet", ResNetStem, spec.resnet_layers, **policy)(x)
    stride = spec.stride
    x = layer(
        "patch_encoder",
        vit_layers.PatchEncoder,
        spec.hidden_dim,
        spec.patch_size,
        use_class_token=spec.has_class_token,
        projection=spec.patch_projection,
        position_embedding=spec.position_embedding,
        base_image_size=tuple(side // stride for side in spec.image_size) if spec.dynamic_image_size else None,
        num_registers=spec.num_registers,
        distillation_token=spec.distillation is not None,
        patch_norm=spec.norm if spec.patch_norm else None,
        norm_epsilon=epsilon,
        **policy,
    )(x)
    x = layer("embedding_dropout", vit_layers.Dropout, spec.dropout_rate, **policy)(x)
    if spec.pre_norm:
        x = layer("pre_norm", make_norm, spec.norm, epsilon, **policy)(x)
    for i in range(spec.num_layers):
        depth_fraction = i / (spec.num_layers - 1) if spec.num_layers > 1 else 1.0
        x = layer(
            f"encoderblock_{i}",
            vit_layers.TransformerBlock,
            num_heads=spec.num_heads,
            mlp_dim=spec.mlp_dim,
            dropout_rate=spec.dropout_rate,
            attention_dropout_rate=spec.attention_dropout_rate,
            stochastic_depth_rate=spec.stochastic_depth_rate * depth_fraction,
            activation=spec.activation,
            layer_norm_epsilon=epsilon,
            **({"layer_scale": spec.layer_scale} if spec.layer_scale is not None else {}),
            **({} if spec.qkv_bias else {"qkv_bias": False}),
            norm=spec.norm,
            mlp=spec.mlp,
            sub_norms=spec.sub_norms,
            parallel=spec.parallel,
            **policy,
        )(x)
    if not spec.pooled_norm:
        x = layer("encoder_norm", make_norm, spec.norm, epsilon, **policy)(x)
    tokens = x
    if spec.classifier == "map":
        x = layer("pooling", vit_layers.MAPHead, spec.num_heads, spec.mlp_dim, activation=spec.activation,
                  layer_norm_epsilon=epsilon, norm=spec.norm, **policy)(x)  # fmt: skip
    else:
        # Mean pooling reads the patches' tokens, not the class token nor the registers before them.
        prefix = int(spec.has_class_token) + spec.num_registers if spec.classifier in ("gap", "token_gap") else 0
        x = layer("pooling", vit_layers.TokenPooling, spec.classifier,
                  **({"prefix_tokens": prefix} if prefix else {}), **policy)(x)  # fmt: skip
    if spec.pooled_norm:
        x = layer("pooled_norm", make_norm, spec.norm, epsilon, **policy)(x)
    if spec.representation_size:
        x = layer("pre_logits", Dense, spec.representation_size, activation="tanh", **policy)(x)
    if spec.num_classes:
        # float32 logits under any policy: softmax and the loss need the range.
        initializer = keras.initializers.get(spec.head_kernel_initializer)  # A name or a config.
        x = layer("head", Dense, spec.num_classes, kernel_initializer=initializer, dtype="float32")(x)
        if spec.distillation == "head":
            distilled = layer("distillation_pooling", vit_layers.TokenPooling, "token", prefix_tokens=1,
                              **policy)(tokens)  # fmt: skip
            distilled = layer("head_distillation", Dense, spec.num_classes,
                              kernel_initializer=initializer, dtype="float32")(distilled)  # fmt: skip
            x = layer("distilled_logits", keras.layers.Average, dtype="float32")([x, distilled])
    return images, x


def _rescaling(spec, policy, name):
    """The layer mapping raw pixels to what the weights expect: [-1, 1], or (x / 255 - mean) / std."""
    if spec.pixel_mean is None:
        return keras.layers.Rescaling(1.0 / 127.5, offset=-1.0, name=name, **policy)
    mean, std = pixel_statistics(spec.pixel_mean, spec.pixel_std, spec.num_channels)
    return keras.layers.Rescaling(
        [float(v) for v in 1.0 / (255.0 * std)], offset=[float(v) for v in -mean / std], name=name, **policy
    )
