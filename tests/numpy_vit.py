"""An independent NumPy implementation of the ViT forward pass (paper eq. 1-4).

Written from the paper's equations, in float64, with explicit loops over
patches and heads, sharing no code with `keras_vit`.  Its weights come in the
original checkpoint's naming and shapes (query/key/value kernels
(D, heads, head_dim), output kernel (heads, head_dim, D)), read from a model by
`params_from_model`.
"""

import math

import numpy as np
from scipy.special import erf


def layer_norm(x, scale, bias, eps=1e-6):
    """LayerNorm; with `bias` None, RMSNorm (Zhang and Sennrich 2019): x / sqrt(mean(x^2) + eps) * scale."""
    if bias is None:
        return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * scale
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * scale + bias


def gelu(x):
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def gelu_quick(x):
    """CLIP's x * sigmoid(1.702 x)."""
    return x / (1.0 + np.exp(-1.702 * x))


def silu(x):
    """x * sigmoid(x) (Elfwing et al. 2018)."""
    return x / (1.0 + np.exp(-x))


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _norm_params(p, key, norm):
    """A LayerNorm's scale and bias, or an RMSNorm's scale alone, into `p` under `key`/scale and /bias."""
    if hasattr(norm, "gamma"):
        p[key + "/scale"], p[key + "/bias"] = norm.gamma.numpy(), norm.beta.numpy()
    else:
        p[key + "/scale"] = norm.scale.numpy()


def _branch_params(p, pre, branch):
    """One attention and MLP (a block, or a parallel block's branch) into `p` under `pre`."""
    att = branch.attention
    dim, heads = att.qkv_kernel.shape[0], att.num_heads
    qkv_kernel = att.qkv_kernel.numpy().reshape(dim, 3, heads, dim // heads)
    qkv_bias = None if att.qkv_bias is None else att.qkv_bias.numpy().reshape(3, heads, dim // heads)
    for j, name in enumerate(("query", "key", "value")):
        p[pre + f"{name}/kernel"] = qkv_kernel[:, j]
        if qkv_bias is not None:
            p[pre + f"{name}/bias"] = qkv_bias[j]
    if branch.attention_scale is not None:
        p[pre + "attention_scale"] = branch.attention_scale.numpy()
        p[pre + "mlp_scale"] = branch.mlp_scale.numpy()
    p[pre + "out/kernel"] = att.output_kernel.numpy().reshape(heads, dim // heads, dim)
    p[pre + "out/bias"] = att.output_bias.numpy()
    if getattr(att, "norm", None) is not None:
        _norm_params(p, pre + "attention_sub_norm", att.norm)
    for ours, theirs in (("attention_norm", "LayerNorm_0"), ("mlp_norm", "LayerNorm_2"),
                         ("mlp_sub_norm", "mlp_sub_norm")):  # fmt: skip
        if getattr(branch, ours, None) is not None:
            _norm_params(p, pre + theirs, getattr(branch, ours))
    for ours, theirs in (("mlp_dense_1", "Dense_0"), ("mlp_dense_2", "Dense_1"), ("mlp_gate", "Gate_0")):
        dense = getattr(branch, ours, None)
        if dense is not None:
            p[pre + theirs + "/kernel"] = dense.kernel.numpy()
            p[pre + theirs + "/bias"] = dense.bias.numpy()


def params_from_model(model):
    """The model's weights as float64 arrays in the original checkpoint naming."""
    p = {}
    enc = model.get_layer("patch_encoder")
    if getattr(enc, "norm", None) is not None:
        _norm_params(p, "embedding_norm", enc.norm)
    p["embedding/kernel"] = enc.kernel.numpy()
    p["embedding/bias"] = enc.bias.numpy()
    if enc.use_class_token:
        p["cls"] = enc.class_token.numpy()
    p["pos_embedding"] = enc.position_embedding.numpy()
    if getattr(enc, "num_registers", 0):
        p["registers"] = enc.register_tokens.numpy()
    if getattr(enc, "distillation_token", False):
        p["dist"] = enc.distillation_token_weight.numpy()
    i = 0
    while True:
        try:
            block = model.get_layer(f"encoderblock_{i}")
        except ValueError:
            break
        # A parallel block's branch j >= 1 is read as a block of its own, `encoderblock_{i}_{j}/`.
        branches = block._branches() if hasattr(block, "_branches") else [block]
        for j, branch in enumerate(branches):
            _branch_params(p, f"encoderblock_{i}/" if j == 0 else f"encoderblock_{i}_{j}/", branch)
        i += 1
    _norm_params(p, "encoder_norm", model.get_layer("encoder_norm"))
    for name in ("pre_logits", "head", "head_distillation"):
        try:
            layer = model.get_layer(name)
        except ValueError:
            continue
        p[name + "/kernel"], p[name + "/bias"] = layer.kernel.numpy(), layer.bias.numpy()
    return {k: np.asarray(v, np.float64) for k, v in p.items()}, i


def vit_forward(params, num_layers, images, classifier="token", rescale=True, attention=None, *, mean=None, std=None,
                eps=1e-6, activation=None):
    """Logits (or pooled features if the params have no head) for NHWC images.

    If `attention` is a list, each layer's attention probabilities
    [batch, heads, tokens, tokens] are appended to it.  `rescale`: pixels in
    [0, 255] to [-1, 1], or with `mean` and `std` to (x / 255 - mean) / std.
    `eps`: the LayerNorms' epsilon; `activation`: the MLPs' (`gelu`, the
    default, `gelu_tanh`, `gelu_quick` or `silu`).

    Options, by the params present: norms without a bias are RMSNorms;
    `embedding_norm/*`, a norm of the patch embeddings; a block's `Gate_0/*`,
    a SiLU-gated MLP; `attention_sub_norm/*` and `mlp_sub_norm/*`, BEiT-3's
    sub-LN (Wang et al. 2022) of the heads' output and of the MLP's hidden
    units; `encoderblock_{i}_{j}/*`, branch j of a parallel block i (Touvron
    et al. 2022, "Three things everyone should know about Vision
    Transformers"); `registers` (1, R, D), tokens placed
    after the class token once the positions are added (Darcet et al. 2023),
    left out of "gap"'s mean; `dist` (1, 1, D), DeiT's distillation token
    after the class token, with its own position row (Touvron et al. 2021,
    section 5), and `head_distillation/*`, its head, whose logits are
    averaged with the class token's; a block's `attention_scale` and `mlp_scale`
    (D,), LayerScale's per-channel factors on its two residual branches
    (CaiT, Touvron et al. 2021, eq. 3); a block without `query/bias` (and
    key, value) projects without biases.
    """
    activation = activation or gelu
    x = np.asarray(images, np.float64)
    if rescale and mean is not None:
        x = (x / 255.0 - np.asarray(mean)) / np.asarray(std)
    elif rescale:
        x = x / 127.5 - 1.0
    batch, height, width, _ = x.shape
    ph, pw, _, dim = params["embedding/kernel"].shape
    kernel = params["embedding/kernel"].reshape(-1, dim)
    # Eq. 1: flatten each patch, project, prepend the class token, add positions.
    tokens = []
    for r in range(height // ph):
        for c in range(width // pw):
            patch = x[:, r * ph : (r + 1) * ph, c * pw : (c + 1) * pw, :].reshape(batch, -1)
            tokens.append(patch @ kernel + params["embedding/bias"])
    z = np.stack(tokens, axis=1)
    if "embedding_norm/scale" in params:  # A norm of the patch embeddings (timm's patch_embed.norm).
        z = layer_norm(z, params["embedding_norm/scale"], params.get("embedding_norm/bias"), eps)
    prefix_tokens = [params["cls"]] if "cls" in params else []  # With "gap": a class token the mean leaves out.
    prefix_tokens += [params["dist"]] if "dist" in params else []
    if prefix_tokens:
        z = np.concatenate([np.repeat(t, batch, axis=0) for t in prefix_tokens] + [z], axis=1)
    z = z + params["pos_embedding"]
    registers = params.get("registers")
    prefix = len(prefix_tokens)
    if registers is not None:
        z = np.concatenate([z[:, :prefix], np.repeat(registers, batch, axis=0), z[:, prefix:]], axis=1)
    for i in range(num_layers):
        # A parallel block (Touvron et al. 2022): each step sums its branches' attentions, then MLPs.
        branches = [f"encoderblock_{i}/"] + [f"encoderblock_{i}_{j}/" for j in range(1, 64)
                                              if f"encoderblock_{i}_{j}/query/kernel" in params]  # fmt: skip
        # Eq. 2: z' = MSA(LN(z)) + z.
        layer_attention, attended = [], z
        for pre in branches:
            y = layer_norm(z, params[pre + "LayerNorm_0/scale"], params.get(pre + "LayerNorm_0/bias"), eps)
            heads = params[pre + "query/kernel"].shape[1]
            out = []
            for h in range(heads):
                q, k, v = (
                    y @ params[pre + f"{name}/kernel"][:, h] + (params[pre + f"{name}/bias"][h]
                                                                if pre + f"{name}/bias" in params else 0.0)
                    for name in ("query", "key", "value")
                )
                a = softmax(q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1]))
                out.append(a @ v)
                layer_attention.append(a)
            heads_out = np.concatenate(out, axis=-1)  # The heads side by side: [A_1 v_1, ..., A_k v_k].
            if pre + "attention_sub_norm/scale" in params:  # BEiT-3's sub-LN, before the output projection.
                heads_out = layer_norm(heads_out, params[pre + "attention_sub_norm/scale"],
                                       params.get(pre + "attention_sub_norm/bias"), eps)  # fmt: skip
            out = heads_out @ params[pre + "out/kernel"].reshape(-1, z.shape[-1])
            attended = attended + (out + params[pre + "out/bias"]) * params.get(pre + "attention_scale", 1.0)
        if attention is not None:
            attention.append(np.stack(layer_attention, axis=1))
        # Eq. 3: z = MLP(LN(z')) + z'.
        z, x = attended, attended
        for pre in branches:
            y = layer_norm(x, params[pre + "LayerNorm_2/scale"], params.get(pre + "LayerNorm_2/bias"), eps)
            if pre + "Gate_0/kernel" in params:  # SwiGLU (Shazeer 2020, eq. 6): SiLU(y W_gate) * (y W).
                gate = y @ params[pre + "Gate_0/kernel"] + params[pre + "Gate_0/bias"]
                y = gate / (1.0 + np.exp(-gate)) * (y @ params[pre + "Dense_0/kernel"] + params[pre + "Dense_0/bias"])
            else:
                y = activation(y @ params[pre + "Dense_0/kernel"] + params[pre + "Dense_0/bias"])
            if pre + "mlp_sub_norm/scale" in params:  # Sub-LN of the hidden units.
                y = layer_norm(y, params[pre + "mlp_sub_norm/scale"], params.get(pre + "mlp_sub_norm/bias"), eps)
            z = z + (y @ params[pre + "Dense_1/kernel"] + params[pre + "Dense_1/bias"]) * params.get(pre + "mlp_scale",
                                                                                                      1.0)  # fmt: skip
    # Eq. 4: y = LN(z_L^0) (or the mean of the tokens for "gap").
    z = layer_norm(z, params["encoder_norm/scale"], params.get("encoder_norm/bias"), eps)
    skip = prefix + (0 if registers is None else registers.shape[1])
    pooled = z[:, 0] if classifier == "token" else z[:, skip:].mean(axis=1)
    if "pre_logits/kernel" in params:
        pooled = np.tanh(pooled @ params["pre_logits/kernel"] + params["pre_logits/bias"])
    if "head_distillation/kernel" in params:
        distilled = z[:, 1] @ params["head_distillation/kernel"] + params["head_distillation/bias"]
        return (pooled @ params["head/kernel"] + params["head/bias"] + distilled) / 2
    if "head/kernel" in params:
        return pooled @ params["head/kernel"] + params["head/bias"]
    return pooled


# === big_vision's fixed position embeddings and MAP head ===


def posemb_sincos_2d(h, w, width, temperature=10_000.0):
    """big_vision's `posemb_sincos_2d` (big_vision/models/vit.py) in NumPy: y, x = mgrid[:h, :w],
    omega = 1 / temperature ** (arange(width // 4) / (width // 4 - 1)), the outer products of the
    flattened x and y with omega, concatenated as [sin(x), cos(x), sin(y), cos(y)]."""
    y, x = np.mgrid[:h, :w]
    omega = np.arange(width // 4) / (width // 4 - 1)
    omega = 1.0 / temperature**omega
    y = np.einsum("m,d->md", y.flatten(), omega)
    x = np.einsum("m,d->md", x.flatten(), omega)
    return np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1)[None]


def map_head(tokens, params, gelu):
    """big_vision's MAPHead in float64, from its checkpoint arrays (`MAPHead_0/` stripped): a probe
    (1, 1, D); per-head attention from the probe to the tokens with query/key/value kernels
    (D, heads, head_dim), biases (heads, head_dim), output kernel (heads, head_dim, D); then
    x + MLP(LayerNorm(x)) with Flax's epsilon 1e-6; the probe's output."""
    tokens = np.asarray(tokens, np.float64)
    attention = "MultiHeadDotProductAttention_0/"
    probe = np.repeat(params["probe"], len(tokens), axis=0)
    heads = params[attention + "query/kernel"].shape[1]
    x = np.zeros_like(probe) + params[attention + "out/bias"]
    for h in range(heads):
        q = probe @ params[attention + "query/kernel"][:, h] + params[attention + "query/bias"][h]
        k = tokens @ params[attention + "key/kernel"][:, h] + params[attention + "key/bias"][h]
        v = tokens @ params[attention + "value/kernel"][:, h] + params[attention + "value/bias"][h]
        a = softmax(q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1]))
        x += (a @ v) @ params[attention + "out/kernel"][h]
    y = layer_norm(x, params["LayerNorm_0/scale"], params["LayerNorm_0/bias"])
    y = gelu(y @ params["MlpBlock_0/Dense_0/kernel"] + params["MlpBlock_0/Dense_0/bias"])
    x = x + y @ params["MlpBlock_0/Dense_1/kernel"] + params["MlpBlock_0/Dense_1/bias"]
    return x[:, 0]


def random_map_head_params(rng, dim, heads, mlp_dim):
    """Arrays named and shaped as big_vision's MAPHead's (`MAPHead_0/` stripped)."""
    head_dim = dim // heads
    shapes = {"probe": (1, 1, dim), "LayerNorm_0/scale": (dim,), "LayerNorm_0/bias": (dim,)}
    for name in ("query", "key", "value"):
        shapes[f"MultiHeadDotProductAttention_0/{name}/kernel"] = (dim, heads, head_dim)
        shapes[f"MultiHeadDotProductAttention_0/{name}/bias"] = (heads, head_dim)
    shapes["MultiHeadDotProductAttention_0/out/kernel"] = (heads, head_dim, dim)
    shapes["MultiHeadDotProductAttention_0/out/bias"] = (dim,)
    for i, (fan_in, fan_out) in enumerate([(dim, mlp_dim), (mlp_dim, dim)]):
        shapes[f"MlpBlock_0/Dense_{i}/kernel"] = (fan_in, fan_out)
        shapes[f"MlpBlock_0/Dense_{i}/bias"] = (fan_out,)
    return {key: rng.normal(0.0, 0.3, shape) + (key == "LayerNorm_0/scale") for key, shape in shapes.items()}


def map_head_params(dim, mlp_dim):
    """The parameters of big_vision's MAPHead: probe, query/key/value/out kernels and biases, the
    LayerNorm's scale and bias, the MLP's two kernels and biases."""
    return dim + 4 * (dim * dim + dim) + 2 * dim + (dim * mlp_dim + mlp_dim) + (mlp_dim * dim + dim)
