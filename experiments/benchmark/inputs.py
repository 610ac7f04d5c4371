"""`--mode=input`: images per second this host's training input pipeline delivers.

`keras_vit.data.training_pipeline`, what the ImageNet recipe's job feeds
`fit`: JPEG bytes read, decoded inside the sampled Inception crop, flipped,
optionally augmented, batched as uint8 images, in up to three forms measured
in one run:

- `crop_flip`: decode, Inception crop, flip;
- `keras_vit`: the same with keras_vit's RandAugment(NUM_OPS, MAGNITUDE);
- `model_garden`: the same with TF Model Garden's RandAugment at the same
  setting (`official.vision.ops.augment.RandAugment(...).distort`), plugged in
  through `training_pipeline(randaugment=callable)`, where `official` imports.

The forms take turns (crop_flip, keras_vit, model_garden, crop_flip, ...), each
turn in a fresh iterator (only one pipeline's threads at work at a time) that
first delivers untimed batches to reach its steady state; the figures are the
medians over the turns: images/s of the host, CPU seconds per image (this
process's, all of tf.data's threads), cores kept busy, and from them the cores
a form needs per 1,000 images/s, the ratio keras_vit / model_garden and the
cost RandAugment adds to decode + crop + flip. Compare the rate with
`--mode=train` at the same image size: the slower of the two sets the pace.
"""

import math
import os
import statistics
import tempfile
import time

import numpy as np

from experiments.benchmark.timing import machine_name

# The forms' names, in the order they take turns, and what the first computes.
BASE = "crop_flip"
BASE_WHAT = "decode, Inception crop, flip"
OURS = "keras_vit"
PEER = "model_garden"
# scikit-image's colour photographs (bundled with it, no download) that `write_photo_folder` crops.
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina")


def write_synthetic_folder(root, count, size, seed=0):
    """`count` JPEGs (quality 90) of `size` (width, height) in two class folders: smooth gradients
    and noise, which encode to about 100 KB at 500x375, as ImageNet's photos do."""
    import tensorflow as tf

    width, height = size
    rng = np.random.default_rng(seed)
    rows, columns = np.mgrid[0:height, 0:width]
    for i in range(count):
        folder = os.path.join(root, f"class{i % 2}")
        os.makedirs(folder, exist_ok=True)
        base = np.stack([columns * (i % 7 + 1), rows * (i % 5 + 1), columns + rows + 20 * i], -1) % 256
        image = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
        with open(os.path.join(folder, f"{i}.jpg"), "wb") as f:
            f.write(tf.io.encode_jpeg(image, quality=90).numpy())
    return root


def write_photo_folder(root, count, size, seed=0):
    """`count` JPEGs (quality 90) cut from scikit-image's photographs (`PHOTOS`) in two class folders:
    each a random crop (a third of the photo's area or more, the aspect of `size`) resized to `size`
    (width, height), every fourth one turned to portrait, some mirrored. Real photos, so that the
    decoder and the augmentation see what ImageNet's JPEGs hold."""
    try:
        import skimage.data
    except ImportError:
        raise SystemExit(
            "--synthetic=photos cuts its JPEGs from scikit-image's photographs: `pip install scikit-image`, "
            "or --synthetic=gradients."
        ) from None
    import tensorflow as tf

    photos = [getattr(skimage.data, name)() for name in PHOTOS]
    rng = np.random.default_rng(seed)
    for i in range(count):
        photo = photos[i % len(photos)]
        width, height = size if i % 4 else size[::-1]
        # A crop of the output's aspect, of at least a third of the photo's area where the photo allows.
        scale = min(photo.shape[0] / height, photo.shape[1] / width) * np.sqrt(rng.uniform(1 / 3, 1))
        crop_height, crop_width = max(1, round(height * scale)), max(1, round(width * scale))
        top = rng.integers(0, photo.shape[0] - crop_height + 1)
        left = rng.integers(0, photo.shape[1] - crop_width + 1)
        crop = photo[top : top + crop_height, left : left + crop_width]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        image = tf.image.resize(crop, (height, width), antialias=True)
        image = tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)
        folder = os.path.join(root, f"class{i % 2}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{i}.jpg"), "wb") as f:
            f.write(tf.io.encode_jpeg(image, quality=90).numpy())
    return root


def usable_cores():
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def model_garden_randaugment(num_ops, magnitude):
    """(TF Model Garden's RandAugment(num_ops, magnitude) as a `training_pipeline(randaugment=...)`
    callable, None); (None, why it is not measured) where `official` does not import."""
    try:
        from official.vision.ops import augment
    except ImportError as error:  # Model Garden's own imports (tf_keras, gin, ...) included.
        return None, (
            f"Model Garden's RandAugment not measured: `from official.vision.ops import augment` failed ({error}). "
            "docs/performance.md says how to install it beside keras_vit."
        )
    policy = augment.RandAugment(num_layers=num_ops, magnitude=magnitude)

    def distort(image, seed):
        del seed  # Model Garden draws with TensorFlow's stateful random ops.
        return policy.distort(image)

    return distort, None


def time_turns(pipelines, batches_per_turn, warmup_batches, repeats, first_turn_batches=0):
    """{name: [(seconds, CPU seconds) of each timed turn]} of `pipelines` ({name: an iterable of
    batches}), which take turns in their order, `repeats` timed turns each.

    Each turn opens a fresh iterator (the previous one's threads are gone: no pipeline works in
    another's time, none starts its turn with batches made in another's), takes `warmup_batches`
    untimed to reach its steady state, then times `batches_per_turn`. Before the timed turns, each
    pipeline has one untimed turn of `first_turn_batches` (reading the files once, the first calls'
    set-up).
    """
    timings = {name: [] for name in pipelines}
    for turn in range(-1, repeats):
        for name, pipeline in pipelines.items():
            batches = iter(pipeline)
            for _ in range(warmup_batches + (first_turn_batches if turn < 0 else 0)):
                next(batches)
            if turn >= 0:
                start, cpu = time.perf_counter(), time.process_time()
                for _ in range(batches_per_turn):
                    next(batches)
                timings[name].append((time.perf_counter() - start, time.process_time() - cpu))
            del batches  # Its threads stop before the next pipeline's turn.
    return timings


def summarize(timings, images_per_turn, cores):
    """The figures and ratios of a row from `time_turns`' timings of `images_per_turn` images a turn
    on a host of `cores` cores: per form the median images/s, images/s per core of the host, CPU
    seconds per image, busy cores and cores needed per 1,000 images/s (from the CPU time); with
    `OURS` and `BASE`, the cost RandAugment adds to decode + crop + flip, (1/ours - 1/base) / (1/base),
    the ratios ours / each other form's images/s, and both again in CPU time per image."""
    rate, per_core, cpu_per_image, busy, needed = {}, {}, {}, {}, {}
    for name, turns in timings.items():
        rate[name] = statistics.median(images_per_turn / seconds for seconds, _ in turns)
        per_core[name] = rate[name] / cores
        cpu_per_image[name] = statistics.median(cpu / images_per_turn for _, cpu in turns)
        busy[name] = statistics.median(cpu / seconds for seconds, cpu in turns)
        needed[name] = 1000 * cpu_per_image[name]
    figures = {
        "images_per_second": rate,
        "images_per_second_per_core": per_core,
        "cpu_seconds_per_image": cpu_per_image,
        "busy_cores": busy,
        "cores_per_1000_images_per_second": needed,
        "cores": cores,
    }
    ratios = {}
    if OURS in rate:
        figures["ours"] = OURS
        ratios = {name: {"ratio": rate[OURS] / rate[name], "against": name} for name in rate if name != OURS}
        # The same comparisons in CPU time, which other jobs on a shared machine disturb less than the rates.
        figures["cpu_time_ratios"] = {name: cpu_per_image[name] / cpu_per_image[OURS] for name in ratios}
        if BASE in rate:
            figures["randaugment_added_cost"] = (1 / rate[OURS] - 1 / rate[BASE]) * rate[BASE]
            figures["randaugment_added_cpu_time"] = cpu_per_image[OURS] / cpu_per_image[BASE] - 1
    return figures, ratios


def input_figures(source, image_size, batch_size, forms, repeats, images_per_repeat, what, note="", cache=False):
    """Measures and prints the training input pipeline's images/s in each of `forms` ({name: the
    `randaugment` argument of `training_pipeline`}) on `source`, with the encoded bytes kept in memory
    after the first pass where `cache`; returns {"figures", "ratios"} of a row."""
    from keras_vit import data as vit_data

    pipelines = {
        name: vit_data.training_pipeline(source, image_size, batch_size, randaugment=randaugment, cache=cache)
        for name, randaugment in forms.items()
    }
    per_turn = math.ceil(images_per_repeat / batch_size)
    load = os.getloadavg()[0]
    timings = time_turns(
        pipelines, per_turn, warmup_batches=max(2, per_turn // 4), repeats=repeats,
        # A pass over the files (the cache filled), or over what the timed turns read of a large set.
        first_turn_batches=math.ceil(min(source.num_train, 4 * per_turn * batch_size) / batch_size),
    )  # fmt: skip
    cores = usable_cores()
    figures, ratios = summarize(timings, per_turn * batch_size, cores)
    figures["load_average"] = [load, os.getloadavg()[0]]
    print(
        f"Input pipeline at {image_size} px, batch {batch_size}, on {machine_name()} ({what}): JPEG bytes "
        f"{'cached in memory' if cache else 'read from the files'}, {BASE_WHAT}, uint8 batches; the forms in "
        f"turns, median of {repeats} turns of {per_turn * batch_size} images each after a warm-up; CPU time: "
        "this process's"
    )
    print(f"  Load average (1 min) {load:.2f} before, {figures['load_average'][1]:.2f} after, on {cores} cores")
    print(f"  {'form':<58}{'images/s':>10}{'per core':>10}{'CPU ms/image':>14}{'busy cores':>12}{'cores/1k/s':>12}")
    setting = next((value for value in forms.values() if isinstance(value, tuple)), None)
    for name, randaugment in forms.items():
        cpu_ms = 1000 * figures["cpu_seconds_per_image"][name]
        print(
            f"  {describe(name, randaugment, setting):<58}{figures['images_per_second'][name]:>10.1f}"
            f"{figures['images_per_second_per_core'][name]:>10.1f}{cpu_ms:>14.2f}"
            f"{figures['busy_cores'][name]:>12.2f}{figures['cores_per_1000_images_per_second'][name]:>12.1f}"
        )
    for name, ratio in ratios.items():
        print(
            f"  {OURS} / {name}: {ratio['ratio']:.2f}x images/s, {figures['cpu_time_ratios'][name]:.2f}x images "
            "per CPU second"
        )
    if "randaugment_added_cost" in figures:
        print(
            f"  RandAugment adds {100 * figures['randaugment_added_cost']:.0f}% to the time of {BASE_WHAT} "
            f"({100 * figures['randaugment_added_cpu_time']:.0f}% to its CPU time)"
        )
    if note:
        print(f"  {note}")
        figures["not_measured"] = note
    if source.skipped.count:
        print(f"  {source.skipped.count} image(s) skipped: failed to decode, e.g. {source.skipped.paths[:3]}")
    print(f"  Compare: --mode=train --image_size={image_size} gives the model's images/s on this host.")
    figures.update(data=what, cached=cache, skipped_images=source.skipped.count)
    measured = {"figures": figures, "ratios": ratios}
    if PEER in forms:
        measured["versions"] = peer_versions()
    return measured


def peer_versions():
    """{distribution: version} of Model Garden and its Keras, where installed."""
    import importlib.metadata

    versions = {}
    for name in ("tf-models-nightly", "tf-models-official", "tf-keras"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def describe(name, randaugment, setting):
    """What the form `name` computes, for the report; `setting`: the (num_ops, magnitude) of the run."""
    if randaugment is None:
        return BASE_WHAT
    setting = tuple(randaugment) if isinstance(randaugment, tuple) else setting
    return f"+ {'Model Garden' if name == PEER else name}'s RandAugment{setting or ''}"


def input_rate(source, image_size, batch_size, randaugment, repeats, images_per_repeat, what):
    """Measures and prints the training input pipeline's images/s with `randaugment` (None, (num_ops,
    magnitude) or a callable); returns the median."""
    forms = {OURS if randaugment else BASE: tuple(randaugment) if isinstance(randaugment, list) else randaugment}
    measured = input_figures(source, image_size, batch_size, forms, repeats, images_per_repeat, what)
    return next(iter(measured["figures"]["images_per_second"].values()))


def input_benchmark(
    image_size, batch_size, repeats, data="", data_dir="", synthetic="photos", synthetic_images=512,
    synthetic_size="500x375", randaugment=(2, 10), model_garden=True, input_images=1024,
):  # fmt: skip
    """The training input pipeline on `data` (a folder, local or gs://, or tfds:NAME[:SPLIT]), else on
    `synthetic_images` JPEGs of `synthetic_size` (WIDTHxHEIGHT) written to a temporary folder, cut
    from scikit-image's photos (`synthetic="photos"`) or drawn (`"gradients"`): decode + crop + flip,
    with keras_vit's `randaugment` (NUM_OPS, MAGNITUDE; empty: not measured) and, with
    `model_garden`, Model Garden's at the same setting where it imports. Prints and returns
    {"figures", "ratios"}."""
    from keras_vit import data as vit_data

    if randaugment and len(randaugment) != 2:
        raise SystemExit(f"--randaugment takes NUM_OPS,MAGNITUDE. Received: {list(randaugment)}")
    forms = {BASE: None}
    note = ""
    if randaugment:
        num_ops, magnitude = int(randaugment[0]), float(randaugment[1])
        magnitude = int(magnitude) if magnitude.is_integer() else magnitude
        forms[OURS] = (num_ops, magnitude)
        if model_garden:
            peer, note = model_garden_randaugment(num_ops, magnitude)
            if peer is not None:
                forms[PEER] = peer
    written = not data
    with tempfile.TemporaryDirectory() as tmp:
        if data.startswith("tfds:"):
            what = data
        else:
            if not data:
                size = tuple(int(v) for v in synthetic_size.lower().split("x"))
                write = write_photo_folder if synthetic == "photos" else write_synthetic_folder
                data = write(tmp, synthetic_images, size)
                kind = "JPEGs cut from scikit-image's photos" if synthetic == "photos" else "synthetic JPEGs"
                what = f"{synthetic_images} {synthetic_size} {kind}"
            else:
                what = f"folder {data}"
            data = f"folder:{data}"
        source = vit_data.load_image_source(data, data_dir=data_dir or None, test_fraction=0.1)
        # The synthetic folder's bytes are kept in memory, as the ImageNet recipe keeps ImageNet's
        # (`config.cache`): the figures are then decoding and augmenting. A set of one's own is read from its
        # files (ImageNet's would not fit in memory here).
        return input_figures(source, image_size, batch_size, forms, repeats, input_images, what, note, cache=written)
