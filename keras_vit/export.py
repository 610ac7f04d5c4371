"""Export for serving: SavedModel with serving signatures, TFLite, ONNX.

Every artefact takes raw pixels (the model rescales them itself), so it drops
into a serving stack with no preprocessing code of ours:

- `export_saved_model`: `serving_default` takes uint8 images
  [batch, H, W, 3] (of any height and width for a model built with
  `dynamic_image_size`); `serving_bytes` takes encoded JPEG/PNG/GIF/BMP/WebP
  bytes and decodes, resizes and center-crops in the graph (as the model's
  `preprocessing` says, for a model from `from_pretrained`), refusing images
  past `ImageLimits` before decoding them.  Both return
  `logits`, `probabilities`, `top_k` (class indices) and `top_k_probabilities`,
  plus `top_k_names` when class names are given.  Load it with plain
  `tf.saved_model.load` or as `keras.layers.TFSMLayer`.
- `export_tflite`: builtin ops only (conversion fails rather than falling
  back to Flex/Select TF ops), float32, float16, dynamic-range or full-integer
  quantisation; run it with `ai_edge_litert.interpreter.Interpreter`.
- `export_onnx`: through tf2onnx (the optional `onnx` extra); run it with
  onnxruntime.
"""

import os
import tempfile

import numpy as np

from keras_vit.data import center_crop_resize, decode_image, resize_and_crop
from keras_vit.data.header import as_image_limits
from keras_vit.files import atomic_path, write_bytes_atomically
from keras_vit.kernels import portable_ops
from keras_vit.requirements import import_tensorflow

tf = import_tensorflow("keras_vit.export")

QUANTIZATIONS = (None, "float16", "dynamic", "int8")


class ExportError(RuntimeError):
    """A conversion that cannot produce the artefact asked for."""


def _check_destination(path, overwrite):
    """`path` as a string; FileExistsError if it exists and `overwrite` is False.  An existing file or folder is
    left in place: the writers replace it only once the new one is complete (`atomic_path`)."""
    path = os.fspath(path)
    if tf.io.gfile.exists(path) and not overwrite:
        raise FileExistsError(f"{path!r} already exists; pass overwrite=True to replace it.")
    return path


def fixed_image_shape(model):
    """The (height, width, channels) a model takes; for one that takes any size (`dynamic_image_size`), the size
    its weights were made for."""
    shape = tuple(model.input_shape[1:])
    if len(shape) == 3 and None in shape[:2] and shape[2] is not None:
        size = _base_size(model)
        if size is not None:
            return (*size, shape[2])
    if len(shape) != 3 or None in shape:
        raise ValueError(f"Expected a model with a static (height, width, channels) input. Received: {shape}")
    return shape


def _base_size(model):
    """The image size the weights of a model from `build_vit(dynamic_image_size=True)` were made for."""
    preprocessing = getattr(model, "preprocessing", None)
    if preprocessing is not None:
        return preprocessing.image_size
    encoders = [layer for layer in model.layers if getattr(layer, "base_image_size", None) is not None]
    hybrid = any(layer.name == "resnet" for layer in model.layers)
    return encoders[0].base_image_size if len(encoders) == 1 and not hybrid else None


def _is_dynamic(model):
    return None in tuple(model.input_shape[1:3])


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


def _bytes_preprocessing(model, preprocessing, crop_fraction):
    """The `Preprocessing` serving_bytes applies (None: a center crop of `crop_fraction`): `preprocessing`,
    else the model's own unless `crop_fraction` is given; its crop checked against the model's fixed size."""
    if preprocessing is not None and crop_fraction is not None:
        raise ValueError("Pass `crop_fraction` or `preprocessing`, not both.")
    if preprocessing is None and crop_fraction is None:
        preprocessing = getattr(model, "preprocessing", None)
    if preprocessing is not None:
        height, width = preprocessing.image_size
        if not _is_dynamic(model) and (height, width) != fixed_image_shape(model)[:2]:
            raise ValueError(
                f"The preprocessing crops {preprocessing.image_size}, the model takes {fixed_image_shape(model)[:2]}."
            )
    return preprocessing


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


def _bytes_decoder(limits, channels, preprocessing, size, crop_fraction):
    """The function serving_bytes maps over the request: encoded bytes to a uint8 image of `size` and
    `channels`, refused past `limits`, resized and cropped by `preprocessing` (or a center crop of
    `crop_fraction`, 1.0 when None)."""

    def decode(encoded):
        image = decode_image(encoded, limits)
        if channels == 1:
            image = tf.cast(tf.round(tf.image.rgb_to_grayscale(tf.cast(image, tf.float32))), tf.uint8)
        if preprocessing is not None:
            return resize_and_crop(image, preprocessing)
        return center_crop_resize(image, size, 1.0 if crop_fraction is None else crop_fraction)

    return decode


def export_saved_model(
    model,
    path,
    *,
    class_names=None,
    top_k=None,
    crop_fraction=None,
    preprocessing=None,
    image_limits=None,
    overwrite=False,
):
    """Writes a SavedModel (local or gs://) with two serving signatures.

    Args:
        model: a Keras model taking (batch, H, W, C) pixels in [0, 255] and
            returning logits (a model from `build_vit`).
        path: the SavedModel folder.
        class_names: optional names of the classes, returned for the top k
            (default: the model's `class_names`, set by `from_pretrained`).
        top_k: how many of the most probable classes to return (default 5,
            or all classes if there are fewer).
        crop_fraction: for `serving_bytes`, the central fraction kept (1.0:
            resize the shorter side to the model's size and crop the longer;
            bilinear).
        preprocessing: for `serving_bytes`, a `keras_vit.Preprocessing`
            instead (the resize and crop of the weights' own library);
            default: the model's `preprocessing` (set by `from_pretrained`)
            unless `crop_fraction` is given.
        image_limits: for `serving_bytes`, the largest image decoded
            (`keras_vit.data.ImageLimits`: total pixels and aspect ratio; None:
            its defaults).  A request with an image past them, or with bytes
            that are not an image, fails with an InvalidArgumentError naming
            the limit and the image's size, before anything is decoded; a GIF
            is cut after its first frame, the only one decoded.
        overwrite: replace an existing `path`.

    Returns:
        The path written.
    """
    height, width, channels = fixed_image_shape(model)
    if channels not in (1, 3):
        raise ValueError(f"Expected a model of RGB or grey-scale images (3 or 1 channels). Received: {channels}")
    limits = as_image_limits(image_limits)
    preprocessing = _bytes_preprocessing(model, preprocessing, crop_fraction)
    if preprocessing is not None:
        height, width = preprocessing.image_size
    class_names, top_k = _serving_labels(model, class_names, top_k)
    path = _check_destination(path, overwrite)
    decode = _bytes_decoder(limits, channels, preprocessing, (height, width), crop_fraction)

    def serve_images(images):
        return _outputs(model(tf.cast(images, tf.float32), training=False), top_k, class_names)

    def serve_bytes(encoded):
        images = tf.map_fn(
            decode,
            encoded,
            fn_output_signature=tf.TensorSpec([height, width, channels], tf.uint8),
        )
        return serve_images(images)

    with atomic_path(path) as temporary:
        _write_saved_model(
            model,
            temporary,
            {
                "serving_default": (
                    serve_images,
                    tf.TensorSpec(
                        [None, *((None, None) if _is_dynamic(model) else (height, width)), channels],
                        tf.uint8,
                        name="images",
                    ),
                ),
                "serving_bytes": (serve_bytes, tf.TensorSpec([None], tf.string, name="encoded")),
            },
        )
    return path


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


def _write_saved_model(model, path, endpoints):
    """Saves `endpoints` ({name: (function, input spec)}) as signatures over the model's variables.

    A tf.Module holding the variables once: Keras's ExportArchive (keras 3.15)
    writes every variable twice, doubling the SavedModel's size.  Traced with
    `portable_ops()`, so the graph runs on any device and converts to TFLite.
    """
    module = _ServingModule(model)
    signatures = {}
    for name, (function, spec) in endpoints.items():
        traced = tf.function(function, input_signature=[spec])
        setattr(module, name, traced)
        with portable_ops():
            signatures[name] = traced.get_concrete_function()
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
                    tf.TensorSpec([batch_size, height, width, channels], tf.float32, name="images"),
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
