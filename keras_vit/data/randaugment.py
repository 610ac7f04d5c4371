"""RandAugment as published (Cubuk et al. 2019), in graph-mode TensorFlow on uint8 images.

The op set and magnitude ranges are the TPU reference implementation's (big_vision's `pp/autoaugment.py`,
forked from tensorflow/tpu's EfficientNet code; TF Model Garden's `official/vision/ops/augment.py`). Each op
does what PIL does (timm's `auto_augment.py` applies the same ops with PIL), so a PIL reference checks it:

| op | at magnitude M (m = M / 10) | PIL |
|---|---|---|
| AutoContrast, Equalize, Invert | no argument | `ImageOps.autocontrast`, `equalize`, `invert` |
| Rotate | 30 * m degrees, random sign | `Image.rotate` about the centre |
| ShearX, ShearY | 0.3 * m, random sign | `Image.transform(AFFINE, (1, s, 0, 0, 1, 0))` |
| TranslateX, TranslateY | 100 * m pixels, random sign | `Image.transform(AFFINE, (1, 0, t, 0, 1, 0))` |
| Posterize | keep int(4 * m) bits, in [0, 8] | `ImageOps.posterize` |
| Solarize | invert pixels >= int(256 * m), in [0, 256] | `ImageOps.solarize` |
| SolarizeAdd | add int(110 * m) (at most 255) to pixels < 128, clipped at 255 | a `point` lookup table |
| Color, Contrast, Brightness, Sharpness | factor 1.8 * m + 0.1 (1 = unchanged, M = 5) | `ImageEnhance` |
| Cutout | grey square of side 2 * int(40 * m), centre uniform over the image | - |

Rotate, shear and translate sample nearest pixels, with PIL's pixel centres, and fill what comes from outside
the image with grey 128; so does Cutout. M is on the paper's 0-10 scale; above 10 every argument extrapolates
linearly (as timm's with `magnitude_max` set), clamped where the op would lose its meaning (the bits kept, the
solarize threshold); below 0 it counts as 0.

Where the reference departs from PIL, PIL is followed: Contrast blends towards the rounded mean of the grey
(PIL "L") image, not the pixel count / 256 of the reference's histogram sum; Posterize at 0 bits gives black,
not the reference's one bit (TensorFlow clamps its shift of 8 to 7); Sharpness rounds the smoothed image, as
PIL's filter does, where the reference truncates; Equalize, AutoContrast and the enhance blends repeat PIL's
arithmetic (integers; Python's float64 for AutoContrast's table; C's float32 for the blends).

`apply_op` applies one op; `rand_augment` draws `num_ops` ops (`draw_ops`) uniformly from the 16 (as big_vision
and the tensorflow/tpu code do; Model Garden's RandAugment draws from 17, the 17th leaving the image as it is)
and computes only the drawn one (`tf.switch_case`). Everything random comes from the per-image `seed`, an int32
pair: the same seed gives the same image, and the pipeline gives each image of each epoch its own.

On the device: every op also compiles with XLA (in a `tf.function(jit_compile=True)`, as a TPU training step
is compiled) and gives the host's images bit for bit (tests/test_tf_xla.py). Where the host's form would not
compile or would compute other numbers, the op takes another form where it is traced for XLA
(`keras_vit.compat.in_xla_context()`); on the host each keeps the form that is fastest there:
- Rotate and the shears: ImageProjectiveTransformV3 has no XLA kernel; `_affine_in_xla` computes its float32
  source coordinates, rounds them as it does and gathers the pixels.
- The translations: padding by an amount that depends on the seed does not compile; a gather of the rows or
  columns does. (Cutout's box, made from comparisons, and Equalize's histogram, of a constant size, compile in
  their one form.)
- The random draws: XLA would pick another generator than the host's Philox, and makes floats from other bits
  of a draw; Philox is named and the floats are made as the CPU kernel makes them (`_random_bits`, `_uniform`).
- The products that XLA would fuse with the add that takes them (a fused multiply-add, rounded once): the
  blends, AutoContrast's stretch and the affine coordinates round each product as the host does
  (`_rounded_product`).

Cost: the magnitude is a Python number and every op's argument is computed from it in Python, as the reference
computes it, so the graph holds only the image work. That keeps each of the 16 branches small, which matters:
TensorFlow runs `tf.switch_case` in a tf.data map as switch/merge, and every node of the 15 branches not taken
still costs about a microsecond per image. On whole images, `tf.where` and `tf.gather` cost about ten times
element-wise arithmetic, so the ops compute PIL's integers with arithmetic wherever it gives the same ones.
"""

import functools
import math
import numbers

import numpy as np
import tensorflow as tf

from keras_vit import compat

RANDAUGMENT_OPS = (
    "AutoContrast",
    "Equalize",
    "Invert",
    "Rotate",
    "Posterize",
    "Solarize",
    "Color",
    "Contrast",
    "Brightness",
    "Sharpness",
    "ShearX",
    "ShearY",
    "TranslateX",
    "TranslateY",
    "Cutout",
    "SolarizeAdd",
)

_MAX_LEVEL = 10.0  # the top of the magnitude scale, M = 10 <=> m = 1
_FILL_VALUE = 128  # grey: what the geometric ops bring in from outside the image, and Cutout's colour
_PACKED_FILL = float(-(0x100000000 - 0x80808080))  # four bytes of 128 as one int32 (exact in float32)
_TRANSLATE_CONST = 100.0  # pixels at M = 10
_CUTOUT_CONST = 40.0  # half the side of the Cutout square at M = 10

# PIL's RGB -> "L" conversion (libImaging/Convert.c): L = (19595 R + 38470 G + 7471 B + 0x8000) >> 16. In float32
# the weighted sum (below 2 ** 24) and the division by 2 ** 16 are exact.
_GREY_WEIGHTS = np.array([19595.0, 38470.0, 7471.0], np.float32)

# PIL's SMOOTH filter, [[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13, for a depthwise convolution of 3 channels.
_SMOOTH = np.tile(np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float32)[:, :, None, None], [1, 1, 3, 1])


def _arguments(magnitude):
    """Every op's argument at `magnitude`, in Python, with the reference's arithmetic, clamped where needed."""
    if isinstance(magnitude, bool) or not isinstance(magnitude, numbers.Real) or not math.isfinite(magnitude):
        raise ValueError(f"`magnitude` must be a finite Python number (M on the 0-10 scale). Received: {magnitude!r}")
    m = max(float(magnitude), 0.0) / _MAX_LEVEL
    return {
        "degrees": m * 30.0,
        "shear": m * 0.3,
        "pixels": m * _TRANSLATE_CONST,
        "bits": min(int(m * 4), 8),
        "threshold": min(int(m * 256), 256),
        "addition": min(int(m * 110), 255),
        "factor": m * 1.8 + 0.1,
        "half": int(m * _CUTOUT_CONST),
    }


def _rounded_product(coefficient, integers, bits):
    """`coefficient` * `integers`, rounded once to their float type (float32 or float64) whether or not XLA fuses
    the multiply with the add that takes its result; `integers` hold whole numbers below 2 ** `bits` in
    magnitude, `bits` at most 12 for float32 and 26 for float64.

    XLA's CPU compiler fuses a multiply and the add that takes its result into one fused multiply-add, rounded
    once, where TensorFlow's kernels (and PIL) round the product, then the sum: the results differ where the
    sum lands near a rounding or truncation boundary. So the coefficient is split into a high part (its low
    `bits` mantissa bits cleared) and the low part those bits make (exact): both products with such integers
    are exact, so their sum is the product rounded once, fused or not.
    """
    coefficient = tf.convert_to_tensor(coefficient)
    as_integer = tf.int32 if coefficient.dtype == tf.float32 else tf.int64
    mask = tf.constant(-(1 << bits), as_integer)
    high = tf.bitcast(tf.bitwise.bitwise_and(tf.bitcast(coefficient, as_integer), mask), coefficient.dtype)
    low = coefficient - high
    return high * integers + low * integers


def _blend(degenerate, pixels, factor):
    """PIL's `Image.blend(degenerate, image, factor)` (what `ImageEnhance` computes): in float32, truncated.

    `degenerate` and `pixels` are float32 and broadcast; `factor` is rounded to float32 as PIL's C code takes
    it. At factor 1 PIL copies the image, and so does this. Traced for XLA, the product is rounded on its own
    as on the host (`_rounded_product`: pixels - degenerate is a whole number, at most 255 in magnitude).
    """
    if factor == 1.0:
        return tf.cast(pixels, tf.uint8)
    if compat.in_xla_context():
        blended = degenerate + _rounded_product(np.float32(factor), pixels - degenerate, 8)
    else:
        blended = degenerate + np.float32(factor) * (pixels - degenerate)
    return tf.cast(tf.clip_by_value(blended, 0.0, 255.0), tf.uint8)


def _grey(pixels, channels):
    """PIL's grey-scale ("L") image of float32 RGB `pixels`, float32 (H, W, `channels`): 1, or 3 copies."""
    weighted = tf.reshape(pixels, [-1, 3]) @ np.tile(_GREY_WEIGHTS[:, None], [1, channels])
    shape = tf.concat([tf.shape(pixels)[:2], [channels]], 0)
    return tf.reshape(tf.floor((weighted + 32768.0) / 65536.0), shape)


def _box(height, width, top, bottom, left, right):
    """A uint8 (height, width, 3) mask: 1 in rows [top, bottom) and columns [left, right), 0 elsewhere.

    Bounds known when traced (Python ints: Sharpness's, for a static shape) pad a box of ones by constants:
    two graph ops. Bounds known only when it runs (Cutout's) compare the row and column indices with them: the
    shape is the image's whatever the bounds, which XLA needs (it refuses padding by amounts it cannot know
    when it compiles), and the row mask times the column mask tiled over the channels is also faster on the host
    than padding a box of ones of a size not known in advance.
    """
    if all(isinstance(value, int) for value in (height, width, top, bottom, left, right)):
        top, left = min(max(top, 0), height), min(max(left, 0), width)
        bottom, right = min(max(bottom, top), height), min(max(right, left), width)
        ones = tf.ones([bottom - top, right - left, 3], tf.uint8)
        return tf.pad(ones, [[top, height - bottom], [left, width - right], [0, 0]])
    rows, columns = tf.range(height), tf.range(width)
    in_rows = tf.cast((rows >= top) & (rows < bottom), tf.uint8)
    in_columns = tf.cast((columns >= left) & (columns < right), tf.uint8)
    return in_rows[:, None, None] * tf.tile(in_columns[None, :, None], [1, 1, 3])


def _random_bits(shape, seed):
    """int32 of `shape`, uniform over the full range, from `seed` (an int32 pair): the same on the host and in
    XLA.

    Left to choose, TensorFlow's stateless generators take Philox on CPUs and another algorithm in XLA. Naming
    Philox gives XLA the host's numbers, but makes the key from the seed in some 40 graph ops (about 10 us a
    draw on the host, and a cost in every branch not taken), so it is named only where traced for XLA.
    """
    alg = "philox" if compat.in_xla_context() else "auto_select"
    return tf.random.stateless_uniform(shape, seed, minval=None, maxval=None, dtype=tf.int32, alg=alg)


def _uniform(shape, seed):
    """float32 in [0, 1) of `shape` from `seed`: `tf.random.stateless_uniform(shape, seed)` on the host.

    XLA's float draws differ even with Philox named (made from other bits of the draw), so where traced for XLA
    they are made from `_random_bits` as the CPU kernel makes them: the low 23 bits as the mantissa of a float
    in [1, 2), minus 1.
    """
    if not compat.in_xla_context():
        return tf.random.stateless_uniform(shape, seed)
    mantissa = tf.bitwise.bitwise_and(_random_bits(shape, seed), 0x7FFFFF)
    return tf.bitcast(tf.bitwise.bitwise_or(mantissa, 0x3F800000), tf.float32) - 1.0


def _negative(seed):
    """True or False, even odds, from `seed`: whether rotate, shear or translate goes the other way."""
    return _uniform([], seed) < 0.5


def _size(image):
    """(height, width): Python ints where the shape is static, else int32 scalars."""
    height, width = image.shape[0], image.shape[1]
    if height is None or width is None:
        height, width, _ = tf.unstack(tf.shape(image), 3)
    return height, width


def _transform(a, b, c, d, e, f):
    """TensorFlow's transform (float32 [8]) for PIL's affine coefficients (Python floats or float64 scalars).

    PIL maps each output pixel's centre (x + 0.5, y + 0.5) to (a x + b y + c, d x + e y + f) in the input,
    in coordinates where pixel i spans [i, i + 1), and takes the pixel there. TensorFlow's transform maps
    the output index (x, y) and rounds to the nearest index, so the offsets shift by half a pixel.
    """
    row = [a, b, c + 0.5 * (a + b) - 0.5, d, e, f + 0.5 * (d + e) - 0.5, 0.0, 0.0]
    if all(isinstance(value, float) for value in row):
        return np.array(row, np.float32)  # computed in Python's float64, rounded once, as TensorFlow would
    return tf.cast(tf.stack([tf.convert_to_tensor(value, tf.float64) for value in row]), tf.float32)


def _affine(image, plus, minus, seed):
    """PIL's `Image.transform(size, AFFINE, coefficients, NEAREST, fillcolor=grey)` of a uint8 image, with the
    coefficients `plus` or `minus` (6-tuples, see `_transform`), even odds from `seed`.

    TensorFlow's ImageProjectiveTransformV3 does it, but has no XLA kernel: traced for XLA, `_affine_in_xla`
    computes the same pixels with ops that compile.
    """
    negative = _negative(seed)
    plus, minus = _transform(*plus), _transform(*minus)
    # One int32 per pixel (RGB and a grey fourth byte): the transform then finds each pixel's source once, not
    # once per channel.
    packed = tf.bitcast(tf.pad(image, [[0, 0], [0, 0], [0, 1]], constant_values=_FILL_VALUE), tf.int32)
    if compat.in_xla_context():
        return _affine_in_xla(image, packed, plus, minus, negative)
    transform = tf.where(negative, minus, plus)
    transformed = tf.raw_ops.ImageProjectiveTransformV3(
        images=tf.expand_dims(tf.expand_dims(packed, 0), 3),
        transforms=tf.expand_dims(transform, 0),
        output_shape=tf.shape(packed),
        fill_value=_PACKED_FILL,
        interpolation="NEAREST",
        fill_mode="CONSTANT",
    )
    unpacked = tf.bitcast(tf.squeeze(transformed, [0, 3]), tf.uint8)
    return tf.slice(unpacked, [0, 0, 0], tf.shape(image))


def _products(plus, minus, negative, index, size):
    """float32 [size]: coefficient `index` of the transform `minus` if `negative` else `plus` times 0, 1, ...,
    size - 1, each product rounded to float32 on its own, as TensorFlow's kernel rounds it.

    XLA would fuse a product with the add that takes it (`_rounded_product`), which moves some source
    coordinates by an ulp, and a pixel where that crosses a half. With static coefficients and size (`apply_op`
    on an image of static shape) the products are NumPy constants, exact at any size; otherwise they are
    `_rounded_product`'s, exact for images of up to 4096 pixels a side.
    """
    if isinstance(plus, np.ndarray) and isinstance(size, int):
        steps = np.arange(size, dtype=np.float32)
        return tf.where(negative, minus[index] * steps, plus[index] * steps)
    coefficient = tf.where(negative, minus[index], plus[index])
    return _rounded_product(coefficient, tf.cast(tf.range(size), tf.float32), 12)


def _nearest(coordinate, size):
    """The pixel index TensorFlow's NEAREST takes at float32 `coordinate`, std::round's (halves away from 0),
    as int32, and whether it is in [0, size).

    round(c) is in [0, size) exactly when -0.5 < c < size - 0.5. floor(c + 0.5) would round a c just below a
    half up (c + 0.5 rounds to the integer above), so the fraction is compared instead: c - floor(c) is
    exact for c >= 0, and for c in (-0.5, 0) it is at least 0.5, which gives index 0 as std::round does.
    """
    limit = tf.cast(size, tf.float32)
    inside = (coordinate > -0.5) & (coordinate < limit - 0.5)
    whole = tf.floor(tf.clip_by_value(coordinate, -1.0, limit))
    index = tf.cast(whole, tf.int32) + tf.cast(coordinate - whole >= 0.5, tf.int32)
    return index, inside


def _affine_in_xla(image, packed, plus, minus, negative):
    """What `_affine` computes with ImageProjectiveTransformV3 (NEAREST, CONSTANT fill), with ops XLA compiles.

    The kernel (tensorflow/core/kernels/image/image_ops.h, `ProjectiveGenerator`) maps output pixel (x, y) to
    x' = t0 x + t1 y + t2, y' = t3 x + t4 y + t5 in float32, each product and sum rounded in turn (the last
    two coefficients are 0 here, so its division by t6 x + t7 y + 1 = 1 is exact), rounds x' and y' to the
    nearest integer (`_nearest`) and takes that pixel, or the fill value where it is outside the image. This
    computes the same float32 numbers in the same order (`_products` keeps XLA from fusing them differently)
    and gathers the packed pixels by flat index.
    """
    height, width = _size(image)

    def coordinate(k):  # t[k] x + t[k + 1] y + t[k + 2], for every output pixel (y, x)
        along_x = _products(plus, minus, negative, k, width)
        along_y = _products(plus, minus, negative, k + 1, height)
        return (along_x[None, :] + along_y[:, None]) + tf.where(negative, minus[k + 2], plus[k + 2])

    column, column_inside = _nearest(coordinate(0), width)
    row, row_inside = _nearest(coordinate(3), height)
    inside = column_inside & row_inside
    source = tf.where(inside, row * width + column, 0)
    transformed = tf.where(inside, tf.gather(tf.reshape(packed, [-1]), source), int(_PACKED_FILL))
    return tf.bitcast(transformed, tf.uint8)[:, :, :3]


def _translate(image, pixels, seed, axis):
    """PIL's translation by `pixels` (sign from `seed`) along `axis` (0: y, 1: x), filled with grey.

    Output pixel i is input pixel floor(i + 0.5 + pixels) = i + floor(pixels + 0.5) (see `_affine`): a shift
    by whole pixels, which padding and slicing do without computing a coordinate per pixel. XLA needs the
    padding known when it compiles, and it depends on the seed; traced for XLA, a gather of the rows or
    columns i + shift, grey where that is outside the image, gives the same pixels (on the host, about ten
    times slower than padding).
    """
    if not pixels:
        return image
    shift = tf.where(_negative(seed), math.floor(0.5 - pixels), math.floor(pixels + 0.5))
    size = _size(image)[axis]
    if compat.in_xla_context():
        source = tf.range(size) + shift
        inside = (source >= 0) & (source < size)
        moved = tf.gather(image, tf.clip_by_value(source, 0, size - 1), axis=axis)
        inside = inside[:, None, None] if axis == 0 else inside[None, :, None]
        return tf.where(inside, moved, tf.constant(_FILL_VALUE, tf.uint8))
    shift = tf.clip_by_value(shift, -size, size)  # beyond the image: all grey
    before, after = tf.maximum(-shift, 0), tf.maximum(shift, 0)
    padding = [[0, 0], [0, 0], [0, 0]]
    padding[axis] = [before, after]
    begin = [0, 0, 0]
    begin[axis] = after
    return tf.slice(tf.pad(image, padding, constant_values=_FILL_VALUE), tf.stack(begin), tf.shape(image))


def _autocontrast(image, args, seed):
    lo = tf.cast(tf.reduce_min(image, axis=[0, 1]), tf.float64)
    hi = tf.cast(tf.reduce_max(image, axis=[0, 1]), tf.float64)
    # PIL, per channel with hi > lo: scale = 255 / (hi - lo), offset = -lo * scale, int(i * scale + offset)
    # clipped to [0, 255], in Python's float64; otherwise unchanged (scale 1, offset 0).
    stretch = hi > lo
    scale = tf.where(stretch, 255.0 / tf.maximum(hi - lo, 1.0), 1.0)
    if compat.in_xla_context():
        # As PIL does it: a table of the 256 levels of each channel, then a lookup. The products are rounded on
        # their own as on the host (`_rounded_product`), and only 768 of them are in float64.
        offset = tf.where(stretch, -_rounded_product(scale, lo, 8), 0.0)
        levels = tf.range(256, dtype=tf.float64)[:, None]
        table = tf.floor(_rounded_product(scale, levels, 8) + offset)  # (256, 3)
        table = tf.reshape(tf.transpose(tf.cast(tf.clip_by_value(table, 0.0, 255.0), tf.uint8)), [-1])
        return tf.gather(table, tf.cast(image, tf.int32) + np.array([0, 256, 512], np.int32))
    offset = tf.where(stretch, -lo * scale, 0.0)
    stretched = tf.floor(tf.cast(image, tf.float64) * scale + offset)
    return tf.cast(tf.clip_by_value(stretched, 0.0, 255.0), tf.uint8)


def _equalize(image, args, seed):
    index = tf.cast(image, tf.int32) + np.array([0, 256, 512], np.int32)  # one histogram of 256 bins per channel
    # DenseBincount of a constant size: tf.math.bincount computes its size from the data (then clamps it to
    # minlength and maxlength), which XLA refuses unless the image itself is a compile-time constant.
    counts = tf.raw_ops.DenseBincount(input=tf.reshape(index, [-1]), size=768, weights=np.zeros([0], np.int32))
    histogram = tf.reshape(counts, [3, 256])
    top = tf.cast(tf.reduce_max(image, axis=[0, 1]), tf.int32)
    # PIL: step = (count - count of the last non-empty bin) // 255; lut[i] = (step // 2 + count below i) // step.
    step = (tf.reduce_sum(histogram, axis=1) - tf.gather(histogram, top, batch_dims=1)) // 255
    step = step[:, None]
    below = tf.cumsum(histogram, axis=1, exclusive=True)
    table = tf.minimum((step // 2 + below) // tf.maximum(step, 1), 255)
    table = tf.where(step > 0, table, np.arange(256, dtype=np.int32)[None])
    return tf.gather(tf.reshape(tf.cast(table, tf.uint8), [-1]), index)


def _invert(image, args, seed):
    return 255 - image


def _posterize(image, args, seed):
    mask = (0xFF << (8 - args["bits"])) & 0xFF  # the top `bits` bits: 0 for none, 255 for all 8
    return image if mask == 0xFF else tf.bitwise.bitwise_and(image, np.uint8(mask))


def _solarize(image, args, seed):
    threshold = args["threshold"]
    if threshold == 256:
        return image
    # Pixels >= threshold become 255 - pixel, which is pixel XOR 255.
    return tf.bitwise.bitwise_xor(image, tf.cast(image >= threshold, tf.uint8) * 255)


def _solarize_add(image, args, seed):
    addition = args["addition"]
    if not addition:
        return image
    below = tf.cast(image < 128, tf.uint8)
    return image + below * tf.minimum(np.uint8(addition), 255 - image)  # min(pixel + addition, 255) below 128


def _color(image, args, seed):
    pixels = tf.cast(image, tf.float32)
    return _blend(_grey(pixels, 3), pixels, args["factor"])


def _contrast(image, args, seed):
    pixels = tf.cast(image, tf.float32)
    # PIL: the mean of the grey image from its histogram, int(mean + 0.5), as a flat grey image.
    grey = tf.cast(_grey(pixels, 1), tf.float64)
    mean = tf.floor(tf.reduce_sum(grey) / tf.cast(tf.size(grey), tf.float64) + 0.5)
    return _blend(tf.cast(mean, tf.float32), pixels, args["factor"])


def _brightness(image, args, seed):
    return _blend(0.0, tf.cast(image, tf.float32), args["factor"])


def _sharpness(image, args, seed):
    pixels = tf.cast(image, tf.float32)
    # PIL's SMOOTH filter, rounded; the border pixels stay as they are.
    summed = tf.nn.depthwise_conv2d(pixels[None], _SMOOTH, [1, 1, 1, 1], "SAME")[0]
    smooth = tf.floor(summed / 13.0 + 0.5)  # the integer sum / 13 is never within 1/26 of a half: exact
    height, width = _size(image)
    inner = _box(height, width, 1, height - 1, 1, width - 1)
    degenerate = pixels + tf.cast(inner, tf.float32) * (smooth - pixels)
    return _blend(degenerate, pixels, args["factor"])


def _rotate(image, args, seed):
    if not args["degrees"]:
        return image
    height, width = _size(image)
    if isinstance(height, int):
        centre_x, centre_y = width / 2.0, height / 2.0
    else:
        centre_x, centre_y = tf.cast(width, tf.float64) / 2.0, tf.cast(height, tf.float64) / 2.0

    def coefficients(degrees):
        # PIL's rotate (counter-clockwise on screen) about (width / 2, height / 2) in its pixel coordinates.
        cos, sin = math.cos(math.radians(degrees)), math.sin(math.radians(degrees))
        x_offset = centre_x - cos * centre_x + sin * centre_y
        y_offset = centre_y - sin * centre_x - cos * centre_y
        return cos, -sin, x_offset, sin, cos, y_offset

    return _affine(image, coefficients(args["degrees"]), coefficients(-args["degrees"]), seed)


def _shear_x(image, args, seed):
    shear = args["shear"]
    return _affine(image, (1.0, shear, 0.0, 0.0, 1.0, 0.0), (1.0, -shear, 0.0, 0.0, 1.0, 0.0), seed) if shear else image


def _shear_y(image, args, seed):
    shear = args["shear"]
    return _affine(image, (1.0, 0.0, 0.0, shear, 1.0, 0.0), (1.0, 0.0, 0.0, -shear, 1.0, 0.0), seed) if shear else image


def _translate_x(image, args, seed):
    return _translate(image, args["pixels"], seed, 1)


def _translate_y(image, args, seed):
    return _translate(image, args["pixels"], seed, 0)


def _cutout(image, args, seed):
    half = args["half"]
    if not half:
        return image
    height, width = _size(image)
    # The centre, uniform over the pixels, from one random-number op.
    size = tf.stack([height, width])
    centre = tf.minimum(tf.cast(_uniform([2], seed) * tf.cast(size, tf.float32), tf.int32), size - 1)
    low, high = tf.unstack(tf.maximum(centre - half, 0), 2), tf.unstack(tf.minimum(centre + half, size), 2)
    (top, left), (bottom, right) = low, high
    inside = _box(height, width, top, bottom, left, right)
    return image + inside * (_FILL_VALUE - image)  # uint8 arithmetic wraps: 128 where inside is 1


_OPS = {
    "AutoContrast": _autocontrast,
    "Equalize": _equalize,
    "Invert": _invert,
    "Rotate": _rotate,
    "Posterize": _posterize,
    "Solarize": _solarize,
    "Color": _color,
    "Contrast": _contrast,
    "Brightness": _brightness,
    "Sharpness": _sharpness,
    "ShearX": _shear_x,
    "ShearY": _shear_y,
    "TranslateX": _translate_x,
    "TranslateY": _translate_y,
    "Cutout": _cutout,
    "SolarizeAdd": _solarize_add,
}


@tf.autograph.experimental.do_not_convert  # plain TensorFlow ops: nothing to convert, faster traces
def apply_op(image, name, magnitude, seed):
    """One RandAugment op (`name`, one of `RANDAUGMENT_OPS`) at `magnitude` (a Python number, 0-10 scale) on
    one image.

    `image`: uint8 (H, W, 3), H and W static or not; returns uint8 of the same shape. `seed`: an int32 pair,
    which decides the sign of Rotate, Shear and Translate and where Cutout falls (the other ops ignore it).
    Graph-mode TensorFlow ops only, so it runs in `tf.data.Dataset.map` and eagerly alike.
    """
    if name not in _OPS:
        raise ValueError(f"Unknown RandAugment op {name!r}; the ops are {', '.join(RANDAUGMENT_OPS)}.")
    image = tf.convert_to_tensor(image)
    if image.dtype != tf.uint8 or not image.shape.is_compatible_with([None, None, 3]):
        raise ValueError(f"RandAugment takes uint8 (H, W, 3) images. Received: {image.dtype.name} {image.shape}")
    result = tf.convert_to_tensor(_OPS[name](image, _arguments(magnitude), seed))
    result.set_shape(image.shape)
    return result


@tf.autograph.experimental.do_not_convert
def draw_ops(seed, num_ops):
    """The ops `rand_augment(image, seed, num_ops)` applies: (int32 [num_ops] indices into
    `RANDAUGMENT_OPS`, each uniform over the 16; int32 [num_ops, 2] seeds, one per op)."""
    # One random-number op: three full-range int32 per draw, the index (uniform: 16 divides 2 ** 32) and a seed.
    drawn = _random_bits([num_ops, 3], seed)
    return tf.math.floormod(drawn[:, 0], len(RANDAUGMENT_OPS)), drawn[:, 1:]


@tf.autograph.experimental.do_not_convert
def rand_augment(image, seed, num_ops=2, magnitude=10.0):
    """RandAugment(N=`num_ops`, M=`magnitude`) of one uint8 (H, W, 3) image; returns uint8, same shape.

    Each of the `num_ops` draws picks one of the 16 ops uniformly (`draw_ops`) and applies it at `magnitude`
    (a Python number) to the previous draw's output. Only the drawn op is computed: the choice is a
    `tf.switch_case` over the 16. Stateless: `seed` (an int32 pair, one per image and epoch) decides
    everything, so the same seed gives the same image.
    """
    if not isinstance(num_ops, int) or num_ops < 0:
        raise ValueError(f"`num_ops` must be an int >= 0. Received: num_ops={num_ops!r}")
    _arguments(magnitude)  # a bad magnitude fails here, not inside a branch
    image = tf.convert_to_tensor(image)
    if num_ops == 0:
        return image
    indices, seeds = draw_ops(seed, num_ops)
    for index, op_seed in zip(tf.unstack(indices, num_ops), tf.unstack(seeds, num_ops)):
        branches = [functools.partial(apply_op, image, name, magnitude, op_seed) for name in RANDAUGMENT_OPS]
        image = tf.switch_case(index, branches)
    return image
