"""Exported artefacts, each run in a process that never imports keras_vit."""

import collections
import os
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
from tests.builders import serve_all

ROOT = pathlib.Path(__file__).resolve().parents[1]


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


@pytest.fixture(scope="module")
def precision_exports(digits_model, tmp_path_factory):
    """The trained model as bfloat16 and int8 SavedModels, and a copy quantized by Keras exported as it is, each
    with the keyed bytes default, served in one process; the bfloat16 one also where TensorFlow runs no oneDNN:
    (inputs, {name: path}, {name: outputs})."""
    model, dataset = digits_model
    folder = tmp_path_factory.mktemp("precision_exports")
    quantized = keras_vit.ViT.from_config(model.get_config())
    quantized.set_weights(model.get_weights())
    quantized.quantize("int8")
    paths = {
        "bfloat16": export.export_saved_model(model, folder / "bf16", precision="bfloat16", default_signature="bytes"),
        "int8": export.export_saved_model(model, folder / "int8", precision="int8", default_signature="bytes"),
        "keras_int8": export.export_saved_model(quantized, folder / "keras_int8", default_signature="bytes"),
    }
    images = dataset.test.images
    inputs = {"images": images, "encoded": np.array([tf.io.encode_png(image).numpy() for image in images[:20]])}
    served = serve_all({name: ("saved_model_keyed", path, inputs) for name, path in paths.items()}, folder)
    elsewhere = serve_all({"bfloat16": ("saved_model_keyed", paths["bfloat16"], inputs)}, folder / "no_onednn",
                          env={"TF_ENABLE_ONEDNN_OPTS": "0"})  # fmt: skip
    served["bfloat16_no_onednn"] = elsewhere["bfloat16"]
    return inputs, paths, served


def serving_ops(path):
    """{op type: count} in the function of a SavedModel's `serving_images` signature (its forward pass)."""
    from tensorflow.core.protobuf import saved_model_pb2

    saved = saved_model_pb2.SavedModel.FromString((pathlib.Path(path) / "saved_model.pb").read_bytes())
    functions = [f for f in saved.meta_graphs[0].graph_def.library.function
                 if f.signature.name.startswith("__inference_serve_images")]  # fmt: skip
    assert len(functions) == 1, [f.signature.name for f in functions]
    return collections.Counter(node.op for node in functions[0].node_def)


# How far a precision's logits may be from float32's, as a fraction of the float32 logits' largest magnitude:
# bfloat16 keeps 8 significant bits (a relative rounding of 2**-9 per value, the matmuls accumulating in
# float32); int8 rounds weights to 127 levels per column and activations to 255 levels per tensor.
PRECISION_TOLERANCE = {"bfloat16": 0.05, "int8": 0.05}


@pytest.mark.slow
def test_bfloat16_and_int8_saved_models_agree_with_float32(digits_model, precision_exports):
    model, dataset = digits_model
    inputs, paths, served = precision_exports
    expected = model.predict(inputs["images"], verbose=0)
    assert (expected.argmax(-1) == dataset.test.labels).mean() > 0.9  # a trained model
    scale = np.abs(expected).max()
    for name, precision in (("bfloat16", "bfloat16"), ("int8", "int8"), ("keras_int8", "int8"),
                            ("bfloat16_no_onednn", "bfloat16")):  # fmt: skip
        out = served[name]
        difference = np.abs(out["images_logits"] - expected).max() / scale
        agreement = (out["images_logits"].argmax(-1) == expected.argmax(-1)).mean()
        assert difference <= PRECISION_TOLERANCE[precision], (name, difference)
        assert agreement >= 0.98, (name, agreement)
        # The same pixels as PNGs, and with keys: the same logits; the keys come back as sent. int8's activations
        # are quantized over the whole batch (one range per tensor): a batch of 20 and one of all gives each image
        # logits within the tolerance, not the same ones.
        same = 1e-5 if name.startswith("bfloat16") else PRECISION_TOLERANCE["int8"]
        np.testing.assert_allclose(out["bytes_logits"], out["images_logits"][:20], rtol=0, atol=same * scale,
                                   err_msg=name)  # fmt: skip
        np.testing.assert_allclose(out["keyed_logits"], out["bytes_logits"], rtol=0, atol=1e-5 * scale)
        assert list(out["keyed_key"].astype(str)) == [f"request-{i}" for i in range(20)]
        if "warmup_replayed" in out or os.environ.get("CI", "").lower() in ("true", "1"):
            assert list(out["warmup_replayed"].astype(str)) == ["serving_bytes", "serving_default", "serving_images"]
    # Without oneDNN the bfloat16 model computes what it computes with it, within bfloat16's rounding.
    np.testing.assert_allclose(served["bfloat16_no_onednn"]["images_logits"], served["bfloat16"]["images_logits"],
                               rtol=0, atol=0.05 * scale)  # fmt: skip


@pytest.mark.slow
def test_a_keras_quantized_model_exports_to_onednn_int8_matmuls(precision_exports):
    _, paths, served = precision_exports
    # Two blocks of four weight matmuls (query-key-value, output, the MLP's two) and the head: all oneDNN's int8;
    # the patch embedding (a convolution) and the attention's two batched matmuls per block stay float32.
    for name in ("int8", "keras_int8"):
        ops = serving_ops(paths[name])
        assert ops["QuantizedMatMulWithBiasAndDequantize"] == 9, (name, ops)
        assert not {"MatMul", "BatchMatMulV3"} & set(ops) and ops["BatchMatMulV2"] == 4, (name, ops)
    bfloat16 = serving_ops(paths["bfloat16"])
    assert "QuantizedMatMulWithBiasAndDequantize" not in bfloat16 and bfloat16["MatMul"] == 9, bfloat16
    # The same weights, quantized the same way (abs-max per column): the same SavedModel's arithmetic.
    np.testing.assert_array_equal(served["keras_int8"]["images_logits"], served["int8"]["images_logits"])
    # The weights as stored: int8 kernels (and float32 scales, norms and biases) take less than bfloat16 ones.
    sizes = {name: sum(f.stat().st_size for f in (pathlib.Path(path) / "variables").iterdir())
             for name, path in paths.items()}  # fmt: skip
    assert sizes["int8"] < sizes["bfloat16"], sizes


def test_saved_model_precisions_are_checked(small_model, tmp_path):
    with pytest.raises(ValueError, match=r"`precision` must be one of \('float32', 'bfloat16', 'int8'\). Received: "
                       "precision='int4'"):  # fmt: skip
        export.export_saved_model(small_model, tmp_path / "a", precision="int4")
    inputs = keras.Input((32, 32, 3))
    plain = keras.Model(inputs, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(inputs)))
    with pytest.raises(ValueError, match="precision='bfloat16' needs a keras_vit.ViT.*Received: a Functional"):
        export.export_saved_model(plain, tmp_path / "b", precision="bfloat16")
    quantized = keras_vit.ViT.from_config(small_model.get_config())
    quantized.quantize("int8")
    with pytest.raises(ValueError, match=r"The model is quantized \(int8\); precision='bfloat16' needs the float"):
        export.export_saved_model(quantized, tmp_path / "c", precision="bfloat16")
    with pytest.raises(ValueError, match=r"The model is quantized \(int8\); precision='float32' needs the float"):
        export.export_saved_model(quantized, tmp_path / "c", precision="float32")
    # A quantized model in its own precision is itself, traced for oneDNN's int8 matmuls.
    assert export.model_in_precision(quantized) == (quantized, True)
    assert export.model_in_precision(quantized, "int8") == (quantized, True)
    # The artefacts' names: a format and its variant.
    assert export.parse_artefact("saved_model:int8") == ("saved_model", "int8")
    assert export.parse_artefact("tflite") == ("tflite", None) and export.parse_artefact("onnx") == ("onnx", None)
    for bad in ("tflite_int8", "tflite:bfloat16", "onnx:int8", "saved_model:"):
        with pytest.raises(ValueError, match=rf"Unknown export '{bad}'\. Expected one of \['saved_model', "):
            export.export_artefact(small_model, bad, str(tmp_path / "d"))
    assert not any(tmp_path.iterdir())
    # Each precision of the same model, its float32 the model itself; the float model is left as it was.
    weights = small_model.get_weights()
    for precision in export.PRECISIONS:
        copy, for_cpu = export.model_in_precision(small_model, precision)
        assert (copy is small_model) == (precision == "float32") and for_cpu == (precision != "float32")
    assert all(np.array_equal(a, b) for a, b in zip(weights, small_model.get_weights()))
    assert small_model.get_layer("patch_encoder").dtype_policy.name == "float32"


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
        [sys.executable, "-m", "experiments.export", f"--model={tmp_path / 'm.keras'}", "--format=tflite:dynamic",
         f"--out={tmp_path / 'm.tflite'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MiB)" in result.stdout and "top-1 agreement" in result.stdout
    config = ConfigDict(digits.get_config().to_dict())
    config.export = "saved_model,tflite:int8,bogus"
    with pytest.raises(ValueError, match=r"config.export='saved_model,tflite:int8,bogus': Unknown export 'bogus'"):
        train.train_and_evaluate(config, str(tmp_path / "never"))
    assert not (tmp_path / "never").exists()  # refused before anything was written
