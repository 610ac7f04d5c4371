r"""The ViT against a small ResNet as the training set grows.

    python -m experiments.scaling --workdir=runs/scaling
    python -m experiments.scaling --config=experiments/configs/scaling.py \
        --config.seeds="(0, 1)" --config.steps=200 --workdir=runs/scaling

Both models are trained on growing stratified fractions of one training split
(`config.fractions`, nested: each subset holds the smaller ones of its seed),
with the same preprocessing, recipe and budget: `config.steps` optimizer
steps of `config.batch_size` images whatever the subset's size, so each point
costs the same compute and a small subset is seen over more epochs.  Every
run is tested once, after its last step, on the whole held-out split, which
never shrinks and chooses nothing (no early stopping, no best epoch).

Writes into --workdir: `scaling.json` (the config, and per model and size
the test accuracy of each seed, their mean and standard deviation, the
accuracy on the run's own training images and its time), `scaling.md` (the
table) and `scaling.png` (test accuracy against training-set size, log x,
one standard deviation as error bars); prints the table and where the mean
curves cross, or that they do not within the range.

The helpers here (data in memory, stratified subsets, a compiled model
trained again from given weights) serve `experiments.transfer` as well.
"""

import json
import math
import time

import keras
import numpy as np
import tensorflow as tf
from absl import app, flags, logging
from ml_collections import config_flags

import keras_vit
from keras_vit import data as vit_data
from keras_vit import training, visualize
from keras_vit.variants import to_pair

from experiments import baselines

# === Data ===


def load_in_memory(config):
    """The train and test splits of config.dataset as uint8 arrays (`keras_vit.data.Dataset`).

    The digits are in memory already.  A `folder:` or `tfds:` data set is
    read whole, each image resized and centre-cropped to config.image_size
    as the training job evaluates them (`keras_vit.data.center_crop_resize`):
    the experiments here are about small training sets.
    """
    if config.dataset == "digits":
        return vit_data.load_digits(image_size=config.image_size, test_fraction=config.test_fraction, seed=config.seed)
    source = vit_data.load_image_source(
        config.dataset,
        data_dir=config.data_dir or None,
        test_split=config.test_split or None,
        test_fraction=config.test_fraction,
        seed=config.seed,
    )
    size = to_pair(config.image_size, "image_size")

    def to_arrays(pairs):
        pairs = pairs.map(lambda x, y: (vit_data.center_crop_resize(x, size, config.crop_fraction), y)).batch(256)
        images, labels = zip(*((x.numpy(), y.numpy()) for x, y in pairs))
        return vit_data.Split(np.concatenate(images), np.concatenate(labels).astype(np.int32))

    dataset = vit_data.Dataset(to_arrays(source.train), to_arrays(source.test), source.num_classes, source.class_names)
    if source.skipped.count:
        logging.warning("Skipped %d images that failed to decode: %s", source.skipped.count, source.skipped.paths[:10])
    return dataset


def stratified_subset(labels, seed, *, fraction=None, per_class=None):
    """Indices of a class-stratified subset: `fraction` of each class (at least one) or `per_class` of each.

    Each class's examples are put in a random order drawn from `seed` alone,
    and the first ones are taken, so for one seed a smaller subset is part of
    every larger one.  The indices come back sorted.
    """
    if (fraction is None) == (per_class is None):
        raise ValueError(
            f"Give one of `fraction` and `per_class`. Received: fraction={fraction!r}, per_class={per_class!r}"
        )
    if fraction is not None and not 0.0 < fraction <= 1.0:
        raise ValueError(f"`fraction` must be in (0, 1]. Received: fraction={fraction!r}")
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    chosen = []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        count = max(1, round(fraction * len(members))) if fraction is not None else per_class
        if count > len(members):
            raise ValueError(
                f"Class {label} has {len(members)} examples; {count} were asked for (per_class={per_class})."
            )
        chosen.append(members[:count])
    return np.sort(np.concatenate(chosen))


def take(split, indices, labels=None):
    """The examples of `split` at `indices`, with their labels mapped through `labels` (a dict) if given."""
    targets = split.labels[indices]
    if labels is not None:
        targets = np.array([labels[int(y)] for y in targets], np.int32)
    return vit_data.Split(split.images[indices], targets)


# === Training runs ===


def build_vit(config, num_classes):
    """The ViT of config.model for `num_classes`."""
    model = dict(config.model)
    return keras_vit.build_vit(model.pop("variant"), image_size=config.image_size, num_classes=num_classes, **model)


def make_optimizer(config, steps, warmup_steps, recipe=None):
    """`keras_vit.training.make_optimizer` for `steps` steps, with the optimizer, learning rate and weight decay
    of `recipe` (by default config's), config's decay and clipping."""
    recipe = recipe or config
    return training.make_optimizer(
        recipe.optimizer,
        recipe.learning_rate,
        steps,
        min(warmup_steps, steps - 1),
        weight_decay=recipe.weight_decay,
        decay=config.decay,
        grad_clip_norm=config.grad_clip_norm,
    )


def accuracy(model, split, batch_size):
    """Top-1 accuracy of `model` on every example of `split`, in inference mode.

    The images are padded to whole batches, so that every split is
    predicted in batches of one shape: one trace of the predict step.
    """
    padding = -len(split) % batch_size
    images = np.concatenate([split.images, np.zeros((padding, *split.images.shape[1:]), split.images.dtype)])
    logits = model.predict(images, batch_size=batch_size, verbose=0)[: len(split)]
    return float(np.mean(np.argmax(logits, axis=-1) == split.labels))


def train_runs(make_model, runs, test, *, config, steps, warmup_steps, batch_size, num_classes, recipe=None):
    """Trains a model from `make_model()` for each (seed, training split) of `runs`; yields each result.

    Each run starts from the model `make_model()` builds after
    `keras.utils.set_random_seed(seed)`, and from a fresh optimizer state.
    The model is compiled once and its variables are set to the new model's
    for each later run, so that the training step is traced (and compiled by
    XLA) once for all the runs, not once per run.  Training draws batches of
    `batch_size` from the split, shuffled with `seed` and augmented with
    config.max_shift, for `steps` steps; then the test split is evaluated
    once.  Yields dicts of `test_accuracy`, `train_accuracy` (on the run's own
    training images, unaugmented) and `seconds` (training and evaluation),
    with the trained model: (model, result).
    """
    model = None
    for seed, train in runs:
        if batch_size > len(train):
            raise ValueError(
                f"A training set of {len(train)} examples is smaller than one batch of {batch_size}; "
                "use a smaller batch_size or larger fractions."
            )
        keras.utils.set_random_seed(seed)
        fresh = make_model()
        if model is None:
            model = fresh
            model.compile(
                optimizer=make_optimizer(config, steps, warmup_steps, recipe),
                loss=keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=config.label_smoothing),
                metrics=[keras.metrics.CategoricalAccuracy(name="accuracy")],
                jit_compile=training.resolve_jit_compile(config.jit_compile, config.precision),
            )
        else:
            # Weights, batch-norm statistics and the random generators' states (dropout).
            for variable, value in zip(model.variables, fresh.variables, strict=True):
                variable.assign(value)
            for variable in model.optimizer.variables:
                variable.assign(keras.ops.zeros_like(variable))
        start = time.perf_counter()
        batches = vit_data.make_pipeline(
            train, batch_size, training=True, num_classes=num_classes, seed=seed, max_shift=config.max_shift
        ).repeat()
        model.fit(batches, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0)
        result = {
            "test_accuracy": accuracy(model, test, batch_size),
            "train_accuracy": accuracy(model, train, batch_size),
        }
        result["seconds"] = time.perf_counter() - start
        yield model, result


def summarize(results):
    """Per-seed lists of each result's fields, and the mean and standard deviation (ddof=1) of test accuracy."""
    summary = {key: [r[key] for r in results] for key in results[0]}
    accuracies = np.array(summary["test_accuracy"])
    summary["mean"] = float(accuracies.mean())
    summary["std"] = float(accuracies.std(ddof=1)) if len(accuracies) > 1 else 0.0
    return summary


def markdown_table(header, rows):
    """A Markdown table of `header` and `rows` (lists of cells)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_outputs(workdir, name, results, table, figure):
    """Writes `name`.json, `name`.md and `name`.png into workdir; returns their paths."""
    tf.io.gfile.makedirs(workdir)
    paths = [tf.io.gfile.join(workdir, f"{name}.{ext}") for ext in ("json", "md", "png")]
    with tf.io.gfile.GFile(paths[0], "w") as f:
        json.dump(results, f, indent=2)
    with tf.io.gfile.GFile(paths[1], "w") as f:
        f.write(table + "\n")
    visualize.save_figure(figure, paths[2])
    return paths


# === Where the curves cross ===


def crossings(sizes, first, second):
    """Where curve `first` minus curve `second` changes sign, interpolated linearly in log(size).

    Args:
        sizes: increasing positive x values.
        first, second: the two curves' values at `sizes`.

    Returns:
        A list of (size, first_ahead) pairs, one per change of leader:
        `first_ahead` says whether `first` is above `second` after it.  A tie
        at a size between two different leaders is a crossing at that size;
        a tie with the same leader on both sides is none.
    """
    sizes, first, second = (np.asarray(values, np.float64) for values in (sizes, first, second))
    if not (sizes.ndim == 1 and sizes.shape == first.shape == second.shape):
        raise ValueError(
            f"Expected one value of each curve per size. Received: {len(sizes)} sizes, "
            f"{len(first)} and {len(second)} values."
        )
    if np.any(sizes <= 0) or np.any(np.diff(sizes) <= 0):
        raise ValueError(f"`sizes` must be positive and increasing. Received: sizes={sizes.tolist()}")
    difference = first - second
    leaders = np.flatnonzero(difference)  # The sizes where one curve is strictly above.
    found = []
    for before, after in zip(leaders[:-1], leaders[1:]):
        if np.sign(difference[before]) == np.sign(difference[after]):
            continue
        if after > before + 1:  # Tied in between: the first tie is where the lead changes.
            size = sizes[before + 1]
        else:
            d0, d1 = difference[before], difference[after]
            log_size = math.log(sizes[before]) + (math.log(sizes[after]) - math.log(sizes[before])) * d0 / (d0 - d1)
            size = math.exp(log_size)
        found.append((float(size), bool(difference[after] > 0)))
    return found


def describe_crossings(sizes, curves):
    """A sentence on where the two named curves ({name: values}) cross, or who leads over the whole range."""
    (first, a), (second, b) = curves.items()
    found = crossings(sizes, a, b)
    if found:
        return "; ".join(
            f"{first if ahead else second} overtakes {second if ahead else first} at about {size:.0f} training examples"
            for size, ahead in found
        ) + "."
    difference = np.asarray(a) - np.asarray(b)
    if not difference.any():
        return f"{first} and {second} tie at every size from {sizes[0]} to {sizes[-1]}."
    leader, other = (first, second) if difference.sum() > 0 else (second, first)
    gaps = np.abs(difference) * 100
    return (
        f"The curves do not cross between {sizes[0]} and {sizes[-1]} training examples: {leader} is ahead of "
        f"{other} (or tied) at every size, by {gaps.min():.1f} to {gaps.max():.1f} points."
    )


# === The experiment ===


def run(config, workdir):
    """Trains both models at every size and seed; writes scaling.json, .md and .png; returns the results."""
    fractions = sorted(float(f) for f in config.fractions)
    seeds = [int(s) for s in config.seeds]
    if not fractions or not seeds:
        raise ValueError(f"Expected fractions and seeds. Received: fractions={fractions}, seeds={seeds}")
    dataset = load_in_memory(config)
    num_classes = dataset.num_classes
    # The same subsets for both models: seed -> fraction -> indices.
    subsets = {
        seed: {f: stratified_subset(dataset.train.labels, seed, fraction=f) for f in fractions} for seed in seeds
    }
    sizes = [len(subsets[seeds[0]][f]) for f in fractions]
    keras.mixed_precision.set_global_policy(config.precision)
    models = {
        "ViT": lambda: build_vit(config, num_classes),
        "ResNet": lambda: baselines.build_resnet(
            config.image_size, num_classes,
            widths=tuple(config.cnn.widths), blocks_per_stage=config.cnn.blocks_per_stage,
        ),
    }
    results = {
        "config": config.to_dict(),
        "dataset": {
            "name": config.dataset,
            "num_train": len(dataset.train),
            "num_test": len(dataset.test),
            "num_classes": num_classes,
        },
        "budget": {
            "steps": config.steps, "batch_size": config.batch_size, "examples_seen": config.steps * config.batch_size
        },
        "fractions": fractions,
        "sizes": sizes,
        "seeds": seeds,
        "models": {},
    }
    for name, make_model in models.items():
        runs = [(seed, take(dataset.train, subsets[seed][f])) for f in fractions for seed in seeds]
        per_run = []
        for (seed, train), (model, result) in zip(
            runs,
            train_runs(
                make_model, runs, dataset.test, config=config, steps=config.steps,
                warmup_steps=config.warmup_steps, batch_size=config.batch_size, num_classes=num_classes,
            ),
        ):
            per_run.append(result)
            print(
                f"{name} {len(train)} examples, seed {seed}: test {result['test_accuracy']:.3f}, "
                f"train {result['train_accuracy']:.3f} ({result['seconds']:.0f} s)",
                flush=True,
            )
        points = [per_run[i * len(seeds):(i + 1) * len(seeds)] for i in range(len(fractions))]
        results["models"][name] = {
            "parameters": int(model.count_params()),
            "points": [
                {"fraction": f, "size": size, "epochs": config.steps * config.batch_size / size, **summarize(point)}
                for f, size, point in zip(fractions, sizes, points)
            ],
        }
        keras.backend.clear_session()
    means = {name: [p["mean"] for p in model["points"]] for name, model in results["models"].items()}
    results["crossings"] = [{"size": s, "vit_ahead_after": ahead} for s, ahead in crossings(sizes, *means.values())]
    results["summary"] = describe_crossings(sizes, means)

    header = ["training examples", "epochs"] + [
        f"{name} ({model['parameters']:,} params)" for name, model in results["models"].items()
    ]
    rows = [
        [size, f"{config.steps * config.batch_size / size:.0f}"]
        + [f"{m['points'][i]['mean']:.3f} ± {m['points'][i]['std']:.3f}" for m in results["models"].values()]
        for i, size in enumerate(sizes)
    ]
    table = markdown_table(header, rows)
    paths = write_outputs(workdir, "scaling", results, table, plot(results))
    print(table)
    print(results["summary"])
    print("Wrote " + ", ".join(paths))
    return results


def plot(results):
    """Test accuracy against training-set size, one line per model, crossings dotted."""
    budget = results["budget"]
    return plot_curves(
        results["sizes"],
        {f"{name} ({m['parameters']:,} params)": m["points"] for name, m in results["models"].items()},
        xlabel="training examples (log scale)",
        ylabel=f"test accuracy ({results['dataset']['num_test']} images)",
        title=f"{results['dataset']['name']}: {budget['steps']} steps of {budget['batch_size']}, "
        f"mean ± std of {len(results['seeds'])} seeds",
        marks=[crossing["size"] for crossing in results["crossings"]],
    )


def plot_curves(xs, curves, *, xlabel, ylabel, title, marks=()):
    """A figure of curves ({label: points with "mean" and "std"}) against `xs` on a log axis, standard
    deviations as error bars, vertical dotted lines at `marks`."""
    plt = visualize.pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for label, points in curves.items():
        ax.errorbar(
            xs, [p["mean"] for p in points], yerr=[p["std"] for p in points], marker="o", capsize=3, label=label
        )
    for x in marks:
        ax.axvline(x, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.minorticks_off()
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def run_from_command_line(run, config_file, workdir, workdir_help):
    """Defines --config (default `config_file`) and --workdir, then runs `run(config, workdir)` under absl.

    Called from `__main__` only: the flags are defined there, not on import,
    so that other modules and the tests import the helpers here freely.
    """
    config = config_flags.DEFINE_config_file("config", config_file, "Python config file; fields can be overridden.")
    workdir = flags.DEFINE_string("workdir", workdir, workdir_help)

    def main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
        run(config.value, workdir.value)

    app.run(main)


if __name__ == "__main__":
    run_from_command_line(run, "experiments/configs/scaling.py", "runs/scaling", "Where scaling.json, .md and .png go.")
