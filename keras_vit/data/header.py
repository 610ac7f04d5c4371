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


def _require(condition, message):
    """An assertion whose error is `message` alone (a string tensor), eagerly as in a graph."""
    if tf.executing_eagerly():
        if not bool(condition):
            raise tf.errors.InvalidArgumentError(None, None, message.numpy().decode("ascii"))
        return tf.no_op()
    return tf.debugging.Assert(condition, [message], summarize=1)


def _message(*parts):
    """A string tensor joining `parts`: strings, string tensors and integer tensors (in decimal)."""
    return tf.strings.join([
        part if isinstance(part, str) or part.dtype == tf.string else tf.strings.as_string(part) for part in parts
    ])


def _hex(data):
    """uint8 bytes -> "ff d8 00 ...": what arrived, in ASCII whatever it was."""
    digits = tf.constant([f"{i:02x}" for i in range(256)])
    return tf.strings.reduce_join(tf.gather(digits, tf.cast(data, tf.int32)), separator=" ")


def _little(head, start, length):
    """The unsigned little-endian integer of `length` bytes at `start` of the uint8 vector `head`, as int64."""
    return sum(tf.cast(head[start + i], tf.int64) * (1 << (8 * i)) for i in range(length))


def _big(head, start, length):
    return sum(tf.cast(head[start + i], tf.int64) * (1 << (8 * (length - 1 - i))) for i in range(length))


def _int64(value):
    return tf.constant(value, tf.int64)


def _bytes_at(prefix, start, expected):
    """Whether `prefix` (`_prefix` of the encoded bytes) holds `expected` at `start`."""
    return tf.strings.substr(prefix, start, len(expected)) == expected


def _prefix(encoded):
    """The first `_HEAD` bytes of `encoded`, zero-padded to that length, so that every header read is in range
    (a read out of range would fail with an error quoting the bytes)."""
    return tf.strings.join([tf.strings.substr(encoded, 0, _HEAD), b"\0" * _HEAD])


def image_format(encoded):
    """The index in `FORMATS` of the format of `encoded` (a scalar string), from its first bytes; -1 if none."""
    encoded = _prefix(encoded)
    index = tf.constant(-1, tf.int32)
    for i, (name, magic) in reversed(list(enumerate(IMAGE_MAGIC.items()))):
        match = _bytes_at(encoded, 0, magic)
        if name == "WebP":
            match = tf.logical_and(match, _bytes_at(encoded, 8, b"WEBP"))
        index = tf.where(match, i, index)
    return index


def _png_size(prefix, head):
    size = tf.stack([_big(head, 20, 4), _big(head, 16, 4)])
    return tf.where(_bytes_at(prefix, 12, b"IHDR"), size, 0)


def _bmp_size(head):
    # A BITMAPCOREHEADER (12 bytes) has 16-bit sizes; the later headers 32-bit signed ones, a negative
    # height meaning rows stored top-down.
    core = _little(head, 14, 4) == 12
    width = tf.where(core, _little(head, 18, 2), _little(head, 18, 4))
    height = tf.where(core, _little(head, 20, 2), _little(head, 22, 4))
    height = tf.where(height >= 1 << 31, (1 << 32) - height, height)
    return tf.stack([height, tf.where(width >= 1 << 31, _int64(0), width)])


def _webp_size(prefix, head):
    """(height, width) of a WebP from its first chunk: lossy "VP8 ", lossless "VP8L" or extended "VP8X"."""
    bits = _little(head, 21, 4)
    sizes = {
        b"VP8 ": tf.stack([_little(head, 28, 2) % (1 << 14), _little(head, 26, 2) % (1 << 14)]),
        b"VP8L": tf.stack([bits // (1 << 14) % (1 << 14) + 1, bits % (1 << 14) + 1]),
        b"VP8X": tf.stack([_little(head, 27, 3) + 1, _little(head, 24, 3) + 1]),
    }
    size = tf.zeros([2], tf.int64)
    for chunk, chunk_size in sizes.items():
        size = tf.where(_bytes_at(prefix, 12, chunk), chunk_size, size)
    return size


def _webp_animated(prefix, head):
    return tf.logical_and(_bytes_at(prefix, 12, b"VP8X"), head[20] // 2 % 2 == 1)  # The animation flag.


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


def check_image(encoded, limits=None):
    """Reads the size of an encoded image from its header and checks it against `limits` (an `ImageLimits`).

    Returns (the bytes to decode, int64 (height, width)): the bytes as they
    are, but a GIF cut after its first frame (`gif_first_frame`).  Raises
    (or, in a graph, fails with) InvalidArgumentError, its message ASCII
    whatever the bytes: for data that is none of the formats (its first
    bytes in hex), a header whose size cannot be read, an animated WebP
    (which TensorFlow decodes as RGBA frames only), and an image past a
    limit (the limit's name and value, and the image's size).
    """
    limits = as_image_limits(limits)
    encoded = tf.convert_to_tensor(encoded, tf.string)
    prefix = _prefix(encoded)
    head = tf.io.decode_raw(prefix, tf.uint8, fixed_length=_HEAD)
    index = image_format(encoded)
    length = tf.strings.length(encoded)
    first_bytes = tf.strings.join([" starting with ", _hex(head[: tf.minimum(length, 8)]), " (hex)"])
    known = _require(
        index >= 0,
        _message(
            f"Expected an encoded {EXPECTED_FORMATS} image; received ", length, " bytes",
            tf.where(length > 0, first_bytes, ""), ".",
        ),
    )

    def jpeg():
        return encoded, tf.cast(tf.image.extract_jpeg_shape(encoded)[:2], tf.int64)

    def png():
        return encoded, _png_size(prefix, head)

    def gif():
        first, frame = gif_first_frame(encoded)
        screen = tf.stack([_little(head, 8, 2), _little(head, 6, 2)])
        # Decoded at the screen's size; the frame's own raster is allocated at its size.
        larger = tf.where(frame[0] * frame[1] > screen[0] * screen[1], frame, screen)
        return first, tf.where(tf.reduce_all(frame > 0), larger, 0)

    def bmp():
        return encoded, _bmp_size(head)

    def webp():
        still = _require(
            tf.logical_not(_webp_animated(prefix, head)),
            tf.constant(
                "Animated WebP images are not supported (TensorFlow decodes them as RGBA frames only); "
                "send a still image, such as the first frame."
            ),
        )
        with tf.control_dependencies([still]):
            return tf.identity(encoded), _webp_size(prefix, head)

    with tf.control_dependencies([known]):
        data, size = tf.switch_case(tf.maximum(index, 0), [jpeg, png, gif, bmp, webp])
    size.set_shape([2])
    format_name = FORMATS[int(index)] if tf.executing_eagerly() else tf.gather(FORMATS, tf.maximum(index, 0))
    checks = _check_size(size, limits, format_name)
    with tf.control_dependencies(checks):
        return tf.identity(data), tf.identity(size)


def _check_size(size, limits, format_name):
    """The assertions that `size` (height, width) was read and is within `limits`."""
    height, width = tf.unstack(size)
    shown = _message(width, " x ", height, " (width x height)")
    where = "(ImageLimits: an argument of the input pipelines and of export_saved_model)"
    height_, width_ = tf.cast(height, tf.float64), tf.cast(width, tf.float64)
    pixels = height_ * width_
    ratio = tf.maximum(height_, width_) / tf.maximum(tf.minimum(height_, width_), 1.0)
    readable = _require(
        tf.logical_and(height > 0, width > 0),
        _message("Could not read the size of the ", format_name, " image from its header: read ", shown, "."),
    )
    with tf.control_dependencies([readable]):
        return [
            _require(
                pixels <= limits.max_pixels,
                _message(
                    "The ", format_name, " image is ", shown, f" pixels, more than max_pixels={limits.max_pixels} "
                    f"allows {where}.",
                ),
            ),
            _require(
                ratio <= limits.max_aspect_ratio,
                _message(
                    "The ", format_name, " image is ", shown, " pixels: its longer side is more than "
                    f"max_aspect_ratio={limits.max_aspect_ratio:g} times the shorter {where}.",
                ),
            ),
        ]
