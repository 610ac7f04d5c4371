"""Runs exported artefacts in a process that never imports keras_vit.

    python tests/serving_check.py JOBS.json

JOBS.json: a list of [KIND, ARTEFACT, INPUTS.npz, OUTPUTS.npz], served one
after the other in this process.  KIND: saved_model (both signatures, plain
tf.saved_model.load), saved_model_keyed (one exported with the keyed bytes
default: its three signatures, and its warmup requests replayed where
tensorflow_serving's protos import), tfsmlayer (keras.layers.TFSMLayer), tflite
(ai_edge_litert), onnx (onnxruntime).  INPUTS.npz holds `images` (uint8
NHWC) and, for saved_model, `encoded` (encoded image bytes).  Writes each
job's outputs to its OUTPUTS.npz and fails if keras_vit was imported.
"""

import json
import sys

import numpy as np


def run_saved_model(path, inputs):
    import tensorflow as tf

    loaded = tf.saved_model.load(path)
    images = loaded.signatures["serving_default"](images=tf.constant(inputs["images"]))
    outputs = {f"images_{k}": v.numpy() for k, v in images.items()}
    if "encoded" in inputs:
        encoded = loaded.signatures["serving_bytes"](encoded=tf.constant(list(inputs["encoded"])))
        outputs.update({f"bytes_{k}": v.numpy() for k, v in encoded.items()})
        # A request that is not an image gets an error, and the process goes on serving.
        try:
            loaded.signatures["serving_bytes"](encoded=tf.constant([b"GIF? no: plain text"]))
            outputs["bad_request_error"] = np.array("")
        except tf.errors.InvalidArgumentError as error:
            outputs["bad_request_error"] = np.array(error.message)
        again = loaded.signatures["serving_default"](images=tf.constant(inputs["images"]))
        outputs["after_error_logits"] = again["logits"].numpy()
    return outputs


def run_saved_model_keyed(path, inputs):
    import tensorflow as tf

    loaded = tf.saved_model.load(path)
    encoded = tf.constant(list(inputs["encoded"]))
    keys = tf.constant([f"request-{i}" for i in range(len(inputs["encoded"]))])
    outputs = {
        "images_logits": loaded.signatures["serving_images"](images=tf.constant(inputs["images"]))["logits"],
        "bytes_logits": loaded.signatures["serving_bytes"](encoded=encoded)["logits"],
    }
    keyed = loaded.signatures["serving_default"](image_bytes=encoded, key=keys)
    outputs.update(keyed_logits=keyed["logits"], keyed_key=keyed["key"])
    outputs = {name: value.numpy() for name, value in outputs.items()}
    try:
        from tensorflow_serving.apis import prediction_log_pb2
    except ImportError:
        return outputs
    replayed = []
    for record in tf.data.TFRecordDataset(f"{path}/assets.extra/tf_serving_warmup_requests").as_numpy_iterator():
        request = prediction_log_pb2.PredictionLog.FromString(record).predict_log.request
        feeds = {alias: tf.constant(tf.make_ndarray(tensor)) for alias, tensor in request.inputs.items()}
        logits = loaded.signatures[request.model_spec.signature_name](**feeds)["logits"].numpy()
        replayed.append(request.model_spec.signature_name if np.isfinite(logits).all() else "not finite")
    outputs["warmup_replayed"] = np.array(sorted(replayed))
    return outputs


def run_tfsmlayer(path, inputs):
    import keras

    layer = keras.layers.TFSMLayer(path, call_endpoint="serving_default")
    return {"logits": keras.ops.convert_to_numpy(layer(inputs["images"])["logits"])}


def run_tflite(path, inputs):
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=path)
    detail = interpreter.get_input_details()[0]
    images = inputs["images"]
    batch = detail["shape"][0]
    if detail["shape_signature"][0] == -1:  # Resizable batch: all at once.
        interpreter.resize_tensor_input(detail["index"], images.shape)
        batch = len(images)
    interpreter.allocate_tensors()
    output = interpreter.get_output_details()[0]["index"]
    logits = []
    for start in range(0, len(images), batch):
        interpreter.set_tensor(detail["index"], images[start : start + batch].astype(detail["dtype"]))
        interpreter.invoke()
        logits.append(interpreter.get_tensor(output).copy())
    return {"logits": np.concatenate(logits), "input_dtype": np.array(str(np.dtype(detail["dtype"])))}


def run_onnx(path, inputs):
    import onnxruntime

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return {"logits": session.run(None, {name: inputs["images"].astype(np.float32)})[0]}


RUNNERS = {
    "saved_model": run_saved_model,
    "saved_model_keyed": run_saved_model_keyed,
    "tfsmlayer": run_tfsmlayer,
    "tflite": run_tflite,
    "onnx": run_onnx,
}


def main(jobs_path):
    with open(jobs_path) as f:
        jobs = json.load(f)
    for kind, artefact, inputs_path, outputs_path in jobs:
        outputs = RUNNERS[kind](artefact, dict(np.load(inputs_path, allow_pickle=False)))
        if any(name == "keras_vit" or name.startswith("keras_vit.") for name in sys.modules):
            raise SystemExit("keras_vit was imported by the serving process")
        # Strings come back as object arrays; fixed-width bytes need no pickling.
        outputs = {k: v.astype(bytes) if v.dtype == object else v for k, v in outputs.items()}
        np.savez(outputs_path, **outputs)


if __name__ == "__main__":
    main(*sys.argv[1:])
