r"""ViT-S/16 on ImageNet-1k from scratch: big_vision's `configs/vit_s16_i1k.py` ("Better plain ViT baselines").

    python -m experiments.train --config=experiments/configs/imagenet_s16.py \
        --config.data_dir=gs://BUCKET/tensorflow_datasets \
        --strategy=tpu --tpu=local --workdir=gs://BUCKET/vit/imagenet_s16

Reported (Beyer, Zhai, Kolesnikov 2022): 76.5% top-1 on ImageNet's validation
set after 90 epochs, in about 7 hours on a TPU v3-8.  ImageNet must be
prepared in data_dir beforehand (`tfds build imagenet2012` with the manual
download); nothing is downloaded here.

Point by point against big_vision's config:

- Data: `train[:99%]` to train on; `train[99%:]` (12,812 images) is the
  minival that validates each epoch and selects best.keras; ImageNet's
  `validation` split is the test set, read once, after training.  The
  encoded bytes are cached (`cache_raw=True`: up to 120 GB of host memory)
  and shuffled 250,000 per host.  Same.
- Training images: Inception crop of 5-100% of the area, aspect 3/4-4/3,
  decoded inside the crop (`decode_jpeg_and_inception_crop(224)`), flip,
  RandAugment(2, 10) as published.  Same, but for the resize of the crop
  to 224: bilinear with antialiasing here, without in big_vision (the
  crops larger than 224 come out a little smoother here).
- Evaluation images: `resize_small(256)|central_crop(224)` is crop_fraction
  0.875 at 224 (the short side resized to 224 / 0.875 = 256, the centre
  224 x 224 kept).  Different in the resampling: big_vision resizes with
  TensorFlow's "area" method and rounds the long side; `center_crop_resize`
  resizes bilinearly with antialiasing (close to "area" when shrinking) and
  rounds the long side up.  The central 224 x 224 is the same region to
  within a pixel.
- Pixels: [-1, 1] (`value_range(-1, 1)`): the model's own rescaling.  Same.
- Model: S/16, global average pooling, fixed 2-D sin-cos position
  embeddings, a pre-logits layer (`rep_size=True`: Dense(384) + tanh), a
  zero-initialised head, no dropout: 22,122,472 parameters.  Differences:
  the exact GELU where big_vision computes Flax's tanh approximation
  (`--config.model.activation=gelu_tanh` for that), and the pre-logits kernel drawn
  as Keras's Dense draws it (Glorot-uniform; Flax's default is
  LeCun-normal).
- Loss: softmax cross-entropy on one-hot labels, no label smoothing.  Same.
- MixUp: big_vision's `mixup=dict(p=0.2)` mixes every batch with one
  coefficient drawn from Beta(0.2, 0.2) (p is the Dirichlet concentration,
  not a probability), images and labels alike; here `mixup_alpha=0.2` does
  the same inside the training step.  The partner of each image differs
  (big_vision: the batch rolled by one; here: the batch reversed), and
  big_vision keeps the larger weight on the image itself, which with a
  symmetric Beta and a symmetric pairing gives the same distribution.
- Optimizer: Adam (0.9, 0.999), learning rate 1e-3, 10,000 linear warm-up
  steps, cosine decay to 0, global gradient clipping at 1.0, batch 1024, 90
  epochs of `train[:99%]` (1,268,355 images: 1,238 steps per epoch, the
  last partial batch of each epoch dropped, 111,420 steps where big_vision
  counts 111,477); decoupled weight decay 1e-4 on the kernels only
  (big_vision's `wd_mults` default), multiplied by the schedule.  Keras's
  AdamW multiplies its weight_decay by the learning rate, so the same decay
  is weight_decay = 1e-4 / 1e-3 = 0.1 here.  Differences: Adam's epsilon is
  Keras's 1e-7 (optax: 1e-8), and the first moment is kept in float32
  (big_vision: `mu_dtype=bfloat16`, to save memory).
- Extra evaluations: ImageNet-v2 (`imagenet_v2`, split `test`) and ReaL
  (`imagenet2012_real`, `validation`, accuracy among the real labels, images
  without one left out), evaluated after training when prepared in data_dir,
  skipped with a log line when not.  Same sets; big_vision also evaluates on
  `train[:2%]` during training, which is not done here (`fit` logs the
  training loss and accuracy).
- Execution: bfloat16 mixed precision (big_vision: float32 parameters with
  TPU's default bfloat16 matrix products), 100 steps per call; a backup of
  the run every epoch (big_vision: a checkpoint every 1,000 steps).
"""

import ml_collections

from experiments.configs import common


def get_config():
    config = common.get_base_config()

    config.dataset = "tfds:imagenet2012:train[:99%]"
    config.validation_split = "train[99%:]"  # big_vision's minival
    config.test_split = "validation"
    config.num_classes = 1000
    config.image_size = 224
    config.crop_fraction = 0.875  # resize_small(256) | central_crop(224)
    config.cache = True  # The encoded bytes, as big_vision's cache_raw.
    config.shuffle_buffer = 250_000  # Per host.
    config.augment.crop_area_range = (0.05, 1.0)  # decode_jpeg_and_inception_crop's area_min=5
    config.augment.randaugment = (2, 10)
    config.augment.mixup_alpha = 0.2

    config.model.variant = "S/16"
    config.model.classifier = "gap"
    config.model.position_embedding = "sincos2d"
    config.model.representation_size = 384  # rep_size=True: the width.

    config.batch_size = 1024
    config.epochs = 90
    config.optimizer = "adamw"
    config.learning_rate = 1e-3
    config.weight_decay = 0.1  # = big_vision's 1e-4, see the docstring
    config.weight_decay_kernels_only = True
    config.warmup_steps = 10_000

    config.extra_evals = ml_collections.ConfigDict(
        {
            "v2": {"dataset": "imagenet_v2", "split": "test", "label": "label"},
            "real": {"dataset": "imagenet2012_real", "split": "validation", "label": "real_label"},
        }
    )

    config.steps_per_execution = 100
    config.precision = "mixed_bfloat16"
    return config
