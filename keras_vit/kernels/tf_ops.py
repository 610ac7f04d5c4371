"""TensorFlow forms for any device."""

import tensorflow as tf
from keras import ops

from keras_vit.kernels import reference


def dense(x, kernel, bias, activation=None):
    """The reference `dense` as a 2-D MatMul, then BiasAdd (then GELU, exact or tanh).

    TensorFlow's graph optimiser fuses MatMul + BiasAdd + activation into one
    kernel (oneDNN's on a CPU, cuBLASLt's epilogue on a GPU); MatMul + AddV2
    only gets the bias fused, and a 3-D matmul none of it. A kernel of more
    than two axes (the attention's (hidden, 3, hidden)) is multiplied as its
    (rows, columns) reshape, and the result takes its trailing axes back.
    """
    shape = x.shape
    kernel = ops.cast(kernel, x.dtype)
    outputs = tuple(kernel.shape[1:])
    if len(outputs) > 1:
        kernel = tf.reshape(kernel, (kernel.shape[0], -1))
    y = tf.matmul(tf.reshape(x, (-1, shape[-1])), kernel)
    if bias is not None:
        y = tf.nn.bias_add(y, tf.reshape(ops.cast(bias, x.dtype), (-1,)))
    if activation == "gelu_tanh":
        # TensorFlow's own op: the form its graph optimiser fuses into the matmul.
        y = tf.nn.gelu(y, approximate=True)
    else:
        y = reference.ACTIVATIONS[activation](y)
    return unflatten_rows(y, x, outputs)


def unflatten_rows(y, x, trailing):
    """The 2-D result `y` of a matmul of `x` flattened to rows, reshaped to x's leading axes (each known size
    kept, the others read at run time) and `trailing`."""
    middle = [size if size is not None else tf.shape(x)[axis] for axis, size in enumerate(x.shape[1:-1], 1)]
    return tf.reshape(y, [-1, *middle, *trailing])


def assert_divisible(images, patch_size, message):
    """An assertion, run with the graph, that the NHWC images' height and width divide by `patch_size`."""
    shape = tf.shape(images)
    tf.debugging.assert_equal(tf.stack([shape[1] % patch_size[0], shape[2] % patch_size[1]]), 0, message=message)
