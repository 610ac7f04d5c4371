"""Keras' post-training quantization for the layers whose matmuls use kernels of their own.

`model.quantize("int8")` (Keras 3) converts each layer through the hooks of Keras' guide "Writing
quantization-compatible layers": `quantize(mode)` replaces the float kernels by int8 ones with a scale per
output column (abs-max, as `keras.layers.Dense` does), switches the layer's dtype policy to `int8_from_...`, and
Keras then calls `_int8_call` instead of `call`. The attention's query-key-value and output projections and the
MAP head's are such kernels (`MultiHeadSelfAttention`, `MAPHead`); the MLPs and the head are `Dense` layers,
which Keras quantizes itself, in every mode it has.

The int8 matmul is `keras_vit.kernels.int8_dense`, for these layers and the `Dense` ones alike: Keras' own
(the inputs quantized per token, abs-max over the last axis, an int8 x int8 matmul into int32, the result
divided by both scales), or oneDNN's where TensorFlow runs it on a CPU.
"""

import keras
import numpy as np
from keras import ops

from keras_vit import kernels


class Int8Kernels:
    """Keras' int8 quantization for a layer whose kernels are its own weights, named in `QUANTIZED_KERNELS`.

    The layer computes its projections with `self.project(x, name, bias)`, which runs the int8 matmul once
    the layer is quantized. Other modes (int4, float8, GPTQ) are refused with NotImplementedError, which
    `model.quantize` turns into a warning: those layers then stay in float.
    """

    QUANTIZED_KERNELS = ()

    def quantize(self, mode=None, type_check=True, config=None):
        if mode != "int8":
            raise self._int8_only(f"mode={mode!r}")
        self.quantize_kernels(config)
        if self.dtype_policy.quantization_mode is None:
            self.dtype_policy = keras.dtype_policies.get(f"int8_from_{self.dtype_policy.name}")

    def quantize_kernels(self, config=None):
        """Replaces each float kernel by int8 values and a float scale per output column (`NAME_scale`), with the
        weight quantizer of `config` (a `keras.quantizers.QuantizationConfig`; default abs-max per column); its
        activation quantizer (default abs-max per token; None: weight-only) quantizes the inputs when called."""
        defaults = keras.quantizers.QuantizationConfig
        self.quantization_config = config
        self.inputs_quantizer = defaults.activation_quantizer_or_default(config, keras.quantizers.AbsMaxQuantizer())
        weight_quantizer = defaults.weight_quantizer_or_default(config, keras.quantizers.AbsMaxQuantizer(axis=0))
        for name in self.QUANTIZED_KERNELS:
            variable = getattr(self, name)
            shape = tuple(variable.shape)
            values, scale = weight_quantizer(np.reshape(ops.convert_to_numpy(variable), (shape[0], -1)), to_numpy=True)
            delattr(self, name)
            kernel = self.add_weight(name=name, shape=shape, initializer="zeros", dtype="int8", trainable=False)
            kernel.assign(np.reshape(values, shape))
            kernel_scale = self.add_weight(name=f"{name}_scale", shape=shape[1:], initializer="ones", trainable=False)
            kernel_scale.assign(np.reshape(scale, shape[1:]))
            setattr(self, name, kernel)
            setattr(self, f"{name}_scale", kernel_scale)
        # Keras' guide: set before the dtype policy changes, so that its setter does not quantize again.
        self._is_quantized = True

    def project(self, x, name, bias):
        """x @ kernel `name` + bias: `kernels.dense` in float, the int8 matmul once quantized."""
        if self.quantization_mode == "int8":
            return kernels.int8_dense(x, getattr(self, name), getattr(self, f"{name}_scale"), bias,
                                      self.compute_dtype, self.inputs_quantizer)  # fmt: skip
        return kernels.dense(x, getattr(self, name), bias)

    def build_quantized(self):
        """At the end of `build`: a layer made with an int8 dtype policy (as Keras' loading makes one) holds
        int8 kernels from the start."""
        mode = self.quantization_mode
        if mode is None:
            return
        if mode != "int8":
            raise self._int8_only(f"dtype policy {self.dtype_policy.name!r}")
        self.quantize_kernels()

    def _int8_only(self, received):
        return NotImplementedError(
            f"Layer {type(self).__name__} ({self.name!r}) quantizes its kernels to int8 only. Received: {received}"
        )

    def _int8_call(self, *args, **kwargs):
        # Keras calls this for a layer quantized to int8; `call` takes the int8 path through `project`.
        return self.call(*args, **kwargs)
