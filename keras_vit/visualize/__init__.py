"""What a ViT learned: attention maps, rollout, attention distance, embeddings.

And what it reads: the image cut into the sequence of patches the encoder
takes (paper Figure 1), by `patch_sequence` and `plot_patch_grid`.

Two modules, imported one way: `keras_vit.visualize.analysis` computes NumPy
arrays from a model (so the numbers can be tested and reused without a
figure); `keras_vit.visualize.figures` draws them with matplotlib (no display
needed), and saves any figure with `save_figure` (local or gs://).  Every
name below is importable from `keras_vit.visualize`.

Every function reads the model it is given, layer by layer, with that model's
own weights: no copy that could drift, no retraining.  They work for both
classifiers ("token" and "gap") and for models whose weights were loaded from
checkpoints.

    >>> import numpy as np
    >>> from keras_vit import visualize
    >>> uniform = np.full((2, 1, 4, 5, 5), 0.2)  # [layers, batch, heads, tokens, tokens]; rows sum to 1
    >>> joint = visualize.rollout(uniform)
    >>> joint.shape, bool(np.allclose(joint.sum(axis=-1), 1.0))
    ((1, 5, 5), True)

Paper: Dosovitskiy et al. 2020, Figure 1 (the patch sequence), Figure 7
(filters, position similarity, mean attention distance) and Figure 6
(attention maps by rollout, Abnar & Zuidema 2020, "Quantifying Attention Flow
in Transformers").
"""

from keras_vit.visualize.analysis import (
    HEAD_FUSIONS,
    PatchSequence,
    attention_rollout,
    attention_weights,
    mean_attention_distance,
    mean_distance,
    neighbour_similarity,
    patch_distances,
    patch_embedding_filters,
    patch_sequence,
    position_embedding_similarity,
    rollout,
)
from keras_vit.visualize.figures import (
    plot_attention_rollout,
    plot_filters,
    plot_head_attention,
    plot_mean_distance,
    plot_patch_grid,
    plot_position_similarity,
    pyplot,
    save_figure,
    write_figures,
)

__all__ = [
    "HEAD_FUSIONS",
    "PatchSequence",
    "attention_rollout",
    "attention_weights",
    "mean_attention_distance",
    "mean_distance",
    "neighbour_similarity",
    "patch_distances",
    "patch_embedding_filters",
    "patch_sequence",
    "plot_attention_rollout",
    "plot_filters",
    "plot_head_attention",
    "plot_mean_distance",
    "plot_patch_grid",
    "plot_position_similarity",
    "position_embedding_similarity",
    "pyplot",
    "rollout",
    "save_figure",
    "write_figures",
]
