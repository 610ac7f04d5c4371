r"""Exports a trained model, or pretrained weights, for serving and checks it against the Keras model.

    python -m experiments.export --model=runs/digits/model.keras \
        --format=tflite:int8 --out=runs/digits/model_int8.tflite
    python -m experiments.export --pretrained=timm/vit_base_patch16_224.augreg2_in21k_ft_in1k \
        --out=vit_b16_saved_model

--model: a .keras file (a keras_vit.ViT brings its own preprocessing and class
names); or --pretrained: what `keras_vit.from_pretrained` opens (a hub id, a
folder, an .npz), exported with the weights' own resize, crop and label names.

--format: what to write, by the names the training job's config.export takes
(`keras_vit.export.ARTEFACTS`): saved_model (signatures `serving_images`,
`serving_bytes` and `serving_default`: the first, or with
--default_signature=bytes encoded `image_bytes` and a passthrough `key`, as
Vertex AI and TF Serving's REST API send them; TF Serving's warmup requests
unless --nowarmup), in the model's own precision or, after a colon, the one it
computes in on CPUs (saved_model:float32, :bfloat16, :int8); tflite, or
tflite:float16, :dynamic, :int8 (quantized); onnx.  int8 TFLite is calibrated on
the digits training images when the model takes digits-sized images,
otherwise on --calibration_images (an .npy file of NHWC pixels).
--max_pixels and --max_aspect_ratio: the largest image `serving_bytes` decodes
(`keras_vit.data.ImageLimits`); larger ones are refused from their header.
Prints the file size and the parity of the artefact with the Keras model on the
same images.
"""

import os

import keras
import numpy as np
import tensorflow as tf
from absl import flags

from experiments import jobs
from keras_vit import export
from keras_vit.data.header import ImageLimits


def define_flags():
    """The job's flags, defined when it runs as a program (`jobs.run_job`), not on import."""
    return {
        "model": flags.DEFINE_string("model", None, "A .keras model (or --pretrained)."),
        "pretrained": flags.DEFINE_string(
            "pretrained", None, "Pretrained weights for keras_vit.from_pretrained: a hub id, folder or .npz."
        ),
        "format": flags.DEFINE_enum(
            "format", "saved_model", list(export.ARTEFACTS),
            "What to write: a format, or a format and its precision or quantization (docs/export.md).",
        ),
        "out": flags.DEFINE_string("out", None, "Where to write the artefact.", required=True),
        "overwrite": flags.DEFINE_bool("overwrite", False, "Replace an existing --out."),
        "calibration_images": flags.DEFINE_string("calibration_images", None, ".npy images for int8 calibration."),
        "class_names": flags.DEFINE_list("class_names", None, "Class names for the SavedModel's outputs."),
        "default_signature": flags.DEFINE_enum(
            "default_signature", "images", list(export.DEFAULT_SIGNATURES),
            "SavedModel: what serving_default takes, uint8 images or encoded image_bytes with a key.",
        ),
        "warmup": flags.DEFINE_bool("warmup", True, "SavedModel: write TF Serving's warmup requests."),
        "max_pixels": flags.DEFINE_integer(
            "max_pixels", ImageLimits.max_pixels, "serving_bytes: the most pixels (width x height) decoded."
        ),
        "max_aspect_ratio": flags.DEFINE_float(
            "max_aspect_ratio", ImageLimits.max_aspect_ratio, "serving_bytes: the longest side over the shortest."
        ),
    }


def artefact_size(path):
    """Bytes of the file at `path`, or of every file under it for a SavedModel folder."""
    if tf.io.gfile.isdir(path):
        return sum(
            tf.io.gfile.stat(os.path.join(root, name)).length
            for root, _, files in tf.io.gfile.walk(path)
            for name in files
        )
    return tf.io.gfile.stat(path).length


def sample_images(model, count, seed=0):
    """Images to calibrate and compare on: digits when the model takes them, else random pixels."""
    height, width, channels = model.input_shape[1:]
    if height is None or width is None:  # A model taking any size: the size of its weights.
        height, width = export.fixed_image_shape(model)[:2]
    if height == width and channels == 3:
        from keras_vit.data import load_digits

        return load_digits(image_size=height).test.images[:count]
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, channels)).astype(np.uint8)


def run_artefact(artefact, path, images):
    """Logits of the exported artefact (`keras_vit.export.ARTEFACTS`) at `path` on `images`."""
    kind, _ = export.parse_artefact(artefact)
    if kind == "saved_model":
        loaded = tf.saved_model.load(path)
        return loaded.signatures["serving_images"](images=tf.constant(images))["logits"].numpy()
    if kind == "tflite":
        from ai_edge_litert.interpreter import Interpreter

        interpreter = Interpreter(model_path=path)
        interpreter.allocate_tensors()
        detail, output = interpreter.get_input_details()[0], interpreter.get_output_details()[0]
        logits = []
        for image in images:
            interpreter.set_tensor(detail["index"], image[None].astype(detail["dtype"]))
            interpreter.invoke()
            logits.append(interpreter.get_tensor(output["index"])[0].copy())
        return np.stack(logits)
    import onnxruntime

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: images.astype(np.float32)})[0]


def export_and_check(
    model, artefact, out, *, calibration=None, class_names=None, image_limits=None, overwrite=False,
    default_signature="images", warmup=True,
):
    """Exports `model` as `artefact` (`keras_vit.export.ARTEFACTS`: "saved_model", "tflite:int8", "onnx", ...)
    to `out`, then runs the artefact on 100 sample images (`sample_images`) and compares it with the Keras
    model.

    `calibration` (images) calibrates int8 TFLite, by default the sample images; `class_names`,
    `image_limits`, `default_signature` and `warmup` are the SavedModel's.  Returns (path written, largest
    |logit difference|, top-1 agreement) and prints them with the artefact's size.
    """
    images = sample_images(model, 100)
    path = export.export_artefact(
        model, artefact, out, representative_data=images if calibration is None else calibration,
        class_names=class_names, image_limits=image_limits, default_signature=default_signature, warmup=warmup,
        overwrite=overwrite,
    )  # fmt: skip
    if export.parse_artefact(artefact)[0] == "tflite":
        print(f"TFLite operators: {', '.join(export.tflite_operators(path))}")
    expected = model.predict(images, verbose=0)
    got = run_artefact(artefact, path, images)
    difference = float(np.abs(got - expected).max())
    agreement = float((got.argmax(-1) == expected.argmax(-1)).mean())
    print(f"Wrote {path} ({artefact_size(path) / 2**20:.2f} MiB)")
    print(
        f"Parity with the Keras model on {len(images)} images: max |logit difference| "
        f"{difference:.3g}, top-1 agreement {100 * agreement:.1f}%"
    )
    return path, difference, agreement


def main(cli):
    if (cli.model.value is None) == (cli.pretrained.value is None):
        raise ValueError(
            f"Give one of --model and --pretrained. Received: --model={cli.model.value!r}, "
            f"--pretrained={cli.pretrained.value!r}"
        )
    if cli.model.value is not None:
        model = keras.saving.load_model(cli.model.value)
    else:
        from keras_vit import from_pretrained

        model = from_pretrained(cli.pretrained.value)
    export_and_check(
        model,
        cli.format.value,
        cli.out.value,
        calibration=np.load(cli.calibration_images.value) if cli.calibration_images.value else None,
        class_names=cli.class_names.value,
        image_limits=ImageLimits(cli.max_pixels.value, cli.max_aspect_ratio.value),
        overwrite=cli.overwrite.value,
        default_signature=cli.default_signature.value,
        warmup=cli.warmup.value,
    )


if __name__ == "__main__":
    jobs.run_job(main, define_flags)
