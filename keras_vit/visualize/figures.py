"""The figures of `keras_vit.visualize`: what `keras_vit.visualize.analysis` computes, drawn with matplotlib.

The `plot_*` functions take the arrays the analysis returns and write a PNG
(local or gs://); `write_figures` computes and draws them all for one image.
No display is needed (matplotlib's Agg backend).  `pyplot` and `save_figure`
serve any other figure, so that every figure of the project is saved the same
way.
"""

import math

import numpy as np

from keras_vit.files import atomic_path
from keras_vit.visualize.analysis import (
    attention_rollout,
    attention_weights,
    check_images,
    mean_distance,
    patch_embedding_filters,
    patch_encoder,
    patch_layout,
    patch_sequence,
    position_embedding_similarity,
    prefix_tokens,
    reads_class_token,
    resnet_stride,
)


def pyplot():
    """`matplotlib.pyplot` with the Agg backend: figures are drawn to files, no display is needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _hide_axes(ax):
    """No frame, ticks or labels on `ax`. `axis("off")` alone leaves the two axes visible to the layout, which
    then makes and measures their ticks: a third of a figure's time, for nothing drawn."""
    ax.axis("off")
    ax.xaxis.set_visible(False)
    ax.yaxis.set_visible(False)


# A patch drawn in a mosaic of patches is enlarged to about this many pixels a side, each of its pixels a block.
_PATCH_PIXELS = 24


def _enlarged(pixels, scale):
    """`pixels` (height, width, ...) with each pixel a `scale` x `scale` block: nearest-neighbour, so small patches
    stay sharp when the mosaic is drawn as one image."""
    return np.repeat(np.repeat(pixels, scale, axis=0), scale, axis=1)


def save_figure(figure, path, *, dpi=100):
    """Writes a matplotlib figure as a PNG to `path` (local, gs:// or any TensorFlow file system), closes it,
    returns the path as a string.

    The PNG is written whole or not at all (`keras_vit.files.atomic_path`):
    under a temporary name, renamed onto `path` when complete, so a failed
    write leaves the previous file as it was and no partial file.
    """
    path = str(path)
    try:
        with atomic_path(path) as temporary:
            figure.savefig(temporary, format="png", dpi=dpi)
    finally:
        pyplot().close(figure)
    return path


def _display_image(image):
    image = np.asarray(image, np.float32)
    if image.max() > 1.0:
        image = image / 255.0
    image = np.clip(image, 0.0, 1.0)
    return image[..., 0] if image.shape[-1] == 1 else image


def plot_attention_rollout(image, attention_map, path):
    """The image, its rollout map, and the map overlaid on the image."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(9, 3.2))
    axes[0].imshow(_display_image(image), cmap="gray")
    axes[0].set_title("image")
    axes[1].imshow(attention_map, cmap="inferno", vmin=0, vmax=1)
    axes[1].set_title("attention rollout")
    axes[2].imshow(_display_image(image), cmap="gray")
    axes[2].imshow(attention_map, cmap="jet", alpha=0.5, vmin=0, vmax=1)
    axes[2].set_title("overlay")
    for ax in axes:
        _hide_axes(ax)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_head_attention(image, attentions, grid_size, has_class_token, path, prefix=None):
    """Per-head attention of the last layer, from the class token (or averaged over queries).

    `attentions` is one image's last-layer attention, [heads, tokens, tokens]; `prefix`: the tokens before the
    patches' (default: the class token if any).
    """
    prefix = int(has_class_token) if prefix is None else prefix
    plt = pyplot()
    heads = attentions.shape[0]
    cols = min(heads, 6)
    rows = 1 + math.ceil(heads / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2 * cols, 2 * rows), squeeze=False)
    for ax in axes.ravel():
        _hide_axes(ax)
    axes[0, 0].imshow(_display_image(image), cmap="gray")
    axes[0, 0].set_title("image")
    for h in range(heads):
        maps = attentions[h, 0, prefix:] if has_class_token else attentions[h, prefix:, prefix:].mean(axis=0)
        ax = axes[1 + h // cols, h % cols]
        ax.imshow(maps.reshape(grid_size), cmap="inferno")
        ax.set_title(f"head {h}")
    fig.suptitle("last layer attention" + (" of the class token" if has_class_token else ""))
    fig.tight_layout()
    return save_figure(fig, path)


def plot_mean_distance(distances, path, image_size=None):
    """Mean attention distance of every head against network depth (Figure 7, right)."""
    plt = pyplot()
    layers, heads = distances.shape
    fig, ax = plt.subplots(figsize=(5, 4))
    for h in range(heads):
        ax.scatter(np.arange(layers), distances[:, h], s=12, label=f"head {h}" if heads <= 16 else None)
    ax.set_xlabel("network depth (layer)")
    ax.set_ylabel("mean attention distance (pixels)")
    if image_size:
        ax.set_ylim(0, math.hypot(*image_size))
    if heads <= 16:
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return save_figure(fig, path)


def similarity_mosaic(similarity, gap=1):
    """The (gh, gw, gh, gw) similarity maps tiled into one (gh * (gh + gap) - gap, gw * (gw + gap) - gap) array: the
    map of patch (i, j) at tile (i, j), tiles apart by `gap` NaN pixels (drawn as the background)."""
    gh, gw = similarity.shape[:2]
    mosaic = np.full((gh * (gh + gap) - gap, gw * (gw + gap) - gap), np.nan, np.float32)
    for i in range(gh):
        for j in range(gw):
            top, left = i * (gh + gap), j * (gw + gap)
            mosaic[top:top + gh, left:left + gw] = similarity[i, j]
    return mosaic


def plot_position_similarity(similarity, path):
    """For each patch position, its embedding's cosine similarity with all others (Figure 7, centre): the map of
    patch (i, j) in row i and column j of the grid, all drawn as one image (one draw call for any grid size)."""
    from matplotlib import colormaps

    plt = pyplot()
    gh, gw = similarity.shape[:2]
    fig, ax = plt.subplots(figsize=(max(gw, 2) * 0.8, max(gh, 2) * 0.8))
    cmap = colormaps["viridis"].with_extremes(bad="white")
    ax.imshow(similarity_mosaic(similarity), cmap=cmap, vmin=-1, vmax=1, interpolation="nearest")
    _hide_axes(ax)
    fig.suptitle("position embedding similarity")
    fig.subplots_adjust(left=0.02, right=0.98, bottom=0.02, top=0.9)
    return save_figure(fig, path)


def plot_filters(filters, path):
    """Principal components of the patch-embedding filters as RGB patches (Figure 7, left), each scaled to its
    own range, 7 to a row. They are drawn as one image (one resampling, where an axes per filter costs each its
    own layout and drawing)."""
    plt = pyplot()
    filters = [np.asarray(component, np.float32) for component in filters]
    count = len(filters)
    cols = min(count, 7)
    rows = math.ceil(count / cols)
    height, width, channels = filters[0].shape
    scale = max(1, math.ceil(_PATCH_PIXELS / max(height, width)))
    tile_h, tile_w = height * scale, width * scale
    gap = max(1, max(tile_h, tile_w) // 8)
    canvas = np.ones((rows * (tile_h + gap) - gap, cols * (tile_w + gap) - gap, 3 if channels == 1 else channels),
                     np.float32)  # fmt: skip
    for k, component in enumerate(filters):
        low, high = component.min(), component.max()
        shown = (component - low) / max(high - low, 1e-12)
        if channels == 1:
            shown = np.repeat(shown, 3, axis=-1)  # Grey.
        top, left = (k // cols) * (tile_h + gap), (k % cols) * (tile_w + gap)
        canvas[top:top + tile_h, left:left + tile_w] = _enlarged(shown, scale)
    fig, ax = plt.subplots(figsize=(cols, rows + 0.4))
    ax.imshow(canvas, interpolation="nearest")
    _hide_axes(ax)
    fig.suptitle("patch embedding filters (principal components)")
    return save_figure(fig, path)


def _fitting_fontsize(width_in, height_in, characters, largest=9.0):
    """The font size (points) at which `characters` characters fit in a box of these inches."""
    # A digit is about 0.6 em wide; one more em leaves room for the label's padding.
    return min(largest, 72 * width_in / (0.6 * characters + 1.0), 72 * height_in * 0.7)


def plot_patch_grid(image, sequence, path, *, columns=None):
    """The image with its patch grid, and its patches laid out in order (paper Figure 1).

    Top: the image, the grid drawn over it and each cell labelled with its
    position in the encoder's sequence.  Below: the sequence itself, read
    left to right and top to bottom, each patch under its position index;
    with a class token, a "[class]" slot at position 0 comes first.

    Args:
        image: the image `sequence` was cut from.
        sequence: a `PatchSequence` from `patch_sequence`.
        path: where the PNG goes (local or gs://).
        columns: slots per row of the sequence (default: all, at most 16).
    """
    plt = pyplot()
    shown = _display_image(image)
    height, width = shown.shape[:2]
    (gh, gw), (ph, pw) = sequence.grid_size, sequence.patch_size
    if (gh * ph, gw * pw) != (height, width):
        raise ValueError(
            f"The sequence's {sequence.grid_size} grid of {sequence.patch_size} pixel patches does not "
            f"cover the image. Received: image of height and width {(height, width)}"
        )
    count = len(sequence.positions) + sequence.class_token
    columns = min(count, 16) if columns is None else columns
    if not isinstance(columns, int) or columns < 1:
        raise ValueError(f"`columns` must be a positive integer. Received: columns={columns!r}")
    seq_rows = math.ceil(count / columns)
    # The sequence in units of one patch width: each slot is a patch under a label band.  It is drawn as one
    # image (one resampling, where a patch per `imshow` costs one each), `scale` pixels to a patch's pixel.
    scale = max(1, math.ceil(_PATCH_PIXELS / pw))
    unit, patch_h = pw * scale, ph * scale
    gap_px, band_px = max(1, round(0.2 * unit)), round(0.5 * unit)
    slot_w_px, slot_h_px = unit + gap_px, patch_h + band_px + gap_px
    aspect, gap, band = ph / pw, gap_px / unit, band_px / unit
    slot_w, slot_h = slot_w_px / unit, slot_h_px / unit
    fig_w = min(max(columns * 0.6, 4.0), 10.0)
    image_w = min(fig_w * 0.6, 4.0 * width / height)
    image_h = image_w * height / width
    seq_h = fig_w * seq_rows * slot_h / (columns * slot_w)
    fig = plt.figure(figsize=(fig_w, image_h + seq_h + 1.0))
    grid_ax, seq_ax = fig.subplots(2, 1, gridspec_kw={"height_ratios": [image_h, seq_h]})

    digits = len(str(int(sequence.positions[-1])))
    grid_ax.imshow(shown, cmap="gray", interpolation="nearest", extent=(0, width, height, 0))
    for x in range(0, width + 1, pw):
        grid_ax.axvline(x, color="white", linewidth=1)
    for y in range(0, height + 1, ph):
        grid_ax.axhline(y, color="white", linewidth=1)
    fontsize = _fitting_fontsize(image_w / gw, image_h / gh, digits)
    if fontsize >= 4:  # Smaller labels are unreadable; the sequence below carries them.
        for (top, left, bottom, right), position in zip(sequence.boxes, sequence.positions):
            grid_ax.text(
                (left + right) / 2, (top + bottom) / 2, str(position), color="white", fontsize=fontsize,
                ha="center", va="center", bbox={"facecolor": "black", "alpha": 0.4, "pad": 0.5, "linewidth": 0},
            )
    grid_ax.set_title(f"{gh}x{gw} patches of {ph}x{pw} pixels", fontsize=10)
    _hide_axes(grid_ax)

    label_size = _fitting_fontsize(fig_w / columns, band * fig_w / (columns * slot_w), digits)
    # Patches are cut from the displayed image, so they share its scaling; None is the class token.
    crops = [shown[top:bottom, left:right] for top, left, bottom, right in sequence.boxes]
    slots = list(zip(sequence.positions, crops))
    if sequence.class_token:
        slots.insert(0, (0, None))
    canvas = np.zeros((seq_rows * slot_h_px, columns * slot_w_px, 4), np.float32)
    for k, (position, crop) in enumerate(slots):
        left, top = (k % columns) * slot_w, (k // columns) * slot_h + band
        if crop is None:
            seq_ax.add_patch(
                plt.Rectangle((left, top), 1, aspect, facecolor="#d9c8ec", edgecolor="#6a3d9a", linewidth=1)
            )
            seq_ax.text(
                left + 0.5, top + aspect / 2, "[class]", ha="center", va="center",
                fontsize=_fitting_fontsize(fig_w / columns, aspect * fig_w / (columns * slot_w), 7, 8.0),
            )
        else:
            x, y = (k % columns) * slot_w_px, (k // columns) * slot_h_px + band_px
            pixels = _enlarged(crop, scale)
            canvas[y:y + patch_h, x:x + unit, :3] = pixels[..., None] if pixels.ndim == 2 else pixels
            canvas[y:y + patch_h, x:x + unit, 3] = 1.0
        seq_ax.text(left + 0.5, top - 0.05, str(position), ha="center", va="bottom", fontsize=label_size)
    # Transparent between the patches; drawn under the class token's slot, which it leaves empty.
    seq_ax.imshow(canvas, interpolation="nearest", extent=(0, canvas.shape[1] / unit, canvas.shape[0] / unit, 0),
                  zorder=0)
    seq_ax.set_xlim(-gap / 2, columns * slot_w - gap / 2)
    seq_ax.set_ylim(seq_rows * slot_h, 0)
    seq_ax.set_aspect("equal")
    seq_ax.set_title("the sequence the encoder reads (position index above each patch)", fontsize=10)
    _hide_axes(seq_ax)
    fig.tight_layout()
    return save_figure(fig, path)


def write_figures(model, image, out_dir, *, prefix=""):
    """Writes every figure for one image into `out_dir`; returns the paths.

    The files (each name after `prefix`): `patch_grid.png` (the image as the
    sequence of patches the encoder reads), `attention_rollout.png`,
    `head_attention.png`, `mean_attention_distance.png`,
    `position_similarity.png` and, except for hybrids, whose embedding acts
    on ResNet features rather than pixels, `embedding_filters.png`.
    """
    import tensorflow as tf

    tf.io.gfile.makedirs(str(out_dir))
    image = check_images(model, image)[:1]
    grid_size, patch_size, has_class_token = patch_layout(model)
    tokens_before, _ = prefix_tokens(model)
    attentions = attention_weights(model, image)

    def join(name):
        return f"{str(out_dir).rstrip('/')}/{prefix}{name}"

    height, width = image.shape[1:3]
    paths = [
        plot_patch_grid(image[0], patch_sequence(model, image), join("patch_grid.png")),
        plot_attention_rollout(image[0], attention_rollout(model, image)[0], join("attention_rollout.png")),
        plot_head_attention(image[0], attentions[-1, 0], grid_size, reads_class_token(model),
                            join("head_attention.png"), prefix=tokens_before),  # fmt: skip
        plot_mean_distance(
            mean_distance(attentions, grid_size, patch_size, tokens_before),
            join("mean_attention_distance.png"),
            image_size=(height, width),
        ),
        plot_position_similarity(position_embedding_similarity(model), join("position_similarity.png")),
    ]
    if resnet_stride(model) == 1:  # Hybrids embed ResNet features, not pixels.
        encoder = patch_encoder(model)
        patch_values = int(np.prod(encoder.kernel.shape[:3]))
        filters = patch_embedding_filters(model, min(28, encoder.hidden_dim, patch_values))
        paths.append(plot_filters(filters, join("embedding_filters.png")))
    return paths
