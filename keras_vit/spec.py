"""`ViTSpec`: everything a `keras_vit.ViT` is, in one frozen, validated value.

A spec holds the architecture (the transformer's sizes, the patches, the image size, the head, the options of
the layers), how raw images become the model's input (the pixel statistics its `rescaling` layer applies and,
for evaluation and serving, the resize and crop of a `Preprocessing`) and the names of its classes.  The model
is built from it and saves it as its config, so a `.keras` file restores all of it.

>>> spec = ViTSpec.from_variant("Ti/16", image_size=32, num_classes=10)
>>> spec.hidden_dim, spec.patch_size, spec.image_size
(192, (16, 16), (32, 32))
>>> ViTSpec.from_config(spec.to_config()) == spec
True
"""

import dataclasses

import keras
import numpy as np

from keras_vit.layers.common import check_positive_int, check_rate
from keras_vit.layers.core import MLP_ACTIVATIONS, check_norm, mlp_activation, read_activation
from keras_vit.layers.embedding import PatchEncoder
from keras_vit.layers.encoder import MLPS, check_layer_scale
from keras_vit.preprocessing import Preprocessing
from keras_vit.resnet import ResNetStem
from keras_vit.variants import ViTConfig, parse_variant, to_pair

CLASSIFIERS = ("token", "gap", "map", "token_gap")
POSITION_EMBEDDINGS = PatchEncoder.POSITION_EMBEDDINGS
PATCH_PROJECTIONS = ("conv", "matmul")
# DeiT's distillation token: None (none), "token" (the token; the head reads the class token, as transformers'
# DeiTForImageClassification) or "head" (the token with a head of its own, the two heads' logits averaged: timm's
# distilled DeiTs and DeiTForImageClassificationWithTeacher at inference).
DISTILLATIONS = (None, "token", "head")


def _optional_positive(name, value):
    """None for None or 0 (no such layer), else a positive int."""
    if value is None or value == 0:  # 0 and False: no such layer.
        return None
    return check_positive_int(name, value, optional=True)


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False. Received: {name}={value!r}")


def pixel_statistics(pixel_mean, pixel_std, num_channels):
    """The per-channel (mean, std) the rescaling applies: 0.5 and 0.5 (the [-1, 1] of the original weights)
    when both are None; a ValueError for one without the other, a non-finite mean or a std that is not
    positive."""
    if pixel_mean is None and pixel_std is None:
        return np.full(num_channels, 0.5), np.full(num_channels, 0.5)
    if pixel_mean is None or pixel_std is None:
        raise ValueError(
            f"`pixel_mean` and `pixel_std` go together. Received: pixel_mean={pixel_mean!r}, pixel_std={pixel_std!r}"
        )
    try:
        mean, std = (np.broadcast_to(np.asarray(v, np.float64), (num_channels,)) for v in (pixel_mean, pixel_std))
    except (TypeError, ValueError):
        mean = std = np.full(num_channels, np.nan)
    if not (np.all(np.isfinite(mean)) and np.all(std > 0) and np.all(np.isfinite(std))):
        raise ValueError(
            "`pixel_mean` must be finite and `pixel_std` positive, one value or one per channel. Received: "
            f"pixel_mean={pixel_mean!r}, pixel_std={pixel_std!r}"
        )
    return mean, std


@dataclasses.dataclass(frozen=True)
class ViTSpec:
    """A Vision Transformer: its architecture, how it takes images, and its classes; every field is checked
    here, with a ValueError naming what was received and what was expected.

    `ViTSpec.from_variant("B/16", **fields)` takes the transformer's sizes from the variant's entry
    (`keras_vit.VARIANTS`) and `keras_vit.build_vit(variant, **fields)` builds the model of that spec.

    The transformer (`keras_vit.ViTConfig`'s fields; given to `from_variant`, they win over the variant's):
        hidden_dim, num_layers, num_heads, mlp_dim: the width D, the blocks, the attention heads and the MLP's
            hidden width.
        patch_size: int or (height, width).
        resnet_layers: a hybrid's ResNet stem, its stage sizes; None for a plain ViT.

    Images:
        image_size: int or (height, width) the weights are made for, each divisible by the patch size.
        dynamic_image_size: the model takes images of any height and width that divide by the patch size
            (timm's `dynamic_img_size`): learned position embeddings are resampled to each input's patch grid
            in the graph (bicubic with antialias, as timm); the input shape is (batch, None, None, channels).
        num_channels: channels of the input images.
        include_rescaling: the model takes raw pixels (uint8 or float in [0, 255]) and maps them to
            (x / 255 - mean) / std itself, as the original checkpoints expect.
        pixel_mean, pixel_std: with `include_rescaling`, the per-channel mean and standard deviation of pixels
            in [0, 1] the weights were trained with (DeiT's and timm's ImageNet statistics, CLIP's); both None:
            0.5 and 0.5, pixels to [-1, 1] as the original weights.
        preprocessing: a `keras_vit.Preprocessing`, how a photo of any size is resized and cropped for
            evaluation and `serving_bytes`; its crop is `image_size`, its mean and std the model's.  None: the
            shorter side resized to the model's and the center cropped.

    Tokens:
        patch_projection: "conv" or "matmul" (see `PatchEncoder`).
        patch_norm: a norm (of kind `norm`) on the patch embeddings before the tokens and positions are added
            (timm's `patch_embed.norm`).
        position_embedding: "learned" (the paper's) or "sincos2d" (fixed 2-D sin-cos embeddings of the patch
            grid, big_vision's "Better plain ViT baselines"; no weights, hidden_dim a multiple of 4).
        class_token: None (as `classifier` says), or True with classifier "gap": a class token the mean leaves
            out (timm's BEiT-3 and EVA layouts with `global_pool="avg"`).
        num_registers: register tokens after the class token (Darcet et al. 2023; DINOv2 with registers):
            attended to, not pooled.
        distillation: DeiT's distillation token (Touvron et al. 2021), after the class token with a position
            of its own: None, "token" (the head reads the class token) or "head" (a second head,
            `head_distillation`, reads it; the logits are the two heads' mean, as DeiT's distilled models
            infer).

    Blocks:
        pre_norm: a norm on the tokens before the first block (timm's `norm_pre`, CLIP's layout).
        norm: every norm's kind: "layer" (LayerNorm) or "rms" (RMSNorm, Zhang and Sennrich 2019: AIMv2's).
        layer_norm_epsilon: every norm's epsilon: 1e-6 as the original implementation, big_vision and most of
            timm; timm's CLIP models 1e-5, transformers' `google/vit-*` configs 1e-12.
        activation: the MLPs' activation, by timm's names: "gelu" (x * Phi(x)), "gelu_tanh" (its tanh
            approximation, which the original implementation and big_vision compute: use it to reproduce an
            original checkpoint's outputs to float precision), "quick_gelu" (CLIP's x * sigmoid(1.702 x)) or
            "silu" (x * sigmoid(x)).
        mlp: "plain" (Dense -> GELU -> Dense) or "swiglu" (SiLU-gated: DINOv2 giant, AIMv2).
        qkv_bias: the attention's query, key and value have biases (False: timm's `qkv_bias=False`).
        layer_scale: None, or the initial value of learned per-channel scales on each block's two residual
            branches (LayerScale, CaiT; DeiT III, DINOv2: timm's `init_values`).
        sub_norms: norms inside each attention (of its output, before the output projection) and MLP (of its
            hidden units): BEiT-3's sub-LN.
        parallel: branches per block: 2 or more sums that many attentions, then that many MLPs, each with its
            own norm (Touvron et al. 2022, "Three things everyone should know about Vision Transformers").
        dropout_rate: dropout after the embeddings, the attention and in the MLPs.
        attention_dropout_rate: dropout on the attention probabilities.
        stochastic_depth_rate: drop-path rate of the last block; block i uses
            `stochastic_depth_rate * i / (num_layers - 1)` (linear rule).

    Head:
        classifier: "token" (the class token), "gap" (mean of the patch tokens), "map" (big_vision's
            multi-head attention pooling, `MAPHead`) or "token_gap" (the class token and the patches' mean,
            concatenated: DINOv2's linear classifier); "gap" and "map" models have no class token.
        pooled_norm: the final norm on the pooled features instead of on the tokens (timm's `fc_norm`).
        representation_size: a Dense + tanh "pre-logits" layer of this width before the head (ImageNet-21k
            pre-training); None or 0: none.
        num_classes: the head's width; None or 0: no head, the model returns the pooled features (a backbone).
        head_kernel_initializer: the head kernel's initializer (a name or a config): zeros as in the original
            implementation, what fine-tuning wants.
        class_names: a name for each of the `num_classes` classes, or None (the SavedModel's `top_k_names`,
            the evaluation's reports).
    """

    hidden_dim: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    patch_size: tuple
    resnet_layers: tuple = None
    image_size: tuple = (224, 224)
    dynamic_image_size: bool = False
    num_channels: int = 3
    num_classes: int = 1000
    classifier: str = "token"
    representation_size: int = None
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    stochastic_depth_rate: float = 0.0
    include_rescaling: bool = True
    pixel_mean: tuple = None
    pixel_std: tuple = None
    head_kernel_initializer: object = "zeros"  # A name, or an initializer's config (keras.initializers.serialize).
    patch_projection: str = "conv"
    activation: str = "gelu"
    position_embedding: str = "learned"
    pre_norm: bool = False
    pooled_norm: bool = False
    layer_norm_epsilon: float = 1e-6
    layer_scale: float = None
    num_registers: int = 0
    qkv_bias: bool = True
    distillation: str = None
    norm: str = "layer"
    patch_norm: bool = False
    mlp: str = "plain"
    class_token: bool = None
    sub_norms: bool = False
    parallel: int = 1
    preprocessing: Preprocessing = None
    class_names: tuple = None

    def __post_init__(self):
        def store(name, value):
            object.__setattr__(self, name, value)

        # The transformer's sizes: ViTConfig's checks.
        store("resnet_layers", None if self.resnet_layers is None else tuple(self.resnet_layers))
        store("patch_size", self.config.patch_size)
        received = self.image_size
        store("image_size", to_pair(self.image_size, "image_size"))
        stride = self.stride
        height, width = self.image_size
        if height % (stride * self.patch_size[0]) or width % (stride * self.patch_size[1]):
            hybrid = f" times the ResNet stride {stride}" if self.resnet_layers is not None else ""
            raise ValueError(
                f"`image_size` must be divisible by the patch size{hybrid}. Received: image_size="
                f"{received!r}, patch_size={self.patch_size}"
            )
        if isinstance(self.include_rescaling, (int, np.integer, np.bool_)) and self.include_rescaling in (0, 1):
            store("include_rescaling", bool(self.include_rescaling))  # 1 and np.True_ are True.
        for name in ("dynamic_image_size", "include_rescaling", "pre_norm", "pooled_norm", "qkv_bias", "patch_norm",
                     "sub_norms"):  # fmt: skip
            _check_bool(name, getattr(self, name))
        store("parallel", check_positive_int("parallel", self.parallel))
        check_norm(self.norm)
        if self.mlp not in MLPS:
            raise ValueError(f"`mlp` must be one of {MLPS}. Received: mlp={self.mlp!r}")
        store("layer_scale", check_layer_scale(self.layer_scale))
        if isinstance(self.num_registers, bool) or not isinstance(self.num_registers, (int, np.integer)) or (
                self.num_registers < 0):
            raise ValueError(f"`num_registers` must be an integer >= 0. Received: num_registers={self.num_registers!r}")
        store("num_registers", int(self.num_registers))
        if not isinstance(self.head_kernel_initializer, (str, dict)):
            # Kept as its config, so that specs compare and save by value.
            initializer = keras.initializers.get(self.head_kernel_initializer)
            store("head_kernel_initializer", keras.initializers.serialize(initializer))
        check_positive_int("num_channels", self.num_channels)
        store("num_classes", _optional_positive("num_classes", self.num_classes))
        store("representation_size", _optional_positive("representation_size", self.representation_size))
        if self.classifier not in CLASSIFIERS:
            raise ValueError(f"`classifier` must be one of {CLASSIFIERS}. Received: classifier={self.classifier!r}")
        read = self.classifier in ("token", "token_gap")  # The classifiers that read a class token.
        if self.class_token is not None:
            _check_bool("class_token", self.class_token)
            if self.class_token != read and not (self.class_token and self.classifier == "gap"):
                raise ValueError(
                    f"class_token={self.class_token} with classifier={self.classifier!r}: a class token is read by "
                    "'token' and 'token_gap', and may stand unread beside 'gap' (its mean leaves it out)."
                )
            if self.class_token == read:
                store("class_token", None)  # As the classifier says: one spec, one form.
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(
                f"`position_embedding` must be one of {POSITION_EMBEDDINGS}. Received: "
                f"position_embedding={self.position_embedding!r}"
            )
        if self.patch_projection not in PATCH_PROJECTIONS:
            raise ValueError(
                f"`patch_projection` must be one of {PATCH_PROJECTIONS}. Received: "
                f"patch_projection={self.patch_projection!r}"
            )
        mlp_activation(self.activation)
        epsilon = self.layer_norm_epsilon
        if not isinstance(epsilon, (int, float)) or isinstance(epsilon, bool) or not 0 < epsilon < 1:
            raise ValueError(
                f"`layer_norm_epsilon` must be a number in (0, 1). Received: layer_norm_epsilon={epsilon!r}"
            )
        store("layer_norm_epsilon", float(epsilon))
        for name in ("dropout_rate", "attention_dropout_rate", "stochastic_depth_rate"):
            store(name, check_rate(name, getattr(self, name)))
        self._check_distillation()  # After num_classes and representation_size are normalised.
        self._check_input()
        self._check_classes()

    def _check_distillation(self):
        if self.distillation not in DISTILLATIONS:
            raise ValueError(
                f"`distillation` must be one of {DISTILLATIONS}. Received: distillation={self.distillation!r}"
            )
        if self.distillation is None:
            return
        refused = {
            "classifier='token'": self.classifier == "token",
            "representation_size=None": self.representation_size is None,
            "pooled_norm=False": not self.pooled_norm,
        }
        if self.distillation == "head":
            refused["num_classes (the heads)"] = self.num_classes is not None
        missing = [option for option, ok in refused.items() if not ok]
        if missing:
            raise ValueError(
                f"distillation={self.distillation!r} (DeiT's distillation token) needs {', '.join(missing)}."
            )

    def _check_input(self):
        if not self.include_rescaling and (self.pixel_mean is not None or self.pixel_std is not None):
            raise ValueError(
                "`pixel_mean` and `pixel_std` need include_rescaling=True. Received: include_rescaling=False"
            )
        mean, std = pixel_statistics(self.pixel_mean, self.pixel_std, self.num_channels)
        if self.pixel_mean is not None:
            object.__setattr__(self, "pixel_mean", tuple(float(v) for v in mean))
            object.__setattr__(self, "pixel_std", tuple(float(v) for v in std))
        preprocessing = self.preprocessing
        if preprocessing is None:
            return
        if not isinstance(preprocessing, Preprocessing):
            raise ValueError(
                f"`preprocessing` must be a keras_vit.Preprocessing or None. Received: {type(preprocessing).__name__}"
            )
        if preprocessing.image_size != self.image_size:
            raise ValueError(
                f"The preprocessing crops {preprocessing.image_size}, the model's image_size is {self.image_size}."
            )
        if self.include_rescaling:
            for name, model_value, value in (("mean", mean, preprocessing.mean), ("std", std, preprocessing.std)):
                try:
                    agree = np.allclose(np.asarray(value, np.float64), model_value)
                except ValueError:  # Shapes that do not broadcast.
                    agree = False
                if not agree:
                    raise ValueError(
                        f"The preprocessing's {name} {value} is not the model's pixel_{name} "
                        f"{tuple(float(v) for v in model_value)}."
                    )

    def _check_classes(self):
        if self.class_names is None:
            return
        if isinstance(self.class_names, str):
            raise ValueError(f"`class_names` must be a sequence of names. Received: {self.class_names!r}")
        names = tuple(str(name) for name in self.class_names)
        if len(names) != (self.num_classes or 0):
            raise ValueError(f"{len(names)} class names for a model with num_classes={self.num_classes}.")
        object.__setattr__(self, "class_names", names)

    # === Built from, read as ===

    @classmethod
    def from_variant(cls, variant, **fields):
        """The spec of `variant` ("B/16", "R50+B/16", "testing", ...) with `fields` set; `hidden_dim`,
        `num_layers`, `num_heads`, `mlp_dim` and `patch_size` win over the variant's table entry."""
        if "gelu" in fields:  # The field's name in configs saved before it was `activation` (`read_activation`).
            raise ValueError(
                f"The MLPs' activation is the field `activation`, one of {MLP_ACTIVATIONS}. Received: "
                f"gelu={fields['gelu']!r}"
            )
        architecture = {field.name for field in dataclasses.fields(ViTConfig)}
        own = {field.name for field in dataclasses.fields(cls)} - architecture
        # The sizes, and anything that is no field, to parse_variant: it takes OVERRIDABLE and names the rest.
        overrides = {name: fields.pop(name) for name in list(fields) if name not in own}
        config = parse_variant(variant, **overrides)
        try:
            return cls(**dataclasses.asdict(config), **fields)
        except ValueError as error:
            raise ValueError(f"{error} (variant {variant!r})") from None

    @property
    def config(self):
        """The transformer's sizes, as a `keras_vit.ViTConfig`."""
        return ViTConfig(self.hidden_dim, self.num_layers, self.num_heads, self.mlp_dim, self.patch_size,
                         self.resnet_layers)  # fmt: skip

    @property
    def stride(self):
        """How many pixels one step of the patch grid's input is: the ResNet stem's stride (1 without one)."""
        return 1 if self.resnet_layers is None else ResNetStem.stride(self.resnet_layers)

    @property
    def has_class_token(self):
        """Whether the token sequence starts with a class token (read by the classifier or not)."""
        return self.classifier in ("token", "token_gap") or bool(self.class_token)

    def replace(self, **changes):
        """A copy with `changes` (checked as a new spec is)."""
        return dataclasses.replace(self, **changes)

    def to_config(self):
        """The spec as JSON-compatible values (what `keras_vit.ViT.get_config` saves)."""
        config = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, tuple):
                value = list(value)
            config[field.name] = value
        if self.preprocessing is not None:
            config["preprocessing"] = {k: list(v) if isinstance(v, tuple) else v
                                       for k, v in dataclasses.asdict(self.preprocessing).items()}  # fmt: skip
        return config

    @classmethod
    def from_config(cls, config):
        """The spec that `to_config` wrote (a `gelu` entry, as files saved before the field was named
        `activation` hold it, is read as `activation`); unknown fields are refused by name."""
        config = read_activation(dict(config))
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"Unknown ViTSpec field(s) {unknown}. Expected a subset of {sorted(known)}.")
        if config.get("preprocessing") is not None:
            config["preprocessing"] = Preprocessing(**config["preprocessing"])
        return cls(**config)
