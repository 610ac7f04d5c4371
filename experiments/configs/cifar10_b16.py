r"""Fine-tune ViT-B/16 (ImageNet-21k) on CIFAR-10 at 384 px: the paper's fine-tuning recipe.

    python -m experiments.train --config=experiments/configs/cifar10_b16.py \
        --config.data_dir=gs://BUCKET/tensorflow_datasets \
        --config.pretrained=gs://vit_models/imagenet21k/ViT-B_16.npz \
        --strategy=tpu --tpu=local --workdir=gs://BUCKET/vit/cifar10_b16

Recipe (Dosovitskiy et al. 2020, section 4.1 and appendix B.1.1): SGD with
momentum 0.9, no weight decay, batch 512, 10,000 steps (~102 epochs of 50,000
images), 500 warm-up steps then cosine decay, gradient clipping at global
norm 1.0, learning rate picked from {0.001, 0.003, 0.01, 0.03} (0.03 here),
resolution 384, random crop and flip.  The pre-trained head (21,843 classes)
is replaced by a zero-initialised 10-class head and the position embeddings
are resampled from 14x14 to 24x24.  Reported: 99.0% top-1 for B/16 from
ImageNet-21k (paper Table 2 / REFERENCE).  CIFAR-10 must be prepared in
data_dir beforehand (`tfds build cifar10`); nothing is downloaded here.
"""

from experiments.configs import common


def get_config():
    config = common.get_base_config()

    config.dataset = "tfds:cifar10"
    config.test_split = "test"
    config.num_classes = 10
    config.image_size = 384

    config.model.variant = "B/16"
    config.pretrained = ""  # e.g. gs://vit_models/imagenet21k/ViT-B_16.npz

    config.batch_size = 512
    config.epochs = 102
    config.optimizer = "sgd"
    config.learning_rate = 0.03
    config.warmup_steps = 500

    config.steps_per_execution = 50
    config.precision = "mixed_bfloat16"
    return config
