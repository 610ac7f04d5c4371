"""`count_flops` against the matmuls and convolutions TensorFlow actually runs."""

import numpy as np
import pytest
import tensorflow as tf

import keras_vit
from keras_vit.flops import count_flops


def graph_flops(model, image_size):
    """2 x multiply-adds of every MatMul, BatchMatMul and Conv2D in the traced forward pass."""
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    spec = tf.TensorSpec((1, height, width, model.input_shape[-1]), tf.float32)
    graph = tf.function(lambda x: model(x, training=False)).get_concrete_function(spec).graph
    total = 0
    for op in graph.get_operations():
        if op.type == "MatMul":
            a, b = (t.shape.as_list() for t in op.inputs)
            m, k = a[::-1] if op.get_attr("transpose_a") else a
            n = b[0] if op.get_attr("transpose_b") else b[1]
            total += 2 * m * k * n
        elif op.type in ("BatchMatMulV2", "BatchMatMulV3"):
            a, b = (t.shape.as_list() for t in op.inputs)
            m, k = a[-1:-3:-1] if op.get_attr("adj_x") else a[-2:]
            n = b[-2] if op.get_attr("adj_y") else b[-1]
            total += 2 * int(np.prod(np.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2])))) * m * k * n
        elif op.type == "Conv2D":
            kernel = op.inputs[1].shape.as_list()
            total += 2 * int(np.prod(op.outputs[0].shape.as_list())) * int(np.prod(kernel[:3]))
    return total


@pytest.mark.parametrize(
    "variant, image_size, kwargs",
    [
        ("testing", 32, {}),
        ("testing", (48, 32), dict(classifier="gap", num_classes=7)),
        ("testing", 32, dict(representation_size=6, num_classes=None)),
        ("testing", 64, dict(hidden_dim=12, num_heads=3, mlp_dim=20, num_layers=2, patch_size=8)),
        ("R+Ti/16", 32, dict(num_layers=1)),
        ("R26+S/32", 64, dict(num_layers=1)),
    ],
)
def test_count_flops_matches_the_traced_graph(variant, image_size, kwargs):
    model = keras_vit.build_vit(variant, image_size=image_size, **kwargs)
    flops = count_flops(variant, image_size=image_size, **kwargs)
    assert flops == graph_flops(model, image_size)
    assert count_flops(variant, image_size=image_size, training=True, **kwargs) == 3 * flops


def test_count_flops_of_the_paper_models():
    # 17.6 GMACs for B/16 at 224 px (timm's model card), 4.6 for S/16, 1.3 for Ti/16.
    assert count_flops("B/16") == 35_127_656_448
    assert round(count_flops("S/16") / 2e9, 1) == 4.6
    assert round(count_flops("Ti/16") / 2e9, 1) == 1.3


def test_count_flops_rejects_an_image_size_the_model_rejects():
    with pytest.raises(ValueError, match=r"divisible by the patch size.*Received: image_size=100"):
        count_flops("B/16", image_size=100)
    with pytest.raises(ValueError, match=r"ResNet stride"):
        count_flops("R50+B/16", image_size=200)
