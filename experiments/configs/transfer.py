r"""Transfer against training from scratch, with few examples: pre-train on some classes, learn the others.

    python -m experiments.transfer --workdir=/tmp/transfer
    python -m experiments.transfer --config=experiments/configs/transfer.py \
        --config.target.shots="(5, 10)" --workdir=/tmp/transfer

The ViT of `scaling.py` is pre-trained on the digits 0-4 (all their training
images), saved as an original-format .npz, then learns the digits 5-9 from 5, 10,
25 or 50 training images per class (three seeds each): from scratch, as a
frozen backbone with a new head, and fully fine-tuned; each run tested on all
held-out images of the digits 5-9.  About 10 minutes on 2 CPU cores
(docs/experiments.md has the measured time and the results).
"""

import ml_collections

from experiments.configs import scaling


def get_config():
    # The scaling experiment's ViT, data and recipe (for pre-training and for training from scratch).
    config = scaling.get_config()
    del config.fractions, config.seeds, config.steps, config.cnn, config.eval_every, config.patience
    # Every run trains a fixed budget and is tested once: nothing is selected, so no validation split is held
    # out of the training images.
    config.validation_fraction = 0.0

    # Pre-training: every training image of these classes; the target task is the other classes.
    config.source_classes = (0, 1, 2, 3, 4)
    config.pretrain_steps = 1000
    config.warmup_steps = 100

    config.target = ml_collections.ConfigDict(
        {
            "shots": (5, 10, 25, 50),  # Training images per target class.
            "seeds": (0, 1, 2),  # Per point: the images drawn, the initialisation (from scratch), the order.
            "steps": 600,  # Optimizer steps of every run, whatever the method.
            "batch_size": 16,
            "warmup_steps": 60,
        }
    )
    # The frozen backbone and the fine-tuning start from the pre-trained weights with the paper's
    # fine-tuning recipe (SGD, momentum 0.9, no weight decay, cosine decay; appendix B.1.1); from
    # scratch uses the pre-training recipe above.  The learning rate is the largest of the paper's
    # fine-tuning grid {0.001, 0.003, 0.01, 0.03}: in a trial of 10 images per class it fitted the
    # training images best (0.01 left fine-tuning at 78-84% of them); no test image was looked at.
    config.finetune = ml_collections.ConfigDict({"optimizer": "sgd", "learning_rate": 0.03, "weight_decay": 0.0})
    return config
