"""What the jobs write: text and JSON written whole (atomically, local or gs://), Markdown tables, figures."""

import json

import tensorflow as tf

from keras_vit import visualize
from keras_vit.files import write_text_atomically


def write_json(path, data):
    """Writes `data` as indented JSON to `path` (local or gs://), whole or not at all
    (`keras_vit.files.write_text_atomically`); returns path."""
    return write_text_atomically(str(path), json.dumps(data, indent=2))


def markdown_table(header, rows):
    """A Markdown table of `header` and `rows` (lists of cells).

    >>> print(markdown_table(["size", "accuracy"], [[10, "0.5"]]))
    | size | accuracy |
    |---|---|
    | 10 | 0.5 |
    """
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_outputs(workdir, name, results, table, figure):
    """Writes `name`.json (results), `name`.md (table) and `name`.png (figure) into workdir; returns their paths."""
    tf.io.gfile.makedirs(workdir)
    paths = [tf.io.gfile.join(workdir, f"{name}.{ext}") for ext in ("json", "md", "png")]
    write_json(paths[0], results)
    write_text_atomically(str(paths[1]), table + "\n")
    visualize.save_figure(figure, paths[2])
    return paths


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
