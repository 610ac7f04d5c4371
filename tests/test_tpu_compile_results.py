"""`python -m experiments.tpu_compile`'s batch search, its recorded rows and the table docs/distributed.md shows
of them. No TPU compiler needed: the search is driven by a stand-in compiler here (the real one runs in
tests/test_tpu_compile.py, `-m tpu_compile`)."""

import importlib.util
import json

import pytest

from experiments import tpu_compile
from experiments.benchmark import tables

GIB = 2**30


def stand_in_compiler(fixed_gib, gib_per_image, hbm_gib, overhead, log):
    """A compile of `batch` as the TPU compiler answers it: the memory grows linearly with the batch until the
    chip is full; beyond, the compiler recomputes (`overhead(batch)`) or fails when even that does not help."""

    def attempt(batch):
        log.append(batch)
        needed = fixed_gib + gib_per_image * batch
        if needed > 1.5 * hbm_gib:
            return {"global_batch": batch, "fits": False, "compiles": False, "error": "does not fit"}
        extra = overhead(batch)
        return {
            "global_batch": batch, "compiles": True, "fits": extra <= tpu_compile.MAX_RECOMPUTE,
            "bytes_per_chip": {"total": int(min(needed, hbm_gib) * GIB)}, "input_bytes_per_chip": 0,
            "recompute_overhead": extra,
        }  # fmt: skip

    return attempt


def test_the_search_finds_the_largest_batch_without_recomputation():
    log = []
    # 2 GiB fixed, 0.1 GiB per image: the 16 GiB chip is full at 140 images; from there on it recomputes.
    attempt = stand_in_compiler(2, 0.1, 16, lambda batch: 0.0 if batch <= 136 else 0.08, log)
    answer = tpu_compile.largest_fitting_batch(attempt, 8, 16 * GIB)
    assert answer["global_batch"] == 136 and answer["fits"]
    assert answer["search"]["tried"]["144"] == {"compiles": True, "fits": False, "recompute_overhead": 0.08}
    assert answer["search"]["twice"] == {"global_batch": 272, "compiles": False, "recompute_overhead": None}
    assert len(log) <= 6  # 8, 16, the estimate (136), its neighbour, twice the answer


def test_the_search_bisects_when_the_compiler_recomputes_early_and_not_monotonically():
    """Recomputation well before the memory is full, and not monotonic in the batch (as L/16 on v5e: 11% at
    256, under 3% at 128): the answer is a batch that fits with the next one not fitting."""
    log = []
    overheads = {96: 0.0, 104: 0.01, 112: 0.05, 120: 0.02}
    attempt = stand_in_compiler(2, 0.1, 16, lambda batch: overheads.get(batch, 0.0 if batch < 96 else 0.11), log)
    answer = tpu_compile.largest_fitting_batch(attempt, 8, 16 * GIB)
    assert answer["fits"]
    batch = answer["global_batch"]
    assert answer["search"]["tried"][str(batch + 8)]["fits"] is False
    assert batch in (104, 120)
    assert len(log) == len(set(log))  # No batch compiled twice.


def test_the_search_says_when_nothing_fits():
    attempt = stand_in_compiler(30, 0.1, 16, lambda batch: 0.0, [])
    answer = tpu_compile.largest_fitting_batch(attempt, 8, 16 * GIB)
    assert answer["fits"] is False and answer["global_batch"] == 8


def test_a_pre_logits_layer_as_wide_as_the_model_follows_the_variant():
    from experiments.configs import imagenet_s16

    config = tpu_compile.setting_from(imagenet_s16.get_config(), variant="L/16", image_size=384, precision="float32")
    assert (config.model.variant, config.model.representation_size) == ("L/16", 1024)
    assert (config.image_size, config.precision) == (384, "float32")


def recorded_rows():
    return [json.loads(line) for line in tpu_compile.RESULTS_FILE.read_text().splitlines() if line.strip()]


def test_the_recorded_rows_answer_for_the_paper_variants():
    """results/tpu_compile.jsonl, which the table in docs/distributed.md is made of: the largest batch that fits
    each variant on v5e, found by --find_batch, its compiled FLOPs within 3% of the analytic count, with the
    command that reproduces it."""
    rows = recorded_rows()
    found = {(r["variant"], r["image_size"]): r for r in rows if "search" in r and r["fits"]}
    assert {("Ti/16", 224), ("S/16", 224), ("B/16", 224)} <= set(found)
    for row in found.values():
        assert abs(row["recompute_overhead"]) <= tpu_compile.MAX_RECOMPUTE
        assert row["bytes_per_chip"]["total"] + row["input_bytes_per_chip"] <= row["hbm_bytes_per_chip"]
        unit = 8 * row["mesh"]["batch"]  # The search's step: 8 images per batch shard.
        assert row["search"]["tried"][str(row["global_batch"] + unit)]["fits"] is False
    required = {"variant", "topology", "chips", "chip_kind", "global_batch", "precision", "layout", "compile_seconds",
                "bytes_per_chip", "hbm_bytes_per_chip", "fits", "flops_per_chip", "analytic_flops_per_chip",
                "recompute_overhead", "command", "commit", "versions"}  # fmt: skip
    for row in rows:
        assert required <= set(row), required - set(row)
        assert set(row["bytes_per_chip"]) >= {"arguments", "outputs", "temporaries", "total"}
        assert row["recompute_overhead"] == round(row["flops_per_chip"] / row["analytic_flops_per_chip"] - 1, 4)
        assert row["command"].startswith("KERAS_BACKEND=jax python -m experiments.tpu_compile")
        assert row["host_transfers"] == 0


def test_the_table_shows_each_question_once_with_its_command():
    rows = recorded_rows()
    text = tables.view_text("tpu_compile")
    assert len({tables.tpu_compile_key(r) for r in rows}) == sum(1 for line in text.splitlines()
                                                                 if line.startswith("| ") and "[" in line)
    for row in rows:
        assert f"`{row['command']}`" in text


@pytest.mark.parametrize("topology", ["v5e:2x2", "v4:2x2x1", "v5p:2x2x1", "v6e:4x4"])
def test_each_generation_has_its_chip_facts(topology):
    from keras_vit import aot

    chip = aot.chip(topology)
    assert chip.hbm_bytes >= 16 * GIB and chip.bf16_flops_per_second >= 197e12 and chip.source.startswith("https://")
    assert topology in aot.known_topologies()


def test_an_unknown_generation_lists_the_known_topologies():
    from keras_vit import aot

    with pytest.raises(ValueError, match=r"Unknown TPU generation 'v9'.*v5e:2x2"):
        aot.chip("v9:2x2")


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None, reason="libtpu is installed here")
def test_without_libtpu_the_error_says_how_to_install_it():
    from keras_vit import aot

    with pytest.raises(aot.NoTPUCompilerError, match=r'pip install "jax\[tpu\]"'):
        aot.topology_devices("v5e:2x2")
