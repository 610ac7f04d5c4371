r"""The documentation's performance tables, made from the rows of results/*.jsonl.

    python -m experiments.benchmark.tables          # rewrites the marked regions of the pages
    python -m experiments.benchmark.tables --check  # exits 1 naming each region that differs

A page marks each table's place with `<!-- results:VIEW -->` ... `<!-- /results -->`; everything between the
two is generated. A view (`VIEWS`) is the `infer`/`train` rows of one results file, optionally of CPUs with
a feature; of the rows that measured the same thing (mode, variant, image size, batch, precision, XLA,
backend) it shows the last one appended, with the date, commit, machine and versions it was measured on,
and a row marked `stale` says so under the table.  The `input` view is the last `--mode=input` row: one
line per form of the input pipeline.
"""

import argparse
import dataclasses
import pathlib
import re
import string
import sys

from experiments.benchmark.results import RESULTS, ROOT, read_rows

PAGES = ("README.md", "docs/performance.md", "docs/distributed.md")
REGION = re.compile(r"(<!-- results:(?P<view>[\w-]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)
# The peers in the order of their columns, with their names in the headers.
PEER_LABELS = {"keras_hub": "keras-hub", "timm": "timm (eager)", "timm_compiled": "timm (torch.compile)"}
# The versions a footnote names, in this order (JAX's CUDA plugins after jaxlib).
SHOWN_VERSIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-tpu", "jax", "jaxlib", "cuda", "keras", "keras-hub",
                  "timm", "torch", "tf-models-nightly", "tf-models-official")  # fmt: skip
DEFAULT_IMAGE_SIZE = 224


@dataclasses.dataclass(frozen=True)
class View:
    """The rows of `file` (under results/) for `modes`, of machines whose CPU has every feature of `has`
    and none of `lacks` (`results.CPU_FLAGS`)."""

    file: str
    has: tuple = ()
    lacks: tuple = ()
    modes: tuple = ("infer", "train")

    def select(self, rows):
        def fits(flags):
            return all(flag in flags for flag in self.has) and not any(flag in flags for flag in self.lacks)

        return [row for row in rows if row["mode"] in self.modes and fits(row["device"].get("cpu_flags", []))]


VIEWS = {
    "gpu_h200": View("gpu_h200.jsonl"),
    # A CPU with AMX, where TensorFlow runs oneDNN (bfloat16 matmuls on AMX), and one with AVX2 but no
    # AVX-512, where TensorFlow leaves oneDNN off.
    "cpu_amx": View("cpu.jsonl", has=("amx_tile",)),
    "cpu_avx2": View("cpu.jsonl", has=("avx2",), lacks=("avx512f",)),
    "cpu_input": View("cpu.jsonl", modes=("input",)),
    # `python -m experiments.tpu_compile` rows: steps compiled for TPU slices (rows of their own, not runs).
    "tpu_compile": View("tpu_compile.jsonl", modes=("tpu_compile",)),
}
# big_vision's ViT-S/16 ImageNet run: 90 epochs in about 7 hours on a TPU v3-8 (Beyer et al. 2022).
RECIPE_IMAGES_PER_SECOND = 4_600
# The forms of the input pipeline `--mode=input` measures, in the order of their lines.
INPUT_FORMS = {
    "crop_flip": "(a) decode, Inception crop, flip",
    "keras_vit": "(b) + keras_vit's RandAugment",
    "model_garden": "(c) + TF Model Garden's RandAugment",
}


def measurement_key(row):
    """What a throughput row measured: rows with the same key measured the same thing."""
    config = row["config"]
    return (
        row["mode"], config["variant"], config["image_size"], config["batch_size"], config["precision"],
        row.get("xla"), row.get("backend"), config.get("quantize", "none"),
    )  # fmt: skip


def latest(rows):
    """The last row of each measurement, in the order each measurement first appears."""
    by_key = {}
    for row in rows:
        by_key[measurement_key(row)] = row  # A dict keeps the first position of a key.
    return list(by_key.values())


def images_per_second(value):
    return f"{value:,.0f}" if value >= 1000 else f"{value:.2f}"


def flop_rate(value):
    return f"{value / 1e12:.0f} TFLOP/s" if value >= 1e13 else f"{value / 1e9:.0f} GFLOP/s"


def label(row):
    config = row["config"]
    what = "training step (AdamW)" if row["mode"] == "train" else "inference"
    size = f" at {config['image_size']} px" if config["image_size"] != DEFAULT_IMAGE_SIZE else ""
    xla = "XLA" if row.get("xla") else "no XLA"
    quantized = f", {config['quantize']} (model.quantize)" if config.get("quantize", "none") != "none" else ""
    return f"{config['variant']} {what}{size}, batch {config['batch_size']}, {config['precision']}{quantized}, {xla}"


def peer_cell(row, peer):
    ratio = row["ratios"].get(peer)
    if ratio is None:
        return "—"
    name = ratio["against"]
    form = re.search(r"\((XLA|no XLA)\)$", name)
    value = images_per_second(row["figures"]["images_per_second"][name])
    return f"{value} ({form[1]})" if form else value


def ratio_cell(row, name):
    ratio = row["ratios"].get(name)
    return f"{ratio['ratio']:.2f}x" if ratio else "—"


def peak_cell(row):
    figures = row["figures"]
    of_peak = figures.get("of_peak", {}).get(figures["ours"])
    if of_peak is None or "peak_flops_per_second" not in figures:
        return "—"
    return f"{100 * of_peak:.1f}% of {flop_rate(figures['peak_flops_per_second'])}"


def footnote(row):
    """Where and with what `row` was measured, and why it is stale if it is (its `note` apart)."""
    device = row["device"]
    machine = device["machine"]
    if device.get("accelerator") == "cpu":
        machine += f", {device['cpu_cores']} cores" if device.get("cpu_cores") else ""
        if device.get("cpu_flags"):
            machine += f" ({', '.join(device['cpu_flags'])})"
        if "onednn" in device:
            machine += f", oneDNN {'on' if device['onednn'] else 'off'}"
    if device.get("gpu_driver"):
        machine += f", driver {device['gpu_driver']}"
    versions = row["versions"]
    names = [name for name in SHOWN_VERSIONS if name in versions]
    names += sorted(name for name in versions if name.startswith("jax-cuda"))
    commit = row["commit"][:7] if row.get("commit") else "no commit recorded"
    if row.get("dirty"):
        commit += " with local changes"
    parts = [f"{row['date'][:10]}, commit {commit}", machine, ", ".join(f"{n} {versions[n]}" for n in names)]
    parts += [f"from {row['source']}"] if row.get("source") else []
    text = "; ".join(part for part in parts if part) + "."
    return text + (f" **Stale**: {row['stale']}." if row.get("stale") else "")


def table(rows, platform):
    """The Markdown of a view's rows: one line per measurement, the footnotes under it (where and
    with what each row was measured, and each row's note)."""
    rows = latest(rows)
    if not rows:
        return "No results yet.\n"
    peers = [peer for peer in PEER_LABELS if any(peer in row["ratios"] for row in rows)]
    float32 = any("float32" in row["ratios"] for row in rows)
    quantized = any("quantized" in row["ratios"] for row in rows)
    peak = any(peak_cell(row) != "—" for row in rows)
    header = ["measurement (224 px unless noted)", "keras_vit images/s"]
    header += [PEER_LABELS[peer] for peer in peers] + [f"ours / {PEER_LABELS[peer]}" for peer in peers]
    header += ["ours 16-bit / float32"] * float32
    header += ["ours quantized / unquantized"] * quantized
    header += ["MFU" if platform.startswith(("gpu", "tpu")) else "of matmul peak"] * peak
    header += ["measured"]
    notes, lines = {}, []
    for row in rows:
        letters = [
            notes.setdefault(text, string.ascii_lowercase[len(notes)])
            for text in [footnote(row)] + ([row["note"] + "."] if row.get("note") else [])
        ]
        figures = row["figures"]
        cells = [label(row), images_per_second(figures["images_per_second"][figures["ours"]])]
        cells += [peer_cell(row, peer) for peer in peers] + [ratio_cell(row, peer) for peer in peers]
        cells += [ratio_cell(row, "float32")] * float32
        cells += [ratio_cell(row, "quantized")] * quantized
        cells += [peak_cell(row)] * peak
        cells += [f"{row['date'][:10]} [{', '.join(letters)}]"]
        lines.append(cells)
    text = "\n".join(
        "| " + " | ".join(cells) + " |" for cells in [header, ["---"] * len(header), *lines]
    )
    text += "\n\n" + "\n".join(f"- [{letter}] {note}" for note, letter in notes.items())
    return text + "\n\n"


def input_table(rows):
    """The Markdown of the last input-pipeline row that measured every form (Model Garden's included, where any
    did; a run without it, e.g. for `experiments.tpu_compile --with_input`, does not replace the comparison): a
    line per form, the comparisons and where it was measured."""
    if not rows:
        return "No results yet.\n"
    complete = [row for row in rows if set(INPUT_FORMS) <= set(row["figures"]["images_per_second"])]
    row = (complete or rows)[-1]
    figures, config = row["figures"], row["config"]
    randaugment = ", ".join(config.get("randaugment") or [])
    header = [f"form ({config['image_size']} px, batch {config['batch_size']})", "images/s", "per core",
              "CPU ms / image", "cores per 1,000 images/s"]  # fmt: skip
    lines = []
    for form, name in INPUT_FORMS.items():
        if form not in figures["images_per_second"]:
            continue
        name += f"({randaugment})" if form != "crop_flip" and randaugment else ""
        lines.append([
            name, f"{figures['images_per_second'][form]:.0f}", f"{figures['images_per_second_per_core'][form]:.0f}",
            f"{1000 * figures['cpu_seconds_per_image'][form]:.2f}",
            f"{figures['cores_per_1000_images_per_second'][form]:.1f}",
        ])  # fmt: skip
    text = "\n".join("| " + " | ".join(cells) + " |" for cells in [header, ["---"] * len(header), *lines])
    notes = []
    if "model_garden" in figures["images_per_second"]:
        notes.append(
            f"keras_vit / Model Garden: {row['ratios']['model_garden']['ratio']:.2f}x the images/s; Model Garden's "
            f"CPU time per image / keras_vit's: {figures['cpu_time_ratios']['model_garden']:.2f}x."
        )
    if "randaugment_added_cost" in figures:
        notes.append(
            f"RandAugment adds {100 * figures['randaugment_added_cost']:.1f}% to the time of (a), "
            f"{100 * figures['randaugment_added_cpu_time']:.1f}% to its CPU time."
        )
    if "keras_vit" in figures["cores_per_1000_images_per_second"]:
        cores = figures["cores_per_1000_images_per_second"]["keras_vit"]
        notes.append(
            f"The recipe's pipeline (b) at the {RECIPE_IMAGES_PER_SECOND:,} images/s of big_vision's ImageNet S/16 "
            f"run on a TPU v3-8: about {cores * RECIPE_IMAGES_PER_SECOND / 1000:.0f} cores of this CPU."
        )
    load = figures.get("load_average")
    busy = ", ".join(f"{figures['busy_cores'][form]:.2f}" for form in INPUT_FORMS if form in figures["busy_cores"])
    notes.append(
        f"{figures['data']}{', bytes cached in memory' if figures.get('cached') else ''}; the process kept "
        f"{busy} cores busy" + (f" (load average {load[0]:.1f} before, {load[1]:.1f} after)." if load else ".")
    )
    notes.append(footnote(row))
    return text + "\n\n" + "\n".join(f"- {note}" for note in notes) + "\n\n"


def tpu_compile_key(row):
    """What a compile row answered: rows with the same key answered the same question."""
    return (row["variant"], row["image_size"], row["topology"], row["layout"], row["mode"], row["precision"],
            "search" in row, None if "search" in row else row["global_batch"])  # fmt: skip


def tpu_compile_table(rows):
    """The Markdown of `experiments.tpu_compile` rows: the last row of each question, a line each, and the
    command that reproduces it."""
    by_key = {}
    for row in rows:
        by_key[tpu_compile_key(row)] = row
    header = ["model", "slice", "layout", "global batch (per chip)", "GiB per chip (of HBM)", "recomputed",
              "beyond it", "TFLOP per chip-step", "images/s per chip at 50% of peak", "host cores per chip: "
              "needed / VM has", "compile s"]  # fmt: skip
    lines, commands = [], []
    for number, row in enumerate(by_key.values(), 1):
        gib = row["bytes_per_chip"]["total"] / 2**30
        batch = f"{row['global_batch']:,} ({row['batch_per_chip']:g})" + (" largest" if "search" in row else "")
        beyond = "—"
        if "search" in row:
            twice = row["search"]["twice"]
            beyond = (f"{twice['global_batch']:,}: +{100 * twice['recompute_overhead']:.0f}% FLOPs"
                      if twice["compiles"] else f"{twice['global_batch']:,}: does not compile")  # fmt: skip
        feed = row.get("input") or {}
        mesh = "x".join(str(n) for n in row["mesh"].values())
        model = f"{row['variant']} {row['image_size']} px, {row['precision']}" + (
            ", serving" if row["mode"] == "serve" else "")
        lines.append([
            f"{model} [{number}]", f"{row['topology']} ({row['chips']} chips)", f"{row['layout']} ({mesh})",
            batch + ("" if row["fits"] else ", **does not fit**"),
            f"{gib:.1f} ({row['hbm_bytes_per_chip'] / 2**30:.0f})", f"{100 * row['recompute_overhead']:+.1f}%",
            beyond, f"{row['flops_per_chip'] / 1e12:.2f}",
            f"{feed['chip_images_per_second_at_half_peak']:,.0f}" if feed else "—",
            f"{feed['host_cores_needed_per_chip']:.1f} / {feed['host_cores_per_chip']:.0f}" if feed else "—",
            f"{row['compile_seconds']:.0f}",
        ])  # fmt: skip
        versions, host = row["versions"], row["host"]
        commands.append(f"{number}. `{row['command']}` ({row['date'][:10]}, commit {(row['commit'] or '')[:7]}"
                        f"{' with local changes' if row.get('dirty') else ''}; jax {versions['jax']}, libtpu "
                        f"{versions['libtpu']}; {host['cpu']}, {host['cores']} cores)")  # fmt: skip
    if not lines:
        return "No results yet.\n"
    text = "\n".join("| " + " | ".join(cells) + " |" for cells in [header, ["---"] * len(header), *lines])
    inputs = {json_key(r["input"]["input_measured"]): r["input"] for r in by_key.values() if r.get("input")}
    notes = [f"Input: {i['host_images_per_second_per_core']:.0f} images/s per core of {m['cpu']} ({m['date'][:10]}, "
             f"`{m['command']}`)." for i, m in ((i, i["input_measured"]) for i in inputs.values())]  # fmt: skip
    return text + "\n\n" + "\n".join(commands + notes) + "\n\n"


def json_key(value):
    return repr(sorted(value.items()))


def read_compile_rows(path):
    """The rows of results/tpu_compile.jsonl, in order."""
    import json

    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def view_text(name, results=RESULTS):
    """The generated text of the region `<!-- results:name -->`."""
    if name not in VIEWS:
        raise ValueError(f"No view named {name!r}; the views: {sorted(VIEWS)}")
    view = VIEWS[name]
    path = pathlib.Path(results) / view.file
    if view.modes == ("tpu_compile",):
        return tpu_compile_table(read_compile_rows(path) if path.exists() else [])
    rows = view.select(read_rows(path)) if path.exists() else []
    return input_table(rows) if view.modes == ("input",) else table(rows, name)


def render(text, results=RESULTS):
    """`text` with every marked region replaced by its view's table."""
    return REGION.sub(lambda m: m[1] + view_text(m["view"], results) + m[4], text)


def stale_regions(root=ROOT, results=RESULTS):
    """[(page, view)] of each region of `PAGES` whose text is not its view's table."""
    found = []
    for page in PAGES:
        text = (pathlib.Path(root) / page).read_text()
        for match in REGION.finditer(text):
            if match["body"] != view_text(match["view"], results):
                found.append((page, match["view"]))
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if a table differs")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_regions()
        for page, view in stale:
            print(f"{page}: the table of results:{view} differs from its rows", file=sys.stderr)
        return 1 if stale else 0
    for page in PAGES:
        path = ROOT / page
        text = path.read_text()
        updated = render(text)
        if updated != text:
            from keras_vit.files import write_text_atomically  # Here: checking the tables needs no Keras.

            write_text_atomically(path, updated)
            print(f"Updated {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
