r"""The ViT against a small ResNet as the training set grows (the paper's Figures 3 and 4, in miniature).

    python -m experiments.scaling --workdir=/tmp/scaling
    python -m experiments.scaling --config=experiments/configs/scaling.py \
        --config.dataset=folder:/data/flowers --config.image_size=32 --workdir=/tmp/scaling

The digits ViT of `digits.py` with 4x4 patches (a 4x4 grid of 17 tokens
rather than 8x8: a quarter of the tokens, so the runs fit the time) and a
ResNet of three stages of one basic block each, of about the same size, are
trained on stratified 6%, 10%, 25%, 50% and 100% of 1,293 of the digits'
training images, three seeds each, with the same preprocessing and recipe
(AdamW, batches of 64, a cosine schedule of 1,500 steps), each until its
accuracy on the other 144 (a validation split) stops improving, and tested
on the same 360 held-out images.  About 25 minutes on 2 CPU cores
(docs/experiments.md has the measured time and the results).
"""

import ml_collections

from experiments.configs import digits


def get_config():
    # The digits job's data, ViT and recipe (AdamW, learning rate, weight decay, label smoothing,
    # random translation); `steps` replaces its epochs, so `epochs` and `warmup_epochs` are unused.
    config = digits.get_config()
    config.visualize = False
    config.model.patch_size = 4
    # When to stop is chosen on a validation split held out of the training images (10%, 144 images,
    # stratified), the same for every run; the subsets are drawn from the other 1,293; the test split is
    # read once per run, after it stops.
    config.validation_fraction = 0.1

    config.fractions = (0.06, 0.1, 0.25, 0.5, 1.0)  # Of the training split, stratified by class.
    config.seeds = (0, 1, 2)  # Per point: the subset, the initialisation and the batch order.
    # Each run: validated every `eval_every` steps, stopped after `patience` evaluations without improvement
    # (the best evaluation's weights kept), or at `steps`, where the cosine schedule reaches 0.
    # patience=0: no early stopping, every run trains `steps` steps.
    config.steps = 1500
    config.warmup_steps = 100
    config.eval_every, config.patience = 100, 3

    # The ResNet (experiments.baselines.build_resnet): its parameter count near the ViT's.
    config.cnn = ml_collections.ConfigDict({"widths": (22, 44, 88), "blocks_per_stage": 1})
    return config
