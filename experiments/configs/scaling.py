r"""The ViT against a small ResNet as the training set grows (the paper's Figures 3 and 4, in miniature).

    python -m experiments.scaling --workdir=/tmp/scaling
    python -m experiments.scaling --config=experiments/configs/scaling.py \
        --config.dataset=folder:/data/flowers --config.image_size=32 --workdir=/tmp/scaling

The digits ViT of `digits.py` with 4x4 patches (a 4x4 grid of 17 tokens
rather than 8x8: a quarter of the tokens, so the runs fit the time) and a
ResNet of three stages of one basic block each, of about the same size, are
trained on stratified 5%, 10%, 25%, 50% and 100% of the digits' 1,437
training images, three seeds each, for the same 400 AdamW steps of batch 64
with the same preprocessing and recipe, and tested on the same 360 held-out
images.  About 15 minutes on 2 CPU cores (docs/experiments.md has the
measured time and the results).
"""

import ml_collections

from experiments.configs import digits


def get_config():
    # The digits job's data, ViT and recipe (AdamW, learning rate, weight decay, label smoothing,
    # random translation); `steps` replaces its epochs, so `epochs` and `warmup_epochs` are unused.
    config = digits.get_config()
    config.visualize = False
    config.model.patch_size = 4
    # Every run trains a fixed budget with fixed settings and is tested once: nothing is selected, so no
    # validation split is held out, and the subsets are drawn from all 1,437 training images.
    config.validation_fraction = 0.0

    config.fractions = (0.05, 0.1, 0.25, 0.5, 1.0)  # Of the training split, stratified by class.
    config.seeds = (0, 1, 2)  # Per point: the subset, the initialisation and the batch order.
    config.steps = 400  # Optimizer steps per run, whatever the subset's size.
    config.warmup_steps = 40

    # The ResNet (experiments.baselines.build_resnet): its parameter count near the ViT's.
    config.cnn = ml_collections.ConfigDict({"widths": (22, 44, 88), "blocks_per_stage": 1})
    return config
