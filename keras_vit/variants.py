"""ViT variants as data: one table, parsed from paper notation.

A variant is written as in the ViT paper and its follow-ups: ``"<size>/<patch>"``,
e.g. ``"B/16"`` is ViT-Base with 16x16 patches.  The size names come from the
paper (Table 1: Base, Large, Huge) and from DeiT / AugReg (Tiny, Small).
``"testing"`` is the tiny configuration of the original implementation's unit
tests (hidden 10, one layer, two heads, MLP 10, patch 16).

Hybrids (paper section 3.1) put a ResNet in front of the transformer and cut
its feature map into patches: ``"R50+B/16"`` is a ResNet-50-like stem with
stages of (3, 4, 9) units (stride 16) and 1x1 patches.  Their names give the
effective patch size; the table below gives the stem and the real patch size,
as in the original implementation's configs.

>>> parse_variant("S/32")
ViTConfig(hidden_dim=384, num_layers=12, num_heads=6, mlp_dim=1536, patch_size=(32, 32), resnet_layers=None)
>>> parse_variant("R50+B/16").resnet_layers
(3, 4, 9)
>>> parse_variant("B/16", num_layers=6).num_layers
6
"""

import dataclasses
import re

# === Sizes ===
# (hidden_dim D, num_layers L, num_heads, mlp_dim).
MODEL_SIZES = {
    "Ti": (192, 12, 3, 768),
    "S": (384, 12, 6, 1536),
    "B": (768, 12, 12, 3072),
    "L": (1024, 24, 16, 4096),
    "H": (1280, 32, 16, 5120),
}

# The "testing" variant: size and patch together, as in vit_jax's test config.
TESTING = (10, 1, 2, 10, 16)

# Hybrids: name -> (size, ResNet stage sizes, patch size on the feature map).
HYBRIDS = {
    "R+Ti/16": ("Ti", (), 8),
    "R26+S/32": ("S", (2, 2, 2, 2), 1),
    "R26+B/32": ("B", (2, 2, 2, 2), 1),
    "R50+B/16": ("B", (3, 4, 9), 1),
    "R50+L/32": ("L", (3, 4, 6, 3), 1),
}

# The canonical variants: every one of them has its exact parameter count
# pinned by the tests (tests/test_variants.py).  Other patch sizes of a known
# size ("B/14") are accepted by `parse_variant` too.
VARIANTS = (
    "testing",
    "Ti/16",
    "S/16",
    "S/32",
    "B/8",
    "B/16",
    "B/32",
    "L/16",
    "L/32",
    "H/14",
    *HYBRIDS,
)

OVERRIDABLE = ("hidden_dim", "num_layers", "num_heads", "mlp_dim", "patch_size")

_VARIANT_RE = re.compile(r"^(?P<size>[A-Za-z]+)/(?P<patch>\d+)$")


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """Architecture of the transformer part of a ViT."""

    hidden_dim: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    patch_size: tuple
    resnet_layers: tuple = None  # ResNet stage sizes of a hybrid; None for a plain ViT.

    def __post_init__(self):
        for field in ("hidden_dim", "num_layers", "num_heads", "mlp_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"`{field}` must be a positive integer. Received: {field}={value!r}"
                )
        object.__setattr__(self, "patch_size", to_pair(self.patch_size, "patch_size"))
        if self.hidden_dim % self.num_heads:
            raise ValueError(
                "`hidden_dim` must be divisible by `num_heads`. Received: "
                f"hidden_dim={self.hidden_dim}, num_heads={self.num_heads}"
            )


def to_pair(value, name):
    """Returns `value` as a (height, width) pair of positive ints."""
    pair = (value, value) if isinstance(value, int) and not isinstance(value, bool) else value
    try:
        pair = tuple(pair)
    except TypeError:
        pair = None
    if (
        pair is None
        or len(pair) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in pair)
    ):
        raise ValueError(
            f"`{name}` must be a positive integer or a pair (height, width) of "
            f"positive integers. Received: {name}={value!r}"
        )
    return pair


def parse_variant(variant, **overrides):
    """Returns the `ViTConfig` of `variant` ("B/16", "Ti/16", "testing", ...).

    Keyword overrides (`hidden_dim`, `num_layers`, `num_heads`, `mlp_dim`,
    `patch_size`) win over the table.
    """
    unknown = sorted(set(overrides) - set(OVERRIDABLE))
    if unknown:
        raise ValueError(
            f"Unknown architecture override(s) {unknown}. Expected a subset of {list(OVERRIDABLE)}."
        )
    if not isinstance(variant, str):
        raise ValueError(
            f"`variant` must be a string such as 'B/16'. Received: variant={variant!r}"
        )
    resnet_layers = None
    if variant == "testing":
        hidden_dim, num_layers, num_heads, mlp_dim, patch = TESTING
    elif variant in HYBRIDS:
        size, resnet_layers, patch = HYBRIDS[variant]
        hidden_dim, num_layers, num_heads, mlp_dim = MODEL_SIZES[size]
    else:
        match = _VARIANT_RE.match(variant)
        if not match or match["size"] not in MODEL_SIZES:
            raise ValueError(
                f"Unknown ViT variant {variant!r}. Expected '<size>/<patch size>' with size "
                f"in {list(MODEL_SIZES)} (e.g. 'B/16'), a hybrid in {list(HYBRIDS)}, or 'testing'. "
                f"Canonical variants: {list(VARIANTS)}"
            )
        hidden_dim, num_layers, num_heads, mlp_dim = MODEL_SIZES[match["size"]]
        patch = int(match["patch"])
    values = dict(
        hidden_dim=hidden_dim,
        num_layers=num_layers,
        num_heads=num_heads,
        mlp_dim=mlp_dim,
        patch_size=patch,
        resnet_layers=resnet_layers,
    )
    values.update({k: v for k, v in overrides.items() if v is not None})
    return ViTConfig(**values)
