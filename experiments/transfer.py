r"""Transfer against training from scratch when the target task has few examples.

    python -m experiments.transfer --workdir=runs/transfer
    python -m experiments.transfer --config=experiments/configs/transfer.py \
        --config.target.seeds="(0, 1)" --workdir=runs/transfer

A ViT is pre-trained on the classes config.source_classes (every training
image of them) and saved with `keras_vit.save_npz` as an original-format
.npz, the file a user downloads.  The other classes are the target task:
`config.target.shots` training images per class, drawn with each seed of
`config.target.seeds` (nested: for one seed, the 5 images of a class are among
its 10), and the same draws for three methods:

- `scratch`: the same ViT, randomly initialised, with the pre-training recipe;
- `frozen_backbone`: `load_pretrained`, `replace_head` (a new zero head) and
  `freeze_backbone`: only the head trains;
- `fine_tune`: `load_pretrained` and `replace_head`; every weight trains.

The two transferred models use config.finetune's recipe (the paper's
fine-tuning, SGD).  Every run has the same `config.target.steps` steps of
`config.target.batch_size` images and is tested once, after its last step, on
every held-out image of the target classes; the pre-training never sees a
target class nor a held-out image.

Writes into --workdir: `pretrained.npz`, `transfer.json` (the config, the
pre-training's accuracy on the held-out images of its classes, and per method
and number of shots the test accuracy of each seed, their mean and standard
deviation), `transfer.md` (the table, also printed) and `transfer.png` (test
accuracy against training images per class, one line per method).
"""

import keras
import numpy as np
import tensorflow as tf

import keras_vit
from experiments import datasets, jobs, models, outputs, short_runs

METHODS = ("scratch", "frozen_backbone", "fine_tune")


def split_classes(dataset, classes):
    """The train and test examples of `classes` (a list of labels), relabelled 0 .. len(classes) - 1 in that order."""
    mapping = {label: i for i, label in enumerate(classes)}
    return [
        datasets.take(split, np.flatnonzero(np.isin(split.labels, classes)), mapping)
        for split in (dataset.train, dataset.test)
    ]


def pretrained_vit(config, checkpoint, num_classes, *, freeze):
    """The route of a user with a checkpoint: build, load the .npz, new head, optionally freeze the backbone."""
    model = models.build_model(config, num_classes)
    keras_vit.load_pretrained(model, checkpoint)
    model = keras_vit.replace_head(model, num_classes)
    return keras_vit.freeze_backbone(model) if freeze else model


def run(config, workdir):
    """Pre-trains, then trains each method at each number of shots and seed; writes the outputs; returns the results."""
    dataset = datasets.load_in_memory(config)
    source_classes, target_classes = checked_classes(config, dataset.num_classes)
    target = config.target
    shots, seeds = sorted(int(s) for s in target.shots), [int(s) for s in target.seeds]
    target_train, target_test = split_classes(dataset, target_classes)
    keras.mixed_precision.set_global_policy(config.precision)
    tf.io.gfile.makedirs(workdir)
    source = pretrain(config, workdir, source_classes, split_classes(dataset, source_classes))
    keras.backend.clear_session()
    results = {
        "config": config.to_dict(),
        "dataset": {"name": config.dataset, "num_classes": dataset.num_classes},
        "source": source,
        "target": {
            "classes": target_classes,
            "num_train_available": len(target_train),
            "num_test": len(target_test),
            "shots": shots,
            "seeds": seeds,
            "steps": target.steps,
            "batch_size": target.batch_size,
        },
        "methods": train_methods(
            config, source["checkpoint"], len(target_classes), (target_train, target_test), shots, seeds
        ),
    }
    return write_report(results, workdir)


def checked_classes(config, num_classes):
    """(source classes, target classes): config.source_classes, and the data set's other classes."""
    source_classes = sorted(int(c) for c in config.source_classes)
    target_classes = [c for c in range(num_classes) if c not in source_classes]
    if not source_classes or not target_classes or not set(source_classes) <= set(range(num_classes)):
        raise ValueError(
            f"config.source_classes must be some, not all, of the data set's classes 0..{num_classes - 1}. "
            f"Received: source_classes={source_classes}"
        )
    return source_classes, target_classes


def pretrain(config, workdir, classes, splits):
    """Trains on the train split of the source `classes`, writes pretrained.npz; returns what the results
    record of it."""
    source_train, source_test = splits
    num_classes = len(classes)
    (model, pretraining), = short_runs.train_runs(
        lambda: models.build_model(config, num_classes), [(config.seed, source_train)], source_test,
        config=config, steps=config.pretrain_steps, warmup_steps=config.warmup_steps,
        batch_size=config.batch_size, num_classes=num_classes,
    )
    checkpoint = tf.io.gfile.join(workdir, "pretrained.npz")
    keras_vit.save_npz(model, checkpoint)
    print(
        f"Pre-trained on classes {classes} ({len(source_train)} images): "
        f"{pretraining['test_accuracy']:.3f} on their {len(source_test)} held-out images; wrote {checkpoint}",
        flush=True,
    )
    return {
        "classes": classes,
        "num_train": len(source_train),
        "num_test": len(source_test),
        "steps": config.pretrain_steps,
        "test_accuracy": pretraining["test_accuracy"],
        "checkpoint": checkpoint,
    }


def train_methods(config, checkpoint, num_classes, splits, shots, seeds):
    """{method: its trainable parameters and, per number of shots, the seeds' results}: each method trained on
    the same draws of `shots` training images per class, with each seed, and tested on the test split."""
    target = config.target
    target_train, target_test = splits
    draws = [
        (seed, datasets.take(target_train, datasets.stratified_subset(target_train.labels, seed, per_class=k)))
        for k in shots
        for seed in seeds
    ]
    makers = {
        "scratch": lambda: models.build_model(config, num_classes),
        "frozen_backbone": lambda: pretrained_vit(config, checkpoint, num_classes, freeze=True),
        "fine_tune": lambda: pretrained_vit(config, checkpoint, num_classes, freeze=False),
    }
    methods = {}
    for method in METHODS:
        per_run = []
        for (seed, train), (trained, result) in zip(
            draws,
            short_runs.train_runs(
                makers[method], draws, target_test, config=config, steps=target.steps,
                warmup_steps=target.warmup_steps, batch_size=target.batch_size, num_classes=num_classes,
                recipe=None if method == "scratch" else config.finetune,
            ),
        ):
            per_run.append(result)
            trainable = int(sum(np.prod(w.shape) for w in trained.trainable_weights))
            print(
                f"{method}, {len(train) // num_classes} per class, seed {seed}: test {result['test_accuracy']:.3f}, "
                f"train {result['train_accuracy']:.3f} ({result['seconds']:.0f} s)",
                flush=True,
            )
        methods[method] = {
            "trainable_parameters": trainable,
            "points": [
                {"shots": k, "size": k * num_classes}
                | short_runs.summarize(per_run[i * len(seeds):(i + 1) * len(seeds)])
                for i, k in enumerate(shots)
            ],
        }
        keras.backend.clear_session()
    return methods


def write_report(results, workdir):
    """Writes transfer.json, .md and .png into `workdir`, prints the table; returns `results`."""
    header = ["method (trainable parameters)"] + [f"{k} per class" for k in results["target"]["shots"]]
    rows = [
        [f"{method} ({m['trainable_parameters']:,})"] + [f"{p['mean']:.3f} ± {p['std']:.3f}" for p in m["points"]]
        for method, m in results["methods"].items()
    ]
    table = outputs.markdown_table(header, rows)
    paths = outputs.write_outputs(workdir, "transfer", results, table, plot(results))
    print(table)
    print("Wrote " + ", ".join(paths))
    return results


def plot(results):
    """Test accuracy against training images per class, one line per method."""
    source, target = results["source"], results["target"]
    return outputs.plot_curves(
        target["shots"],
        {method.replace("_", " "): m["points"] for method, m in results["methods"].items()},
        xlabel=f"training images per class ({len(target['classes'])} classes, log scale)",
        ylabel=f"test accuracy ({target['num_test']} images)",
        title=f"classes {target['classes']} after pre-training on {source['classes']}\n"
        f"{target['steps']} steps of {target['batch_size']}, mean ± std of {len(target['seeds'])} seeds",
    )


def define_flags():
    """The job's flags, defined when it runs as a program (`jobs.run_job`), not on import."""
    config, workdir = jobs.define_config_and_workdir(
        "experiments/configs/transfer.py", "runs/transfer", "Where pretrained.npz and transfer.json, .md, .png go."
    )
    return {"config": config, "workdir": workdir}


def main(cli):
    run(cli.config.value, cli.workdir.value)


if __name__ == "__main__":
    jobs.run_job(main, define_flags)
