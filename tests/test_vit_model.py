"""`keras_vit.ViT` and its `ViTSpec`: what the model is (architecture, preprocessing, class names) is saved with
it and survives `keras.models.load_model`, model surgery and export."""

import dataclasses
import json
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit import ViT, ViTSpec
from keras_vit.testing import random_images, randomize_weights
from tests.builders import CLASSES, IMAGENET_MEAN, IMAGENET_STD, SIDE, serve_all, small_vit, timm_folder
from tests.conftest import ROOT

# In a fresh interpreter: the saved model loaded with Keras' own function (keras_vit imported, no custom_objects),
# what it says of itself, its logits, the pixels its preprocessing makes of a photo, and its SavedModel.
RELOAD = r"""
import json, sys
import numpy as np
import keras
import keras_vit
from keras_vit.data import decode_image
from keras_vit.export import export_saved_model

path, out = sys.argv[1], sys.argv[2]
model = keras.models.load_model(path)
inputs = np.load(out + "/inputs.npz")
spec = model.spec
print(json.dumps({"class": type(model).__name__, "name": model.name, "class_names": list(model.class_names),
                  "spec": spec.to_config()}))
np.savez(out + "/reloaded.npz", logits=model.predict(inputs["images"], verbose=0),
         pixels=model.preprocessing(decode_image(inputs["photo"].tobytes())).numpy())
export_saved_model(model, out + "/reloaded_saved_model")
"""


def jpeg(shape, seed):
    import tensorflow as tf

    return tf.io.encode_jpeg(random_images(shape, seed=seed).astype(np.uint8), quality=90).numpy()


@pytest.mark.slow
def test_a_pretrained_model_saved_and_loaded_in_a_fresh_process_keeps_what_it_is(tmp_path):
    """timm hub folder -> from_pretrained -> save -> keras.models.load_model in another process: the same
    preprocessing (the same pixels for a photo), class names and logits; the SavedModel exported from the
    reloaded model serves a JPEG as the original's does."""
    from keras_vit.data import decode_image
    from keras_vit.export import export_saved_model

    timm_folder(tmp_path / "deit")
    model = keras_vit.from_pretrained(tmp_path / "deit")
    assert isinstance(model, ViT)
    model.save(tmp_path / "deit.keras")
    photo = jpeg((61, 83, 3), seed=3)  # Another size and aspect: resized (bicubic, crop 0.9) and cropped.
    images = random_images((3, SIDE, SIDE, 3), seed=5).astype(np.uint8)
    np.savez(tmp_path / "inputs.npz", images=images, photo=np.frombuffer(photo, np.uint8))
    result = subprocess.run([sys.executable, "-c", RELOAD, str(tmp_path / "deit.keras"), str(tmp_path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, env={"TF_CPP_MIN_LOG_LEVEL": "2",
                            "PATH": "/usr/bin:/bin", "KERAS_BACKEND": "tensorflow"})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    said = json.loads(result.stdout.strip().splitlines()[-1])
    assert said["class"] == "ViT" and said["name"] == model.name
    assert said["class_names"] == [f"timm {i}" for i in range(CLASSES)] == list(model.class_names)
    assert ViTSpec.from_config(said["spec"]) == model.spec
    assert ViTSpec.from_config(said["spec"]).preprocessing == keras_vit.Preprocessing(
        (SIDE, SIDE), (26, 26), interpolation="bicubic", mean=IMAGENET_MEAN, std=IMAGENET_STD
    )
    reloaded = np.load(tmp_path / "reloaded.npz")
    np.testing.assert_array_equal(reloaded["pixels"], model.preprocessing(decode_image(photo)).numpy())
    np.testing.assert_array_equal(reloaded["logits"], model.predict(images, verbose=0))

    export_saved_model(model, tmp_path / "original_saved_model")
    served = serve_all({
        name: ("saved_model", tmp_path / f"{name}_saved_model", {"images": images, "encoded": np.array([photo])})
        for name in ("original", "reloaded")
    }, tmp_path / "serving")  # fmt: skip
    expected = model.predict(model.preprocessing(decode_image(photo)).numpy()[None], verbose=0)
    np.testing.assert_allclose(served["original"]["bytes_logits"], expected, atol=1e-5)
    np.testing.assert_array_equal(served["reloaded"]["bytes_logits"], served["original"]["bytes_logits"])
    np.testing.assert_array_equal(served["reloaded"]["bytes_top_k_names"], served["original"]["bytes_top_k_names"])
    assert served["reloaded"]["bytes_top_k_names"][0, 0].decode() == model.class_names[int(expected.argmax())]


def random_small_vit(**options):
    """The small model with random weights everywhere (its norms and biases too)."""
    return randomize_weights(small_vit(**options), seed=1, scale=0.2)


def test_the_spec_is_the_models_config_and_round_trips(tmp_path):
    preprocessing = keras_vit.Preprocessing.center_crop(16, 0.875, interpolation="bicubic",
                                                        mean=IMAGENET_MEAN, std=IMAGENET_STD)  # fmt: skip
    model = random_small_vit(pixel_mean=IMAGENET_MEAN, pixel_std=IMAGENET_STD, preprocessing=preprocessing,
                             num_classes=3, class_names=["cat", "dog", "bird"], classifier="gap",
                             pooled_norm=True)  # fmt: skip
    spec = model.spec
    assert (spec.hidden_dim, spec.num_layers, spec.patch_size, spec.image_size) == (16, 2, (4, 4), (16, 16))
    assert model.preprocessing is spec.preprocessing and model.class_names == ("cat", "dog", "bird")
    config = model.get_config()
    assert json.loads(json.dumps(config)) == config  # JSON as saved
    assert ViTSpec.from_config(config["spec"]) == spec and config["frozen_layers"] == []
    rebuilt = ViT.from_config(config)
    assert [w.path for w in rebuilt.weights] == [w.path for w in model.weights]
    rebuilt.set_weights(model.get_weights())
    images = random_images((2, 16, 16, 3), seed=2)
    np.testing.assert_array_equal(rebuilt.predict(images, verbose=0), model.predict(images, verbose=0))

    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert type(loaded) is ViT and loaded.spec == spec and loaded.name == model.name
    np.testing.assert_array_equal(loaded.predict(images, verbose=0), model.predict(images, verbose=0))
    # The same layers, under the same names, as the functional graph build_vit always made.
    assert [layer.name for layer in model.layers] == [
        "images", "rescaling", "patch_encoder", "embedding_dropout", "encoderblock_0", "encoderblock_1", "pooling",
        "pooled_norm", "head",
    ]


def test_build_vit_takes_truthy_flags_and_false_for_no_head_and_custom_initializers_compare_by_value(tmp_path):
    assert random_small_vit(include_rescaling=1).spec.include_rescaling is True
    assert random_small_vit(include_rescaling=np.True_).spec.include_rescaling is True
    assert random_small_vit(num_classes=False).output_shape == (None, 16)  # A backbone, as with None or 0.
    with pytest.raises(ValueError, match=r"Unknown architecture override\(s\) \['resnet_layers'\]"):
        keras_vit.build_vit("testing", resnet_layers=(1,))
    with pytest.raises(ValueError, match=r"image_size=30, patch_size=\(16, 16\) \(variant 'testing'\)"):
        keras_vit.build_vit("testing", image_size=30)
    model = random_small_vit(head_kernel_initializer=keras.initializers.RandomNormal(stddev=0.5, seed=3))
    assert ViTSpec.from_config(model.spec.to_config()) == model.spec
    model.save(tmp_path / "initializer.keras")
    assert keras.models.load_model(tmp_path / "initializer.keras").spec == model.spec


def test_a_spec_refuses_what_contradicts_it():
    spec = ViTSpec.from_variant("testing", image_size=16, patch_size=4, num_classes=3)
    with pytest.raises(ValueError, match=r"2 class names for a model with num_classes=3"):
        spec.replace(class_names=["a", "b"])
    with pytest.raises(ValueError, match=r"crops \(32, 32\), the model's image_size is \(16, 16\)"):
        spec.replace(preprocessing=keras_vit.Preprocessing(32, 36))
    with pytest.raises(ValueError, match=r"preprocessing's mean \(0\.485, 0\.456, 0\.406\) is not the model's "
                                         r"pixel_mean \(0\.5, 0\.5, 0\.5\)"):
        spec.replace(preprocessing=keras_vit.Preprocessing(16, 18, mean=IMAGENET_MEAN, std=IMAGENET_STD))
    with pytest.raises(ValueError, match=r"Unknown ViTSpec field\(s\) \['depth'\]"):
        ViTSpec.from_config({**spec.to_config(), "depth": 3})
    with pytest.raises(ValueError, match=r"`spec` must be a keras_vit.ViTSpec. Received: str"):
        ViT("B/16")
    with pytest.raises(ValueError, match=r"`class_names` must be a sequence of names. Received: 'abc'"):
        spec.replace(class_names="abc")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_layers = 2


def test_surgery_keeps_the_spec_and_saving_keeps_frozen_layers_and_the_dtype_policy(tmp_path):
    preprocessing = keras_vit.Preprocessing(16, 20, interpolation="bicubic")
    model = random_small_vit(preprocessing=preprocessing, num_classes=3, class_names=["a", "b", "c"])

    bigger = keras_vit.set_image_size(model, 32)
    assert type(bigger) is ViT and bigger.spec == model.spec.replace(
        image_size=(32, 32), preprocessing=keras_vit.Preprocessing(32, 40, interpolation="bicubic")
    )
    assert bigger.class_names == ("a", "b", "c")

    five = keras_vit.replace_head(model, 5)
    # A new head, started at zero whatever the model's head started from.
    expected = model.spec.replace(num_classes=5, class_names=None, head_kernel_initializer="zeros")
    assert type(five) is ViT and five.spec == expected
    assert five.preprocessing == preprocessing
    assert five.get_layer("encoderblock_1") is model.get_layer("encoderblock_1")  # shared, not copied
    backbone = keras_vit.replace_head(model, None)
    assert backbone.spec.num_classes is None and backbone.output_shape == (None, 16)

    keras_vit.freeze_backbone(five)
    assert five.spec == expected
    five.save(tmp_path / "frozen.keras")
    loaded = keras.models.load_model(tmp_path / "frozen.keras")
    assert [w.path for w in loaded.trainable_weights] == ["head/kernel", "head/bias"]
    # Every frozen layer stays frozen, also those without weights: a frozen Dropout drops nothing in training.
    assert [layer.name for layer in loaded.layers if not layer.trainable] == [
        layer.name for layer in five.layers if not layer.trainable
    ]
    dropping = keras_vit.freeze_backbone(random_small_vit(dropout_rate=0.5))
    dropping.save(tmp_path / "dropping.keras")
    reloaded = keras.models.load_model(tmp_path / "dropping.keras")
    images = random_images((2, 16, 16, 3), seed=8)
    np.testing.assert_allclose(reloaded(images, training=True), dropping(images, training=False), atol=1e-6)

    # Built under mixed_bfloat16, loaded under float32: bfloat16 computation as saved, the head float32.
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        mixed = random_small_vit()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    mixed.save(tmp_path / "mixed.keras")
    loaded = keras.models.load_model(tmp_path / "mixed.keras")
    assert loaded.get_layer("encoderblock_0").compute_dtype == "bfloat16"
    assert loaded.get_layer("head").compute_dtype == "float32"
    images = random_images((2, 16, 16, 3), seed=3)
    np.testing.assert_array_equal(loaded.predict(images, verbose=0), mixed.predict(images, verbose=0))


def test_a_keras_file_of_a_plain_functional_of_the_same_layers_loads(tmp_path):
    """Files saved before the model had a class of its own: a `Functional` of the same layers."""
    model = random_small_vit()
    functional = keras.Model(model.inputs, model.outputs, name="vit_testing")
    assert type(functional) is keras.Model or type(functional).__name__ == "Functional"
    functional.save(tmp_path / "old.keras")
    loaded = keras.models.load_model(tmp_path / "old.keras")
    images = random_images((2, 16, 16, 3), seed=4)
    np.testing.assert_array_equal(loaded.predict(images, verbose=0), model.predict(images, verbose=0))
    assert [layer.name for layer in loaded.layers] == [layer.name for layer in model.layers]


# === Keras' quantization ===


def matmul_kernels(model):
    """{path: dtype} of every matmul kernel of the model (the attention's and MAP head's own ones included)."""
    return {
        v.path: str(v.dtype) for v in model.weights
        if v.path.rsplit("/", 1)[-1] in ("kernel", "qkv_kernel", "output_kernel", "query_kernel", "key_value_kernel")
    }  # fmt: skip


@pytest.mark.slow
def test_int8_quantizes_every_matmul_but_the_patch_embedding_and_saves_reloads_and_exports(tmp_path):
    """A model with every kind of matmul: the blocks' attention and MLPs, the MAP head (its own projections and
    MLP), the pre-logits layer and the head."""
    import warnings

    from keras_vit.export import export_saved_model

    images = random_images((4, 16, 16, 3), seed=6).astype(np.uint8)
    model = random_small_vit(classifier="map", representation_size=8)
    float_logits = model.predict(images, verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.quantize("int8")
    assert [str(w.message) for w in caught] == []  # No layer refused, nothing to ignore.
    kernels = matmul_kernels(model)
    assert kernels.pop("patch_encoder/kernel") == "float32"
    # qkv, attention output and the MLP's two per block; the MAP head's three and its MLP's two; pre-logits, head.
    assert set(kernels.values()) == {"int8"} and len(kernels) == 2 * 4 + 3 + 2 + 2
    logits = model.predict(images, verbose=0)
    # Per-channel int8 weights and per-token int8 activations: within a few percent of the float logits.
    assert np.abs(logits - float_logits).max() < 0.05 * np.abs(float_logits).max()
    assert not np.array_equal(logits, float_logits)

    model.save(tmp_path / "int8.keras")
    loaded = keras.models.load_model(tmp_path / "int8.keras")
    assert matmul_kernels(loaded) == matmul_kernels(model)
    np.testing.assert_array_equal(loaded.predict(images, verbose=0), logits)
    # Another size keeps the quantized layers (the learned position embeddings resampled, as in float).
    bigger = keras_vit.set_image_size(loaded, 32)
    assert matmul_kernels(bigger) == matmul_kernels(model) and bigger.output_shape == (None, 5)
    export_saved_model(loaded, tmp_path / "saved_model")
    served = serve_all({"int8": ("saved_model", tmp_path / "saved_model", {"images": images})}, tmp_path / "serving")
    np.testing.assert_allclose(served["int8"]["images_logits"], logits, atol=1e-5)


def test_int4_quantizes_the_dense_layers_and_the_attention_says_it_takes_int8_only():
    model = random_small_vit()
    with pytest.warns(UserWarning, match=r"MultiHeadSelfAttention \('attention'\) quantizes its kernels to int8 "
                                         r"only\. Received: mode='int4'"):  # fmt: skip
        model.quantize("int4")
    kernels = matmul_kernels(model)
    assert {path: dtype for path, dtype in kernels.items() if "mlp" in path or path.startswith("head")} == {
        path: "int8" for path in kernels if "mlp" in path or path.startswith("head")  # int4, packed two per byte
    }
    assert kernels["encoderblock_0/attention/qkv_kernel"] == "float32"
    assert model.get_layer("encoderblock_0").mlp_dense_1.quantization_mode == "int4"
    assert np.isfinite(model.predict(random_images((2, 16, 16, 3), seed=7), verbose=0)).all()


@pytest.mark.slow  # Each quantization (Keras' too) collects garbage per kernel: seconds in a large process.
def test_a_quantized_models_file_keeps_each_layers_quantization_config(tmp_path):
    """int4 in blocks along the inputs and int8 of the weights alone (activations in float): reloaded as made."""
    images = random_images((2, 16, 16, 3), seed=9)
    for name, config in (
        ("int4_blocks", keras.quantizers.Int4QuantizationConfig(block_size=8)),
        ("int8_weights", keras.quantizers.Int8QuantizationConfig(activation_quantizer=None)),
    ):
        model = random_small_vit()
        model.quantize(config=config)
        model.save(tmp_path / f"{name}.keras")
        loaded = keras.models.load_model(tmp_path / f"{name}.keras")
        np.testing.assert_array_equal(loaded.predict(images, verbose=0), model.predict(images, verbose=0))
    # Weight-only: the attention's inputs are not quantized either.
    assert model.get_layer("encoderblock_0").attention.inputs_quantizer is None


@pytest.mark.slow
def test_the_digits_model_after_int8_is_within_a_point_of_float32(digits_main_job):
    from keras_vit import data as vit_data

    workdir, _, _ = digits_main_job
    model = keras.models.load_model(workdir / "model.keras")
    assert type(model) is ViT and model.class_names == tuple(str(i) for i in range(10))
    test = vit_data.load_digits(image_size=16, test_fraction=0.2, seed=0).test
    float_top1 = float((model.predict(test.images, verbose=0).argmax(-1) == test.labels).mean())
    model.quantize("int8")
    int8_top1 = float((model.predict(test.images, verbose=0).argmax(-1) == test.labels).mean())
    assert abs(int8_top1 - float_top1) <= 0.01, (float_top1, int8_top1)
