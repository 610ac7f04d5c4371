"""transformers' ViT state dicts (`ViTForImageClassification`, `ViTModel`): read by `load_pretrained`,
written by `save_transformers`, exactly, and checked against a NumPy forward pass of a file written by hand
in transformers' names and layouts."""

import json
import re

import numpy as np
import pytest
from safetensors.numpy import save_file

import keras_vit
from keras_vit import checkpoints
from keras_vit.testing import random_images, randomize_weights
from tests.builders import (
    HAND_WRITTEN,
    HEADS,
    LAYERS,
    MLP,
    PATCH,
    SIDE,
    D,
    hand_written_state_dict,
    small_vit,
    transformers_numpy_params,
)
from tests.numpy_vit import vit_forward


def transformers_keys(layers, prefix="vit."):
    """The keys of a ViTForImageClassification state dict, as transformers names them."""
    keys = [f"{prefix}embeddings.{name}" for name in (
        "cls_token", "position_embeddings", "patch_embeddings.projection.weight", "patch_embeddings.projection.bias"
    )]
    for i in range(layers):
        for module in ("attention.attention.query", "attention.attention.key", "attention.attention.value",
                       "attention.output.dense", "intermediate.dense", "output.dense", "layernorm_before",
                       "layernorm_after"):
            keys += [f"{prefix}encoder.layer.{i}.{module}.weight", f"{prefix}encoder.layer.{i}.{module}.bias"]
    return keys + [f"{prefix}layernorm.weight", f"{prefix}layernorm.bias", "classifier.weight", "classifier.bias"]


def test_a_file_in_transformers_names_gives_the_numpy_forward_pass(tmp_path):
    state = hand_written_state_dict()
    assert sorted(state) == sorted(transformers_keys(LAYERS))
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = small_vit(**HAND_WRITTEN)
    assert keras_vit.load_pretrained(model, str(tmp_path / "model.safetensors")) == []
    images = random_images((3, SIDE, SIDE, 3), seed=1)
    expected = vit_forward(transformers_numpy_params(state), LAYERS, images)
    np.testing.assert_allclose(model.predict(images, verbose=0), expected, atol=1e-4)
    assert np.ptp(expected, axis=0).max() > 0.1  # the images are told apart: the check can fail


def test_save_transformers_writes_their_names_config_and_labels_and_reads_back_exactly(tmp_path):
    model = randomize_weights(small_vit(**HAND_WRITTEN), scale=0.2)
    folder = keras_vit.save_transformers(model, tmp_path / "vit", class_names=list("abcde"))
    state = checkpoints.read_checkpoint(f"{folder}/model.safetensors")
    assert sorted(state) == sorted(transformers_keys(LAYERS))
    assert state["vit.encoder.layer.1.intermediate.dense.weight"].shape == (MLP, D)
    assert state["vit.embeddings.patch_embeddings.projection.weight"].shape == (D, 3, PATCH, PATCH)
    config = json.loads((tmp_path / "vit" / "config.json").read_text())
    assert config["architectures"] == ["ViTForImageClassification"] and config["model_type"] == "vit"
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]) == (D, LAYERS, HEADS)
    assert (config["intermediate_size"], config["image_size"], config["patch_size"]) == (MLP, SIDE, PATCH)
    assert config["hidden_act"] == "gelu" and config["qkv_bias"] is True
    assert config["id2label"] == {str(i): name for i, name in enumerate("abcde")}
    assert config["label2id"]["c"] == 2
    again = small_vit(**HAND_WRITTEN)
    assert keras_vit.load_pretrained(again, f"{folder}/model.safetensors") == []
    for a, b in zip(model.weights, again.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    # The layouts: transformers' -> timm's -> transformers' is the identity.
    timm_state, _ = checkpoints.from_transformers(state)
    back = checkpoints.to_transformers(timm_state)
    assert sorted(back) == sorted(state) and all(np.array_equal(back[k], state[k]) for k in state)


def test_a_vitmodel_file_loads_its_pooler_as_the_pre_logits(tmp_path):
    """ViTModel (no `vit.` prefix, a pooler, no classifier): the pooler is the original representation layer."""
    state = {key.removeprefix("vit."): value for key, value in hand_written_state_dict().items()
             if not key.startswith("classifier.")}
    rng = np.random.default_rng(3)
    state["pooler.dense.weight"], state["pooler.dense.bias"] = rng.normal(0, 0.3, (D, D)), rng.normal(0, 0.3, D)
    state["embeddings.mask_token"] = np.zeros((1, 1, D))
    timm_state, notes = checkpoints.from_transformers(state)
    assert "pre_logits.fc.weight" in timm_state and any("mask_token" in note for note in notes)
    save_file({k: np.asarray(v, np.float32) for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    model = small_vit(**{**HAND_WRITTEN, "num_classes": 0}, representation_size=D)
    keras_vit.load_pretrained(model, str(tmp_path / "model.safetensors"))
    np.testing.assert_allclose(model.get_layer("pre_logits").kernel.numpy(), state["pooler.dense.weight"].T, atol=1e-7)


def test_what_transformers_cannot_hold_is_refused_by_name(tmp_path):
    state = hand_written_state_dict()
    state["vit.encoder.layer.0.attention.attention.q_norm.weight"] = np.ones(D, np.float32)
    save_file(state, str(tmp_path / "model.safetensors"))
    model = small_vit(**HAND_WRITTEN)
    before = [w.numpy() for w in model.weights]
    with pytest.raises(checkpoints.CheckpointError, match=r"no place for.*q_norm"):
        keras_vit.load_pretrained(model, str(tmp_path / "model.safetensors"))
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(before, model.weights))
    # A missing key is named as transformers names it.
    state = hand_written_state_dict()
    del state["vit.encoder.layer.1.output.dense.bias"]
    save_file(state, str(tmp_path / "missing.safetensors"))
    with pytest.raises(checkpoints.CheckpointError, match=re.escape("vit.encoder.layer.1.output.dense.bias")):
        keras_vit.load_pretrained(model, str(tmp_path / "missing.safetensors"))
    for options, named in (({"classifier": "gap"}, "classifier='token'"),
                           ({"position_embedding": "sincos2d"}, "position_embedding='learned'"),
                           ({"representation_size": 8}, "representation_size=None"),
                           ({"pre_norm": True}, "pre_norm=False"),
                           ({"layer_scale": 1e-5}, "layer_scale=None, num_registers=0 and distillation=None"),
                           ({"num_registers": 2}, "num_registers=0"), ({"distillation": "token"}, "distillation=None"),
                           ({"classifier": "token_gap"}, "classifier='token'"),
                           ({"norm": "rms"}, "norm='layer'"), ({"mlp": "swiglu"}, "mlp='plain'"),
                           ({"parallel": 2}, "parallel=1"), ({"patch_norm": True}, "patch_norm=False")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(named)):
            keras_vit.save_transformers(small_vit(**options), tmp_path / "refused")
    with pytest.raises(ValueError, match="`class_names` has 2 names, the model has 5 classes"):
        keras_vit.save_transformers(small_vit(), tmp_path / "refused", class_names=["a", "b"])


def test_save_transformers_writes_the_options_its_layout_holds(tmp_path):
    """ViT's layout holds query, key and value without biases (`qkv_bias` in the config) and the quick GELU
    (`hidden_act="quick_gelu"`): written, and read back to the same model."""
    model = randomize_weights(small_vit(**HAND_WRITTEN, qkv_bias=False, activation="quick_gelu"), seed=4)
    keras_vit.save_transformers(model, tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["qkv_bias"] is False and config["hidden_act"] == "quick_gelu"
    assert not any(key.endswith(("query.bias", "key.bias", "value.bias"))
                   for key in checkpoints.read_checkpoint(str(tmp_path / "saved" / "model.safetensors")))  # fmt: skip
    loaded = keras_vit.from_pretrained(tmp_path / "saved")
    assert loaded.spec.qkv_bias is False and loaded.spec.activation == "quick_gelu"
    images = random_images((2, SIDE, SIDE, 3))
    np.testing.assert_allclose(loaded.predict(images, verbose=0), model.predict(images, verbose=0), atol=1e-5)
