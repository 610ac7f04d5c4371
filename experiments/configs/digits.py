"""A small ViT trained from scratch on scikit-learn's digits (the bundled default).

    python -m experiments.train --workdir=/tmp/vit_digits

1,797 8x8 images (1,437 train, 360 held out, stratified), upsampled to 16x16
and cut into 2x2 patches: 64 tokens of width 64, 4 blocks.  Expected: >= 97%
test accuracy in a few minutes on 2 CPU cores (sklearn's own SVM reaches ~99%,
a plain MLP ~97-98%).
"""

import ml_collections


def get_config():
    config = ml_collections.ConfigDict()
    config.seed = 0

    config.dataset = "digits"
    config.image_size = 16
    config.test_fraction = 0.2
    config.max_shift = 2  # Random translation in pixels, training only.

    config.model = ml_collections.ConfigDict()
    config.model.variant = "Ti/2"
    config.model.hidden_dim = 64
    config.model.num_layers = 4
    config.model.num_heads = 4
    config.model.mlp_dim = 128
    config.model.classifier = "token"
    config.model.dropout_rate = 0.1
    config.model.attention_dropout_rate = 0.0
    config.model.stochastic_depth_rate = 0.1

    # Transfer learning: an original-format .npz (local or gs://) to start from,
    # and whether to train the head alone.
    config.pretrained = ""
    config.interpolation = "bicubic"
    config.freeze_backbone = False

    config.batch_size = 64
    config.epochs = 60
    config.optimizer = "adamw"
    config.learning_rate = 2e-3
    config.weight_decay = 0.05
    config.warmup_epochs = 5
    config.grad_clip_norm = 1.0
    config.label_smoothing = 0.1

    # BackupAndRestore frequency: "epoch" or a number of steps.
    config.backup_every = "epoch"

    config.steps_per_execution = 1

    config.precision = "float32"  # or "mixed_bfloat16", "mixed_float16".
    config.jit_compile = True

    # Exports written to workdir/export at the end, comma separated: saved_model,
    # tflite, tflite_float16, tflite_dynamic, tflite_int8, onnx.
    config.export = ""

    # Figures of keras_vit.visualize for the first few test images, in workdir/figures.
    config.visualize = True
    config.visualize_images = 2
    return config
