"""`ViTSpec` is where the model's options are defined: each documented once there, `build_vit` a thin call on
it, and the defaults that docs/model.md lists are the spec's."""

import ast
import dataclasses
import inspect
import re

import keras
import pytest

import keras_vit
from keras_vit import ViTSpec
from tests.conftest import ROOT


def test_every_field_is_documented_on_the_spec():
    doc = inspect.getdoc(ViTSpec)
    missing = [field.name for field in dataclasses.fields(ViTSpec) if not re.search(rf"\b{field.name}\b", doc)]
    assert not missing, missing
    assert list(inspect.signature(keras_vit.build_vit).parameters) == ["variant", "name", "fields"]


def test_the_defaults_docs_list_are_the_specs():
    text = (ROOT / "docs" / "model.md").read_text()
    listed = text.split("with these defaults:", 1)[1].split("\n\n", 1)[0]
    documented = dict(re.findall(r"`(\w+)=([^`]+)`", listed))
    defaults = {field.name: field.default for field in dataclasses.fields(ViTSpec)
                if field.default is not dataclasses.MISSING and field.name != "resnet_layers"}  # fmt: skip
    assert set(documented) == set(defaults)
    for name, value in documented.items():
        expected = defaults[name][0] if name == "image_size" else defaults[name]  # 224 stands for (224, 224)
        assert ast.literal_eval(value) == expected, name


def test_build_vit_is_the_model_of_the_spec_with_its_errors():
    model = keras_vit.build_vit("testing", image_size=16, num_classes=3, classifier="gap", layer_scale=0.1)
    assert model.spec == ViTSpec.from_variant("testing", image_size=16, num_classes=3, classifier="gap",
                                              layer_scale=0.1)  # fmt: skip
    assert model.name == "vit_testing" and keras_vit.build_vit("testing", image_size=16, name="m").name == "m"
    assert keras_vit.build_vit("testing", image_size=16, hidden_dim=8, num_heads=2).spec.hidden_dim == 8
    with pytest.raises(ValueError, match=r"Unknown architecture override\(s\) \['bogus'\]"):
        keras_vit.build_vit("testing", bogus=1)
    refused = r"`classifier` must be one of .*Received: classifier='cls' \(variant 'S/16'\)"
    with pytest.raises(ValueError, match=refused):
        keras_vit.build_vit("S/16", classifier="cls")
    with pytest.raises(TypeError):
        keras_vit.build_vit("testing", 32)
    keras.backend.clear_session()


@pytest.mark.parametrize("word, activation", [("exact", "gelu"), ("tanh", "gelu_tanh"), ("quick", "quick_gelu"),
                                              ("silu", "silu")])  # fmt: skip
def test_configs_that_name_the_activation_gelu_read_as_activation(word, activation):
    """A spec's, a block's or a MAP head's config saved with `gelu` (in its words) builds the same activation."""
    config = ViTSpec.from_variant("testing", image_size=16).to_config()
    config["gelu"] = word
    del config["activation"]
    assert ViTSpec.from_config(config).activation == activation
    for layer in (keras_vit.layers.TransformerBlock(2, 8), keras_vit.layers.MAPHead(2, 8)):
        layer_config = layer.get_config()
        layer_config["gelu"] = word
        del layer_config["activation"]
        assert type(layer).from_config(layer_config).activation == activation


def test_a_saved_gelu_that_names_no_activation_is_refused():
    config = ViTSpec.from_variant("testing", image_size=16).to_config()
    config["gelu"] = "erf"
    del config["activation"]
    with pytest.raises(ValueError, match=r"saved `gelu` must be one of \('exact', 'tanh', 'quick', 'silu'\).*'erf'"):
        ViTSpec.from_config(config)
