"""Exported artefacts, each run in a process that never imports keras_vit."""

import json
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from ml_collections import ConfigDict

import keras_vit
from experiments import train
from experiments.configs import digits
from keras_vit import data as vit_data
from keras_vit import export
from keras_vit.testing import random_images, randomize_weights

ROOT = pathlib.Path(__file__).resolve().parents[1]


def serve_all(jobs, folder):
    """{name: (kind, artefact, inputs)} served one after the other in one fresh interpreter that never imports
    keras_vit (tests/serving_check.py); returns {name: outputs}."""
    folder.mkdir(parents=True, exist_ok=True)
    listed = []
    for name, (kind, artefact, inputs) in jobs.items():
        np.savez(folder / f"{name}_inputs.npz", **inputs)
        listed.append([kind, str(artefact), str(folder / f"{name}_inputs.npz"), str(folder / f"{name}_outputs.npz")])
    (folder / "jobs.json").write_text(json.dumps(listed))
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "serving_check.py"), str(folder / "jobs.json")],
        capture_output=True, text=True, timeout=600, env={"TF_CPP_MIN_LOG_LEVEL": "2", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {name: dict(np.load(folder / f"{name}_outputs.npz", allow_pickle=False)) for name in jobs}


def serve(kind, artefact, tmp_path, **inputs):
    """One artefact served as `serve_all` serves them: its outputs."""
    return serve_all({"served": (kind, artefact, inputs)}, tmp_path / "serving")["served"]


def make_small_model():
    return randomize_weights(
        keras_vit.build_vit("testing", image_size=32, num_classes=4, patch_size=8, num_heads=2, num_layers=2),
        scale=0.1,
    )


@pytest.fixture
def small_model():
    return make_small_model()


@pytest.fixture(scope="module")
def small_exports(tmp_path_factory):
    """The small model as TFLite (batch 1 and any batch), ONNX and a SavedModel, all served in one process:
    (model, images, {name: path}, {name: outputs})."""
    keras.utils.set_random_seed(0)
    model = make_small_model()
    folder = tmp_path_factory.mktemp("small_exports")
    images = random_images((5, 32, 32, 3)).astype(np.uint8)
    paths = {
        "tflite_1": export.export_tflite(model, folder / "batch1.tflite", batch_size=1),
        "tflite_None": export.export_tflite(model, folder / "any_batch.tflite", batch_size=None),
        "onnx": export.export_onnx(model, folder / "m.onnx"),
        "tfsmlayer": export.export_saved_model(model, folder / "sm"),
    }
    kinds = {"tflite_1": "tflite", "tflite_None": "tflite", "onnx": "onnx", "tfsmlayer": "tfsmlayer"}
    served = serve_all({name: (kinds[name], path, {"images": images}) for name, path in paths.items()}, folder)
    return model, images, paths, served


@pytest.fixture(scope="module")
def digits_model():
    """A small ViT trained on the digits (about 94% test accuracy), and its data."""
    keras.utils.set_random_seed(0)
    dataset = vit_data.load_digits(image_size=16)
    model = keras_vit.build_vit(
        "testing", image_size=16, patch_size=4, hidden_dim=32, num_layers=2, num_heads=2, mlp_dim=64,
        num_classes=10, head_kernel_initializer="glorot_uniform",
    )  # fmt: skip
    model.compile(keras.optimizers.AdamW(3e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=True)  # fmt: skip
    model.fit(dataset.train.images, dataset.train.labels, batch_size=64, epochs=15, verbose=0)
    return model, dataset


@pytest.fixture(scope="module")
def digits_exports(digits_model, tmp_path_factory):
    """The trained model as a SavedModel with its class names, and as float16 and int8 TFLite, all served in one
    process: {name: (path, inputs, outputs)}."""
    model, dataset = digits_model
    folder = tmp_path_factory.mktemp("digits_exports")
    images = dataset.test.images[:20]
    other_size = tf.image.resize(images[:3], (23, 37)).numpy().round().astype(np.uint8)
    encoded = [tf.io.encode_png(image).numpy() for image in images] + [
        tf.io.encode_jpeg(image).numpy() for image in other_size
    ]
    calibration = vit_data.make_pipeline(dataset.train, 32, training=False)
    jobs = {
        "saved_model": ("saved_model", export.export_saved_model(
            model, folder / "sm", class_names=dataset.class_names, top_k=3), {"images": images,
                                                                              "encoded": np.array(encoded)}),
        **{quantize: ("tflite", export.export_tflite(
            model, folder / f"{quantize}.tflite", quantize=quantize, representative_data=calibration),
            {"images": dataset.test.images}) for quantize in ("float16", "int8")},
    }  # fmt: skip
    served = serve_all(jobs, folder)
    return {name: (path, inputs, served[name]) for name, (_, path, inputs) in jobs.items()}


@pytest.mark.slow
def test_saved_model_signatures_match_keras(digits_model, digits_exports):
    model, dataset = digits_model
    _, inputs, out = digits_exports["saved_model"]
    images, encoded = inputs["images"], inputs["encoded"]
    expected = model.predict(images, verbose=0)
    np.testing.assert_allclose(out["images_logits"], expected, atol=1e-5)
    # The probabilities are the softmax of the signature's own logits, and so within the logits' tolerance of
    # Keras' (a softmax moves by at most a quarter of its logits' change). Two float32 softmaxes of the same logits
    # (the graph's kernel and this eager one) each round: an exp per class (a few units in the last place), a sum
    # of K terms (up to K more), the division; each is within (K + 4) u of the exact value relative to it (u, the
    # unit roundoff, 2**-24), so two are within twice that of each other, probabilities being at most 1.
    classes = expected.shape[-1]
    softmax_rounding = 2 * (classes + 4) * np.finfo(np.float32).eps / 2
    np.testing.assert_allclose(out["images_probabilities"], tf.nn.softmax(out["images_logits"]).numpy(),
                               rtol=0, atol=softmax_rounding)  # fmt: skip
    np.testing.assert_allclose(out["images_probabilities"], tf.nn.softmax(expected).numpy(), atol=1e-5)
    np.testing.assert_array_equal(out["images_top_k"][:, 0], expected.argmax(-1))
    names = np.array(dataset.class_names)[out["images_top_k"]]
    np.testing.assert_array_equal(out["images_top_k_names"].astype(str), names)
    # Encoded bytes: PNGs of the model's size decode to the same pixels.
    np.testing.assert_allclose(out["bytes_logits"][:20], expected, atol=1e-5)
    # Other sizes are resized and center-cropped in the graph as the evaluation pipeline does.
    decoded = np.stack(
        [vit_data.center_crop_resize(tf.io.decode_jpeg(e, channels=3), (16, 16)).numpy() for e in encoded[20:]]
    )
    np.testing.assert_allclose(out["bytes_logits"][20:], model.predict(decoded, verbose=0), atol=1e-5)
    # Bytes that are not an image: a clear error for that request, and the process serves on.
    assert "Expected an encoded JPEG, PNG, GIF, BMP or WebP image; received 19 bytes" in str(out["bad_request_error"])
    np.testing.assert_allclose(out["after_error_logits"], expected, atol=1e-5)


@pytest.mark.slow  # small_exports: four exports and a serving process, about 15 s
def test_saved_model_as_a_keras_layer(small_exports):
    model, images, _, served = small_exports
    np.testing.assert_allclose(served["tfsmlayer"]["logits"], model.predict(images, verbose=0), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, None])
def test_tflite_float32_matches_keras(small_exports, batch_size):
    model, images, paths, served = small_exports
    path = paths[f"tflite_{batch_size}"]
    np.testing.assert_allclose(served[f"tflite_{batch_size}"]["logits"], model.predict(images, verbose=0), atol=1e-4)
    assert not [op for op in export.tflite_operators(path) if op.startswith("CUSTOM")]
    assert "GELU" in export.tflite_operators(path)


@pytest.mark.slow
def test_quantized_tflite_agrees_with_keras_on_digits(digits_model, digits_exports):
    model, dataset = digits_model
    images = dataset.test.images
    expected = model.predict(images, verbose=0).argmax(-1)
    assert (expected == dataset.test.labels).mean() > 0.5  # a trained model, not a constant one
    agreement = {}
    for quantize in ("float16", "int8"):
        path, _, out = digits_exports[quantize]
        agreement[quantize] = (out["logits"].argmax(-1) == expected).mean()
        if quantize == "int8":
            assert str(out["input_dtype"]) == "uint8"  # raw pixels in
            assert "QUANTIZE" in export.tflite_operators(path)
    assert agreement["float16"] >= 0.99, agreement
    assert agreement["int8"] >= 0.97, agreement


@pytest.mark.slow
def test_int8_tflite_of_ti16_is_under_30_percent_of_float32(tmp_path):
    # At 32 px: the weights are Ti/16's but for the position embeddings (5 rows, not 197), and calibration is fast.
    model = keras_vit.build_vit("Ti/16", image_size=32, num_classes=10)
    float32 = export.export_tflite(model, tmp_path / "f32.tflite")
    calibration = np.random.default_rng(0).integers(0, 256, (8, 32, 32, 3)).astype(np.uint8)
    int8 = export.export_tflite(model, tmp_path / "int8.tflite", quantize="int8", representative_data=calibration)
    ratio = pathlib.Path(int8).stat().st_size / pathlib.Path(float32).stat().st_size
    assert ratio <= 0.30, ratio


@pytest.mark.slow  # small_exports: four exports and a serving process, about 15 s
def test_onnx_matches_keras(small_exports):
    model, images, _, served = small_exports
    np.testing.assert_allclose(served["onnx"]["logits"], model.predict(images, verbose=0), atol=1e-4)


@keras.saving.register_keras_serializable(package="tests")
class InverseErf(keras.layers.Layer):
    def call(self, x):
        return keras.ops.erfinv(keras.ops.tanh(x))


def test_tflite_refuses_ops_that_need_flex(tmp_path):
    inputs = keras.Input((8, 8, 3))
    model = keras.Model(inputs, InverseErf()(keras.layers.Flatten()(inputs)))
    with pytest.raises(export.ExportError, match="builtin ops only"):
        export.export_tflite(model, tmp_path / "flex.tflite")
    assert not (tmp_path / "flex.tflite").exists()


def test_bad_export_requests(small_model, tmp_path):
    path = export.export_tflite(small_model, tmp_path / "m.tflite")
    with pytest.raises(FileExistsError, match="already exists; pass overwrite=True"):
        export.export_tflite(small_model, path)
    export.export_tflite(small_model, path, overwrite=True, quantize="dynamic")
    with pytest.raises(ValueError, match="quantize='int4'"):
        export.export_tflite(small_model, tmp_path / "x.tflite", quantize="int4")
    with pytest.raises(ValueError, match="needs `representative_data`"):
        export.export_tflite(small_model, tmp_path / "x.tflite", quantize="int8")
    sm = export.export_saved_model(small_model, tmp_path / "sm")
    with pytest.raises(FileExistsError):
        export.export_saved_model(small_model, sm)
    with pytest.raises(ValueError, match="3 names, the model has 4 classes"):
        export.export_saved_model(small_model, tmp_path / "sm2", class_names=["a", "b", "c"])


@pytest.mark.slow
def test_export_command_and_training_exports(digits_model, tmp_path):
    model, _ = digits_model
    model.save(tmp_path / "m.keras")
    result = subprocess.run(
        [sys.executable, "-m", "experiments.export", f"--model={tmp_path / 'm.keras'}", "--format=tflite",
         "--quantize=dynamic", f"--out={tmp_path / 'm.tflite'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MiB)" in result.stdout and "top-1 agreement" in result.stdout
    config = ConfigDict(digits.get_config().to_dict())
    config.export = "saved_model,tflite_int8,bogus"
    with pytest.raises(ValueError, match="bogus"):
        train.train_and_evaluate(config, str(tmp_path / "never"))
    assert not (tmp_path / "never").exists()  # refused before anything was written
