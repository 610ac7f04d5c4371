"""The options of the ViT family beyond the paper (LayerScale, registers, qkv_bias, the GELUs, RMSNorm, SwiGLU, the
patch norm, Sub-LN, parallel blocks, distillation): each against the NumPy reference, its parameter count, the values
it refuses, and the default model without any of them."""

import re

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit.testing import random_images, randomize_weights
from tests import numpy_vit
from tests.builders import SMALL, small_vit

# The options of the ViT family beyond the paper, each alone and together, as DINOv2 (with registers), DeiT III,
# OpenAI CLIP and timm's qkv_bias=False models combine them.
FAMILY_OPTIONS = {
    "layer_scale": dict(layer_scale=1e-5),
    "registers": dict(num_registers=3),
    "registers_gap": dict(num_registers=2, classifier="gap"),
    "no_qkv_bias": dict(qkv_bias=False),
    "quick_gelu": dict(activation="quick_gelu"),
    "silu": dict(activation="silu"),
    "dinov2_registers": dict(layer_scale=1e-5, num_registers=4),
    "distilled": dict(distillation="head"),
    "distillation_token": dict(distillation="token"),
    "rms_norm": dict(norm="rms"),
    "swiglu": dict(mlp="swiglu"),
    "aimv2": dict(norm="rms", patch_norm=True, mlp="swiglu", qkv_bias=False, classifier="gap"),
    "unpooled_class_token": dict(classifier="gap", class_token=True),
    "sub_norms": dict(sub_norms=True),
    "parallel": dict(parallel=2, layer_scale=1e-5),
    "beit3": dict(sub_norms=True, classifier="gap", class_token=True),
}


@pytest.mark.parametrize("name", list(FAMILY_OPTIONS))
def test_family_options_match_the_numpy_reference_and_survive_saving(name, tmp_path):
    """Each option against the NumPy reference written from its paper within 1e-5, clearly apart from the
    model without it (the same weights where both have them), and restored whole by `load_model`."""
    kwargs = FAMILY_OPTIONS[name]
    model = randomize_weights(small_vit(**kwargs))
    images = random_images((3, 16, 16, 3))
    params, num_layers = numpy_vit.params_from_model(model)
    activation = {"quick_gelu": numpy_vit.gelu_quick, "silu": numpy_vit.silu}.get(kwargs.get("activation"))
    classifier = kwargs.get("classifier", "token")
    expected = numpy_vit.vit_forward(params, num_layers, images, classifier=classifier, activation=activation)
    got = model.predict(images, verbose=0)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert np.ptp(expected, axis=0).max() > 0.1
    # Without the option (the options' own weights dropped, the rest kept): other logits.
    plain = {k: v for k, v in params.items() if not k.endswith(("_scale", "registers", "dist", "cls"))
             and not k.startswith(("head_distillation", "embedding_norm")) and "Gate_0" not in k
             and "sub_norm" not in k and not re.match(r"encoderblock_\d+_\d+/", k)}  # fmt: skip
    for key in [k for k in plain if k.endswith("/scale") and k[: -len("scale")] + "bias" not in plain]:
        plain[key[: -len("scale")] + "bias"] = np.zeros_like(plain[key])  # RMSNorm -> LayerNorm
    if "dist" in params:  # Without the token: its position row goes too.
        plain["pos_embedding"] = np.delete(params["pos_embedding"], 1, axis=1)
    if classifier == "token":
        plain["cls"] = params["cls"]
    elif "cls" in params:  # The unread class token: without it (and its position row), other logits.
        plain["pos_embedding"] = plain["pos_embedding"][:, 1:]
    if kwargs.get("qkv_bias") is False:
        plain = {**plain, **{k.replace("/kernel", "/bias"): np.full(v.shape[1:], 0.3) for k, v in plain.items()
                             if k.endswith(("query/kernel", "key/kernel", "value/kernel"))}}  # fmt: skip
    without = numpy_vit.vit_forward(plain, num_layers, images, classifier=classifier,
                                    activation=None if activation is not None else numpy_vit.gelu_quick)  # fmt: skip
    assert np.abs(without - expected).max() > 1e-3
    model.save(tmp_path / "model.keras")
    reloaded = keras.saving.load_model(tmp_path / "model.keras")
    assert reloaded.spec == model.spec
    np.testing.assert_array_equal(reloaded.predict(images, verbose=0), got)


DIM, LAYERS, MLP = SMALL["hidden_dim"], SMALL["num_layers"], SMALL["mlp_dim"]


def blocks_parameters(model):
    return sum(model.get_layer(f"encoderblock_{i}").count_params() for i in range(LAYERS))


# What each option adds to the parameter count of the model without it (the default model, or `than`).
@pytest.mark.parametrize(
    "options, added, than",
    [
        pytest.param(dict(layer_scale=1e-6), 2 * DIM * LAYERS, {}, id="layer_scale"),  # 2 D per block
        pytest.param(dict(num_registers=4), 4 * DIM, {}, id="num_registers"),  # R D
        pytest.param(dict(qkv_bias=False), -3 * DIM * LAYERS, {}, id="qkv_bias=False"),  # 3 D per block
        pytest.param(dict(activation="quick_gelu"), 0, {}, id="activation=quick_gelu"),
        pytest.param(dict(activation="silu"), 0, {}, id="activation=silu"),
        # RMSNorm: no bias in its 2 L + 1 norms.
        pytest.param(dict(norm="rms"), -DIM * (2 * LAYERS + 1), {}, id="norm=rms"),
        # SwiGLU: a gate as large as the first MLP layer.
        pytest.param(dict(mlp="swiglu"), LAYERS * (DIM + 1) * MLP, {}, id="mlp=swiglu"),
        pytest.param(dict(patch_norm=True), 2 * DIM, {}, id="patch_norm"),
        # Sub-LN: a norm of D and one of the MLP's width per block.
        pytest.param(dict(sub_norms=True), 2 * LAYERS * (DIM + MLP), {}, id="sub_norms"),
        # Each block's weights twice.
        pytest.param(dict(parallel=2), blocks_parameters, {}, id="parallel"),
        # The token and its position row; with "head", a second head of the same size as the first (5 classes).
        pytest.param(dict(distillation="token"), 2 * DIM, {}, id="distillation=token"),
        pytest.param(dict(distillation="head"), 2 * DIM + 5 * DIM + 5, {}, id="distillation=head"),
        # A MAP head's norm follows `norm`: an RMSNorm has no bias, in the blocks, the encoder and the head.
        pytest.param(dict(classifier="map", norm="rms"), -DIM * (2 * LAYERS + 2), dict(classifier="map"),
                     id="classifier=map,norm=rms"),
    ],
)  # fmt: skip
def test_each_family_option_has_its_parameter_count(options, added, than):
    without = small_vit(**than)
    added = added(without) if callable(added) else added
    assert small_vit(**options).count_params() == without.count_params() + added


@pytest.mark.parametrize(
    "options, message",
    [
        pytest.param(dict(distillation="head", classifier="gap"), "needs classifier='token'",
                     id="distillation=head,classifier=gap"),
        pytest.param(dict(distillation="head", num_classes=0), r"needs num_classes \(the heads\)",
                     id="distillation=head,num_classes=0"),
        pytest.param(dict(layer_scale=0.0), "layer_scale", id="layer_scale=0"),
        pytest.param(dict(num_registers=-1), "num_registers", id="num_registers=-1"),
        pytest.param(dict(activation="swish"), "quick_gelu", id="activation=swish"),
    ],
)  # fmt: skip
def test_family_options_refuse_what_they_cannot_take(options, message):
    with pytest.raises(ValueError, match=message):
        small_vit(**options)


def test_a_distilled_model_takes_representation_size_0_as_none():
    assert small_vit(distillation="head", representation_size=0).spec.representation_size is None


def test_the_default_model_has_none_of_the_options_weights():
    """The default model's layers, weights and config carry no LayerScale, register or qkv_bias=False."""
    base = small_vit()
    names = {w.path for w in base.weights}
    assert not any(("scale" in n and "norm" not in n) or "register" in n for n in names), names
    block = base.get_layer("encoderblock_0").get_config()
    assert block["layer_scale"] is None and block["qkv_bias"] is True
    assert base.get_layer("patch_encoder").get_config()["num_registers"] == 0


def test_a_distilled_models_heads_are_replaced_and_trained_together(tmp_path):
    """replace_head gives a distilled model two new heads (and a backbone keeps the token without its head);
    freeze_backbone leaves both heads trainable."""
    model = randomize_weights(small_vit(distillation="head"))
    ten = keras_vit.replace_head(model, 10)
    assert ten.output_shape == (None, 10) and ten.spec.distillation == "head"
    assert not np.any(ten.get_layer("head_distillation").kernel.numpy())
    assert ten.get_layer("encoderblock_0") is model.get_layer("encoderblock_0")
    backbone = keras_vit.replace_head(model, None)
    assert backbone.spec.distillation == "token" and backbone.output_shape == (None, SMALL["hidden_dim"])
    keras_vit.freeze_backbone(ten)
    assert {layer.name for layer in ten.layers if layer.trainable} == {"head", "head_distillation", "distilled_logits"}
