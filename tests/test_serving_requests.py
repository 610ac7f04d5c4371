"""The SavedModel as TF Serving and Vertex AI serve it: the JSON requests docs/export.md shows, decoded by TF
Serving's rules (tests/tf_serving_json.py), the keyed bytes default, and the warmup requests."""

import base64
import json
import os
import pathlib
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_vit
from experiments import export as export_job
from keras_vit import export
from keras_vit.data import center_crop_resize
from keras_vit.testing import randomize_weights
from tests import tf_serving_json
from tests.builders import fenced_blocks

ROOT = pathlib.Path(__file__).resolve().parents[1]
CLASS_NAMES = ["tabby", "tiger cat", "Egyptian cat", "lynx"]


def _model():
    return randomize_weights(
        keras_vit.build_vit(
            "testing", image_size=32, num_classes=4, patch_size=8, num_heads=2, num_layers=2, class_names=CLASS_NAMES
        ),
        scale=0.1,
    )


def _files():
    """The files the documented requests name: a JPEG of another size and a PNG of the model's."""
    rng = np.random.default_rng(1)
    return {
        "cat.jpg": tf.io.encode_jpeg(rng.integers(0, 256, (40, 52, 3)).astype(np.uint8)).numpy(),
        "dog.png": tf.io.encode_png(rng.integers(0, 256, (32, 32, 3)).astype(np.uint8)).numpy(),
    }


@pytest.fixture(scope="module")
def serving_exports(tmp_path_factory):
    """The model exported with each default signature: (model, {"images" | "bytes": path})."""
    keras.utils.set_random_seed(0)
    model = _model()
    folder = tmp_path_factory.mktemp("serving_exports")
    paths = {
        default: export.export_saved_model(model, folder / default, default_signature=default)
        for default in export.DEFAULT_SIGNATURES
    }
    return model, paths


def _input_dtypes(loaded):
    """{signature: {input: NumPy dtype}} of a loaded SavedModel, as TF Serving reads them from its SignatureDefs."""
    return {
        name: {alias: (np.object_ if spec.dtype == tf.string else spec.dtype.as_numpy_dtype)
               for alias, spec in function.structured_input_signature[1].items()}
        for name, function in loaded.signatures.items()
    }  # fmt: skip


def _serve(loaded, body):
    """A JSON request answered as TF Serving answers it: the body decoded, the signature run, the row-format
    answer parsed back."""
    name, inputs = tf_serving_json.decode_request(body, _input_dtypes(loaded))
    outputs = loaded.signatures[name](**{alias: tf.constant(array) for alias, array in inputs.items()})
    answer = tf_serving_json.encode_response({key: value.numpy() for key, value in outputs.items()})
    return name, inputs, json.loads(answer)["predictions"]


def _documented_requests():
    """The JSON request bodies of docs/export.md, each base64 placeholder replaced by the file it names."""
    files = _files()
    blocks = [code for language, _, code in fenced_blocks((ROOT / "docs" / "export.md").read_text())
              if language == "json"]  # fmt: skip

    def fill(match):
        return base64.b64encode(files[match.group(1)]).decode("ascii")

    return [re.sub(r"<base64 of ([\w.]+)>", fill, block) for block in blocks]


def _expected_logits(model, encoded):
    """The Keras model's logits for one encoded file, prepared as serving_bytes prepares it (the model has no
    preprocessing of its own: the shorter side resized to 32 and the center cropped)."""
    image = center_crop_resize(tf.io.decode_image(encoded, channels=3, expand_animations=False), (32, 32))
    return model.predict(image.numpy()[None], verbose=0)[0]


def test_the_documented_requests_are_answered_as_the_keras_model_answers(serving_exports):
    model, paths = serving_exports
    requests = _documented_requests()
    assert len(requests) == 3  # TF Serving's request, the serving_bytes one, Vertex AI's
    answered = 0
    for body in requests:
        named = "signature_name" in json.loads(body)
        # A body naming serving_bytes is for the default export; the others for default_signature="bytes".
        loaded = tf.saved_model.load(paths["images" if named else "bytes"])
        name, inputs, predictions = _serve(loaded, body)
        encoded = inputs["encoded" if named else "image_bytes"]
        assert len(predictions) == len(encoded) >= 1
        for sent, answer in zip(encoded, predictions):
            expected = _expected_logits(model, sent)
            np.testing.assert_allclose(answer["logits"], expected, atol=1e-4)
            assert answer["top_k"][0] == int(np.argmax(expected))
            assert answer["top_k_names"] == [CLASS_NAMES[c] for c in answer["top_k"]]
            np.testing.assert_allclose(sum(answer["probabilities"]), 1.0, atol=1e-5)
            answered += 1
        if not named:
            # The keys come back as they were sent, and the documented answer lists every output there is.
            assert [answer["key"] for answer in predictions] == [k.decode() for k in inputs["key"]]
            documented = [code for language, _, code in fenced_blocks((ROOT / "docs" / "export.md").read_text())
                          if language == "text" and '"predictions"' in code]  # fmt: skip
            assert documented and all(f'"{output}"' in documented[0] for output in predictions[0])
            assert name == "serving_default" and set(inputs) == {"image_bytes", "key"}
    assert answered == 4


def test_the_bytes_default_passes_keys_through_and_feeds_no_key_as_empty_ones(serving_exports, tmp_path):
    model, paths = serving_exports
    loaded = tf.saved_model.load(paths["bytes"])
    assert set(loaded.signatures) == {"serving_default", "serving_images", "serving_bytes"}
    files = list(_files().values())
    keyed = loaded.signatures["serving_default"](image_bytes=tf.constant(files), key=tf.constant(["a/1", "b,2"]))
    assert [k.decode() for k in keyed["key"].numpy()] == ["a/1", "b,2"]
    plain = loaded.signatures["serving_bytes"](encoded=tf.constant(files))
    np.testing.assert_array_equal(keyed["logits"].numpy(), plain["logits"].numpy())
    # TF Serving (2.14 and later) feeds a request without `key` the SignatureDef's default.
    from tensorflow.core.protobuf import saved_model_pb2

    saved = saved_model_pb2.SavedModel.FromString((pathlib.Path(paths["bytes"]) / "saved_model.pb").read_bytes())
    defaults = saved.meta_graphs[0].signature_def["serving_default"].defaults
    assert set(defaults) == {"key"}
    default_key = tf.make_ndarray(defaults["key"])
    assert default_key.shape == (0,)
    unkeyed = loaded.signatures["serving_default"](image_bytes=tf.constant(files), key=tf.constant(default_key))
    assert list(unkeyed["key"].numpy()) == [b"", b""]
    np.testing.assert_array_equal(unkeyed["logits"].numpy(), plain["logits"].numpy())
    with pytest.raises(tf.errors.InvalidArgumentError, match="one `key` per image"):
        loaded.signatures["serving_default"](image_bytes=tf.constant(files), key=tf.constant(["only one"]))
    # TF Serving's JSON API: every instance names every input, and a plain list of b64 objects is for one input.
    b64 = {"b64": base64.b64encode(files[0]).decode()}
    for body in ({"instances": [{"image_bytes": b64}]}, {"instances": [b64]}):
        with pytest.raises(tf_serving_json.RequestError):
            _serve(loaded, json.dumps(body))
    # The default export keeps uint8 images on serving_default, as before, and names them serving_images too.
    images = tf.saved_model.load(paths["images"]).signatures
    assert set(images["serving_default"].structured_input_signature[1]) == {"images"}
    assert set(images["serving_images"].structured_input_signature[1]) == {"images"}


def _prediction_log_pb2():
    """TF Serving's PredictionLog message (the tensorflow-serving-api package, which .ci/run installs without
    its dependencies: it names the `tensorflow` build)."""
    if os.environ.get("CI", "").lower() in ("true", "1"):
        from tensorflow_serving.apis import prediction_log_pb2

        return prediction_log_pb2
    return pytest.importorskip("tensorflow_serving.apis.prediction_log_pb2", reason="pip install --no-deps "
                               "tensorflow-serving-api")  # fmt: skip


def test_the_warmup_file_holds_a_prediction_log_per_signature_that_it_answers(serving_exports, tmp_path):
    prediction_log_pb2 = _prediction_log_pb2()
    _, paths = serving_exports
    for default, path in paths.items():
        loaded = tf.saved_model.load(path)
        records = list(tf.data.TFRecordDataset(f"{path}/assets.extra/tf_serving_warmup_requests").as_numpy_iterator())
        logs = [prediction_log_pb2.PredictionLog.FromString(record) for record in records]
        assert all(log.WhichOneof("log_type") == "predict_log" for log in logs)
        requests = [log.predict_log.request for log in logs]
        assert sorted(r.model_spec.signature_name for r in requests) == sorted(loaded.signatures), default
        for request in requests:
            signature = loaded.signatures[request.model_spec.signature_name]
            specs = signature.structured_input_signature[1]
            inputs = {alias: tf.make_ndarray(tensor) for alias, tensor in request.inputs.items()}
            assert set(inputs) == set(specs)
            for alias, array in inputs.items():
                assert specs[alias].is_compatible_with(tf.constant(array)), (alias, array.shape, specs[alias])
            outputs = signature(**{alias: tf.constant(array) for alias, array in inputs.items()})
            assert outputs["logits"].shape == (1, 4) and np.isfinite(outputs["logits"].numpy()).all()
    model = _model()
    quiet = export.export_saved_model(model, tmp_path / "no_warmup", warmup=False)
    assert not (pathlib.Path(quiet) / "assets.extra").exists()


def test_export_options_are_checked_and_the_export_command_takes_the_bytes_default(tmp_path):
    model = _model()
    with pytest.raises(ValueError, match="default_signature='jpeg'"):
        export.export_saved_model(model, tmp_path / "a", default_signature="jpeg")
    with pytest.raises(ValueError, match="one line each"):
        export.export_saved_model(model, tmp_path / "b", class_names=["a", "b\nc", "d", "e"])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    path, difference, agreement = export_job.export_and_check(
        model, "saved_model", str(tmp_path / "c"), default_signature="bytes", warmup=False
    )
    assert difference < 1e-4 and agreement == 1.0
    loaded = tf.saved_model.load(path)
    assert set(loaded.signatures["serving_default"].structured_input_signature[1]) == {"image_bytes", "key"}
    assert (pathlib.Path(path) / "assets" / "labels.txt").read_text().split("\n")[:-1] == CLASS_NAMES


@pytest.mark.slow  # two exports and their checks, 6 s
def test_the_export_command_exports_and_checks_each_precision(tmp_path):
    model = _model()
    for precision, tolerance in (("bfloat16", 0.05), ("int8", 0.05)):
        path, difference, agreement = export_job.export_and_check(
            model, f"saved_model:{precision}", str(tmp_path / precision), warmup=False
        )
        # Against the float32 Keras model on 100 random images: within the precision's rounding.
        scale = float(np.abs(model.predict(export_job.sample_images(model, 100), verbose=0)).max())
        assert 0 < difference <= tolerance * scale and agreement >= 0.9, (precision, difference, agreement)
        assert set(tf.saved_model.load(path).signatures) == {"serving_default", "serving_images", "serving_bytes"}
