"""Position embeddings resampled to another patch grid: the class-token row kept apart, the patch rows
treated as an image and resized as PyTorch, Pillow, timm or the original code would.

Each method but "zoom" is a (new, old) matrix per grid axis, applied to the rows and then to the columns;
the matrices are written from the kernels' definitions, so no image library is needed.
"""

import numpy as np

from keras_vit.checkpoints.base import check_interpolation, square_side


def _keys_cubic(t, a):
    """The cubic convolution kernel of Keys (1981) with parameter `a`."""
    t = np.abs(t)
    return np.where(
        t <= 1,
        ((a + 2) * t - (a + 3)) * t * t + 1,
        np.where(t < 2, ((a * t - 5 * a) * t + 8 * a) * t - 4 * a, 0.0),
    )


def _antialiased_bicubic_matrix(old, new):
    """(new, old) matrix of PyTorch's bicubic resize with antialias=True (Pillow's resampling):
    Keys' kernel with a = -0.5, stretched by the scale old / new when shrinking (a low-pass
    filter), output i centred at (i + 0.5) * scale in input pixels, taps outside the input left
    out and each row's weights normalised to sum to 1. What timm's `resample_abs_pos_embed`
    computes (`F.interpolate(mode="bicubic", antialias=True, align_corners=False)`)."""
    scale = old / new
    stretch = max(scale, 1.0)
    support = 2.0 * stretch
    matrix = np.zeros((new, old))
    for i in range(new):
        center = scale * (i + 0.5)
        # int() truncates towards zero, as the C code's casts do.
        start = max(int(center - support + 0.5), 0)
        stop = min(int(center + support + 0.5), old)
        taps = np.arange(start, stop)
        weights = _keys_cubic((taps - center + 0.5) / stretch, -0.5)
        matrix[i, taps] = weights / weights.sum()
    return matrix


def interpolation_matrix(old, new, interpolation):
    """(new, old) matrix resampling a 1-D signal of `old` samples to `new` by `interpolation` (one of
    `INTERPOLATIONS` but "zoom", see `resample_position_embeddings`): half-pixel centres; edges clamped, or
    (antialiased) taps outside left out."""
    if interpolation == "bicubic_antialias":
        return _antialiased_bicubic_matrix(old, new)
    matrix = np.zeros((new, old))
    source = (np.arange(new) + 0.5) * old / new - 0.5
    if interpolation == "bilinear":
        source = np.clip(source, 0, old - 1)
        low = np.floor(source).astype(int)
        high = np.minimum(low + 1, old - 1)
        frac = source - low
        matrix[np.arange(new), low] += 1 - frac
        matrix[np.arange(new), high] += frac
        return matrix
    # Bicubic convolution (Keys 1981) with a = -0.75, edge samples repeated: the
    # kernel of PyTorch's (without antialias) and OpenCV's bicubic resize.
    base = np.floor(source).astype(int)
    for offset in (-1, 0, 1, 2):
        taps = base + offset
        np.add.at(matrix, (np.arange(new), np.clip(taps, 0, old - 1)), _keys_cubic(source - taps, -0.75))
    return matrix


def resample_position_embeddings(
    posemb, new_grid, interpolation="bicubic", *, old_grid=None, num_prefix_tokens=None
):
    """Resamples position embeddings to another patch grid.

    Args:
        posemb: (1, tokens, D) or (tokens, D): the class-token row (if any)
            followed by the patch rows in row-major order.
        new_grid: (height, width) of the new patch grid.
        interpolation: "bicubic" (Keys, a = -0.75, as PyTorch without
            antialias), "bicubic_antialias" (PyTorch's bicubic with
            antialias=True, as timm resamples a checkpoint's position
            embeddings; Pillow's bicubic resize), "bilinear" (half-pixel
            centres, no antialias: timm's .npz loader) or "zoom"
            (`scipy.ndimage.zoom`, order 1: the original implementation).
        old_grid: the checkpoint's grid; by default the square grid that fits.
        num_prefix_tokens: rows kept apart (1 for a class token); by default 1
            if tokens - 1 is a square number and tokens is not, else 0.

    Returns:
        An array of the same rank with the prefix rows unchanged.
    """
    check_interpolation(interpolation)
    posemb = np.asarray(posemb)
    squeeze = posemb.ndim == 2
    if squeeze:
        posemb = posemb[None]
    if posemb.ndim != 3 or posemb.shape[0] != 1:
        raise ValueError(
            f"Expected position embeddings of shape (1, tokens, D) or (tokens, D). Received: shape {posemb.shape}"
        )
    tokens = posemb.shape[1]
    if num_prefix_tokens is None:
        num_prefix_tokens = 1 if (square_side(tokens - 1) is not None and square_side(tokens) is None) else 0
    patches = tokens - num_prefix_tokens
    if old_grid is None:
        side = square_side(patches)
        if side is None:
            raise ValueError(
                f"{patches} patch rows do not form a square grid; pass `old_grid`. Received: "
                f"shape {posemb.shape}, num_prefix_tokens={num_prefix_tokens}"
            )
        old_grid = (side, side)
    old_grid, new_grid = tuple(old_grid), tuple(new_grid)
    if old_grid[0] * old_grid[1] != patches:
        raise ValueError(f"old_grid={old_grid} does not match {patches} patch rows.")
    prefix, grid = posemb[:, :num_prefix_tokens], posemb[0, num_prefix_tokens:]
    grid = grid.reshape(*old_grid, -1)
    if old_grid == new_grid:
        resampled = grid
    elif interpolation == "zoom":
        from scipy import ndimage

        factors = (new_grid[0] / old_grid[0], new_grid[1] / old_grid[1], 1)
        resampled = ndimage.zoom(grid.astype(np.float64), factors, order=1)
    else:
        rows = interpolation_matrix(old_grid[0], new_grid[0], interpolation)
        cols = interpolation_matrix(old_grid[1], new_grid[1], interpolation)
        resampled = np.einsum("ij,jkd,lk->ild", rows, grid.astype(np.float64), cols)
    resampled = resampled.reshape(1, new_grid[0] * new_grid[1], -1).astype(posemb.dtype)
    out = np.concatenate([prefix, resampled], axis=1)
    return out[0] if squeeze else out


def resize_patch_kernel(kernel, new_patch_size, interpolation="bicubic_antialias"):
    """A patch embedding's kernel (P_h, P_w, C, D) for patches of `new_patch_size`, by FlexiViT's pseudo-inverse
    resize (Beyer et al. 2023, "FlexiViT: One Model for All Patch Sizes", section 3.4).

    With B the (p_h p_w, P_h P_w) matrix resizing a patch by `interpolation` (separable: the rows' and the
    columns' `interpolation_matrix`), the new kernel of each channel and output is w' = pinv(B^T) w: a patch
    resized to the new size embeds as the original did (exactly when the new size is larger, in the least-squares
    sense when smaller).  timm's `resample_patch_embed` computes the same, with PyTorch's resize.

    >>> kernel = np.random.default_rng(0).normal(size=(4, 4, 3, 8))
    >>> resize_patch_kernel(kernel, (8, 8)).shape
    (8, 8, 3, 8)
    """
    if interpolation not in ("bilinear", "bicubic", "bicubic_antialias"):
        raise ValueError(
            "`interpolation` must be 'bilinear', 'bicubic' or 'bicubic_antialias'. Received: "
            f"interpolation={interpolation!r}"
        )
    kernel = np.asarray(kernel)
    if kernel.ndim != 4:
        raise ValueError(f"Expected a patch kernel (P_h, P_w, channels, D). Received: shape {kernel.shape}")
    (old_h, old_w), (new_h, new_w) = kernel.shape[:2], tuple(int(v) for v in new_patch_size)
    rows, columns = (interpolation_matrix(old, new, interpolation) for old, new in ((old_h, new_h), (old_w, new_w)))
    resize = np.kron(rows, columns)
    flat = kernel.reshape(old_h * old_w, -1).astype(np.float64)
    resized = np.linalg.pinv(resize.T) @ flat
    return resized.reshape(new_h, new_w, *kernel.shape[2:]).astype(kernel.dtype)
