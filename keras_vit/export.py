"""Export for serving: SavedModel with serving signatures, TFLite, ONNX.

Every artefact takes raw pixels (the model rescales them itself), so it drops
into a serving stack with no preprocessing code of ours:

- `export_saved_model`: `serving_images` takes uint8 images
  [batch, H, W, 3] (of any height and width for a model built with
  `dynamic_image_size`); `serving_bytes` takes encoded JPEG/PNG/GIF/BMP/WebP
  bytes and decodes, resizes and center-crops in the graph (as the model's
  `preprocessing` says, for a model from `from_pretrained`), refusing images
  past `ImageLimits` before decoding them; `serving_default` is the first,
  or (default_signature="bytes") encoded `image_bytes` with a passthrough
  `key`, as Vertex AI and TF Serving's REST API send them.  All return
  `logits`, `probabilities`, `top_k` (class indices) and `top_k_probabilities`,
  plus `top_k_names` when class names are given.  TF Serving's warmup
  requests come with it.  Load it with plain `tf.saved_model.load` or as
  `keras.layers.TFSMLayer`.  `precision` picks what the CPU computes in:
  float32, bfloat16 (oneDNN's bfloat16 matmuls where the CPU has AMX or
  AVX512-BF16) or int8 (oneDNN's int8 matmuls; docs/export.md).
- `export_tflite`: builtin ops only (conversion fails rather than falling
  back to Flex/Select TF ops), float32, float16, dynamic-range or full-integer
  quantisation; run it with `ai_edge_litert.interpreter.Interpreter`.
- `export_onnx`: through tf2onnx (the optional `onnx` extra); run it with
  onnxruntime.
"""

import contextlib
import os
import tempfile

import keras
import numpy as np

from keras_vit.data.header import as_image_limits
from keras_vit.files import atomic_path, write_bytes_atomically
from keras_vit.kernels import cpu_serving, portable_ops
from keras_vit.prediction import (
    LABELS_FILE,
    fixed_image_shape,
    image_decoder,
    is_dynamic,
    model_preprocessing,
)
from keras_vit.requirements import import_tensorflow

tf = import_tensorflow("keras_vit.export")

QUANTIZATIONS = (None, "float16", "dynamic", "int8")
# What a SavedModel computes in (`export_saved_model(precision=...)`).
PRECISIONS = ("float32", "bfloat16", "int8")
# The artefacts by name, as the training job's `config.export` and the export command's --format take them:
# a format, or a format and its variant after a colon (a SavedModel's precision, a TFLite model's quantization).
ARTEFACTS = (
    "saved_model", *(f"saved_model:{precision}" for precision in PRECISIONS),
    "tflite", *(f"tflite:{quantize}" for quantize in QUANTIZATIONS if quantize),
    "onnx",
)  # fmt: skip


class ExportError(RuntimeError):
    """A conversion that cannot produce the artefact asked for."""


def _check_destination(path, overwrite):
    """`path` as a string; FileExistsError if it exists and `overwrite` is False.  An existing file or folder is
    left in place: the writers replace it only once the new one is complete (`atomic_path`)."""
    path = os.fspath(path)
    if tf.io.gfile.exists(path) and not overwrite:
        raise FileExistsError(f"{path!r} already exists; pass overwrite=True to replace it.")
    return path


def _outputs(logits, top_k, class_names):
    logits = tf.cast(logits, tf.float32)
    probabilities = tf.nn.softmax(logits, axis=-1)
    top = tf.math.top_k(probabilities, k=top_k)
    outputs = {
        "logits": logits,
        "probabilities": probabilities,
        "top_k": top.indices,
        "top_k_probabilities": top.values,
    }
    if class_names is not None:
        outputs["top_k_names"] = tf.gather(tf.constant(class_names), top.indices)
    return outputs


def _serving_labels(model, class_names, top_k):
    """(class names or None, top k) the signatures return: the names given, else the model's, one per class;
    `top_k` by default 5, or all classes if there are fewer."""
    if class_names is None:
        class_names = getattr(model, "class_names", None)
    num_classes = model.output_shape[-1]
    if class_names is not None:
        class_names = [str(name) for name in class_names]
        if len(class_names) != num_classes:
            raise ValueError(
                f"`class_names` has {len(class_names)} names, the model has {num_classes} classes."
            )
    if top_k is None:
        top_k = min(5, num_classes)
    if not isinstance(top_k, int) or not 1 <= top_k <= num_classes:
        raise ValueError(f"`top_k` must be an integer in [1, {num_classes}]. Received: top_k={top_k!r}")
    return class_names, top_k


DEFAULT_SIGNATURES = ("images", "bytes")
# TF Serving's warmup file: requests it runs after loading a model and before taking traffic (TF Serving's
# "SavedModel Warmup" guide), TFRecords of tensorflow.serving.PredictionLog.
WARMUP_FILE = "assets.extra/tf_serving_warmup_requests"


def export_saved_model(
    model,
    path,
    *,
    class_names=None,
    top_k=None,
    crop_fraction=None,
    preprocessing=None,
    image_limits=None,
    default_signature="images",
    warmup=True,
    precision=None,
    overwrite=False,
):
    """Writes a SavedModel (local or gs://) with its serving signatures.

    Signatures (each returns `logits`, `probabilities`, `top_k`,
    `top_k_probabilities`, and `top_k_names` with class names):
        serving_images: uint8 images [batch, H, W, C] (input `images`).
        serving_bytes: encoded images (input `encoded`), decoded, resized
            and cropped in the graph.
        serving_default: with default_signature="images" (the default),
            `serving_images`' function; with "bytes", encoded images
            (input `image_bytes`) and a `key` per image (strings; optional:
            TF Serving feeds none for a request without it), as
            `serving_bytes` does, plus the `key` output, the keys as sent
            (empty strings without them): what Vertex AI and TF Serving's
            REST API send by default, base64 in JSON.

    Args:
        model: a Keras model taking (batch, H, W, C) pixels in [0, 255] and
            returning logits (a model from `build_vit`).
        path: the SavedModel folder.
        class_names: optional names of the classes, returned for the top k
            (default: the model's `class_names`, set by `from_pretrained`)
            and written to assets/labels.txt, one per line.
        top_k: how many of the most probable classes to return (default 5,
            or all classes if there are fewer).
        crop_fraction: for the bytes signatures, the central fraction kept
            (1.0: resize the shorter side to the model's size and crop the
            longer; bilinear).
        preprocessing: for the bytes signatures, a `keras_vit.Preprocessing`
            instead (the resize and crop of the weights' own library);
            default: the model's `preprocessing` (set by `from_pretrained`)
            unless `crop_fraction` is given.
        image_limits: for the bytes signatures, the largest image decoded
            (`keras_vit.data.ImageLimits`: total pixels and aspect ratio; None:
            its defaults).  A request with an image past them, or with bytes
            that are not an image, fails with an InvalidArgumentError naming
            the limit and the image's size, before anything is decoded; a GIF
            is cut after its first frame, the only one decoded.
        default_signature: "images" or "bytes", what `serving_default` takes.
        warmup: write TF Serving's warmup requests
            (assets.extra/tf_serving_warmup_requests): one request of one
            image of the model's size per signature, which TF Serving runs
            before it serves, so that the first requests do not pay for
            loading the graphs.
        overwrite: replace an existing `path`.

    Returns:
        The path written.
    """
    if default_signature not in DEFAULT_SIGNATURES:
        raise ValueError(
            f"`default_signature` must be one of {DEFAULT_SIGNATURES}. "
            f"Received: default_signature={default_signature!r}"
        )
    height, width, channels = fixed_image_shape(model)
    if channels not in (1, 3):
        raise ValueError(f"Expected a model of RGB or grey-scale images (3 or 1 channels). Received: {channels}")
    limits = as_image_limits(image_limits)
    preprocessing = model_preprocessing(model, preprocessing, crop_fraction)
    if preprocessing is not None:
        height, width = preprocessing.image_size
    class_names, top_k = _serving_labels(model, class_names, top_k)
    broken = [name for name in class_names or () if "\n" in name or "\r" in name]
    if broken:
        raise ValueError(f"Class names must be one line each (assets/labels.txt); these are not: {broken[:3]!r}")
    model, for_cpu = model_in_precision(model, precision)
    path = _check_destination(path, overwrite)
    decode = image_decoder(limits, channels, preprocessing, (height, width), crop_fraction)
    image_shape = [None, *((None, None) if is_dynamic(model) else (height, width)), channels]

    def serve_images(images):
        return _outputs(model(tf.cast(images, tf.float32), training=False), top_k, class_names)

    def serve_bytes(encoded):
        images = tf.map_fn(
            decode,
            encoded,
            fn_output_signature=tf.TensorSpec([height, width, channels], tf.uint8),
        )
        return serve_images(images)

    # A default the SignatureDef records (its `defaults`): TF Serving feeds it for a request without a key.
    no_keys = tf.constant([], tf.string)

    def serve_keyed_bytes(image_bytes, key=no_keys):
        outputs = serve_bytes(image_bytes)
        count = tf.shape(image_bytes)[0]
        keys = tf.cond(tf.size(key) > 0, lambda: key, lambda: tf.fill([count], ""))
        tf.debugging.assert_equal(
            tf.shape(keys)[0], count, message="Expected one `key` per image in `image_bytes`, or no key"
        )
        return {**outputs, "key": tf.identity(keys)}

    images_spec = tf.TensorSpec(image_shape, tf.uint8, name="images")
    encoded_spec = tf.TensorSpec([None], tf.string, name="encoded")
    endpoints = {
        "serving_images": (serve_images, [images_spec]),
        "serving_bytes": (serve_bytes, [encoded_spec]),
    }
    if default_signature == "images":
        endpoints["serving_default"] = endpoints["serving_images"]
    else:
        keyed = [tf.TensorSpec([None], tf.string, name="image_bytes"), tf.TensorSpec([None], tf.string, name="key")]
        endpoints["serving_default"] = (serve_keyed_bytes, keyed)
    with atomic_path(path) as temporary:
        _write_saved_model(model, temporary, endpoints, for_cpu=for_cpu)
        if class_names is not None:
            _write_labels(temporary, class_names)
        if warmup:
            write_warmup_requests(temporary, _warmup_requests(endpoints, (height, width, channels)))
    return path


def _write_labels(folder, class_names):
    """assets/labels.txt: the class names, one per line."""
    tf.io.gfile.makedirs(f"{folder}/assets")
    with tf.io.gfile.GFile(f"{folder}/assets/{LABELS_FILE}", "w") as f:
        f.write("".join(f"{name}\n" for name in class_names))


def _warmup_requests(endpoints, shape):
    """[(signature name, {input: array})]: one image of `shape` (mid-grey with a gradient) for each signature,
    as pixels or as a JPEG, with a key for the keyed one."""
    height, width, channels = shape
    ramp = np.add.outer(np.arange(height), np.arange(width)) * 255 // max(height + width - 2, 1)
    image = np.repeat(ramp[:, :, None], channels, axis=2).astype(np.uint8)
    jpeg = tf.io.encode_jpeg(tf.image.grayscale_to_rgb(image) if channels == 1 else image).numpy()
    requests = []
    for name, (_, specs) in endpoints.items():
        inputs = {}
        for spec in specs:
            if spec.dtype == tf.uint8:
                inputs[spec.name] = image[None]
            elif spec.name == "key":
                inputs[spec.name] = np.array([b"warmup"], dtype=object)
            else:
                inputs[spec.name] = np.array([jpeg], dtype=object)
        requests.append((name, inputs))
    return requests


def _varint(value):
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number, payload):
    """One length-delimited protobuf field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def prediction_log(signature_name, inputs):
    """A serialized tensorflow.serving.PredictionLog holding a PredictLog's PredictRequest for
    `signature_name` with `inputs` ({alias: array}).

    The field numbers are those of tensorflow_serving/apis: PredictionLog.predict_log = 6,
    PredictLog.request = 1, PredictRequest.model_spec = 1 and .inputs = 2 (a map<string, TensorProto>:
    entries of key = 1, value = 2), ModelSpec.signature_name = 3.  The tensors are TensorFlow's own
    TensorProtos.  No model name: TF Serving runs a warmup request on the model whose folder holds it.
    """
    spec = _field(3, signature_name.encode())
    request = _field(1, spec) + b"".join(
        _field(2, _field(1, alias.encode()) + _field(2, tf.make_tensor_proto(array).SerializeToString()))
        for alias, array in sorted(inputs.items())
    )
    return _field(6, _field(1, request))


def write_warmup_requests(folder, requests):
    """Writes `requests` ([(signature name, {input: array})]) as TF Serving's warmup file of the SavedModel in
    `folder` (assets.extra/tf_serving_warmup_requests)."""
    tf.io.gfile.makedirs(f"{folder}/assets.extra")
    with tf.io.TFRecordWriter(f"{folder}/{WARMUP_FILE}") as writer:
        for name, inputs in requests:
            writer.write(prediction_log(name, inputs))


class _ServingModule(tf.Module):
    """The SavedModel's root object: the model's variables, each saved once, and the serving functions.

    `variables` and `trainable_variables` are plain attributes here, not
    tf.Module's computed properties, so that they are saved and the loaded
    object has them too (TF Hub's convention for reusable SavedModels).
    """

    variables = ()
    trainable_variables = ()

    def __init__(self, model):
        super().__init__(name="serving")
        self.variables = [v.value for v in model.variables]
        self.trainable_variables = [v.value for v in model.trainable_variables]


def model_in_precision(model, precision=None):
    """(the model to trace for `precision`, whether to trace it for CPUs with oneDNN): `model` itself in its
    own precision (None), else a copy in bfloat16 or quantized to int8; a ValueError for what cannot be made."""
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"`precision` must be one of {PRECISIONS}. Received: precision={precision!r}")
    # A keras_vit.ViT's config records how its layers are quantized; other models are taken as they are.
    config = model.get_config() if hasattr(model, "spec") else {}
    quantized = config.get("quantized", {}).values()
    modes = {keras.dtype_policies.get(saved["policy"]).quantization_mode for saved in quantized}
    own = "int8" if modes == {"int8"} else None if modes else "float32"
    if precision is None or precision == own:
        return model, own == "int8"
    if modes:
        raise ValueError(
            f"The model is quantized ({', '.join(sorted(modes))}); precision={precision!r} needs the float model "
            "it was quantized from."
        )
    if not hasattr(model, "spec"):
        raise ValueError(
            f"precision={precision!r} needs a keras_vit.ViT (a copy of it is made in that precision). "
            f"Received: a {type(model).__name__}"
        )
    copy = type(model).from_config({**config, "dtype": "bfloat16"} if precision == "bfloat16" else config)
    copy.set_weights(model.get_weights())
    if precision == "int8":
        copy.quantize("int8")
    return copy, True


def _write_saved_model(model, path, endpoints, for_cpu=False):
    """Saves `endpoints` ({name: (function, [input specs])}) as signatures over the model's variables.

    A tf.Module holding the variables once: Keras's ExportArchive (keras 3.15)
    writes every variable twice, doubling the SavedModel's size.  Traced with
    `portable_ops()`, so the graph runs on any device and converts to TFLite;
    `for_cpu`: with `cpu_serving()`, the forms for TensorFlow's oneDNN CPU
    kernels (a bfloat16 or int8 model).  Each signature is saved from its tf.function, so that a tensor default of
    an argument becomes the SignatureDef's default for that input.  Two names
    given the same (function, specs) share one traced function.
    """
    module = _ServingModule(model)
    traced = {}
    signatures = {}
    with portable_ops(), (cpu_serving() if for_cpu else contextlib.nullcontext()):
        for name, (function, specs) in endpoints.items():
            if function not in traced:
                traced[function] = tf.function(function, input_signature=specs)
                traced[function].get_concrete_function()
                setattr(module, name, traced[function])
            signatures[name] = traced[function]
        tf.saved_model.save(module, path, signatures=signatures)


def _calibration_data(data, limit):
    """A TFLite representative data set: single float32 images from an array or a tf.data.Dataset."""
    if isinstance(data, tf.data.Dataset):
        if isinstance(data.element_spec, tuple):
            data = data.map(lambda images, *rest: images)
        if len(data.element_spec.shape) == 4:
            data = data.unbatch()
        data = data.take(limit)
    else:
        data = np.asarray(data)[:limit]

    def generate():
        images = data.as_numpy_iterator() if isinstance(data, tf.data.Dataset) else data
        for image in images:
            yield [np.asarray(image, np.float32)[None]]

    return generate


def export_tflite(
    model,
    path,
    *,
    quantize=None,
    representative_data=None,
    num_calibration_images=300,
    batch_size=1,
    overwrite=False,
):
    """Writes a TFLite flatbuffer made of builtin ops only.

    Args:
        model: a Keras model taking pixels in [0, 255].
        path: the .tflite file (local or gs://).
        quantize: None (float32), "float16" (float16 weights), "dynamic"
            (int8 weights, float activations) or "int8" (full integer: int8
            weights and activations, uint8 pixels in, float32 logits out).
        representative_data: images for calibrating "int8": a uint8/float
            array (N, H, W, C), or a tf.data.Dataset of images or
            (images, labels), batched or not; the evaluation pipeline is the
            right source.
        num_calibration_images: how many of them to use.
        batch_size: the input's batch size; None makes it resizable
            (`interpreter.resize_tensor_input`).  The height and width are
            fixed: a model built with `dynamic_image_size` is converted at
            the size its weights were made for.
        overwrite: replace an existing file.

    Returns:
        The path written.
    """
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"`quantize` must be one of {QUANTIZATIONS}. Received: quantize={quantize!r}")
    if quantize == "int8" and representative_data is None:
        raise ValueError(
            "quantize='int8' needs `representative_data`: a few hundred images from the evaluation "
            "pipeline to calibrate the activation ranges."
        )
    height, width, channels = fixed_image_shape(model)
    path = _check_destination(path, overwrite)

    with tempfile.TemporaryDirectory() as tmp:
        # Through a SavedModel: the converter then freezes the variables into
        # constants, which quantisation needs (a concrete function keeps them as
        # resource variables).
        _write_saved_model(
            model,
            tmp,
            {
                "serve": (
                    lambda images: model(images, training=False),
                    [tf.TensorSpec([batch_size, height, width, channels], tf.float32, name="images")],
                )
            },
        )
        converter = tf.lite.TFLiteConverter.from_saved_model(tmp, signature_keys=["serve"])
        flatbuffer = _convert(converter, quantize, representative_data, num_calibration_images)
    custom = [name for name in tflite_operators(flatbuffer) if name.startswith("CUSTOM")]
    if custom:
        raise ExportError(f"The TFLite model would need custom or Flex ops: {custom}.")
    return write_bytes_atomically(path, flatbuffer)


def _convert(converter, quantize, representative_data, num_calibration_images):
    # Builtin ops only: a model that needed Flex (Select TF) ops would not run on
    # a plain TFLite runtime, so conversion fails loudly instead.
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
    if quantize == "float16":
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.target_spec.supported_types = [tf.float16]
    elif quantize == "dynamic":
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
    elif quantize == "int8":
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.representative_dataset = _calibration_data(representative_data, num_calibration_images)
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        # Pixels are integers in [0, 255]: a uint8 input with scale 1 is exact.
        converter.inference_input_type = tf.uint8
    try:
        return converter.convert()
    except Exception as error:  # The converter raises several types; all mean the same here.
        raise ExportError(f"TFLite conversion (quantize={quantize!r}) failed with builtin ops only: {error}") from error


def tflite_operators(flatbuffer):
    """The operator names used by a TFLite model, read from its flatbuffer.

    Builtin ops by name ("FULLY_CONNECTED", ...); custom ops (Flex ops among
    them) as "CUSTOM:<code>".
    """
    from ai_edge_litert import schema_py_generated as schema

    if isinstance(flatbuffer, (str, os.PathLike)):
        with tf.io.gfile.GFile(os.fspath(flatbuffer), "rb") as f:
            flatbuffer = f.read()
    names = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
    tflite_model = schema.Model.GetRootAsModel(flatbuffer, 0)
    operators = set()
    for i in range(tflite_model.OperatorCodesLength()):
        code = tflite_model.OperatorCodes(i)
        builtin = max(code.BuiltinCode(), code.DeprecatedBuiltinCode())
        if builtin == schema.BuiltinOperator.CUSTOM:
            operators.add(f"CUSTOM:{code.CustomCode().decode()}")
        else:
            operators.add(names.get(builtin, str(builtin)))
    return sorted(operators)


def export_onnx(model, path, *, opset=17, overwrite=False):
    """Writes an ONNX model through tf2onnx (install the `onnx` extra).

    The ONNX graph takes float32 pixels "images" [batch, H, W, C] and returns
    the logits.
    """
    try:
        import tf2onnx
    except ImportError as error:
        raise ImportError("ONNX export needs tf2onnx: pip install 'keras-vit[onnx]'.") from error
    height, width, channels = fixed_image_shape(model)
    path = _check_destination(path, overwrite)
    serve = tf.function(lambda images: model(images, training=False))
    spec = [tf.TensorSpec([None, height, width, channels], tf.float32, name="images")]
    with atomic_path(path) as temporary, portable_ops():
        tf2onnx.convert.from_function(serve, input_signature=spec, opset=opset, output_path=temporary)
    return path


def parse_artefact(name):
    """(format, variant) of an artefact's name (`ARTEFACTS`): ("tflite", "int8") for "tflite:int8", ("onnx",
    None) for "onnx"; a ValueError naming the names there are for any other."""
    if name not in ARTEFACTS:
        raise ValueError(f"Unknown export {name!r}. Expected one of {list(ARTEFACTS)}.")
    kind, _, variant = name.partition(":")
    return kind, variant or None


def export_artefact(
    model, name, path, *, representative_data=None, class_names=None, crop_fraction=None, image_limits=None,
    default_signature="images", warmup=True, overwrite=False,
):  # fmt: skip
    """Writes the artefact `name` (`ARTEFACTS`, e.g. "saved_model:bfloat16", "tflite:int8") of `model` to `path`
    and returns the path: `export_saved_model` in the precision it names (none: the model's own) with
    `class_names`, `crop_fraction`, `image_limits`, `default_signature` and `warmup`; `export_tflite` with the
    quantization it names, int8 calibrated on `representative_data`; or `export_onnx`."""
    kind, variant = parse_artefact(name)
    if kind == "saved_model":
        return export_saved_model(
            model, path, precision=variant, class_names=class_names, crop_fraction=crop_fraction,
            image_limits=image_limits, default_signature=default_signature, warmup=warmup, overwrite=overwrite,
        )  # fmt: skip
    if kind == "tflite":
        return export_tflite(
            model, path, quantize=variant, representative_data=representative_data, overwrite=overwrite
        )
    return export_onnx(model, path, overwrite=overwrite)
