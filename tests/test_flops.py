"""`count_flops` against the matmuls and convolutions TensorFlow actually runs."""

import pytest

import keras_vit
from keras_vit.flops import count_flops
from tests.builders import graph_flops


@pytest.mark.parametrize(
    "variant, image_size, kwargs",
    [
        ("testing", 32, {}),
        ("testing", (48, 32), dict(classifier="gap", num_classes=7)),
        ("testing", 32, dict(representation_size=6, num_classes=None)),
        ("testing", 64, dict(hidden_dim=12, num_heads=3, mlp_dim=20, num_layers=2, patch_size=8)),
        ("R+Ti/16", 32, dict(num_layers=1)),
        ("R26+S/32", 64, dict(num_layers=1)),
    ],
)
def test_count_flops_matches_the_traced_graph(variant, image_size, kwargs):
    model = keras_vit.build_vit(variant, image_size=image_size, **kwargs)
    flops = count_flops(variant, image_size=image_size, **kwargs)
    assert flops == graph_flops(model, image_size)
    assert count_flops(variant, image_size=image_size, training=True, **kwargs) == 3 * flops


def test_count_flops_of_the_paper_models():
    # 17.6 GMACs for B/16 at 224 px (timm's model card), 4.6 for S/16, 1.3 for Ti/16.
    assert count_flops("B/16") == 35_127_656_448
    assert round(count_flops("S/16") / 2e9, 1) == 4.6
    assert round(count_flops("Ti/16") / 2e9, 1) == 1.3


def test_count_flops_rejects_an_image_size_the_model_rejects():
    with pytest.raises(ValueError, match=r"divisible by the patch size.*Received: image_size=100"):
        count_flops("B/16", image_size=100)
    with pytest.raises(ValueError, match=r"ResNet stride"):
        count_flops("R50+B/16", image_size=200)
