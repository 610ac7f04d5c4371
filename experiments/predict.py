r"""Predicts the classes of a folder of images and writes them to a CSV file, a row per file.

    python -m experiments.predict --model=runs/digits/model.keras --images=photos/ --out=predictions.csv
    python -m experiments.predict --model=google/vit-base-patch16-224 --images='gs://bucket/photos/*.jpg'

--model: a .keras file, a SavedModel folder (from keras_vit.export.export_saved_model: its `serving_bytes`,
which prepares images as it does when served) or anything `keras_vit.from_pretrained` opens.
--images: a folder (every file under it, sorted; names starting with "." left out), a glob, or a gs:// folder.

Each image is prepared as the model says (its own resize and crop, from `from_pretrained` or training; else
the shorter side resized and the center cropped, --crop_fraction) in a tf.data pipeline that streams the files
in batches.  The CSV has a header and a row per file: path, the --top_k class names with their probabilities
(most probable first), and an error column, empty but for a file that could not be read or decoded (not an
image, corrupt, past --max_pixels or --max_aspect_ratio), which is skipped and says why.  Rows are written as
their batches finish: a run stopped part way and started again with the same --out skips the files already
in it.
"""

import csv
import os
import sys
import time

from absl import flags

from experiments import jobs
from experiments.evaluate import is_saved_model, load_model
from keras_vit import prediction
from keras_vit.data.header import ImageLimits


def define_flags():
    """The job's flags, defined when it runs as a program (`jobs.run_job`), not on import."""
    return {
        "model": flags.DEFINE_string("model", None, "A .keras file, a SavedModel or a from_pretrained name.",
                                     required=True),
        "images": flags.DEFINE_string("images", None, "A folder, a glob or a gs:// folder of images.",
                                      required=True),
        "out": flags.DEFINE_string("out", "predictions.csv", "The CSV file written (and resumed)."),
        "top_k": flags.DEFINE_integer("top_k", None, "Classes per image (default 5, or all if the model has fewer)."),
        "batch_size": flags.DEFINE_integer("batch_size", 64, "Images per batch."),
        "crop_fraction": flags.DEFINE_float(
            "crop_fraction", None, "A model without its own preprocessing: the center crop kept (default 1.0)."
        ),
        "max_pixels": flags.DEFINE_integer(
            "max_pixels", ImageLimits.max_pixels, "The most pixels (width x height) decoded; larger files skipped."
        ),
        "max_aspect_ratio": flags.DEFINE_float(
            "max_aspect_ratio", ImageLimits.max_aspect_ratio, "The longest side over the shortest; past it skipped."
        ),
    }


def header(top_k):
    """The CSV's columns."""
    columns = ["path"]
    for rank in range(1, top_k + 1):
        columns += [f"class_{rank}", f"probability_{rank}"]
    return columns + ["error"]


def row(result, top_k):
    """A `keras_vit.prediction.Prediction` as a CSV row."""
    cells = [result.path]
    for rank in range(top_k):
        if result.error is None:
            cells += [result.names[rank], f"{result.probabilities[rank]:.8g}"]
        else:
            cells += ["", ""]
    return cells + [" ".join((result.error or "").split())]  # One line: a row is one line of the file.


def files_done(out, columns):
    """The paths already in the CSV file `out` (a set; empty if it does not exist), after cutting a row left
    unfinished by a stopped run.  A file with other columns is refused."""
    if not os.path.exists(out):
        return set()
    _cut_unfinished_row(out)
    with open(out, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        found = next(reader, None)
        if found is None:
            return set()
        if found != columns:
            raise ValueError(
                f"{out} has the columns {','.join(found)[:200]}, not those of this run ({','.join(columns)[:200]}): "
                "give another --out, or the --top_k it was written with."
            )
        return {cells[0] for cells in reader if cells}


def _cut_unfinished_row(path):
    """Truncates `path` after its last line break: what follows is a row a stopped run did not finish."""
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        position = end
        while position > 0:
            start = max(0, position - 65536)
            f.seek(start)
            chunk = f.read(position - start)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                position = start + newline + 1
                break
            position = start
        if position != end:
            f.truncate(position)


def predict_to_csv(model, images, out, *, top_k=None, batch_size=64, crop_fraction=None, image_limits=None):
    """Writes (or continues) `out` with a row per file of `images` (`keras_vit.prediction.list_files`) that it
    does not hold yet; returns (images predicted, files skipped as bad, files already done)."""
    if "://" in out:
        raise ValueError(f"--out must be a local file (copy it afterwards). Received: --out={out}")
    # Filled once the columns are known; the listing reads it as it streams, after that.
    done = set()
    results = prediction.predict_files(
        model, prediction.skip_done(prediction.list_files(images), done), top_k=top_k, batch_size=batch_size,
        crop_fraction=crop_fraction, image_limits=image_limits,
    )  # fmt: skip
    top_k = results.top_k
    columns = header(top_k)
    done.update(files_done(out, columns))
    if done:
        print(f"Continuing {out}: the {len(done)} files it holds are skipped.")
    new = not os.path.exists(out) or os.path.getsize(out) == 0
    progress = Progress()
    with open(out, "a", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        if new:
            writer.writerow(columns)
        for count, result in enumerate(results, 1):
            writer.writerow(row(result, top_k))
            progress.count(result.error is None)
            if count % batch_size == 0:
                f.flush()
        f.flush()
    progress.show(final=True)
    predicted, skipped = progress.predicted, progress.skipped
    return predicted, skipped, len(done)


class Progress:
    """The files done so far, on stderr: one line redrawn on a terminal, a line every 30 s in a log."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.terminal = self.stream.isatty()
        self.interval = 0.5 if self.terminal else 30.0
        self.start = self.shown = time.monotonic()
        self.predicted = self.skipped = 0

    def count(self, predicted):
        self.predicted += predicted
        self.skipped += not predicted
        if time.monotonic() - self.shown >= self.interval:
            self.show()

    def show(self, final=False):
        self.shown = time.monotonic()
        files = self.predicted + self.skipped
        rate = files / max(self.shown - self.start, 1e-9)
        line = f"{files} files: {self.predicted} predicted, {self.skipped} skipped, {rate:.1f} files/s"
        if self.terminal:
            self.stream.write(f"\r{line}" + ("\n" if final else ""))
        elif files or final:
            self.stream.write(line + "\n")
        self.stream.flush()


def prediction_model(name):
    """What `--model` names: a SavedModel folder as its path (its own signature prepares the images), else the
    Keras model (`experiments.evaluate.load_model`)."""
    if is_saved_model(name):
        return name
    return load_model(name)


def main(cli):
    model = prediction_model(cli.model.value)
    start = time.monotonic()
    predicted, skipped, done = predict_to_csv(
        model, cli.images.value, cli.out.value, top_k=cli.top_k.value, batch_size=cli.batch_size.value,
        crop_fraction=cli.crop_fraction.value,
        image_limits=ImageLimits(cli.max_pixels.value, cli.max_aspect_ratio.value),
    )  # fmt: skip
    if predicted + skipped + done == 0:
        raise FileNotFoundError(f"No files in {cli.images.value}.")
    seconds = time.monotonic() - start
    print(
        f"{predicted} images predicted ({predicted / max(seconds, 1e-9):.1f}/s), {skipped} files skipped (their "
        f"reason is in the error column){f', {done} done before' if done else ''}: {cli.out.value}"
    )
    return predicted, skipped


if __name__ == "__main__":
    jobs.run_job(main, define_flags)
