"""Images read from their headers before decoding: sizes for every format, limits refused with named errors,
GIFs decoded from their first frame only, ASCII errors whatever arrives, and memory that stays bounded in the
serving signature and the evaluation pipeline."""

import io
import json
import struct
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

import keras_vit
from keras_vit import data as vit_data
from keras_vit import export
from keras_vit.testing import randomize_weights

# === Images built to cost more than their size ===


def encoded(image, fmt, **options):
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _chunk(kind, payload):
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def blank_png(width, height):
    """A valid 1-bit grey PNG of `width` x `height` zeros, compressed row by row: a few bytes per megapixel."""
    row = bytes(1 + (width + 7) // 8)  # filter byte, then the packed bits
    compressor = zlib.compressobj(9)
    parts = [compressor.compress(row) for _ in range(height)]
    idat = b"".join(parts) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def many_frame_gif(frames, side, screen=None, levels=256):
    """A GIF of `frames` frames of a `side` x `side` grey ramp of `levels` steps (the image descriptor and data
    PIL writes for one frame, repeated), and the ramp; `screen` (width, height) declares another screen size."""
    steps = np.arange(side) * levels // side * 255 // max(levels - 1, 1)
    ramp = np.tile(steps.astype(np.uint8)[None, :, None], (side, 1, 3))
    single = encoded(Image.fromarray(ramp), "GIF")
    table = 3 * 2 ** ((single[10] & 7) + 1) if single[10] & 0x80 else 0
    assert single[13 + table] == 0x2C and single[-1:] == b";"  # no extension blocks
    header = single[:6] + (struct.pack("<HH", *screen) if screen else single[6:10]) + single[10:13 + table]
    return header + single[13 + table:-1] * frames + b";", ramp


def declared_jpeg(width, height):
    """A small JPEG whose frame header declares `width` x `height`."""
    jpeg = bytearray(encoded(Image.new("RGB", (16, 16), (10, 20, 30)), "JPEG"))
    start = jpeg.index(b"\xff\xc0")
    jpeg[start + 5:start + 9] = struct.pack(">HH", height, width)
    return bytes(jpeg)


def animated_webp():
    frames = [Image.new("RGB", (24, 24), colour) for colour in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    return encoded(frames[0], "WEBP", save_all=True, append_images=frames[1:])


PHOTO = np.random.default_rng(0).integers(0, 256, (37, 53, 3), dtype=np.uint8)

STILLS = {
    "jpeg": lambda image: encoded(image, "JPEG"),
    "png": lambda image: encoded(image, "PNG"),
    "grey_png": lambda image: encoded(image.convert("L"), "PNG"),
    "gif": lambda image: encoded(image, "GIF"),
    "bmp": lambda image: encoded(image, "BMP"),
    "webp_lossy": lambda image: encoded(image, "WEBP"),
    "webp_lossless": lambda image: encoded(image, "WEBP", lossless=True),
    "webp_extended": lambda image: encoded(image, "WEBP", exif=b"Exif\x00\x00MM"),  # a VP8X header
}


_TRACED = {}


def in_graph(function, encoded, limits=None):
    """`function(encoded, limits)` run as a graph, traced once per function and limits (a scalar string in)."""
    key = (function, limits)
    if key not in _TRACED:
        _TRACED[key] = tf.function(
            lambda data: function(data, limits), input_signature=[tf.TensorSpec([], tf.string)]
        )
    return _TRACED[key](tf.constant(encoded))


# === Sizes, read from headers ===


@pytest.mark.parametrize("kind", list(STILLS))
@pytest.mark.parametrize("shape", [(37, 53), (300, 1), (1, 17)])
def test_the_size_read_from_the_header_is_the_decoded_size(kind, shape):
    image = Image.fromarray(np.resize(PHOTO, (*shape, 3)))
    data = STILLS[kind](image)
    if kind == "webp_extended":
        assert data[12:16] == b"VP8X"
    limits = vit_data.ImageLimits(max_aspect_ratio=300)
    for run in (lambda f, *a: f(*a), in_graph):
        checked, size = run(vit_data.check_image, data, limits)
        assert tuple(size.numpy()) == shape, kind
        assert checked.numpy() == data or kind == "gif"
        assert vit_data.decode_image(data, limits).shape == (*shape, 3)


def test_a_gif_is_decoded_from_its_first_frame_only():
    gif, ramp = many_frame_gif(50, 40)
    assert Image.open(io.BytesIO(gif)).n_frames == 50
    checked, size = vit_data.check_image(gif)
    assert tuple(size.numpy()) == (40, 40) and len(checked.numpy()) < 2 * len(gif) / 50
    assert Image.open(io.BytesIO(checked.numpy())).n_frames == 1
    first = np.asarray(Image.open(io.BytesIO(gif)).convert("RGB"))
    np.testing.assert_array_equal(first, ramp)
    np.testing.assert_array_equal(vit_data.decode_image(gif).numpy(), first)
    np.testing.assert_array_equal(in_graph(vit_data.decode_image, gif).numpy(), first)
    # Extension blocks before the first frame (a comment, the looping block, frame timings) are walked past.
    frames = [Image.fromarray(np.full((9, 13, 3), value, np.uint8)) for value in (30, 200, 120)]
    animated = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], loop=0, duration=50, comment=b"x")
    assert b"NETSCAPE2.0" in animated and b"\x21\xfe" in animated
    np.testing.assert_array_equal(vit_data.decode_image(animated).numpy(), np.asarray(frames[0]))


def test_a_broken_gif_is_refused_however_long_its_blocks():
    gif, _ = many_frame_gif(2, 40)
    end_of_first_frame = len(vit_data.check_image(gif)[0].numpy()) - 1
    cut = gif[: end_of_first_frame - 5]  # ends inside the first frame's data
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"Could not read the size of the GIF image"):
        vit_data.check_image(cut)
    # A first frame in sub-blocks of one byte: more steps than the walk takes.
    descriptor = b"\x2c" + struct.pack("<HHHH", 0, 0, 4, 4) + b"\x00" + b"\x02"
    slow = b"GIF89a" + struct.pack("<HH", 4, 4) + b"\x00\x00\x00" + descriptor
    slow += b"\x01\x00" * (vit_data.MAX_GIF_STEPS + 1) + b"\x00;"
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"Could not read the size of the GIF image"):
        in_graph(vit_data.check_image, slow)
    unknown_block = b"GIF89a" + struct.pack("<HH", 4, 4) + b"\x00\x00\x00" + b"\x99" * 20
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"Could not read the size of the GIF image"):
        vit_data.check_image(unknown_block)


# === Limits ===

REFUSED = {
    "strip_png": (lambda: blank_png(200_000, 1), r"200000 x 1 \(width x height\).*max_aspect_ratio=20 "),
    "tall_png": (lambda: blank_png(1, 1_000_000), r"1 x 1000000 \(width x height\).*max_aspect_ratio=20 "),
    "huge_png": (lambda: blank_png(23_000, 23_000), r"23000 x 23000 \(width x height\).*max_pixels=33554432 "),
    "declared_jpeg": (lambda: declared_jpeg(60_000, 50_000), r"JPEG image is 60000 x 50000.*max_pixels="),
    "huge_gif": (lambda: many_frame_gif(1, 40, screen=(65535, 65535))[0], r"GIF image is 65535 x 65535.*max_pixels="),
    "animated_webp": (animated_webp, r"Animated WebP images are not supported"),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_an_image_past_a_limit_is_refused_naming_the_limit_and_its_size(kind):
    make, message = REFUSED[kind]
    data = make()
    if kind == "strip_png":
        assert len(data) < 300
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        vit_data.decode_image(data)
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        in_graph(vit_data.decode_image, data)


def test_the_limits_are_arguments():
    data = encoded(Image.fromarray(PHOTO), "PNG")
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"53 x 37 .*max_pixels=1000 "):
        vit_data.decode_image(data, vit_data.ImageLimits(max_pixels=1000))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"max_aspect_ratio=1.2 "):
        vit_data.decode_image(data, vit_data.ImageLimits(max_aspect_ratio=1.2))
    strip = blank_png(200_000, 1)
    assert vit_data.decode_image(strip, {"max_aspect_ratio": 200_000}).shape == (1, 200_000, 3)
    for bad in ({"max_pixels": 0}, {"max_pixels": 2.5}, {"max_aspect_ratio": 0.5}, {"max_aspect_ratio": np.inf}):
        with pytest.raises(ValueError, match=f"`{next(iter(bad))}` must be .* Received: {next(iter(bad))}="):
            vit_data.ImageLimits(**bad)
    with pytest.raises(TypeError, match="Expected an ImageLimits"):
        vit_data.decode_image(data, 1000)


HOSTILE = {
    "high_bytes": bytes(range(255, 127, -1)),
    "nul_and_high": b"\x00\xff\xfe\xc3\x28" * 7,
    "empty": b"",
    "tiff": b"II*\x00" + bytes(40),
    "png_magic_only": b"\x89PNG\r\n\x1a\n",
    "png_truncated": encoded(Image.fromarray(PHOTO), "PNG")[:60],
    "jpeg_truncated": encoded(Image.fromarray(PHOTO), "JPEG")[:200],
    "jpeg_magic_then_garbage": b"\xff\xd8\xff" + bytes(range(200, 256)),
    "gif_magic_then_garbage": b"GIF89a" + bytes(range(256)) * 3,
    "riff_not_webp": b"RIFF\x10\x00\x00\x00WAVEfmt \xff\xfe",
    "webp_garbage": b"RIFF\x10\x00\x00\x00WEBPVP8 \xff\xfe\xfd\xfc\x80\x81",
    "bmp_garbage": b"BM" + bytes(range(255, 0, -3)),
}


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_errors_are_ascii_whatever_bytes_arrive(kind):
    for run in (lambda f, *a: f(*a), in_graph):
        with pytest.raises(tf.errors.InvalidArgumentError) as error:
            run(vit_data.decode_image, HOSTILE[kind])
        assert error.value.message.isascii(), error.value.message
        assert str(error.value).isascii()


# === Where users meet them: the serving signature and the pipelines ===


@pytest.fixture(scope="module")
def small_saved_model(tmp_path_factory):
    model = randomize_weights(
        keras_vit.build_vit("testing", image_size=32, num_classes=4, patch_size=8, num_heads=2, num_layers=2),
        scale=0.1,
    )
    return export.export_saved_model(model, tmp_path_factory.mktemp("serving") / "sm")


def test_serving_bytes_serves_webp_and_refuses_what_the_limits_refuse(small_saved_model):
    serve = tf.saved_model.load(small_saved_model).signatures["serving_bytes"]
    image = Image.fromarray(PHOTO)
    outputs = {
        kind: serve(encoded=tf.constant([STILLS[kind](image)]))["logits"].numpy()
        for kind in ("png", "webp_lossless", "webp_extended", "webp_lossy", "bmp")
    }
    np.testing.assert_array_equal(outputs["webp_lossless"], outputs["png"])  # lossless: the same pixels
    np.testing.assert_array_equal(outputs["bmp"], outputs["png"])
    np.testing.assert_allclose(outputs["webp_lossy"], outputs["png"], atol=0.5)
    for make, message in REFUSED.values():
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            serve(encoded=tf.constant([STILLS["png"](image), make()]))
    # Limits chosen at export: a smaller max_pixels refuses this 53 x 37 image.
    model = keras_vit.build_vit("testing", image_size=32, num_classes=4, patch_size=8, num_heads=2, num_layers=2)
    strict = export.export_saved_model(
        model, small_saved_model + "_strict", image_limits=vit_data.ImageLimits(max_pixels=1000)
    )
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"53 x 37 .*max_pixels=1000 "):
        tf.saved_model.load(strict).signatures["serving_bytes"](encoded=tf.constant([STILLS["png"](image)]))


def write_class_folders(root, files):
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    return root


def test_the_pipelines_skip_and_name_images_past_the_limits(tmp_path):
    good = {f"{split}/{label}/{i}.png": STILLS["png"](Image.fromarray(np.roll(PHOTO, i, 0)))
            for split in ("train", "test") for label in ("a", "b") for i in range(2)}
    bad = {"train/a/strip.png": blank_png(200_000, 1), "test/b/huge.png": blank_png(23_000, 23_000),
           "test/a/declared.jpg": declared_jpeg(60_000, 50_000)}
    root = write_class_folders(tmp_path / "folder", {**good, **bad})
    source = vit_data.load_folder(root)
    test = [int(label) for _, label in source.test.as_numpy_iterator()]
    assert test == [0, 0, 1, 1]
    batches = vit_data.training_pipeline(source, 16, 2, crop=True)
    assert sum(len(x) for x, _ in batches.take(4).as_numpy_iterator()) == 8
    errors = source.skipped.errors
    assert sorted(errors) == sorted(str(root / path) for path in bad)
    assert "max_aspect_ratio=20 " in errors[str(root / "train/a/strip.png")]
    assert "23000 x 23000" in errors[str(root / "test/b/huge.png")]
    assert "60000 x 50000" in errors[str(root / "test/a/declared.jpg")]
    # Limits are the loaders' argument, kept by the source for every pipeline it feeds.
    relaxed = vit_data.load_folder(root, image_limits=vit_data.ImageLimits(max_aspect_ratio=200_000))
    assert relaxed.image_limits.max_aspect_ratio == 200_000
    list(vit_data.training_pipeline(relaxed, 16, 2).take(4))
    assert str(root / "train/a/strip.png") not in relaxed.skipped.errors


# Run in a fresh process: its peak resident memory after warming up with good images, then after the hostile
# ones, through the serving signature and through a folder's evaluation pipeline.
MEMORY_CHECK = textwrap.dedent(
    """
    import json, sys
    import tensorflow as tf

    def status_mib(field):
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(field + ":")) / 1024

    def peak_mib():
        return status_mib("VmHWM")

    def resident_mib():
        # The peak starts again from here (Linux's clear_refs): the warm-up's peak would hide a new one.
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return status_mib("VmRSS")

    saved_model, folder, good, hostile = sys.argv[1], sys.argv[2], sys.argv[3:5], sys.argv[5:]
    serve = tf.saved_model.load(saved_model).signatures["serving_bytes"]
    read = lambda path: open(path, "rb").read()
    for path in good:
        serve(encoded=tf.constant([read(path)]))
    from keras_vit import data as vit_data
    list(vit_data.image_pipeline(vit_data.load_folder(folder + "/warm").test, 32, 2, training=False, num_classes=2))
    before = resident_mib()
    errors = {}
    for path in hostile:
        try:
            serve(encoded=tf.constant([read(path)]))
            errors[path] = ""
        except tf.errors.InvalidArgumentError as error:
            errors[path] = error.message
    after_serving = peak_mib()
    source = vit_data.load_folder(folder + "/hostile")
    evaluation = vit_data.image_pipeline(source.test, 32, 2, training=False, num_classes=2)
    labels = [int(i) for _, y in evaluation.as_numpy_iterator() for i in y.argmax(-1)]
    print(json.dumps({"before": before, "after_serving": after_serving, "after_evaluation": peak_mib(),
                      "errors": errors, "labels": labels, "skipped": source.skipped.errors}))
    """
)


@pytest.mark.slow  # a process that serves and evaluates hostile images: 10-16 s
def test_memory_stays_bounded_in_serving_and_evaluation(small_saved_model, tmp_path):
    gif, _ = many_frame_gif(2000, 400, levels=4)  # 2,000 frames of 400 x 400: 320 MB if all were decoded
    hostile = {"strip.png": blank_png(200_000, 1), "tall.png": blank_png(1, 1_000_000),
               "huge.png": blank_png(23_000, 23_000), "frames.gif": gif}
    assert sum(map(len, hostile.values())) < 8_000_000
    paths = []
    for name, data in {"good.png": STILLS["png"](Image.fromarray(PHOTO)), "good.gif": STILLS["gif"](
            Image.fromarray(PHOTO)), **hostile}.items():
        (tmp_path / name).write_bytes(data)
        paths.append(str(tmp_path / name))
    good_files = {f"{split}/{label}/x.png": STILLS["png"](Image.fromarray(PHOTO))
                  for split in ("train", "test") for label in ("a", "b")}
    write_class_folders(tmp_path / "data" / "warm", {**good_files, "test/a/y.gif": STILLS["gif"](
        Image.fromarray(PHOTO))})
    write_class_folders(tmp_path / "data" / "hostile", {
        **good_files, **{f"test/{label}/{name}": data for label, (name, data) in zip("abab", hostile.items())}
    })
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_CHECK, small_saved_model, str(tmp_path / "data"), *paths],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    errors = {path.rpartition("/")[2]: message for path, message in report["errors"].items()}
    assert "max_aspect_ratio=20 " in errors["strip.png"] and "max_aspect_ratio=20 " in errors["tall.png"]
    assert "max_pixels=33554432 " in errors["huge.png"]
    assert errors["frames.gif"] == ""  # served, from its first frame
    # The frames GIF is served and evaluated; the three PNGs are skipped and named.
    assert report["labels"] == [0, 1, 1] and len(report["skipped"]) == 3
    # Without the checks: about 2.7 GB (strip), 12 GB (tall), 1.6 GB (huge), 320 MB (frames).
    assert report["after_serving"] - report["before"] < 100, report
    assert report["after_evaluation"] - report["before"] < 100, report
