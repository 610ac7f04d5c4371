"""The fields every experiment config has, with their defaults; each config overrides what it needs.

Every field the training job reads is here, so `--config.FIELD=VALUE` works
for each of them with any config.
"""

import ml_collections
from ml_collections import config_dict


def get_base_config():
    """Every field the training job reads, with its default, one section at a time."""
    config = ml_collections.ConfigDict()
    config.seed = 0
    add_data_fields(config)
    add_model_fields(config)
    add_optimisation_fields(config)
    add_execution_fields(config)
    add_output_fields(config)
    return config


def add_data_fields(config):
    """The data set, its splits and limits, and the training augmentation."""
    config.dataset = "digits"  # "digits", "tfds:NAME[:SPLIT]" or "folder:PATH"
    config.data_dir = ""  # TFDS data_dir, local or gs://
    config.test_split = ""  # TFDS evaluation split; default "test", else "validation"
    config.num_classes = 0  # If set, must equal the data set's class count.
    config.image_size = 224
    config.test_fraction = 0.2  # Held-out share when a data set has no test split.
    # Model selection (per-epoch validation, best.keras) uses a validation split taken from the training
    # data, never the test split: this share of the training examples (stratified for the digits and
    # folders; for TFDS the end of the training split: 0.01 gives "train[:99%]" / "train[99%:]"), or for
    # TFDS the split named in validation_split (e.g. "train[99%:]" with dataset "tfds:NAME:train[:99%]").
    # A folder's validation/ subfolder, when present, is the validation split.
    config.validation_fraction = 0.1
    config.validation_split = ""
    config.crop_fraction = 1.0  # Evaluation: the central fraction kept.
    # Image sets and the exported serving_bytes: the largest image decoded (keras_vit.data.ImageLimits, whose
    # defaults these are); larger ones are refused from their header, skipped and named.
    config.image_limits = ml_collections.ConfigDict({"max_pixels": 1 << 25, "max_aspect_ratio": 20.0})
    config.cache = False  # Image sets: keep the encoded bytes in memory after the first epoch.
    config.shuffle_buffer = 10_000  # Image sets: examples shuffled per input pipeline (host).
    # "grpc://HOST:PORT" of a tf.data service dispatcher: the training input pipeline runs on its workers
    # (python -m experiments.data_service); empty: on this host.
    config.data_service = ""
    config.max_shift = 0  # digits only: random translation in pixels.
    config.augment = ml_collections.ConfigDict(
        {
            "inception_crop": True,
            # Of the image's area, the range the Inception crop draws from (timm and Keras: 8-100%).
            "crop_area_range": (0.08, 1.0),
            "flip": True,
            "randaugment": None,  # (num_ops, magnitude)
            # MixUp / CutMix, on the device inside the training step (keras_vit.enable_batch_mixing);
            # with both, CutMix for a batch with probability switch_prob.
            "mixup_alpha": 0.0,
            "cutmix_alpha": 0.0,
            "switch_prob": 0.5,
        }
    )


def add_model_fields(config):
    """The model: build_vit's arguments, and the checkpoint a transfer starts from."""
    config.model = ml_collections.ConfigDict()
    config.model.variant = "B/16"
    config.model.classifier = "token"
    config.model.dropout_rate = 0.0
    config.model.attention_dropout_rate = 0.0
    config.model.stochastic_depth_rate = 0.0
    # "learned" or "sincos2d" (fixed 2-D sin-cos); the MLPs' activation, "gelu", "gelu_tanh" (the original
    # code's), "quick_gelu" or "silu".
    config.model.position_embedding = "learned"
    config.model.activation = "gelu"

    # Transfer learning: a checkpoint to start from (local or gs://; the original
    # .npz, or timm's .safetensors), and whether to train the head alone.
    # interpolation: how its position embeddings are resampled to another grid;
    # unset, as the file's own code does (timm's antialiased bicubic for timm
    # files, bicubic for others).
    config.pretrained = ""
    config.interpolation = config_dict.placeholder(str)
    config.freeze_backbone = False


def add_optimisation_fields(config):
    """The optimisation (keras_vit.training): batch, schedule, regularisation and fine-tuning tools."""
    config.batch_size = 512  # Global, over all replicas.
    config.epochs = 10
    config.optimizer = "adamw"  # or "sgd"
    config.learning_rate = 1e-3
    config.weight_decay = 0.0
    config.weight_decay_kernels_only = False  # True: biases, norms and embeddings are not decayed (big_vision).
    config.warmup_epochs = 0
    config.warmup_steps = 0  # Wins over warmup_epochs when set.
    config.decay = "cosine"  # or "linear"
    config.grad_clip_norm = 1.0
    config.label_smoothing = 0.0
    # Fine-tuning tools (docs/fine_tuning.md). A moving average of the weights, `m * average + (1 - m) *
    # weights` after every update, validated, kept as best.keras, evaluated and exported in their place
    # (timm's --model-ema; 0: none, timm's default when on is 0.9998).
    config.ema_momentum = 0.0
    # Layer-wise learning-rate decay (BEiT, timm's --layer-decay): the head at the base rate, each block below
    # it at `layer_decay` times the rate of the one above, the embeddings last; 1.0: one rate for all.
    config.layer_decay = 1.0
    # Gradient accumulation: each batch of batch_size (the update's batch, global) runs as this many
    # micro-batches, one after the other, and updates once; the evaluation batches are micro-batches too.
    config.grad_accum_steps = 1


def add_execution_fields(config):
    """How the steps run: steps per execution, backups, precision, XLA, logging and TensorBoard figures."""
    config.steps_per_execution = 1  # > 1 keeps TPUs busy.
    config.backup_every = "epoch"  # keras_vit.callbacks.Backup: "epoch" or a number of steps.
    config.backup_minutes = 10.0  # Also a backup after this many minutes of training; 0: none.
    # On SIGTERM or SIGINT: the step in flight, a backup, then exit 143 or 130 within this many seconds.
    config.grace_seconds = 30.0
    config.precision = "float32"  # or "mixed_bfloat16", "mixed_float16".
    config.jit_compile = "auto"  # "on", "off"; see keras_vit.training.resolve_jit_compile.
    config.verbose = 2  # 1: progress bar, 2: a line per epoch.
    # TensorBoard images of the validation confusion matrix and of the attention rollout of this many fixed
    # validation images (keras_vit.callbacks.TensorBoardFigures); 0: neither.
    config.tensorboard_figures = 4
    # At the end of at most this many epochs, evenly spaced, the last included (TensorBoard shows 10 steps of an
    # image tag unless started with --samples_per_plugin=images=N); 0: every epoch.
    config.tensorboard_figure_epochs = 10


def add_output_fields(config):
    """What is made at the end: exports, figures and evaluations on more test sets."""
    # Exports into workdir/export, comma separated, by the names of keras_vit.export.ARTEFACTS (the export
    # command's --format): saved_model[:float32|bfloat16|int8], tflite[:float16|dynamic|int8], onnx.
    config.export = ""
    # Figures of keras_vit.visualize for the first few test images (after training), in workdir/figures.
    config.visualize = False
    config.visualize_images = 2
    # More test sets, evaluated after training when prepared in data_dir (skipped with a log line when
    # not): {name: {"dataset": TFDS name, "split": ..., "label": a ClassLabel feature, or a Sequence of
    # them for ReaL-style multi-label accuracy}}.
    config.extra_evals = ml_collections.ConfigDict()
