"""What the tests build and share: the small model, folders of images, hand-written hub checkpoints, the
serving check, small job configs and a few tables and counters. Test modules import from here (and from
tests/numpy_vit.py, the NumPy reference), never from one another."""

import importlib.util
import io
import json
import os
import re
import socket
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from PIL import Image
from safetensors.numpy import save_file

import keras_vit
from tests.conftest import ROOT

# === The small model ===

# The one size of the tests' small ViT: 16 px images in 4 x 4 patches, two blocks of width 16 with 4 heads.
# A test that needs other dimensions passes them to `small_vit`.
SMALL = dict(image_size=16, patch_size=4, hidden_dim=16, num_layers=2, num_heads=4, mlp_dim=32)


def small_vit(**options):
    """A "testing" ViT of the size SMALL with 5 classes and a random (Glorot) head; `options` override any of it."""
    return keras_vit.build_vit("testing", **{**SMALL, "num_classes": 5, "head_kernel_initializer": "glorot_uniform",
                                             **options})


def weights_of(model):
    """{path: a copy of the array} of every weight of a model."""
    return {v.path: keras.ops.convert_to_numpy(v).copy() for v in model.weights}


def write_npz(params, path):
    """Writes a checkpoint's arrays to an .npz file; returns its path as a string."""
    from keras_vit import checkpoints

    checkpoints.write_npz(params, str(path))
    return str(path)


def assert_load_fails_unchanged(path, pattern, exception=None, model=None, **kwargs):
    """load_pretrained(path) into a random `small_vit(**model)` raises `exception` (a CheckpointError by default)
    matching `pattern`, and leaves every weight as it was."""
    from keras_vit import checkpoints
    from keras_vit.testing import randomize_weights

    model = randomize_weights(small_vit(**(model or {})), seed=5)
    before = weights_of(model)
    with pytest.raises(exception or checkpoints.CheckpointError, match=pattern):
        keras_vit.load_pretrained(model, path, **kwargs)
    for key, value in weights_of(model).items():
        np.testing.assert_array_equal(value, before[key], err_msg=key)


# === Folders of images ===


def write_folder(root, classes=("cat", "dog", "eel"), per_class=6, size=(40, 30), corrupt=()):
    rng = np.random.default_rng(0)
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            image = rng.integers(0, 256, (*size, 3)).astype(np.uint8)
            image[..., c % 3] = 255  # a class-dependent colour
            encode = tf.io.encode_png if i % 2 else tf.io.encode_jpeg
            (root / name / f"{i}.{'png' if i % 2 else 'jpg'}").write_bytes(encode(image).numpy())
    for path in corrupt:
        (root / path).write_bytes(b"this is not an image at all")
    return root


# Images in every format a folder of photos holds, and files that are not images.
HEIGHT, WIDTH = 16, 32  # Two 16x16 halves: a JPEG's blocks end where the colours change.


def halves(left, right):
    image = np.empty((HEIGHT, WIDTH, 3), np.uint8)
    image[:, : WIDTH // 2], image[:, WIDTH // 2 :] = left, right
    return image


def encoded(image, format, **kwargs):
    buffer = io.BytesIO()
    image.save(buffer, format, **kwargs)
    return buffer.getvalue()


def palette_image(left, right):
    image = Image.new("P", (WIDTH, HEIGHT))
    image.putpalette([*left, *right])
    image.putdata([0 if x < WIDTH // 2 else 1 for _ in range(HEIGHT) for x in range(WIDTH)])
    return image


def good_images():
    """{file name: (encoded bytes, the RGB uint8 image it must decode to, tolerance)}, one colour pair each."""
    files = {}
    colours = iter([((30 * k + 10) % 256, (70 * k + 40) % 256, (110 * k + 90) % 256) for k in range(40)])

    def pair():
        return next(colours), next(colours)

    left, right = pair()
    rgb = halves(left, right)
    files["rgb.jpg"] = encoded(Image.fromarray(rgb), "JPEG", quality=95, subsampling=0), rgb, 2
    left, right = pair()
    rgb = halves(left, right)
    files["rgb.png"] = encoded(Image.fromarray(rgb), "PNG"), rgb, 0
    left, right = pair()
    rgb = halves(left, right)
    files["cmyk.jpg"] = encoded(Image.fromarray(rgb).convert("CMYK"), "JPEG", quality=95), rgb, 2
    # 16-bit: the high byte is the colour, the low byte 200 (what a wrap to 8 bits would keep).
    left, right = pair()
    rgb = halves(left, right)
    files["deep.png"] = tf.io.encode_png(rgb.astype(np.uint16) * 256 + 200).numpy(), rgb, 0
    grey = halves(left[0], right[0] // 2 + 100)[..., :1]
    files["deep_grey.png"] = (
        tf.io.encode_png(grey.astype(np.uint16) * 256 + 200).numpy(), np.repeat(grey, 3, -1), 0
    )
    left, right = pair()
    grey = halves(left[1], right[1])[..., 0]
    files["grey.png"] = encoded(Image.fromarray(grey, "L"), "PNG"), np.repeat(grey[..., None], 3, -1), 0
    left, right = pair()
    grey = halves(left[2], right[2])[..., 0]
    files["grey.jpg"] = encoded(Image.fromarray(grey, "L"), "JPEG", quality=95), np.repeat(grey[..., None], 3, -1), 2
    left, right = pair()
    grey = halves(left[0], right[0])[..., 0]
    alpha = np.full_like(grey, 77)
    files["grey_alpha.png"] = (
        encoded(Image.fromarray(np.stack([grey, alpha], -1), "LA"), "PNG"), np.repeat(grey[..., None], 3, -1), 0
    )
    # Alpha is dropped, not composited: what PIL's convert("RGB") does too.
    left, right = pair()
    rgb = halves(left, right)
    rgba = np.concatenate([rgb, np.full((HEIGHT, WIDTH, 1), 128, np.uint8)], -1)
    files["rgba.PNG"] = encoded(Image.fromarray(rgba, "RGBA"), "PNG"), rgb, 0
    left, right = pair()
    files["palette.png"] = encoded(palette_image(left, right), "PNG"), halves(left, right), 0
    left, right = pair()
    second = palette_image(*pair())
    files["animated.gif"] = (
        encoded(palette_image(left, right), "GIF", save_all=True, append_images=[second]), halves(left, right), 0
    )
    left, right = pair()
    rgb = halves(left, right)
    files["rgb.bmp"] = encoded(Image.fromarray(rgb), "BMP"), rgb, 0
    left, right = pair()
    rgb = halves(left, right)
    files["rgb.webp"] = encoded(Image.fromarray(rgb), "WEBP", lossless=True), rgb, 0
    return files


def bad_images():
    """{file name: bytes} of files named as images that no decoder reads."""
    rng = np.random.default_rng(1)
    noise = rng.integers(0, 256, 600).astype(np.uint8).tobytes()
    photo = rng.integers(0, 256, (HEIGHT, WIDTH, 3)).astype(np.uint8)
    png, jpeg = encoded(Image.fromarray(photo), "PNG"), encoded(Image.fromarray(photo), "JPEG")
    return {
        "corrupt.png": b"\x89PNG\r\n\x1a\n" + noise,  # a PNG's signature, then garbage
        "corrupt.jpg": b"\xff\xd8\xff" + noise,
        "truncated.png": png[: len(png) // 2],
        "truncated.jpg": jpeg[: len(jpeg) // 2],
        "wrong_magic.png": noise,
        "tiff.jpg": encoded(Image.fromarray(photo), "TIFF"),  # a format decode_image does not read
        "text.jpeg": b"a caption saved with the wrong extension\n",
        "empty.gif": b"",
    }


def write_odd_folder(root):
    """train/ holds every good and bad file over two classes, and files not named as images;
    test/ two good images and a corrupt one. Returns ({path: (image, tolerance, label)}, [bad paths])."""
    good, bad = {}, []
    for i, (name, (data, image, tolerance)) in enumerate(good_images().items()):
        label = i % 2
        path = root / "train" / "ab"[label] / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        good[str(path)] = image, tolerance, label
    for i, (name, data) in enumerate(bad_images().items()):
        path = root / "train" / "ab"[i % 2] / name
        path.write_bytes(data)
        bad.append(str(path))
    (root / "train" / "a" / "notes.txt").write_text("not listed")
    (root / "train" / "b" / "Thumbs.db").write_bytes(b"\x00" * 16)
    for label, name in enumerate("ab"):
        (root / "test" / name).mkdir(parents=True)
        (root / "test" / name / "x.png").write_bytes(tf.io.encode_png(halves((label * 200,) * 3, (9, 9, 9))).numpy())
    (root / "test" / "b" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    return good, bad


def prepare_tfds(tmp_path, files, num_shards=None):
    """A TFDS builder over files the test writes (stored as they are, bad bytes included),
    prepared into a data_dir under tmp_path; returns the data_dir."""
    import tensorflow_datasets as tfds

    class TinyColours(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self,
                features=tfds.features.FeaturesDict(
                    {"image": tfds.features.Image(shape=(None, None, 3)),
                     "label": tfds.features.ClassLabel(names=["cat", "dog", "eel"])}
                ),
            )

        def _split_generators(self, dl_manager):
            return {split: self._generate_examples(paths) for split, paths in files.items()}

        def _generate_examples(self, paths):
            for label, path in paths:
                yield str(path), {"image": str(path), "label": label}

    data_dir = str(tmp_path / f"tfds{num_shards or ''}")
    TinyColours(data_dir=data_dir).download_and_prepare(
        download_config=tfds.download.DownloadConfig(num_shards=num_shards)
    )
    return data_dir


# === Hand-written checkpoints in transformers' and timm's names ===

# The size of the hand-written transformers state dict (hidden size, heads, MLP width, layers, patch, image side,
# classes).
D, HEADS, MLP, LAYERS, PATCH, SIDE, CLASSES = 12, 3, 20, 2, 8, 24, 5
# The options that give `small_vit` that size.
HAND_WRITTEN = dict(image_size=SIDE, patch_size=PATCH, hidden_dim=D, num_heads=HEADS, mlp_dim=MLP, num_layers=LAYERS,
                    num_classes=CLASSES)


def hand_written_state_dict(seed=0):
    """Random arrays in transformers' layouts: Linear weights (out, in), the patch convolution (D, C, P, P)."""
    rng = np.random.default_rng(seed)
    tokens = (SIDE // PATCH) ** 2 + 1
    shapes = {"vit.embeddings.cls_token": (1, 1, D), "vit.embeddings.position_embeddings": (1, tokens, D),
              "vit.embeddings.patch_embeddings.projection.weight": (D, 3, PATCH, PATCH),
              "vit.embeddings.patch_embeddings.projection.bias": (D,),
              "vit.layernorm.weight": (D,), "vit.layernorm.bias": (D,),
              "classifier.weight": (CLASSES, D), "classifier.bias": (CLASSES,)}
    for i in range(LAYERS):
        layer = f"vit.encoder.layer.{i}."
        for name in ("query", "key", "value"):
            shapes[layer + f"attention.attention.{name}.weight"] = (D, D)
            shapes[layer + f"attention.attention.{name}.bias"] = (D,)
        shapes.update({layer + "attention.output.dense.weight": (D, D), layer + "attention.output.dense.bias": (D,),
                       layer + "intermediate.dense.weight": (MLP, D), layer + "intermediate.dense.bias": (MLP,),
                       layer + "output.dense.weight": (D, MLP), layer + "output.dense.bias": (D,)})
        for norm in ("layernorm_before", "layernorm_after"):
            shapes[layer + f"{norm}.weight"], shapes[layer + f"{norm}.bias"] = (D,), (D,)
    state = {key: rng.normal(0, 0.3, shape).astype(np.float32) for key, shape in shapes.items()}
    for key in state:
        if "layernorm" in key and key.endswith("weight"):
            state[key] += 1.0
    return state


def transformers_numpy_params(state):
    """The hand-written state dict in the NumPy reference's names, from transformers' definitions:
    a Linear computes x @ weight.T + bias; heads are consecutive slices of the hidden size."""
    head_dim = D // HEADS
    p = {
        "cls": state["vit.embeddings.cls_token"],
        "pos_embedding": state["vit.embeddings.position_embeddings"],
        "embedding/kernel": state["vit.embeddings.patch_embeddings.projection.weight"].transpose(2, 3, 1, 0),
        "embedding/bias": state["vit.embeddings.patch_embeddings.projection.bias"],
        "encoder_norm/scale": state["vit.layernorm.weight"], "encoder_norm/bias": state["vit.layernorm.bias"],
        "head/kernel": state["classifier.weight"].T, "head/bias": state["classifier.bias"],
    }
    for i in range(LAYERS):
        layer, block = f"vit.encoder.layer.{i}.", f"encoderblock_{i}/"
        for name in ("query", "key", "value"):
            weight = state[layer + f"attention.attention.{name}.weight"]
            p[block + f"{name}/kernel"] = weight.T.reshape(D, HEADS, head_dim)
            p[block + f"{name}/bias"] = state[layer + f"attention.attention.{name}.bias"].reshape(HEADS, head_dim)
        p[block + "out/kernel"] = state[layer + "attention.output.dense.weight"].T.reshape(HEADS, head_dim, D)
        p[block + "out/bias"] = state[layer + "attention.output.dense.bias"]
        for ours, theirs in (("Dense_0", "intermediate.dense"), ("Dense_1", "output.dense")):
            p[block + f"{ours}/kernel"] = state[layer + f"{theirs}.weight"].T
            p[block + f"{ours}/bias"] = state[layer + f"{theirs}.bias"]
        for ours, theirs in (("LayerNorm_0", "layernorm_before"), ("LayerNorm_2", "layernorm_after")):
            p[block + f"{ours}/scale"] = state[layer + f"{theirs}.weight"]
            p[block + f"{ours}/bias"] = state[layer + f"{theirs}.bias"]
    return {key: np.asarray(value, np.float64) for key, value in p.items()}


IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def timm_state_dict(state):
    """transformers' hand-written arrays under timm's names (timm's VisionTransformer: fused qkv, `blocks.{i}`)."""
    timm = {
        "cls_token": state["vit.embeddings.cls_token"],
        "pos_embed": state["vit.embeddings.position_embeddings"],
        "patch_embed.proj.weight": state["vit.embeddings.patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": state["vit.embeddings.patch_embeddings.projection.bias"],
        "norm.weight": state["vit.layernorm.weight"], "norm.bias": state["vit.layernorm.bias"],
        "head.weight": state["classifier.weight"], "head.bias": state["classifier.bias"],
    }
    for i in range(LAYERS):
        layer, block = f"vit.encoder.layer.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias"):
            timm[block + f"attn.qkv.{kind}"] = np.concatenate(
                [state[layer + f"attention.attention.{name}.{kind}"] for name in ("query", "key", "value")]
            )
            for ours, theirs in (("attn.proj", "attention.output.dense"), ("mlp.fc1", "intermediate.dense"),
                                 ("mlp.fc2", "output.dense"), ("norm1", "layernorm_before"),
                                 ("norm2", "layernorm_after")):
                timm[block + f"{ours}.{kind}"] = state[layer + f"{theirs}.{kind}"]
    return timm


def timm_folder(path, architecture="deit_tiny_patch16_224", model_args=None, **config):
    """A folder as timm's `push_to_hf_hub` writes it: model.safetensors and config.json."""
    path.mkdir(parents=True, exist_ok=True)
    state = hand_written_state_dict()
    save_file(timm_state_dict(state), str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architecture": architecture,
        "num_classes": CLASSES,
        "global_pool": "token",
        "model_args": {"img_size": SIDE, "patch_size": PATCH, "embed_dim": D, "depth": LAYERS, **(model_args or {})},
        "pretrained_cfg": {"input_size": [3, SIDE, SIDE], "interpolation": "bicubic", "crop_pct": 0.9,
                           "crop_mode": "center", "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)},
        "label_names": [f"timm {i}" for i in range(CLASSES)],
        **config,
    }
    (path / "config.json").write_text(json.dumps(config))
    return state


def timm_python():
    """A Python with timm: $KERAS_VIT_TIMM_PYTHON, else this one if timm is installed (not imported here)."""
    python = os.environ.get("KERAS_VIT_TIMM_PYTHON")
    if python:
        return python
    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm is not installed (pip install timm, or set KERAS_VIT_TIMM_PYTHON to a Python that has it)")
    return sys.executable


# === Serving, jobs and processes ===


def serve_all(jobs, folder, env=None):
    """{name: (kind, artefact, inputs)} served one after the other in one fresh interpreter that never imports
    keras_vit (tests/serving_check.py), with `env` added to its environment; returns {name: outputs}."""
    folder.mkdir(parents=True, exist_ok=True)
    listed = []
    for name, (kind, artefact, inputs) in jobs.items():
        np.savez(folder / f"{name}_inputs.npz", **inputs)
        listed.append([kind, str(artefact), str(folder / f"{name}_inputs.npz"), str(folder / f"{name}_outputs.npz")])
    (folder / "jobs.json").write_text(json.dumps(listed))
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "serving_check.py"), str(folder / "jobs.json")],
        capture_output=True, text=True, timeout=600,
        env={"TF_CPP_MIN_LOG_LEVEL": "2", "PATH": "/usr/bin:/bin", **(env or {})},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {name: dict(np.load(folder / f"{name}_outputs.npz", allow_pickle=False)) for name in jobs}


def tiny_digits_config(epochs=2):
    from experiments.configs import digits as digits_config

    config = digits_config.get_config()
    config.epochs, config.visualize, config.jit_compile = epochs, True, "off"
    config.visualize_images = 1
    config.model.num_layers, config.model.hidden_dim, config.model.mlp_dim, config.model.num_heads = 1, 16, 32, 2
    return config


class StopAfter(keras.callbacks.Callback):
    """Kills the run (an exception out of `fit`) at the end of epoch `epoch` (0-based), after the backup."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise KeyboardInterrupt("killed")


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


# A fenced block at the start of a line: its language, then its text up to the closing fence.
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", flags=re.M | re.S)


def fenced_blocks(text):
    """(language, first line number of the code, code) of every fenced block of a Markdown text."""
    return [
        (match.group(1).strip(), text.count("\n", 0, match.start(2)) + 1, match.group(2))
        for match in FENCE.finditer(text)
    ]


# === Counts ===

# Exact parameter counts of the GAP models (1000-class head, 224 px, no pre-logits; source:
# google-research/vision_transformer vit_jax/models_test.py).
PARAMS_GAP = {
    "S/16": 22_049_896,
    "S/32": 22_878_184,
    "B/16": 86_566_120,
    "B/32": 88_222_696,
}


def graph_flops(model, image_size):
    """2 x multiply-adds of every MatMul, BatchMatMul and Conv2D in the traced forward pass."""
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    spec = tf.TensorSpec((1, height, width, model.input_shape[-1]), tf.float32)
    graph = tf.function(lambda x: model(x, training=False)).get_concrete_function(spec).graph
    total = 0
    for op in graph.get_operations():
        if op.type == "MatMul":
            a, b = (t.shape.as_list() for t in op.inputs)
            m, k = a[::-1] if op.get_attr("transpose_a") else a
            n = b[0] if op.get_attr("transpose_b") else b[1]
            total += 2 * m * k * n
        elif op.type in ("BatchMatMulV2", "BatchMatMulV3"):
            a, b = (t.shape.as_list() for t in op.inputs)
            m, k = a[-1:-3:-1] if op.get_attr("adj_x") else a[-2:]
            n = b[-2] if op.get_attr("adj_y") else b[-1]
            total += 2 * int(np.prod(np.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2])))) * m * k * n
        elif op.type == "Conv2D":
            kernel = op.inputs[1].shape.as_list()
            total += 2 * int(np.prod(op.outputs[0].shape.as_list())) * int(np.prod(kernel[:3]))
    return total
