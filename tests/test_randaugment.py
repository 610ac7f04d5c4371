"""RandAugment as published (keras_vit.data.randaugment): each op against its PIL definition on real photos,
the seeding, how often each op is drawn, and that only the drawn op is computed."""

import functools

import numpy as np
import pytest
import skimage.data
import tensorflow as tf
from PIL import Image, ImageEnhance, ImageOps

from keras_vit.data import randaugment
from keras_vit.data.randaugment import RANDAUGMENT_OPS, apply_op, draw_ops, rand_augment

GREY = (128, 128, 128)
SIGNED = ("Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY")
ENHANCE = ("Color", "Contrast", "Brightness", "Sharpness")
GEOMETRIC = ("Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY")


@functools.cache
def photos():
    """scikit-image's photos, shrunk (bilinear) to a few thousand pixels each, none of them square."""
    sizes = {"astronaut": (80, 64), "chelsea": (72, 48), "coffee": (96, 64)}  # PIL's (width, height)
    return {
        name: np.asarray(Image.fromarray(getattr(skimage.data, name)()).resize(size, Image.BILINEAR))
        for name, size in sizes.items()
    }


def pil_op(name, image, magnitude, sign=1):
    """`name` at `magnitude` as PIL (and timm's PIL RandAugment) computes it, with the reference's arguments."""
    level = magnitude / 10.0
    image = Image.fromarray(image)
    if name == "AutoContrast":
        result = ImageOps.autocontrast(image)
    elif name == "Equalize":
        result = ImageOps.equalize(image)
    elif name == "Invert":
        result = ImageOps.invert(image)
    elif name == "Posterize":
        bits = min(int(level * 4), 8)
        # Pillow >= 10 refuses 0 bits; its lookup table i & ~(2 ** (8 - bits) - 1) then keeps nothing: black.
        result = ImageOps.posterize(image, bits) if bits else image.point(lambda i: 0)
    elif name == "Solarize":
        result = ImageOps.solarize(image, min(int(level * 256), 256))
    elif name == "SolarizeAdd":
        add = int(level * 110)
        result = image.point([min(255, i + add) if i < 128 else i for i in range(256)] * 3)
    elif name in ENHANCE:
        result = getattr(ImageEnhance, name)(image).enhance(level * 1.8 + 0.1)
    elif name == "Rotate":
        result = image.rotate(sign * level * 30, resample=Image.NEAREST, fillcolor=GREY)
    else:
        value = sign * {"ShearX": 0.3, "ShearY": 0.3, "TranslateX": 100, "TranslateY": 100}[name] * level
        matrix = {
            "ShearX": (1, value, 0, 0, 1, 0),
            "ShearY": (1, 0, 0, value, 1, 0),
            "TranslateX": (1, 0, value, 0, 1, 0),
            "TranslateY": (1, 0, 0, 0, 1, value),
        }[name]
        result = image.transform(image.size, Image.AFFINE, matrix, Image.NEAREST, fillcolor=GREY)
    return np.asarray(result)


# (atol, fraction): at most `fraction` of the pixel values may differ from PIL's by more than `atol`.
TOLERANCE = {
    # Point ops: PIL's own integer arithmetic (AutoContrast's scale and offset in float64, as Python's floats):
    # bit for bit.
    **{name: (0, 0.0) for name in ("AutoContrast", "Equalize", "Invert", "Posterize", "Solarize", "SolarizeAdd")},
    # PIL blends in C float32 and truncates, and so does the op (identical on these photos); a product that
    # lands on an integer may still truncate to either side where a compiler fuses the multiply-add: 1 level.
    **{name: (1, 0.0) for name in ENHANCE},
    # Nearest pixel with PIL's pixel centres: identical but for points within about 1e-4 of a pixel edge, which
    # PIL's 16.16 fixed-point rotation puts on the other side (at most 0.04% of these photos' pixels). A point
    # exactly on an edge may go either way: the magnitudes below avoid the arguments that put whole rows or
    # diagonals there (a shear of 0.36 at M = 12, 45 degrees at M = 15). Up to 0.2% of values.
    **{name: (1, 0.002) for name in GEOMETRIC},
}


def mismatch(ours, expected, atol):
    return float(np.mean(np.abs(ours.astype(np.int32) - expected.astype(np.int32)) > atol))


@pytest.mark.parametrize("name", [name for name in RANDAUGMENT_OPS if name != "Cutout"])
def test_each_op_is_its_pil_definition_on_photos(name):
    atol, fraction = TOLERANCE[name]
    for photo, image in photos().items():
        for magnitude in (0, 3, 7, 10, 13):  # 13: above the scale, extrapolated
            for seed in ([0, 0], [1, 0]):
                ours = apply_op(image, name, magnitude, tf.constant(seed, tf.int32)).numpy()
                assert ours.dtype == np.uint8 and ours.shape == image.shape
                # The sign of rotate, shear and translate is the seed's: compare with the nearer of the two.
                off = min(mismatch(ours, pil_op(name, image, magnitude, sign), atol) for sign in (1, -1))
                assert off <= fraction, (photo, magnitude, seed, off)


def test_the_forms_traced_for_xla_give_the_same_images_without_xla(monkeypatch):
    """Traced for XLA (`keras_vit.compat.in_xla_context()`), Rotate, the shears, the translations, AutoContrast, the
    blends and the random draws take other forms (tests/test_tf_xla.py compiles them). Run as plain TensorFlow
    they give the images the host's forms give on the photos, so they too are PIL's: the same seeds, signs and
    boxes, the same pixels."""
    seeds = [tf.constant(seed, tf.int32) for seed in ([0, 0], [1, 0], [4, 7], [5, 7])]  # 2 of either sign
    images = {}
    for xla in (False, True):
        monkeypatch.setattr(randaugment.compat, "in_xla_context", lambda xla=xla: xla)
        images[xla] = [
            apply_op(image, name, magnitude, seed).numpy()
            for name in RANDAUGMENT_OPS
            for image in photos().values()
            for magnitude in (3, 10, 13)
            for seed in seeds
        ]
    assert all(np.array_equal(host, xla) for host, xla in zip(images[False], images[True]))


def test_every_op_changes_every_photo_at_m_3():
    """The parity test above is not passed by doing nothing: at M = 3 every op changes every photo."""
    for name in RANDAUGMENT_OPS:
        for image in photos().values():
            assert not np.array_equal(apply_op(image, name, 3, tf.constant([0, 0])).numpy(), image), name


@pytest.mark.parametrize("name", SIGNED)
def test_the_sign_of_rotate_shear_and_translate_is_drawn_from_the_seed(name):
    image = photos()["chelsea"]
    plus, minus = pil_op(name, image, 3, 1), pil_op(name, image, 3, -1)
    assert mismatch(plus, minus, 1) > 0.5  # the two signs are far apart
    signs = []
    for seed in range(40):
        ours = apply_op(image, name, 3, tf.constant([seed, 3])).numpy()
        signs.append(mismatch(ours, plus, 1) < mismatch(ours, minus, 1))
        assert np.array_equal(ours, apply_op(image, name, 3, tf.constant([seed, 3])).numpy())
    # 40 fair coin flips: 20 +- 4.5 (the bound is 3 standard deviations either way).
    assert 7 <= sum(signs) <= 33, sum(signs)


def test_cutout_is_a_grey_square_of_side_2_int_40m_anywhere_in_the_image():
    image = np.where(photos()["coffee"] == 128, 127, photos()["coffee"]).astype(np.uint8)  # no grey 128 of its own
    height, width = image.shape[:2]
    side = 2 * int(0.3 * 40)  # M = 3: 24 pixels
    boxes = set()
    for seed in range(30):
        ours = apply_op(image, "Cutout", 3, tf.constant([seed, 5])).numpy()
        grey = np.all(ours == 128, axis=-1)
        rows, columns = np.flatnonzero(grey.any(axis=1)), np.flatnonzero(grey.any(axis=0))
        top, bottom, left, right = rows[0], rows[-1] + 1, columns[0], columns[-1] + 1
        assert grey[top:bottom, left:right].all() and grey.sum() == (bottom - top) * (right - left)  # a rectangle
        outside = ~grey
        assert np.array_equal(ours[outside], image[outside])  # nothing else changes
        assert bottom - top <= side and right - left <= side
        if top > 0 and bottom < height:
            assert bottom - top == side  # cut by the border only
        if left > 0 and right < width:
            assert right - left == side
        boxes.add((top, left, bottom, right))
    assert len(boxes) >= 25  # the centre moves with the seed (uniform over 64 x 96 positions)
    assert np.array_equal(apply_op(image, "Cutout", 0, tf.constant([0, 5])).numpy(), image)
    assert np.all(apply_op(image, "Cutout", 30, tf.constant([0, 5])).numpy() == 128)  # a 240-pixel square


def test_magnitudes_where_the_reference_leaves_the_image_as_it_is():
    image = photos()["astronaut"]
    seed = tf.constant([4, 4])
    identity = {
        0: ("Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY", "Cutout", "SolarizeAdd"),
        5: ENHANCE,  # factor 1.8 * 0.5 + 0.1 = 1
        10: ("Solarize",),  # threshold 256: the reference's Solarize does nothing at M = 10
        20: ("Posterize",),  # 8 bits kept
        30: ("Posterize", "Solarize"),  # clamped at 8 bits, at threshold 256
    }
    for magnitude, names in identity.items():
        for name in names:
            assert np.array_equal(apply_op(image, name, magnitude, seed).numpy(), image), (name, magnitude)
    # Not the identity at M = 0: the enhance ops blend at factor 0.1, Solarize inverts all, Posterize keeps 0 bits.
    assert np.all(apply_op(image, "Posterize", 0, seed).numpy() == 0)
    assert np.array_equal(apply_op(image, "Solarize", 0, seed).numpy(), 255 - image)
    assert np.array_equal(apply_op(image, "Brightness", 0, seed).numpy(), pil_op("Brightness", image, 0))
    # Below 0 counts as 0.
    for name in RANDAUGMENT_OPS:
        assert np.array_equal(apply_op(image, name, -4, seed).numpy(), apply_op(image, name, 0, seed).numpy())


def test_rand_augment_applies_the_drawn_ops_in_turn():
    image = photos()["chelsea"][:32, :40]
    for seed in range(24):
        seed = tf.constant([seed, 11])
        indices, seeds = draw_ops(seed, 2)
        expected = image
        for index, op_seed in zip(indices.numpy(), seeds):
            expected = apply_op(expected, RANDAUGMENT_OPS[index], 10.0, op_seed)
        np.testing.assert_array_equal(rand_augment(image, seed, 2, 10.0).numpy(), expected.numpy())
    assert np.array_equal(rand_augment(image, tf.constant([1, 2]), 0).numpy(), image)


def test_the_same_seed_gives_the_same_image_and_other_seeds_other_images_in_a_tf_data_map():
    image = photos()["coffee"]
    seeds = tf.stack([tf.range(12), tf.fill([12], 9)], axis=1)
    # M = 3: at M = 10 a 100-pixel translation or an 80-pixel Cutout greys most of a 96 x 64 image.
    dataset = tf.data.Dataset.from_tensor_slices(seeds).map(lambda seed: (rand_augment(image, seed, 2, 3.0), seed))
    outputs = []
    for augmented, seed in dataset:  # graph mode, one seed per example
        eager = rand_augment(image, seed, 2, 3.0).numpy()
        np.testing.assert_array_equal(augmented.numpy(), eager)
        outputs.append(eager.tobytes())
    again = [augmented.numpy().tobytes() for augmented, _ in dataset]
    assert again == outputs
    # 12 seeds, 2 of 16 ops each with random signs: a collision needs the same ops (or two that do nothing).
    assert len(set(outputs)) >= 10


@functools.cache
def traced_policy():
    """RandAugment(2, 10) traced once for images of any size (a trace takes seconds: 32 branches)."""
    return tf.function(
        lambda image, seed: rand_augment(image, seed, 2, 10.0),
        input_signature=[tf.TensorSpec([None, None, 3], tf.uint8), tf.TensorSpec([2], tf.int32)],
    )


def test_images_of_any_size_in_a_traced_function():
    for image in photos().values():
        for seed in range(4):
            seed = tf.constant([seed, 1])
            ours = traced_policy()(image, seed)
            assert ours.dtype == tf.uint8 and ours.shape == image.shape
            np.testing.assert_array_equal(ours.numpy(), rand_augment(image, seed, 2, 10.0).numpy())


def test_each_op_is_drawn_one_time_in_16():
    """3,200 images through the real policy in a tf.data map, the ops replaced by stubs that write their index."""
    index_of = {name: i for i, name in enumerate(RANDAUGMENT_OPS)}

    def stub(image, name, magnitude, seed):
        return image * 16 + index_of[name]  # after two draws: first * 16 + second

    images = 3_200
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(randaugment, "apply_op", stub)
        seeds = tf.data.Dataset.range(images).map(lambda i: tf.stack([tf.cast(i, tf.int32), 17]))
        dataset = seeds.map(lambda seed: rand_augment(tf.zeros([1, 1, 3], tf.uint8), seed, 2, 10.0)[0, 0, 0])
        codes = np.fromiter((int(code) for code in dataset.batch(images).get_single_element()), np.int64)
    first, second = codes // 16, codes % 16
    draws = np.concatenate([first, second])
    counts = np.bincount(draws, minlength=16)
    # 6,400 draws, each op with p = 1/16: 400 +- 19.4 (binomial); 5 standard deviations either way.
    assert counts.sum() == 6_400 and np.all(np.abs(counts - 400) <= 97), counts
    # The two draws of an image are independent: the same op twice 1 time in 16 (200 +- 13.7).
    assert abs(np.sum(first == second) - 200) <= 69, np.sum(first == second)


def test_only_the_drawn_op_is_computed():
    """The traced policy holds one switch per draw, whose 16 branches are the ops; the op-specific kernels
    (the projective transform, the smoothing convolution, the histogram, the grey-scale product, the random
    draws of sign and position) live only inside the branches, each in the ops that need it."""
    graph = traced_policy().get_concrete_function().graph.as_graph_def()
    functions = {function.signature.name: function for function in graph.library.function}
    switches = [node for node in graph.node if node.op in ("Case", "StatelessCase")]
    assert len(switches) == 2
    kernels_of = {
        "ImageProjectiveTransformV3": ["Rotate", "ShearX", "ShearY"],
        "DepthwiseConv2dNative": ["Sharpness"],
        "Bincount": ["Equalize"],
        "MatMul": ["Color", "Contrast"],
        "StatelessRandomUniformV2": ["Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY", "Cutout"],
    }
    outer = {node.op for node in graph.node}
    assert not outer & set(kernels_of), outer & set(kernels_of)
    for switch in switches:
        branches = [functions[branch.name] for branch in switch.attr["branches"].list.func]
        assert len(branches) == len(RANDAUGMENT_OPS)
        kernels = [{node.op.replace("DenseBincount", "Bincount") for node in branch.node_def} for branch in branches]
        for kernel, ops in kernels_of.items():
            assert [name for name, used in zip(RANDAUGMENT_OPS, kernels) if kernel in used] == ops, kernel


def test_bad_arguments():
    image = photos()["chelsea"]
    with pytest.raises(ValueError, match="Unknown RandAugment op 'Identity'"):
        apply_op(image, "Identity", 5, tf.constant([0, 0]))
    with pytest.raises(ValueError, match="uint8"):
        apply_op(image.astype(np.float32), "Invert", 5, tf.constant([0, 0]))
    with pytest.raises(ValueError, match="num_ops"):
        rand_augment(image, tf.constant([0, 0]), -1)
    with pytest.raises(ValueError, match="magnitude"):
        rand_augment(image, tf.constant([0, 0]), 2, tf.constant(9.0))  # a Python number: the arguments are Python's
    with pytest.raises(ValueError, match="magnitude"):
        apply_op(image, "Rotate", float("nan"), tf.constant([0, 0]))
