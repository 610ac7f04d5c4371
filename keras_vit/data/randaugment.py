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
PIL's filter does, where the reference truncates; Equalize, AutoContrast and the enhance blends are PIL's
integer and float32 arithmetic.

`rand_augment` draws `num_ops` ops uniformly from the 16 (as big_vision and the tensorflow/tpu code do; Model
Garden's RandAugment draws from 17, the 17th leaving the image as it is) and computes only the drawn one
(`tf.switch_case`). Everything random comes from the per-image `seed`, an int32 pair: the same seed gives the
same image, and the pipeline gives each image of each epoch its own.
"""

import functools
import math

import tensorflow as tf

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
_TRANSLATE_CONST = 100.0  # pixels at M = 10
_CUTOUT_CONST = 40.0  # half the side of the Cutout square at M = 10

# PIL's RGB -> "L" conversion (libImaging/Convert.c): L = (19595 R + 38470 G + 7471 B + 0x8000) >> 16.
_GREY_WEIGHTS = (19595, 38470, 7471)


def _lookup(image, table):
    """Maps every uint8 value through `table` (256 entries, or 3 x 256: one per channel), as PIL's `point`."""
    index = tf.cast(image, tf.int32)
    if table.shape.rank == 2:
        index += tf.constant([0, 256, 512])
        table = tf.reshape(table, [-1])
    return tf.gather(tf.cast(table, tf.uint8), index)


def _blend(degenerate, image, factor):
    """PIL's `Image.blend(degenerate, image, factor)` (what `ImageEnhance` computes): in float32, truncated.

    `degenerate` and `image` are float32 and broadcast; `factor` is a float64 scalar, rounded to float32 as
    PIL's C code takes it.
    """
    factor = tf.cast(factor, tf.float32)
    return tf.cast(tf.clip_by_value(degenerate + factor * (image - degenerate), 0.0, 255.0), tf.uint8)


def _grey(image):
    """PIL's grey-scale ("L") image of a uint8 RGB image, int32 (H, W)."""
    weighted = tf.reduce_sum(tf.cast(image, tf.int32) * tf.constant(_GREY_WEIGHTS), axis=-1)
    return tf.bitwise.right_shift(weighted + 0x8000, 16)


def _enhance_factor(m):
    return m * 1.8 + 0.1


def _signed(value, seed):
    """`value` or `-value`, even odds, from `seed`."""
    return tf.where(tf.random.stateless_uniform([], seed) < 0.5, -value, value)


def _affine(image, a, b, c, d, e, f):
    """PIL's `Image.transform(size, AFFINE, (a, b, c, d, e, f), NEAREST, fillcolor=grey)` of a uint8 image.

    PIL maps each output pixel's centre (x + 0.5, y + 0.5) to (a x + b y + c, d x + e y + f) in the input,
    in coordinates where pixel i spans [i, i + 1), and takes the pixel there. TensorFlow's transform maps
    the output index (x, y) and rounds to the nearest index, so the offsets shift by half a pixel.
    Arguments are float64 scalars.
    """
    offset_x = c + 0.5 * (a + b) - 0.5
    offset_y = f + 0.5 * (d + e) - 0.5
    zero = tf.zeros([], tf.float64)
    transform = tf.cast(tf.stack([a, b, offset_x, d, e, offset_y, zero, zero]), tf.float32)
    transformed = tf.raw_ops.ImageProjectiveTransformV3(
        images=image[None],
        transforms=transform[None],
        output_shape=tf.shape(image)[:2],
        fill_value=float(_FILL_VALUE),
        interpolation="NEAREST",
        fill_mode="CONSTANT",
    )
    return transformed[0]


def _autocontrast(image, m, seed):
    del m, seed
    lo = tf.cast(tf.reduce_min(image, axis=[0, 1]), tf.float64)[:, None]
    hi = tf.cast(tf.reduce_max(image, axis=[0, 1]), tf.float64)[:, None]
    values = tf.range(256, dtype=tf.float64)[None]
    # PIL: scale = 255 / (hi - lo), offset = -lo * scale, int(i * scale + offset) clipped to [0, 255].
    scale = 255.0 / tf.maximum(hi - lo, 1.0)
    stretched = tf.clip_by_value(tf.floor(values * scale + -lo * scale), 0.0, 255.0)
    return _lookup(image, tf.where(hi > lo, stretched, values))


def _equalize(image, m, seed):
    del m, seed
    pixels = tf.reshape(tf.cast(image, tf.int32), [-1, 3]) + tf.constant([0, 256, 512])
    histogram = tf.reshape(tf.math.bincount(pixels, minlength=768, maxlength=768), [3, 256])
    top = tf.cast(tf.reduce_max(image, axis=[0, 1]), tf.int32)
    # PIL: step = (count - count of the last non-empty bin) // 255; lut[i] = (step // 2 + count below i) // step.
    step = (tf.reduce_sum(histogram, axis=1) - tf.gather(histogram, top, batch_dims=1)) // 255
    step = step[:, None]
    below = tf.cumsum(histogram, axis=1, exclusive=True)
    table = tf.minimum((step // 2 + below) // tf.maximum(step, 1), 255)
    return _lookup(image, tf.where(step > 0, table, tf.range(256)[None]))


def _invert(image, m, seed):
    del m, seed
    return 255 - image


def _posterize(image, m, seed):
    del seed
    bits = tf.cast(tf.clip_by_value(tf.floor(m * 4.0), 0.0, 8.0), tf.int32)
    mask = 256 - tf.bitwise.left_shift(1, 8 - bits)  # the top `bits` bits: 0 for none, 255 for all 8
    return tf.bitwise.bitwise_and(image, tf.cast(mask, tf.uint8))


def _solarize(image, m, seed):
    del seed
    threshold = tf.cast(tf.clip_by_value(tf.floor(m * 256.0), 0.0, 256.0), tf.int32)
    values = tf.range(256)
    return _lookup(image, tf.where(values < threshold, values, 255 - values))


def _solarize_add(image, m, seed):
    del seed
    addition = tf.cast(tf.clip_by_value(tf.floor(m * 110.0), 0.0, 255.0), tf.int32)
    values = tf.range(256)
    return _lookup(image, tf.where(values < 128, tf.minimum(values + addition, 255), values))


def _color(image, m, seed):
    del seed
    grey = tf.cast(_grey(image), tf.float32)[..., None]
    return _blend(grey, tf.cast(image, tf.float32), _enhance_factor(m))


def _contrast(image, m, seed):
    del seed
    # PIL: the mean of the grey image from its histogram, int(mean + 0.5), as a flat grey image.
    grey = _grey(image)
    total = tf.reduce_sum(tf.cast(grey, tf.int64))
    mean = tf.floor(tf.cast(total, tf.float64) / tf.cast(tf.size(grey), tf.float64) + 0.5)
    table = _blend(tf.cast(mean, tf.float32), tf.range(256, dtype=tf.float32), _enhance_factor(m))
    return _lookup(image, table)


def _brightness(image, m, seed):
    del seed
    return _lookup(image, _blend(0.0, tf.range(256, dtype=tf.float32), _enhance_factor(m)))


def _sharpness(image, m, seed):
    del seed
    pixels = tf.cast(image, tf.float32)
    # PIL's SMOOTH filter: [[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13, rounded; the border pixels stay as they are.
    kernel = tf.constant([[1.0, 1.0, 1.0], [1.0, 5.0, 1.0], [1.0, 1.0, 1.0]])[:, :, None, None]
    summed = tf.nn.depthwise_conv2d(pixels[None], tf.tile(kernel, [1, 1, 3, 1]), [1, 1, 1, 1], "SAME")[0]
    smooth = tf.floor(summed / 13.0 + 0.5)  # the integer sum / 13 is never within 1/26 of a half: exact
    height, width = tf.shape(image)[0], tf.shape(image)[1]
    rows, columns = tf.range(height), tf.range(width)
    inner = ((rows > 0) & (rows < height - 1))[:, None] & ((columns > 0) & (columns < width - 1))[None]
    degenerate = tf.where(inner[..., None], smooth, pixels)
    return _blend(degenerate, pixels, _enhance_factor(m))


def _rotate(image, m, seed):
    radians = _signed(m * 30.0, seed) * (math.pi / 180.0)
    shape = tf.cast(tf.shape(image), tf.float64)
    centre_x, centre_y = shape[1] / 2.0, shape[0] / 2.0
    cos, sin = tf.cos(radians), tf.sin(radians)
    # PIL's rotate (counter-clockwise on screen) about (width / 2, height / 2) in its pixel coordinates.
    return _affine(
        image,
        cos,
        -sin,
        centre_x - cos * centre_x + sin * centre_y,
        sin,
        cos,
        centre_y - sin * centre_x - cos * centre_y,
    )


def _shear_x(image, m, seed):
    one, zero = tf.ones([], tf.float64), tf.zeros([], tf.float64)
    return _affine(image, one, _signed(m * 0.3, seed), zero, zero, one, zero)


def _shear_y(image, m, seed):
    one, zero = tf.ones([], tf.float64), tf.zeros([], tf.float64)
    return _affine(image, one, zero, zero, _signed(m * 0.3, seed), one, zero)


def _translate_x(image, m, seed):
    one, zero = tf.ones([], tf.float64), tf.zeros([], tf.float64)
    return _affine(image, one, zero, _signed(m * _TRANSLATE_CONST, seed), zero, one, zero)


def _translate_y(image, m, seed):
    one, zero = tf.ones([], tf.float64), tf.zeros([], tf.float64)
    return _affine(image, one, zero, zero, zero, one, _signed(m * _TRANSLATE_CONST, seed))


def _cutout(image, m, seed):
    half = tf.cast(tf.floor(m * _CUTOUT_CONST), tf.int32)
    height, width = tf.shape(image)[0], tf.shape(image)[1]
    row_seed, column_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
    centre_y = tf.random.stateless_uniform([], row_seed, minval=0, maxval=height, dtype=tf.int32)
    centre_x = tf.random.stateless_uniform([], column_seed, minval=0, maxval=width, dtype=tf.int32)
    rows, columns = tf.range(height), tf.range(width)
    inside = ((rows >= centre_y - half) & (rows < centre_y + half))[:, None] & (
        (columns >= centre_x - half) & (columns < centre_x + half)
    )[None]
    return tf.where(inside[..., None], tf.constant(_FILL_VALUE, tf.uint8), image)


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
    """One RandAugment op (`name`, one of `RANDAUGMENT_OPS`) at `magnitude` (0-10 scale) on one image.

    `image`: uint8 (H, W, 3), H and W static or not; returns uint8 of the same shape. `seed`: an int32 pair,
    which decides the sign of Rotate, Shear and Translate and where Cutout falls (the other ops ignore it).
    Graph-mode TensorFlow ops only, so it runs in `tf.data.Dataset.map` and eagerly alike.
    """
    if name not in _OPS:
        raise ValueError(f"Unknown RandAugment op {name!r}; the ops are {', '.join(RANDAUGMENT_OPS)}.")
    image = tf.convert_to_tensor(image)
    if image.dtype != tf.uint8 or not image.shape.is_compatible_with([None, None, 3]):
        raise ValueError(f"RandAugment takes uint8 (H, W, 3) images. Received: {image.dtype.name} {image.shape}")
    m = tf.maximum(tf.cast(magnitude, tf.float64), 0.0) / _MAX_LEVEL
    result = _OPS[name](image, m, tf.convert_to_tensor(seed))
    result.set_shape(image.shape)
    return result


@tf.autograph.experimental.do_not_convert  # plain TensorFlow ops: nothing to convert, faster traces
def draw_ops(seed, num_ops):
    """The ops `rand_augment(image, seed, num_ops)` applies: (int32 [num_ops] indices into
    `RANDAUGMENT_OPS`, each uniform over the 16; int32 [num_ops, 2] seeds, one per op)."""
    seeds = tf.random.experimental.stateless_split(seed, num_ops + 1)
    indices = tf.random.stateless_uniform([num_ops], seeds[0], minval=0, maxval=len(RANDAUGMENT_OPS), dtype=tf.int32)
    return indices, seeds[1:]


@tf.autograph.experimental.do_not_convert  # plain TensorFlow ops: nothing to convert, faster traces
def rand_augment(image, seed, num_ops=2, magnitude=10.0):
    """RandAugment(N=`num_ops`, M=`magnitude`) of one uint8 (H, W, 3) image; returns uint8, same shape.

    Each of the `num_ops` draws picks one of the 16 ops uniformly (`draw_ops`) and applies it at `magnitude`
    to the previous draw's output. Only the drawn op is computed: the choice is a `tf.switch_case` over the
    16. Stateless: `seed` (an int32 pair, one per image and epoch) decides everything, so the same seed gives
    the same image.
    """
    if not isinstance(num_ops, int) or num_ops < 0:
        raise ValueError(f"`num_ops` must be an int >= 0. Received: num_ops={num_ops!r}")
    image = tf.convert_to_tensor(image)
    if num_ops == 0:
        return image
    indices, seeds = draw_ops(seed, num_ops)
    for draw in range(num_ops):
        branches = [functools.partial(apply_op, image, name, magnitude, seeds[draw]) for name in RANDAUGMENT_OPS]
        image = tf.switch_case(indices[draw], branches, name=f"randaugment_draw_{draw}")
    return image
