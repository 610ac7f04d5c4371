"""`Preprocessing`: how pretrained weights want an image prepared for evaluation, the companion of a model from
`keras_vit.from_pretrained`.

The model itself takes raw pixels and applies the weights' mean and standard deviation (its `rescaling`
layer); what it cannot do is choose how a photo of another size becomes its input.  Each library that
publishes weights says it in its own config:

- timm's `pretrained_cfg`: `crop_pct`, `crop_mode`, `interpolation` -> the shorter side resized to
  floor(size / crop_pct) with the aspect ratio kept (torchvision's `Resize(int)`), then the center cropped,
  its offsets rounded half to even as torchvision's `CenterCrop`;
- transformers' `preprocessor_config.json`: `size` (`height`/`width`: squashed to it; `shortest_edge`: the
  aspect kept), `do_center_crop` with `crop_size`, `resample` (Pillow's filter codes), its crop offsets
  floored;
- the original checkpoints: the whole image squashed to the model's size, bilinear.

The resize is TensorFlow's with antialiasing, the filters of Pillow's resize (the kernels of its bilinear,
bicubic and Lanczos filters, stretched when shrinking), rounded to uint8 as Pillow's output is.
"""

import dataclasses

from keras_vit.variants import to_pair

# Names of the resize filters, as timm's configs spell them, and TensorFlow's for each.
RESIZE_METHODS = {"bilinear": "bilinear", "bicubic": "bicubic", "nearest": "nearest", "lanczos": "lanczos3",
                  "box": "area"}
# Pillow's filter codes, what transformers' image processors store as `resample`.
PILLOW_FILTERS = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box"}
CROP_OFFSETS = ("half_even", "floor")


@dataclasses.dataclass(frozen=True)
class Preprocessing:
    """An evaluation resize and center crop, and the pixel statistics the model applies itself.

    Attributes:
        image_size: (height, width) the model takes: the crop.
        resize_size: (height, width) the image is resized to before the crop.
        keep_aspect_ratio: True: the image is scaled by one factor, the
            smallest that makes it cover `resize_size` (for a square
            `resize_size` its shorter side becomes that size, the longer one
            floor(size x longer / shorter)); False: squashed to `resize_size`.
        interpolation: one of `RESIZE_METHODS`.
        crop_offset: how an odd margin is split: "half_even" (torchvision,
            timm: round(margin / 2), ties to even) or "floor" (transformers).
        mean, std: per-channel statistics of pixels scaled to [0, 1] that the
            weights were trained with (the model's `rescaling` layer applies
            them; here for reference).

    Call it on one uint8 (H, W, C) image tensor to get the model's input;
    `keras_vit.export.export_saved_model` bakes it into `serving_bytes`.
    """

    image_size: tuple
    resize_size: tuple
    keep_aspect_ratio: bool = True
    interpolation: str = "bilinear"
    crop_offset: str = "half_even"
    mean: tuple = (0.5, 0.5, 0.5)
    std: tuple = (0.5, 0.5, 0.5)

    def __post_init__(self):
        object.__setattr__(self, "image_size", to_pair(self.image_size, "image_size"))
        object.__setattr__(self, "resize_size", to_pair(self.resize_size, "resize_size"))
        if self.interpolation not in RESIZE_METHODS:
            raise ValueError(
                f"`interpolation` must be one of {tuple(RESIZE_METHODS)}. Received: "
                f"interpolation={self.interpolation!r}"
            )
        if self.crop_offset not in CROP_OFFSETS:
            raise ValueError(f"`crop_offset` must be one of {CROP_OFFSETS}. Received: crop_offset={self.crop_offset!r}")
        if any(r < s for r, s in zip(self.resize_size, self.image_size)):
            raise ValueError(
                "The resize must cover the crop: `resize_size` at least `image_size` on each side. Received: "
                f"resize_size={self.resize_size}, image_size={self.image_size}"
            )
        object.__setattr__(self, "mean", tuple(float(v) for v in self.mean))
        object.__setattr__(self, "std", tuple(float(v) for v in self.std))

    @classmethod
    def center_crop(cls, image_size, crop_fraction=1.0, keep_aspect_ratio=True, **kwargs):
        """timm's evaluation transform: resize to floor(size / crop_fraction) (the aspect kept: its
        `crop_mode` "center"; squashed: "squash"), then crop the center."""
        if not isinstance(crop_fraction, (int, float)) or not 0.0 < crop_fraction <= 1.0:
            raise ValueError(f"`crop_fraction` must be in (0, 1]. Received: crop_fraction={crop_fraction!r}")
        height, width = to_pair(image_size, "image_size")
        # floor(size / crop_pct), as timm's transforms_imagenet_eval; the epsilon keeps 224 / 0.875 at 256.
        resize = tuple(int(side / crop_fraction + 1e-9) for side in (height, width))
        return cls((height, width), resize, keep_aspect_ratio=keep_aspect_ratio, **kwargs)

    def at_size(self, image_size):
        """The same preprocessing for a model of another `image_size`: the resize scaled with the crop."""
        size = to_pair(image_size, "image_size")
        if size == self.image_size:
            return self
        resize = tuple(int(r * s / c) for r, s, c in zip(self.resize_size, size, self.image_size))
        return dataclasses.replace(self, image_size=size, resize_size=resize)

    @property
    def resize_method(self):
        """TensorFlow's name of the resize filter (`tf.image.resize`'s `method`)."""
        return RESIZE_METHODS[self.interpolation]

    @property
    def crop_fraction(self):
        """The fraction of the resized image's shorter side that the crop keeps."""
        return min(s / r for s, r in zip(self.image_size, self.resize_size))

    def __call__(self, image):
        from keras_vit.data.augment import resize_and_crop

        return resize_and_crop(image, self)
