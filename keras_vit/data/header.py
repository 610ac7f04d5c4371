"""What an encoded image will cost, read from its header before anything is decoded, and the limits it must keep.

A few hundred bytes can declare an image that takes gigabytes to decode or to resize: a PNG of 200,000 x 1
pixels is 274 bytes, and resizing its short side to 224 asks for a 224 x 44,800,000 image; a 23,000 x 23,000
PNG of flat colour is half a megabyte; a GIF of 2,000 small frames decodes all of them.  `check_image` reads the
width and height each format keeps near its start (a GIF's first frame's too), refuses an image past
`ImageLimits` with an error naming the limit and the image's size, and cuts a GIF after its first frame, so that
only the first frame is ever decoded, whatever the number of frames.  All of it runs in the graph, so an
exported SavedModel does the same.
"""

import dataclasses

import numpy as np
import tensorflow as tf

# The first bytes of each format tf.io.decode_image reads (a WebP file also has "WEBP" at byte 8).
IMAGE_MAGIC = {"JPEG": b"\xff\xd8\xff", "PNG": b"\x89PNG", "GIF": b"GIF8", "BMP": b"BM", "WebP": b"RIFF"}
FORMATS = tuple(IMAGE_MAGIC)
EXPECTED_FORMATS = "JPEG, PNG, GIF, BMP or WebP"

# The bytes read for the header of every format but GIF (whose first frame can come after any number of
# extension blocks) and JPEG (whose size is in a frame marker after any number of segments).
_HEAD = 32
# A GIF's first frame is found by walking its blocks: each step passes one block, or, in a run of full
# (255-byte) sub-blocks, as many as `_GIF_RUN` of them at once.  Encoders write a frame's data in full
# sub-blocks, but for the last, so a frame takes a step per 1 MB; a file that needs more than
# `MAX_GIF_STEPS` steps before the end of its first frame is refused (bounding the cost of the walk).
MAX_GIF_STEPS = 4096
_GIF_RUN = 4096


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    """The largest encoded image the input pipelines and the serving signatures decode.

    max_pixels: width x height (a GIF's first frame's too).  The default,
        2**25 (about 33.5 megapixels, e.g. 8192 x 4096 or 6000 x 5000), is
        about 100 MB decoded.
    max_aspect_ratio: the longer side over the shorter.  The evaluation
        resize makes the shorter side the model's, so the cost grows with
        the ratio: at 20 (the default) and 224 pixels, 224 x 4,480.

    An image past a limit is refused before it is decoded: a serving
    request gets an InvalidArgumentError naming the limit and the image's
    size, and an input pipeline skips the file and names it.
    """

    max_pixels: int = 1 << 25
    max_aspect_ratio: float = 20.0

    def __post_init__(self):
        if isinstance(self.max_pixels, bool) or not isinstance(self.max_pixels, int) or self.max_pixels < 1:
            raise ValueError(f"`max_pixels` must be a positive integer. Received: max_pixels={self.max_pixels!r}")
        ratio = self.max_aspect_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 1.0 <= ratio < float("inf"):
            raise ValueError(f"`max_aspect_ratio` must be a number >= 1. Received: max_aspect_ratio={ratio!r}")


def as_image_limits(limits):
    """`limits` as an `ImageLimits`: None gives the defaults; a dict its fields."""
    if limits is None:
        return ImageLimits()
    if isinstance(limits, dict):
        return ImageLimits(**limits)
    if not isinstance(limits, ImageLimits):
        raise TypeError(f"Expected an ImageLimits, a dict of its fields or None. Received: {limits!r}")
    return limits


def _message(*parts):
    """A string tensor joining `parts`: strings, string tensors and integer tensors (in decimal)."""
    return tf.strings.join([
        part if isinstance(part, str) or part.dtype == tf.string else tf.strings.as_string(part) for part in parts
    ])


def _hex(data):
    """uint8 bytes -> "ff d8 00 ...": what arrived, in ASCII whatever it was."""
    digits = tf.constant([f"{i:02x}" for i in range(256)])
    return tf.strings.reduce_join(tf.gather(digits, tf.cast(data, tf.int32)), separator=" ")


# The integers the checks read from an image's first bytes: name -> (first byte, number of bytes, byte order).
_FIELDS = {
    "magic2": (0, 2, "little"), "magic3": (0, 3, "little"), "magic4": (0, 4, "little"), "zero": (0, 0, "little"),
    "riff_kind": (8, 4, "little"),  # "WEBP" in a WebP file
    "chunk": (12, 4, "little"),  # the first chunk's type: a PNG's "IHDR", a WebP's "VP8 ", "VP8L" or "VP8X"
    "png_width": (16, 4, "big"), "png_height": (20, 4, "big"),
    "gif_width": (6, 2, "little"), "gif_height": (8, 2, "little"),
    "bmp_header": (14, 4, "little"), "bmp_width": (18, 4, "little"), "bmp_height": (22, 4, "little"),
    "bmp_core_width": (18, 2, "little"), "bmp_core_height": (20, 2, "little"),  # a 12-byte BITMAPCOREHEADER's
    "vp8_width": (26, 2, "little"), "vp8_height": (28, 2, "little"),  # 14 bits each, then 2 bits of scale
    "vp8l_bits": (21, 4, "little"),  # 14 bits of width - 1, 14 of height - 1
    "vp8x_flags": (20, 1, "little"), "vp8x_width": (24, 3, "little"), "vp8x_height": (27, 3, "little"),
}


def _field_weights():
    """(32, fields) float64: the first 32 bytes times this are every field at once (exact below 2**53)."""
    weights = np.zeros((_HEAD, len(_FIELDS)))
    for column, (start, length, order) in enumerate(_FIELDS.values()):
        for i in range(length):
            weights[start + i, column] = 256.0 ** (i if order == "little" else length - 1 - i)
    return weights


_WEIGHTS = _field_weights()


def _as_int(magic):
    return int.from_bytes(magic, "little")


def _header_fields(encoded):
    """{name: int64 scalar} of `_FIELDS`, read from the first bytes of `encoded` (zero-padded) in a few ops:
    a header check runs once per image in the input pipelines, where every small op costs."""
    head = tf.io.decode_raw(encoded, tf.uint8, fixed_length=_HEAD)
    values = tf.linalg.matvec(_WEIGHTS, tf.cast(head, tf.float64), transpose_a=True)
    return dict(zip(_FIELDS, tf.unstack(tf.cast(values, tf.int64)))), head


def _format_index(fields):
    """The index of the format in `FORMATS`, len(FORMATS) for none: each format is two fields' values."""
    tests = [("magic3", "JPEG", "zero", b""), ("magic4", "PNG", "zero", b""), ("magic4", "GIF", "zero", b""),
             ("magic2", "BMP", "zero", b""), ("magic4", "WebP", "riff_kind", b"WEBP")]
    assert [name for _, name, _, _ in tests] == list(FORMATS)
    values = tf.stack([fields[field] for field, _, _, _ in tests] + [fields[field] for _, _, field, _ in tests])
    expected = [_as_int(IMAGE_MAGIC[name][: int(field[-1])]) for field, name, _, _ in tests]
    expected += [_as_int(second) for _, _, _, second in tests]
    matches = tf.reduce_all(tf.reshape(values == expected, [2, len(tests)]), axis=0)
    return tf.argmax(tf.cast(tf.concat([matches, [True]], 0), tf.int32), output_type=tf.int32)


def image_format(encoded):
    """The index in `FORMATS` of the format of `encoded` (a scalar string), from its first bytes; -1 if none."""
    index = _format_index(_header_fields(encoded)[0])
    return tf.where(index == len(FORMATS), -1, index)


def _int64(value):
    return tf.constant(value, tf.int64)


def _still_size(fields, index):
    """(height, width) of a PNG, a BMP or a WebP, as their first bytes give it (0 where they do not)."""
    png = tf.where(fields["chunk"] == _as_int(b"IHDR"), tf.stack([fields["png_height"], fields["png_width"]]), 0)
    core = fields["bmp_header"] == 12
    bmp = tf.where(
        core,
        tf.stack([fields["bmp_core_height"], fields["bmp_core_width"]]),
        tf.stack([fields["bmp_height"], fields["bmp_width"]]),
    )
    # 32-bit signed: a negative height means rows stored top-down; a negative width is no image.
    bmp = tf.where(bmp >= 1 << 31, tf.stack([(1 << 32) - bmp[0], _int64(0)]), bmp)
    bits, chunk = fields["vp8l_bits"], fields["chunk"]
    webp = tf.where(chunk == _as_int(b"VP8 "), tf.stack([fields["vp8_height"], fields["vp8_width"]]) % (1 << 14), 0)
    lossless = tf.stack([bits // (1 << 14) % (1 << 14), bits % (1 << 14)]) + 1
    webp = tf.where(chunk == _as_int(b"VP8L"), lossless, webp)
    webp = tf.where(chunk == _as_int(b"VP8X"), tf.stack([fields["vp8x_height"], fields["vp8x_width"]]) + 1, webp)
    return tf.where(index == FORMATS.index("PNG"), png, tf.where(index == FORMATS.index("BMP"), bmp, webp))


def gif_first_frame(encoded):
    """A GIF cut after its first frame, and (height, width) of that frame, walking its blocks in the graph.

    The screen's size is in the header; each frame's is in its image
    descriptor, after any number of extension blocks.  The bytes up to the
    end of the first frame's data, then a trailer, are a GIF of that frame
    alone: decoding it costs one frame, however many follow.  The size is
    (0, 0) when the file ends, or holds an unknown block, before the first
    frame does, or when reaching that end takes more than `MAX_GIF_STEPS`
    steps.
    """
    data = tf.io.decode_raw(encoded, tf.uint8)
    n = tf.size(data, out_type=tf.int64)

    def at(positions):
        return tf.cast(tf.gather(data, tf.clip_by_value(positions, 0, tf.maximum(n - 1, 0))), tf.int64)

    def colour_table(flags):
        # The flags' top bit: a table follows; their last three: it has 2 ** (n + 1) colours of 3 bytes.
        return tf.where(flags >= 0x80, 3 * tf.bitwise.left_shift(_int64(2), flags % 8), _int64(0))

    # The modes of the walk: at a block, in an extension's sub-blocks, in the first frame's, done, broken.
    block, extension_data, frame_data, done, broken = (_int64(mode) for mode in range(5))

    def step(position, mode, height, width, steps):
        byte, width_low, width_high, height_low, height_high, flags = tf.unstack(
            at(position + _int64([0, 5, 6, 7, 8, 9]))
        )
        is_extension, is_frame = byte == 0x21, byte == 0x2C
        # At a block: an extension (introducer, label, then sub-blocks) or a frame (a 10-byte descriptor, its
        # colour table, the LZW code size, then sub-blocks); anything else before the first frame is broken.
        after_block = tf.where(is_extension, position + 2, position + 11 + colour_table(flags))
        block_mode = tf.where(is_extension, extension_data, tf.where(is_frame, frame_data, broken))
        # In sub-blocks: a length byte and that many bytes; a zero length ends the block.  A run of full ones
        # is passed in one step.
        ahead = position + 256 * tf.range(_GIF_RUN, dtype=tf.int64)
        full = tf.logical_and(at(ahead) == 255, ahead < n)
        run = tf.where(tf.reduce_all(full), _int64(_GIF_RUN), tf.argmin(tf.cast(full, tf.int32), output_type=tf.int64))
        ended = tf.where(mode == extension_data, block, done)
        sub_block_mode = tf.where(byte > 0, mode, ended)
        at_block = mode == block
        next_position = tf.where(at_block, after_block, tf.where(run > 0, position + 256 * run, position + byte + 1))
        next_mode = tf.where(at_block, block_mode, sub_block_mode)
        # Every byte read must be in the file: the next one, unless done; the last one, if done.
        short = tf.where(next_mode == done, next_position > n, next_position >= n)
        next_mode = tf.where(tf.logical_or(short, steps + 1 >= MAX_GIF_STEPS), broken, next_mode)
        next_mode = tf.where(mode == broken, broken, next_mode)
        new_frame = tf.logical_and(at_block, is_frame)
        height = tf.where(new_frame, height_low + height_high * 256, height)
        width = tf.where(new_frame, width_low + width_high * 256, width)
        return next_position, next_mode, height, width, steps + 1

    start = 13 + colour_table(at(_int64(10)))
    zero = _int64(0)
    position, mode, height, width, _ = tf.while_loop(
        lambda position, mode, *_: mode < done, step, (start, tf.where(start < n, block, broken), zero, zero, zero)
    )
    found = mode == done
    first = tf.strings.join([tf.strings.substr(encoded, _int64(0), tf.where(found, position, 0)), b";"])
    return first, tf.where(found, tf.stack([height, width]), 0)


def check_image(encoded, limits=None, *, messages=True):
    """Reads the size of an encoded image from its header and checks it against `limits` (an `ImageLimits`).

    Returns (the bytes to decode, int64 (height, width)): the bytes as they
    are, but a GIF cut after its first frame (`gif_first_frame`).  Raises
    (or, in a graph, fails with) InvalidArgumentError, its message ASCII
    whatever the bytes: for data that is none of the formats (its first
    bytes in hex), a header whose size cannot be read, an animated WebP
    (which TensorFlow decodes as RGBA frames only), and an image past a
    limit (the limit's name and value, and the image's size).

    messages=False, in a graph: the failure's message is the fixed
    `UNNAMED_REFUSAL`, and no Assert, cond or message is added to a JPEG's
    path; the input pipelines, which name each failed file with the error
    of a second, eager, check, use it.
    """
    limits = as_image_limits(limits)
    encoded = tf.convert_to_tensor(encoded, tf.string)
    is_jpeg = tf.strings.substr(encoded, 0, 3) == IMAGE_MAGIC["JPEG"]
    if tf.executing_eagerly():
        check = check_jpeg if bool(is_jpeg) else check_other_formats
        return check(encoded, limits, messages=messages)
    return tf.cond(
        is_jpeg,
        lambda: check_jpeg(encoded, limits, messages=messages),
        lambda: check_other_formats(encoded, limits, messages=messages),
    )


def check_jpeg(encoded, limits=None, *, messages=True):
    """`check_image` for bytes known to start as a JPEG: its size from its frame header, checked against
    `limits`."""
    limits = as_image_limits(limits)
    size = tf.cast(tf.image.extract_jpeg_shape(encoded)[:2], tf.int64)
    problems = _size_problems(size, limits)

    def message():
        return _size_message(tf.argmax(tf.cast(problems, tf.int32)), "JPEG", size, limits)

    return _unless(tf.reduce_any(problems), message, (encoded, size), messages)


# What a check run with messages=False says when it fails (a pipeline then names the file and the reason).
UNNAMED_REFUSAL = (
    "Refused before decoding: an image past its ImageLimits, of an unknown format or with an unreadable header"
)


def _unless(failed, message, values, messages=True):
    """`values`, or an InvalidArgumentError with `message()` (a string tensor) if `failed`.

    Eagerly it raises at once.  In a graph the message is made, and the
    Assert op run, only in the failing branch of a cond; with
    `messages=False` the error is `UNNAMED_REFUSAL`, from a NaN check: no
    control flow and no stateful op on the path every image takes, where
    each of them slows a tf.data map measurably.
    """
    if tf.executing_eagerly():
        if bool(failed):
            raise tf.errors.InvalidArgumentError(None, None, message().numpy().decode("ascii"))
        return values
    if not messages:
        refused = tf.debugging.check_numerics(tf.where(failed, float("nan"), 0.0), UNNAMED_REFUSAL)
        with tf.control_dependencies([refused]):
            return tf.nest.map_structure(tf.identity, values)

    def fail():
        with tf.control_dependencies([tf.debugging.Assert(False, [message()], summarize=1)]):
            return tf.nest.map_structure(tf.identity, values)

    return tf.cond(failed, fail, lambda: tf.nest.map_structure(tf.identity, values))


def _size_problems(size, limits):
    """[unreadable, more than max_pixels, past max_aspect_ratio] of an int64 (height, width)."""
    height, width = tf.unstack(tf.cast(size, tf.float64))
    short = tf.minimum(height, width)
    too_long = tf.maximum(height, width) > limits.max_aspect_ratio * short
    return tf.stack([short < 1, height * width > limits.max_pixels, too_long])


def _size_message(which, format_name, size, limits):
    """The message of problem `which` of `_size_problems` (a scalar), for an image of `format_name`."""
    where = "(ImageLimits: an argument of the input pipelines and of export_saved_model)"
    # Each problem's words before the format's name, between it and the size, and after the size.
    openings = ["Could not read the size of the ", "The ", "The "]
    middles = [" image from its header: read ", " image is ", " image is "]
    endings = [
        ".",
        f" pixels, more than max_pixels={limits.max_pixels} allows {where}.",
        f" pixels: its longer side is more than max_aspect_ratio={limits.max_aspect_ratio:g} times the shorter "
        f"{where}.",
    ]
    height, width = tf.unstack(size)
    return _message(
        tf.gather(openings, which), format_name, tf.gather(middles, which), width, " x ", height,
        " (width x height)", tf.gather(endings, which),
    )


def check_other_formats(encoded, limits=None, *, messages=True):
    """`check_image` for anything but a JPEG."""
    limits = as_image_limits(limits)
    fields, head = _header_fields(encoded)
    index = _format_index(fields)

    def read_gif():
        first, frame = gif_first_frame(encoded)
        screen = tf.stack([fields["gif_height"], fields["gif_width"]])
        # Decoded at the screen's size; the frame's own raster is allocated at its size.
        larger = tf.where(frame[0] * frame[1] > screen[0] * screen[1], frame, screen)
        return first, tf.where(tf.reduce_all(frame > 0), larger, 0)

    gif, webp = FORMATS.index("GIF"), FORMATS.index("WebP")
    if tf.executing_eagerly():
        data, size = read_gif() if int(index) == gif else (encoded, _still_size(fields, index))
    else:
        data, size = tf.cond(index == gif, read_gif, lambda: (encoded, _still_size(fields, index)))
    size.set_shape([2])
    animated = tf.logical_and(fields["chunk"] == _as_int(b"VP8X"), fields["vp8x_flags"] // 2 % 2 == 1)
    problems = tf.concat([
        [index == len(FORMATS), tf.logical_and(index == webp, animated)], _size_problems(size, limits)
    ], 0)

    def message():
        length = tf.strings.length(encoded)
        first_bytes = tf.strings.join([" starting with ", _hex(head[: tf.minimum(length, 8)]), " (hex)"])
        what = [
            lambda: _message(
                f"Expected an encoded {EXPECTED_FORMATS} image; received ", length, " bytes",
                tf.where(length > 0, first_bytes, ""), ".",
            ),
            lambda: tf.constant(
                "Animated WebP images are not supported (TensorFlow decodes them as RGBA frames only); "
                "send a still image, such as the first frame."
            ),
        ]
        which = tf.argmax(tf.cast(problems, tf.int32), output_type=tf.int32)
        format_name = tf.gather(FORMATS + ("unknown",), index)
        what += [lambda k=k: _size_message(k, format_name, size, limits) for k in range(3)]
        return tf.switch_case(which, what)

    return _unless(tf.reduce_any(problems), message, (data, size), messages)
