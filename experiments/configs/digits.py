"""A small ViT trained from scratch on scikit-learn's digits (the bundled default).

    python -m experiments.train --workdir=/tmp/vit_digits

1,797 8x8 images: 360 held out for the test (stratified), and of the other
1,437, 144 (10%, stratified) held out for validation (model selection:
per-epoch validation, best.keras) and 1,293 to train on.  Upsampled to 16x16
and cut into 2x2 patches: 64 tokens of width 64, 4 blocks.  Expected: >= 97%
test accuracy in a few minutes on 2 CPU cores (sklearn's own SVM reaches ~99%,
a plain MLP ~97-98%).
"""

from experiments.configs import common


def get_config():
    config = common.get_base_config()

    config.dataset = "digits"
    config.image_size = 16
    config.max_shift = 2  # Random translation in pixels, training only.

    config.model.variant = "Ti/2"
    config.model.hidden_dim = 64
    config.model.num_layers = 4
    config.model.num_heads = 4
    config.model.mlp_dim = 128
    config.model.dropout_rate = 0.1
    config.model.stochastic_depth_rate = 0.1

    config.batch_size = 64
    config.epochs = 60
    config.learning_rate = 2e-3
    config.weight_decay = 0.05
    config.warmup_epochs = 5
    config.label_smoothing = 0.1

    config.visualize = True
    return config
