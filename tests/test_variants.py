import keras
import pytest

import keras_vit
from keras_vit.variants import MODEL_SIZES
from tests.builders import PARAMS_GAP

# Exact parameter counts: 1000-class head, 224 px, no pre-logits. Source:
# google-research/vision_transformer vit_jax/models_test.py (also the ViT paper, Table 1).
PARAMS_TOKEN = {
    "testing": 21_390,
    "Ti/16": 5_717_416,
    "S/16": 22_050_664,
    "S/32": 22_878_952,
    "B/8": 86_576_872,
    "B/16": 86_567_656,
    "B/32": 88_224_232,
    "L/16": 304_326_632,
    "L/32": 306_535_400,
    "H/14": 632_045_800,
    "R+Ti/16": 6_337_704,
    "R26+S/32": 36_431_912,
    "R26+B/32": 101_383_976,
    "R50+B/16": 98_659_112,
    "R50+L/32": 328_994_856,
}


def test_every_registered_variant_has_a_pinned_count():
    missing = sorted(set(keras_vit.VARIANTS) - set(PARAMS_TOKEN))
    assert not missing, f"variants registered without an exact parameter count: {missing}"
    sizes = {v.split("/")[0] for v in keras_vit.VARIANTS if "/" in v and "+" not in v}
    assert sizes == set(MODEL_SIZES), "every model size needs at least one pinned variant"


# === The counts written out from the paper's architecture ===

# Hidden width, depth, MLP width of each size (the paper's Table 1) and the hybrids' ResNet stages, written out
# here rather than read from keras_vit.variants.
SIZES = {"Ti": (192, 12, 768), "S": (384, 12, 1536), "B": (768, 12, 3072), "L": (1024, 24, 4096),
         "H": (1280, 32, 5120)}  # fmt: skip
# Each hybrid: its ResNet stage sizes and the patch size on the ResNet's feature map (vit_jax/configs/models.py).
HYBRID_STEMS = {"R+Ti/16": ((), 8), "R26+S/32": ((2, 2, 2, 2), 1), "R26+B/32": ((2, 2, 2, 2), 1),
                "R50+B/16": ((3, 4, 9), 1), "R50+L/32": ((3, 4, 6, 3), 1)}  # fmt: skip


def transformer_parameters(hidden, layers, mlp, patch, channels, grid, classes=1000, classifier="token"):
    """Patch embedding, class token, position embeddings, the blocks, the final norm and the head."""
    tokens = grid * grid + (classifier == "token")
    embedding = patch * patch * channels * hidden + hidden + hidden * (classifier == "token") + tokens * hidden
    attention = 3 * hidden * hidden + 3 * hidden + hidden * hidden + hidden  # QKV and output, with biases
    block = 2 * 2 * hidden + attention + hidden * mlp + mlp + mlp * hidden + hidden  # two LayerNorms, the MLP
    return embedding + layers * block + 2 * hidden + hidden * classes + classes


def resnet_parameters(stages):
    """BiT's ResNet stem: a 7x7 root conv (no bias) with GroupNorm, then bottleneck units (1x1, 3x3, 1x1 with 4x
    expansion, each conv with GroupNorm, a 1x1 projection where the shape changes). (parameters, channels out)."""
    width = 64
    total, channels = 7 * 7 * 3 * width + 2 * width, width
    for stage, units in enumerate(stages):
        features = width * 2**stage
        for unit in range(units):
            total += channels * features + 9 * features * features + features * 4 * features + 2 * 6 * features
            if unit == 0:  # The channels change (stage 1) or the stride is 2 (the later stages).
                total += channels * 4 * features + 2 * 4 * features
            channels = 4 * features
    return total, channels


def expected_parameters(variant, classifier="token", image_size=224):
    if variant == "testing":
        return transformer_parameters(10, 1, 10, 16, 3, image_size // 16, classifier=classifier)
    name, patch = variant.split("/")
    if "+" not in name:
        return transformer_parameters(*SIZES[name], int(patch), 3, image_size // int(patch), classifier=classifier)
    stages, feature_patch = HYBRID_STEMS[variant]
    resnet, channels = resnet_parameters(stages)
    stride = 4 * 2 ** max(len(stages) - 1, 0)  # the root's 4, then 2 per stage after the first
    grid = image_size // (stride * feature_patch)
    size = SIZES[name.split("+")[1]]
    return resnet + transformer_parameters(*size, feature_patch, channels, grid, classifier=classifier)


@pytest.mark.parametrize("variant", list(PARAMS_TOKEN))
def test_the_written_out_count_is_the_pinned_count(variant):
    assert expected_parameters(variant) == PARAMS_TOKEN[variant]
    if variant in PARAMS_GAP:
        assert expected_parameters(variant, classifier="gap") == PARAMS_GAP[variant]


# === Real builds: every variant up to 40M parameters here, one large one in the slow tier ===

BUILT = [v for v in PARAMS_TOKEN if PARAMS_TOKEN[v] < 40_000_000]


@pytest.mark.parametrize("variant", [*BUILT, pytest.param("R50+L/32", marks=pytest.mark.slow)])
def test_parameter_count_token(variant):
    model = keras_vit.build_vit(variant)
    assert model.count_params() == PARAMS_TOKEN[variant] == expected_parameters(variant)
    keras.backend.clear_session()


@pytest.mark.parametrize("variant", [v for v in PARAMS_GAP if v in BUILT])
def test_parameter_count_gap(variant):
    model = keras_vit.build_vit(variant, classifier="gap")
    assert model.count_params() == PARAMS_GAP[variant] == expected_parameters(variant, classifier="gap")
    keras.backend.clear_session()


def test_the_counts_follow_the_image_size_and_the_patch_size():
    """Position embeddings grow with the grid, the patch embedding with the patch: the written-out count
    against real builds of sizes and patches the pinned table does not have."""
    for variant, image_size in (("Ti/8", 64), ("S/14", 112), ("testing", 48)):
        model = keras_vit.build_vit(variant, image_size=image_size)
        assert model.count_params() == expected_parameters(variant, image_size=image_size), variant
    keras.backend.clear_session()


def test_representation_size_and_backbone_counts():
    dim = 384
    base = PARAMS_TOKEN["S/16"]
    with_pre_logits = keras_vit.build_vit("S/16", representation_size=dim)
    assert with_pre_logits.count_params() == base + dim * dim + dim
    backbone = keras_vit.build_vit("S/16", num_classes=None)
    assert backbone.count_params() == base - (dim * 1000 + 1000)
    assert backbone.output_shape == (None, dim)
    keras.backend.clear_session()


def test_hybrid_structure():
    config = keras_vit.parse_variant("R50+B/16")
    assert config.resnet_layers == (3, 4, 9) and config.patch_size == (1, 1)
    model = keras_vit.build_vit("R50+B/16", num_classes=None, num_layers=1)  # the stem and embedding in full
    assert model.get_layer("resnet").compute_output_shape((None, 224, 224, 3)) == (None, 14, 14, 1024)
    assert model.get_layer("patch_encoder").position_embedding.shape == (1, 197, 768)
    with pytest.raises(ValueError, match=r"times the ResNet stride 16.*image_size=200"):
        keras_vit.build_vit("R50+B/16", image_size=200)
    keras.backend.clear_session()


def test_parse_variant_table_and_overrides():
    config = keras_vit.parse_variant("L/32")
    assert (config.hidden_dim, config.num_layers, config.num_heads, config.mlp_dim) == (
        1024, 24, 16, 4096,
    )
    assert config.patch_size == (32, 32)
    config = keras_vit.parse_variant("B/16", num_layers=3, patch_size=(8, 4), hidden_dim=96)
    assert (config.num_layers, config.patch_size, config.hidden_dim) == (3, (8, 4), 96)
    assert keras_vit.parse_variant("B/14").patch_size == (14, 14)


@pytest.mark.parametrize(
    "variant, fragment",
    [("Q/16", "'Q/16'"), ("B16", "'B16'"), ("B/x", "'B/x'"), ("", "''"), (16, "16")],
)
def test_unknown_variant_raises(variant, fragment):
    with pytest.raises(ValueError, match="variant") as info:
        keras_vit.build_vit(variant)
    assert fragment in str(info.value)


def test_unknown_override_raises():
    with pytest.raises(ValueError, match=r"depth.*Expected a subset"):
        keras_vit.build_vit("B/16", depth=3)
