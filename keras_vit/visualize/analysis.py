"""What a ViT learned, as NumPy arrays: attention maps, rollout, attention distance, embeddings.

And what it reads: the image cut into the sequence of patches the encoder
takes (paper Figure 1), by `patch_sequence`.

Every function reads the model it is given, layer by layer, with that model's
own weights: no copy that could drift, no retraining.  They work for both
classifiers ("token" and "gap") and for models whose weights were loaded from
checkpoints.  `keras_vit.visualize.figures` draws what these return.

Paper: Dosovitskiy et al. 2020, Figure 1 (the patch sequence), Figure 7
(filters, position similarity, mean attention distance) and Figure 6
(attention maps by rollout, Abnar & Zuidema 2020, "Quantifying Attention Flow
in Transformers").
"""

import typing

import keras
import numpy as np

from keras_vit.layers import PatchEncoder, TransformerBlock
from keras_vit.resnet import ResNetStem
from keras_vit.variants import to_pair

HEAD_FUSIONS = ("mean", "max", "min")


# === Reading the model ===


def patch_encoder(model):
    """The model's one `PatchEncoder` layer; a ValueError for a model that is not a ViT."""
    encoders = [layer for layer in model.layers if isinstance(layer, PatchEncoder)]
    if len(encoders) != 1:
        raise ValueError(
            f"Expected a ViT with one PatchEncoder layer. Received: model {model.name!r} with "
            f"{len(encoders)} PatchEncoder layers."
        )
    return encoders[0]


def check_images(model, images):
    """`images` as a NumPy batch the model takes: (batch, H, W, C), one (H, W, C) image made a batch of one.

    A ValueError names the shape expected and the shape received.
    """
    images = np.asarray(images)
    expected = tuple(model.input_shape[1:])
    if images.ndim == 3:
        images = images[None]
    if images.ndim != 4 or images.shape[1:] != expected:
        raise ValueError(
            f"Expected images of shape (batch, {', '.join(map(str, expected))}) for model "
            f"{model.name!r}. Received: shape {images.shape}"
        )
    return images


def attention_weights(model, images, batch_size=32):
    """The attention probabilities of every encoder block.

    Runs the model's layers in order on `images` (inference mode), asking each
    `TransformerBlock` for its attention probabilities.

    Args:
        model: a model from `build_vit` (or loaded from `.keras`).
        images: (batch, H, W, C) or one (H, W, C) image, pixels as the model
            takes them.
        batch_size: images per forward pass.

    Returns:
        float32 array [layers, batch, heads, tokens, tokens]; rows (queries)
        sum to 1.  Token 0 is the class token when the model has one.
    """
    images = check_images(model, images)
    patch_encoder(model)  # A clear error for models that are not ViTs.
    chunks = []
    for start in range(0, len(images), batch_size):
        x = keras.ops.convert_to_tensor(images[start : start + batch_size])
        scores = []
        for layer in model.layers[1:]:
            if isinstance(layer, TransformerBlock):
                x, s = layer(x, training=False, return_attention_scores=True)
                scores.append(keras.ops.convert_to_numpy(s).astype(np.float32))
            elif scores:
                break  # Past the encoder: the head is not needed.
            else:
                x = layer(x, training=False)
        chunks.append(np.stack(scores))
    return np.concatenate(chunks, axis=1)


def resnet_stride(model):
    """The hybrids' ResNet stride (1 for a plain ViT): input pixels per cell of the feature map the patches are
    cut from."""
    stems = [layer for layer in model.layers if isinstance(layer, ResNetStem)]
    return ResNetStem.stride(stems[0].num_layers) if stems else 1


def patch_layout(model):
    """(grid size, patch size in input pixels, has class token) of a ViT.

    For a hybrid, a patch is a cell of the ResNet feature map: patch size
    times the stem's stride in input pixels.
    """
    encoder = patch_encoder(model)
    stride = resnet_stride(model)
    patch = (encoder.patch_size[0] * stride, encoder.patch_size[1] * stride)
    return encoder.grid_size, patch, encoder.use_class_token


def reads_class_token(model):
    """Whether the model's output reads its class token (classifier "token" or "token_gap"), not only the patches'
    tokens: a class token beside a mean that leaves it out ("gap" with `class_token`) is not read."""
    pooling = next((layer for layer in model.layers if layer.name == "pooling"), None)
    method = getattr(pooling, "method", None)
    if method is None:
        return patch_encoder(model).use_class_token and not hasattr(pooling, "probe")
    return method in ("token", "token_gap")


def prefix_tokens(model):
    """(tokens before the patches' in the sequence the blocks read, those of them with a position embedding):
    the class and distillation tokens have positions, register tokens (after them) none."""
    encoder = patch_encoder(model)
    return encoder.num_prefix_tokens, encoder.num_positioned_prefix


# === Attention rollout ===


def rollout(attentions, head_fusion="mean", discard_ratio=0.0, class_token=True):
    """Attention rollout over the layers (Abnar & Zuidema 2020).

    For each layer: fuse the heads (mean, max or min), zero the weakest
    `discard_ratio` of the attention entries, add the identity for the
    residual path, renormalise the rows; then multiply the layers (last layer
    on the left).

    Args:
        attentions: [layers, batch, heads, tokens, tokens].
        class_token: token 0 is a class token; attention to it is never
            discarded, since it is the path through which the class token's
            own information flows.

    Returns:
        [batch, tokens, tokens]: how much each output token draws on each input
        token.
    """
    if head_fusion not in HEAD_FUSIONS:
        raise ValueError(
            f"`head_fusion` must be one of {HEAD_FUSIONS}. Received: head_fusion={head_fusion!r}"
        )
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(f"`discard_ratio` must be in [0, 1). Received: discard_ratio={discard_ratio!r}")
    attentions = np.asarray(attentions, np.float64)
    if attentions.ndim != 5 or attentions.shape[-1] != attentions.shape[-2]:
        raise ValueError(
            "Expected attentions of shape [layers, batch, heads, tokens, tokens]. Received: "
            f"shape {attentions.shape}"
        )
    _, batch, _, tokens, _ = attentions.shape
    identity = np.eye(tokens)
    joint = np.broadcast_to(identity, (batch, tokens, tokens))
    for layer_attention in attentions:
        fused = getattr(layer_attention, head_fusion)(axis=1)  # [batch, tokens, tokens]
        if discard_ratio > 0:
            flat = fused.reshape(batch, -1).copy()
            num_discard = int(flat.shape[1] * discard_ratio)
            weakest = np.argsort(flat, axis=1)[:, :num_discard]
            for b in range(batch):
                discard = weakest[b]
                if class_token:
                    discard = discard[discard % tokens != 0]
                flat[b, discard] = 0.0
            fused = flat.reshape(batch, tokens, tokens)
        a = fused + identity
        a = a / a.sum(axis=-1, keepdims=True)
        joint = a @ joint
    return joint


def attention_rollout(model, images, *, head_fusion="mean", discard_ratio=0.0):
    """Rollout maps of what the model's output draws on, at the image's size.

    For a class-token model, the class token's row of the rollout; for a "gap"
    model (which pools the mean of all tokens) the mean of the rows.  The map
    over the patch grid is scaled so its maximum is 1 and upsampled
    (bilinear) to the input size.

    Returns:
        float32 [batch, H, W] in [0, 1].
    """
    images = check_images(model, images)
    (gh, gw), _, has_class_token = patch_layout(model)
    prefix, _ = prefix_tokens(model)
    joint = rollout(attention_weights(model, images), head_fusion, discard_ratio, has_class_token)
    if reads_class_token(model):
        maps = joint[:, 0, prefix:]
    else:  # The patches' rows (registers, first, are not pooled), over the patches.
        maps = joint[:, prefix:, prefix:].mean(axis=1)
    maps = maps.reshape(-1, gh, gw)
    maps = maps / np.maximum(maps.max(axis=(1, 2), keepdims=True), 1e-12)
    height, width = images.shape[1:3]
    resized = keras.ops.image.resize(
        maps[..., None].astype(np.float32), (height, width), interpolation="bilinear"
    )
    return np.clip(keras.ops.convert_to_numpy(resized)[..., 0], 0.0, 1.0)


# === Mean attention distance ===


def patch_distances(grid_size, patch_size):
    """Euclidean distances in pixels between patch centres: [patches, patches]."""
    (gh, gw), (ph, pw) = grid_size, patch_size
    rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    centres = np.stack([(rows.ravel() + 0.5) * ph, (cols.ravel() + 0.5) * pw], axis=-1)
    return np.linalg.norm(centres[:, None, :] - centres[None, :, :], axis=-1)


def mean_distance(attentions, grid_size, patch_size, has_class_token):
    """Mean attention distance in pixels, [layers, heads], from attention maps.

    For each query patch: the attention-weighted mean distance between its
    centre and the key patches' centres; averaged over query patches and
    images.  The class token has no position: its row and column are left out,
    and the remaining weights of each row are renormalised over the patches.
    `has_class_token` may also be the number of tokens before the patches
    (class, distillation and register tokens), all left out.
    """
    attentions = np.asarray(attentions, np.float64)
    prefix = int(has_class_token)
    if prefix:
        attentions = attentions[..., prefix:, prefix:]
    distances = patch_distances(grid_size, patch_size)
    if attentions.shape[-1] != distances.shape[0]:
        raise ValueError(
            f"Attention over {attentions.shape[-1]} patches does not match the grid {grid_size}."
        )
    weights = attentions / np.maximum(attentions.sum(axis=-1, keepdims=True), 1e-12)
    per_query = (weights * distances).sum(axis=-1)  # [layers, batch, heads, queries]
    return per_query.mean(axis=(1, 3))


def mean_attention_distance(model, images):
    """Mean attention distance in pixels, [layers, heads] (paper Figure 7, right)."""
    grid_size, patch_size, _ = patch_layout(model)
    return mean_distance(attention_weights(model, images), grid_size, patch_size, prefix_tokens(model)[0])


# === Embeddings ===


def position_embedding_similarity(model):
    """Cosine similarity between the position embeddings of the patches.

    Returns [grid_h, grid_w, grid_h, grid_w]: entry (i, j, k, l) is the
    similarity of patch (i, j)'s embedding with patch (k, l)'s (paper
    Figure 7, centre).  The class token's embedding is left out.
    """
    (gh, gw), _, _ = patch_layout(model)
    posemb = keras.ops.convert_to_numpy(patch_encoder(model).position_embedding)[0]
    posemb = posemb[prefix_tokens(model)[1]:]  # Without the class (and distillation) token's rows.
    posemb = posemb.astype(np.float64)
    unit = posemb / np.maximum(np.linalg.norm(posemb, axis=-1, keepdims=True), 1e-12)
    return (unit @ unit.T).reshape(gh, gw, gh, gw)


def neighbour_similarity(similarity):
    """Mean position similarity of neighbouring versus distant patches.

    Neighbours: patches sharing an edge.  Distant: patches at least half the
    grid apart along one axis (Chebyshev distance >= max(grid) / 2).  A grid
    structure like the paper's shows as neighbours well above distant.

    Returns:
        {"position_similarity_neighbours": float, "position_similarity_distant": float}
    """
    gh, gw = similarity.shape[:2]
    rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    rows, cols = rows.ravel(), cols.ravel()
    dr = np.abs(rows[:, None] - rows[None, :])
    dc = np.abs(cols[:, None] - cols[None, :])
    flat = similarity.reshape(gh * gw, gh * gw)
    neighbours = (dr + dc) == 1
    distant = np.maximum(dr, dc) >= max(gh, gw) / 2
    if not neighbours.any() or not distant.any():
        raise ValueError(f"The patch grid {(gh, gw)} is too small to compare neighbours and distant patches.")
    return {
        "position_similarity_neighbours": float(flat[neighbours].mean()),
        "position_similarity_distant": float(flat[distant].mean()),
    }


def patch_embedding_filters(model, num_components=28):
    """The top principal components of the patch-embedding filters (Figure 7, left).

    Each of the D columns of the embedding kernel is a filter of
    patch_h * patch_w * channels values; the principal components of these D
    filters (centred) are returned as patches, in decreasing order of variance.

    Returns:
        [num_components, patch_h, patch_w, channels]; as flat vectors the
        components are orthonormal.
    """
    encoder = patch_encoder(model)
    if resnet_stride(model) != 1:
        raise ValueError(
            f"Model {model.name!r} is a hybrid: its patch embedding filters act on ResNet features, "
            "not on pixels, so they cannot be shown as image patches."
        )
    kernel = keras.ops.convert_to_numpy(encoder.kernel).astype(np.float64)
    ph, pw, channels, dim = kernel.shape
    filters = kernel.reshape(-1, dim).T  # [D, P*P*C]
    max_components = min(filters.shape)
    if not isinstance(num_components, int) or not 1 <= num_components <= max_components:
        raise ValueError(
            f"`num_components` must be an integer in [1, {max_components}] for this model "
            f"(hidden {dim}, patch values {ph * pw * channels}). Received: num_components={num_components!r}"
        )
    centred = filters - filters.mean(axis=0, keepdims=True)
    _, _, components = np.linalg.svd(centred, full_matrices=False)
    return components[:num_components].reshape(num_components, ph, pw, channels)


# === The patch sequence ===


class PatchSequence(typing.NamedTuple):
    """An image as the sequence of patches the encoder reads (paper Figure 1).

    Fields:
        patches: [num_patches, patch_h, patch_w, channels], the image's pixels
            (as given, before any rescaling inside the model), in the order of
            the encoder's tokens: row-major over the grid.
        boxes: int [num_patches, 4], each patch's (top, left, bottom, right)
            in pixels, bottom and right exclusive.
        positions: int [num_patches], each patch's index in the encoder's
            token sequence (the row of the position embedding it receives):
            1 ... N after the class token at 0, or 0 ... N-1 without one.
        grid_size: (rows, columns) of the patch grid.
        patch_size: (height, width) of a patch in input pixels (for hybrids,
            the patch size times the ResNet stem's stride).
        class_token: the sequence starts with a class token (position 0).
    """

    patches: np.ndarray
    boxes: np.ndarray
    positions: np.ndarray
    grid_size: tuple
    patch_size: tuple
    class_token: bool


def patch_sequence(model_or_patch_size, image, *, class_token=None):
    """Cuts one image into the patches a ViT reads, in the encoder's order.

    Args:
        model_or_patch_size: a model from `build_vit` (its patch size, grid
            and classifier are read from it; for a hybrid a patch is one cell
            of the ResNet feature map, patch size x stem stride pixels wide),
            or a patch size (int or (height, width)) in pixels.
        image: (H, W, C) or (H, W), or a batch of one.  With a model, its
            input size; with a patch size, any size the patch divides.
        class_token: with a patch size, whether the sequence has a class
            token (default True, the paper's classifier).  With a model it is
            the model's; a different value is refused.

    Returns:
        A `PatchSequence`.  Its `patches`, flattened, equal the rows of
        `keras_vit.layers.Patches(patch_size)(image)`: the order in which the
        model embeds them.

    >>> seq = patch_sequence((8, 16), np.zeros((16, 32, 3)), class_token=False)
    >>> seq.grid_size, seq.patches.shape, seq.boxes[1].tolist(), seq.positions.tolist()
    ((2, 2), (4, 8, 16, 3), [0, 16, 8, 32], [0, 1, 2, 3])
    """
    image = np.asarray(image)
    if isinstance(model_or_patch_size, keras.Model):
        model = model_or_patch_size
        image = check_images(model, image if image.ndim != 2 else image[..., None])[0]
        grid_size, patch_size, has_class_token = patch_layout(model)
        if class_token is not None and bool(class_token) != has_class_token:
            raise ValueError(
                f"Model {model.name!r} {'has' if has_class_token else 'has no'} class token. "
                f"Received: class_token={class_token!r}"
            )
        covered = (grid_size[0] * patch_size[0], grid_size[1] * patch_size[1])
        if covered != image.shape[:2]:
            # A hybrid whose input size its ResNet stride does not divide: the
            # feature map's last cells reach past the image.
            raise ValueError(
                f"Model {model.name!r}'s {grid_size} grid of {patch_size} pixel patches covers "
                f"{covered} pixels, not its input size {image.shape[:2]}: its patches are not "
                "pixel blocks of the image."
            )
    else:
        patch_size = to_pair(model_or_patch_size, "patch_size")
        has_class_token = True if class_token is None else bool(class_token)
        if image.ndim == 4 and len(image) == 1:
            image = image[0]
        if image.ndim == 2:
            image = image[..., None]
        if image.ndim != 3:
            raise ValueError(
                "Expected one image of shape (height, width, channels) or (height, width). "
                f"Received: shape {image.shape}"
            )
        height, width = image.shape[:2]
        if height % patch_size[0] or width % patch_size[1]:
            raise ValueError(
                f"The image size must be divisible by the patch size: expected a height that is a "
                f"multiple of {patch_size[0]} and a width that is a multiple of {patch_size[1]}. "
                f"Received: image size (height, width)=({height}, {width}), patch_size={patch_size}"
            )
        grid_size = (height // patch_size[0], width // patch_size[1])
    (gh, gw), (ph, pw) = grid_size, patch_size
    rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    tops, lefts = rows.ravel() * ph, cols.ravel() * pw
    boxes = np.stack([tops, lefts, tops + ph, lefts + pw], axis=1)
    patches = np.stack([image[top:bottom, left:right] for top, left, bottom, right in boxes])
    positioned = prefix_tokens(model_or_patch_size)[1] if isinstance(model_or_patch_size, keras.Model) else int(
        has_class_token)  # fmt: skip
    positions = np.arange(gh * gw) + positioned
    return PatchSequence(patches, boxes, positions, tuple(grid_size), tuple(patch_size), has_class_token)
