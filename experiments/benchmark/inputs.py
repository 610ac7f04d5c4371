"""`--mode=input`: images per second this host's training input pipeline delivers.

`keras_vit.data.training_pipeline`, what the job feeds `fit`: read, decode
with failures skipped, Inception crop, flip, optional RandAugment, uint8
batches; with the CPU time per image and how many cores were busy, the median
of several repetitions after a warm-up pass. Compare its rate with
`--mode=train` at the same image size: the slower of the two sets the pace.
"""

import os
import statistics
import tempfile
import time

import numpy as np

from experiments.benchmark.timing import machine_name


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


def usable_cores():
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def input_figures(source, image_size, batch_size, randaugment, repeats, images_per_repeat, what):
    """Measures and prints the training input pipeline's images/s; returns {"figures": ...} for a row."""
    from keras_vit import data as vit_data

    ds = vit_data.training_pipeline(source, image_size, batch_size, randaugment=randaugment)
    batches = iter(ds)
    per_repeat = -(-images_per_repeat // batch_size)
    for _ in range(-(-source.num_train // batch_size)):  # Warm-up: a pass over the files.
        next(batches)
    rates, cpu_per_image, busy = [], [], []
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(per_repeat):
            next(batches)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
        rates.append(per_repeat * batch_size / seconds)
        cpu_per_image.append(cpu_seconds / (per_repeat * batch_size))
        busy.append(cpu_seconds / seconds)
    cores = usable_cores()
    rate = statistics.median(rates)
    augment = "Inception crop, flip" + (f", RandAugment{tuple(randaugment)}" if randaugment else "")
    print(
        f"Input pipeline ({what}; read, decode, {augment}) at {image_size} px, batch {batch_size}, "
        f"on {machine_name()}: median of {repeats} repetitions of {per_repeat * batch_size} images after a "
        "warm-up pass"
    )
    print(
        f"  {rate:.1f} images/s per host, {1000 * statistics.median(cpu_per_image):.2f} ms of CPU per image, "
        f"{statistics.median(busy):.1f} of {cores} cores busy (tf.data AUTOTUNE: parallel calls up to "
        f"{cores} per map)"
    )
    if source.skipped.count:
        print(f"  {source.skipped.count} image(s) skipped: failed to decode, e.g. {source.skipped.paths[:3]}")
    print(f"  Compare: --mode=train --image_size={image_size} gives the model's images/s on this host.")
    figures = {
        "images_per_second": rate,
        "cpu_seconds_per_image": statistics.median(cpu_per_image),
        "busy_cores": statistics.median(busy),
        "cores": cores,
        "data": what,
        "skipped_images": source.skipped.count,
    }
    return {"figures": figures, "ratios": {}}


def input_rate(source, image_size, batch_size, randaugment, repeats, images_per_repeat, what):
    """Measures and prints the training input pipeline's images/s; returns the median."""
    figures = input_figures(source, image_size, batch_size, randaugment, repeats, images_per_repeat, what)
    return figures["figures"]["images_per_second"]


def input_benchmark(
    image_size, batch_size, repeats, data="", data_dir="", synthetic_images=512, synthetic_size="500x375",
    randaugment=(), input_images=1024,
):  # fmt: skip
    """The input pipeline on `data` (a folder, local or gs://, or tfds:NAME[:SPLIT]), else on
    `synthetic_images` JPEGs of `synthetic_size` (WIDTHxHEIGHT) written to a temporary folder;
    `randaugment`: (NUM_OPS, MAGNITUDE) or empty. Prints and returns {"figures": ...}."""
    from keras_vit import data as vit_data

    if randaugment and len(randaugment) != 2:
        raise SystemExit(f"--randaugment takes NUM_OPS,MAGNITUDE. Received: {list(randaugment)}")
    randaugment = tuple(int(v) for v in randaugment) or None
    with tempfile.TemporaryDirectory() as tmp:
        if data.startswith("tfds:"):
            what = data
        else:
            if not data:
                size = tuple(int(v) for v in synthetic_size.lower().split("x"))
                data = write_synthetic_folder(tmp, synthetic_images, size)
                what = f"{synthetic_images} synthetic {synthetic_size} JPEGs"
            else:
                what = f"folder {data}"
            data = f"folder:{data}"
        source = vit_data.load_image_source(data, data_dir=data_dir or None, test_fraction=0.1)
        return input_figures(source, image_size, batch_size, randaugment, repeats, input_images, what)
