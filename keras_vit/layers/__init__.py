"""The layers of a Vision Transformer, in `keras.ops`: the paper's equations.

Each layer is registered as serializable under the package name "keras_vit",
has a `get_config` returning exactly its constructor arguments, and creates its
weights in `build()`. How attention, layer norm, dense layers and dropout are
computed on each platform is `keras_vit.kernels`' business.

- `Patches`, `PatchEncoder` (`embedding`): eq. 1.
- `MultiHeadSelfAttention` (`attention`): eq. 2's MSA, appendix A.
- `TransformerBlock`, `TokenPooling`, `MAPHead` (`encoder`): eq. 2-4, and
  big_vision's multi-head attention pooling.
- `Dense`, `LayerNormalization`, `Dropout` (`core`): Keras' layers computed by the kernels.
"""

from keras_vit.layers.attention import MultiHeadSelfAttention
from keras_vit.layers.common import register
from keras_vit.layers.core import Dense, Dropout, LayerNormalization
from keras_vit.layers.embedding import PatchEncoder, Patches, extract_patches, sincos_position_embedding
from keras_vit.layers.encoder import MAPHead, TokenPooling, TransformerBlock

__all__ = [
    "Dense",
    "Dropout",
    "LayerNormalization",
    "MAPHead",
    "MultiHeadSelfAttention",
    "PatchEncoder",
    "Patches",
    "TokenPooling",
    "TransformerBlock",
    "extract_patches",
    "register",
    "sincos_position_embedding",
]
