import keras
import pytest

import keras_vit
from keras_vit.variants import MODEL_SIZES

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
PARAMS_GAP = {
    "S/16": 22_049_896,
    "S/32": 22_878_184,
    "B/16": 86_566_120,
    "B/32": 88_222_696,
}


def test_every_registered_variant_has_a_pinned_count():
    missing = sorted(set(keras_vit.VARIANTS) - set(PARAMS_TOKEN))
    assert not missing, f"variants registered without an exact parameter count: {missing}"
    sizes = {v.split("/")[0] for v in keras_vit.VARIANTS if "/" in v and "+" not in v}
    assert sizes == set(MODEL_SIZES), "every model size needs at least one pinned variant"


@pytest.mark.parametrize(
    "variant", [pytest.param(v, marks=pytest.mark.slow) if v.startswith("H/") else v for v in PARAMS_TOKEN]
)
def test_parameter_count_token(variant):
    model = keras_vit.build_vit(variant)
    assert model.count_params() == PARAMS_TOKEN[variant]
    keras.backend.clear_session()


@pytest.mark.parametrize("variant", list(PARAMS_GAP))
def test_parameter_count_gap(variant):
    model = keras_vit.build_vit(variant, classifier="gap")
    assert model.count_params() == PARAMS_GAP[variant]
    keras.backend.clear_session()


def test_representation_size_and_backbone_counts():
    dim = 768
    base = PARAMS_TOKEN["B/16"]
    with_pre_logits = keras_vit.build_vit("B/16", representation_size=dim)
    assert with_pre_logits.count_params() == base + dim * dim + dim
    backbone = keras_vit.build_vit("B/16", num_classes=None)
    assert backbone.count_params() == base - (dim * 1000 + 1000)
    assert backbone.output_shape == (None, dim)
    keras.backend.clear_session()


def test_hybrid_structure():
    config = keras_vit.parse_variant("R50+B/16")
    assert config.resnet_layers == (3, 4, 9) and config.patch_size == (1, 1)
    model = keras_vit.build_vit("R50+B/16", num_classes=None)
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
