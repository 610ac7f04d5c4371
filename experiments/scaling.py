r"""The ViT against a small ResNet as the training set grows.

    python -m experiments.scaling --workdir=runs/scaling
    python -m experiments.scaling --config=experiments/configs/scaling.py \
        --config.seeds="(0, 1)" --config.steps=3000 --workdir=runs/scaling

Both models are trained on growing stratified fractions of one training split
(`config.fractions`, nested: each subset holds the smaller ones of its seed),
with the same preprocessing and recipe, each until it stops improving: its
accuracy on a validation split held out of the training images (the same for
every run) is measured every `config.eval_every` steps, and the run stops
after `config.patience` measurements without improvement, keeping the
weights of its best one, or at `config.steps`, where the cosine schedule
reaches zero.  Every run is then tested once on the whole held-out test
split, which never shrinks and chooses nothing.  With `config.patience=0`
every run trains `config.steps` steps instead (a fixed budget).

Writes into --workdir: `scaling.json` (the config, and per model and size
the test accuracy of each seed, their mean and standard deviation, the
accuracy on the run's own training images, the steps trained and the best
step, its time), `scaling.md` (the table) and `scaling.png` (test accuracy
against training-set size, log x, one standard deviation as error bars);
prints the table and where the mean curves cross, or that they do not within
the range.

The data in memory and the stratified subsets are `experiments.datasets`',
the outputs `experiments.outputs`', the runs `experiments.short_runs`',
shared with `experiments.transfer`.
"""

import math

import keras
import numpy as np

from experiments import baselines, datasets, jobs, models, outputs, short_runs

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
    dataset = datasets.load_in_memory(config)
    num_classes = dataset.num_classes
    # The same subsets for both models: seed -> fraction -> indices.
    subsets = {
        seed: {f: datasets.stratified_subset(dataset.train.labels, seed, fraction=f) for f in fractions}
        for seed in seeds
    }
    sizes = [len(subsets[seeds[0]][f]) for f in fractions]
    keras.mixed_precision.set_global_policy(config.precision)
    builders = {
        "ViT": lambda: models.build_model(config, num_classes),
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
        "dataset_validation": len(dataset.validation) if dataset.validation is not None else 0,
        "budget": {
            "steps": config.steps, "batch_size": config.batch_size, "eval_every": config.eval_every,
            "patience": config.patience,
        },
        "fractions": fractions,
        "sizes": sizes,
        "seeds": seeds,
        "models": {},
    }
    for name, make_model in builders.items():
        runs = [(seed, datasets.take(dataset.train, subsets[seed][f])) for f in fractions for seed in seeds]
        per_run = []
        for (seed, train), (trained, result) in zip(
            runs,
            short_runs.train_runs(
                make_model, runs, dataset.test, config=config, steps=config.steps,
                warmup_steps=config.warmup_steps, batch_size=config.batch_size, num_classes=num_classes,
                validation=dataset.validation, eval_every=config.eval_every, patience=config.patience,
            ),
        ):
            per_run.append(result)
            parameters = int(trained.count_params())
            print(
                f"{name} {len(train)} examples, seed {seed}: test {result['test_accuracy']:.3f}, "
                f"train {result['train_accuracy']:.3f}, {result['steps']} steps "
                + (f"(best {result['best_step']}) " if "best_step" in result else "")
                + f"({result['seconds']:.0f} s)",
                flush=True,
            )
        points = [per_run[i * len(seeds):(i + 1) * len(seeds)] for i in range(len(fractions))]
        results["models"][name] = {
            "parameters": parameters,
            "points": [
                {"fraction": f, "size": size} | short_runs.summarize(point)
                for f, size, point in zip(fractions, sizes, points)
            ],
        }
        keras.backend.clear_session()
    return report(results, workdir)


def report(results, workdir):
    """Adds the crossings and the summary to `results` (what `run` trained, or the scaling.json it wrote),
    writes scaling.json, .md and .png into `workdir`, prints the table; returns the results."""
    sizes = results["sizes"]
    means = {name: [p["mean"] for p in model["points"]] for name, model in results["models"].items()}
    results["crossings"] = [{"size": s, "vit_ahead_after": ahead} for s, ahead in crossings(sizes, *means.values())]
    results["summary"] = describe_crossings(sizes, means)

    # Each model's mean test accuracy ± std, and the steps its runs trained to their best weights (mean).
    header = ["training examples"]
    for name, model in results["models"].items():
        header += [f"{name} ({model['parameters']:,} params)", f"{name} steps"]
    rows = []
    for i, size in enumerate(sizes):
        row = [size]
        for model in results["models"].values():
            point = model["points"][i]
            steps = point.get("best_step", point["steps"])
            row += [f"{point['mean']:.3f} ± {point['std']:.3f}", f"{np.mean(steps):.0f}"]
        rows.append(row)
    table = outputs.markdown_table(header, rows)
    paths = outputs.write_outputs(workdir, "scaling", results, table, plot(results))
    print(table)
    print(results["summary"])
    print("Wrote " + ", ".join(paths))
    return results


def plot(results):
    """Test accuracy against training-set size, one line per model, crossings dotted."""
    budget = results["budget"]
    return outputs.plot_curves(
        results["sizes"],
        {f"{name} ({m['parameters']:,} params)": m["points"] for name, m in results["models"].items()},
        xlabel="training examples (log scale)",
        ylabel=f"test accuracy ({results['dataset']['num_test']} images)",
        title=f"{results['dataset']['name']}: "
        + (f"each run until validation stops improving (at most {budget['steps']} steps of {budget['batch_size']})"
           if budget["patience"] else f"{budget['steps']} steps of {budget['batch_size']}")
        + f"\nmean ± std of {len(results['seeds'])} seeds",
        marks=[crossing["size"] for crossing in results["crossings"]],
    )


def define_flags():
    """The job's flags, defined when it runs as a program (`jobs.run_job`), not on import."""
    config, workdir = jobs.define_config_and_workdir(
        "experiments/configs/scaling.py", "runs/scaling", "Where scaling.json, .md and .png go."
    )
    return {"config": config, "workdir": workdir}


def main(cli):
    run(cli.config.value, cli.workdir.value)


if __name__ == "__main__":
    jobs.run_job(main, define_flags)
