r"""ViT-S/16 on ImageNet-1k from scratch: the "Better plain ViT baselines" recipe (big_vision).

    python -m experiments.train --config=experiments/configs/imagenet_s16.py \
        --config.data_dir=gs://BUCKET/tensorflow_datasets \
        --strategy=tpu --tpu=local --workdir=gs://BUCKET/vit/imagenet_s16

Recipe (Beyer, Zhai, Kolesnikov 2022): 90 epochs, batch 1024, Adam with
decoupled weight decay, learning rate 1e-3, 10,000 warm-up steps (~8 epochs),
cosine decay, gradient clipping at 1.0, Inception crop 224 + flip +
RandAugment(2, 10) + MixUp (alpha 0.2), global average pooling, fixed 2-D
sin-cos position embeddings, no dropout. Reported: 76.5% top-1 in about 7
hours on a TPU v3-8.

The model is big_vision's (`position_embedding="sincos2d"`, 21,974,632
parameters), with the exact GELU where big_vision computes Flax's tanh
approximation (`--config.model.gelu=tanh` for that). One deliberate
difference: big_vision applies weight decay 1e-4 scaled by the schedule
alone, Keras's AdamW scales it by the learning rate, so the same decay is
weight_decay = 1e-4 / 1e-3 = 0.1 here.  ImageNet must be prepared in data_dir
beforehand (`tfds build imagenet2012` with the manual download); nothing is
downloaded here.
"""

from experiments.configs import common


def get_config():
    config = common.get_base_config()

    config.dataset = "tfds:imagenet2012"
    config.test_split = "validation"
    config.num_classes = 1000
    config.image_size = 224
    config.crop_fraction = 0.875
    config.augment.randaugment = (2, 10)
    config.augment.mixup_alpha = 0.2

    config.model.variant = "S/16"
    config.model.classifier = "gap"
    config.model.position_embedding = "sincos2d"

    config.batch_size = 1024
    config.epochs = 90
    config.optimizer = "adamw"
    config.learning_rate = 1e-3
    config.weight_decay = 0.1  # = big_vision's 1e-4, see the docstring
    config.warmup_steps = 10_000

    config.steps_per_execution = 100
    config.precision = "mixed_bfloat16"
    return config
