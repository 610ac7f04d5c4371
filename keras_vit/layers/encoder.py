"""The Transformer encoder block and the pooling of its tokens (paper eq. 2-4)."""

import dataclasses

import keras
from keras import ops

from keras_vit import kernels
from keras_vit.layers.attention import MultiHeadSelfAttention
from keras_vit.layers.common import add_stacked_projections, check_positive_int, check_rate, read_renamed, register
from keras_vit.layers.core import Dense, Dropout, check_norm, make_norm, mlp_activation, read_activation
from keras_vit.layers.quantization import Int8Kernels


@register
class TransformerBlock(keras.layers.Layer):
    """One pre-norm encoder block (paper eq. 2-3).

    z' = z + DropPath(g_1 * Dropout(MSA(LN(z))))      (parallel: summed over the branches)
    z  = z' + DropPath(g_2 * MLP(LN(z'))),  MLP = Dense(mlp_dim) -> GELU -> Dropout ->
         Dense(hidden) -> Dropout

    g_1 and g_2 are 1 unless `layer_scale` is set: then they are learned
    per-channel scales (LayerScale, Touvron et al. 2021, "Going deeper with
    Image Transformers" (CaiT), section 2; DeiT III and DINOv2 use it),
    initialised to `layer_scale`.  With `mlp="swiglu"` the MLP is gated
    (SwiGLU, Shazeer 2020, "GLU Variants Improve Transformer", eq. 6):
    Dense(hidden)(SiLU(x W_gate) * (x W)), W and W_gate (hidden, mlp_dim).
    LN is a LayerNorm, or with `norm="rms"` an RMSNorm.

    Args:
        num_heads: attention heads.
        mlp_dim: width of the MLP's hidden layer.
        dropout_rate: dropout after the attention and in the MLP.
        attention_dropout_rate: dropout on the attention probabilities.
        stochastic_depth_rate: probability of dropping the block's residual
            branches for a whole sample in training (Huang et al. 2016).
        layer_norm_epsilon: 1e-6, as in the original implementation.
        seed: seed of the dropouts and of stochastic depth.
        activation: the MLP's, "gelu" (exact), "gelu_tanh" (the
            approximation the original implementation and big_vision
            compute), "quick_gelu" (CLIP's) or "silu".
        layer_scale: None (no scales), or the initial value of the
            LayerScale weights (timm's `init_values`: 1e-5 for DINOv2, 1e-6
            for DeiT III's deeper models).
        qkv_bias: the attention's query, key and value have biases.
        norm: "layer" (LayerNorm) or "rms" (RMSNorm).
        mlp: "plain" (the paper's) or "swiglu" (gated by SiLU; `activation`
            is then unused).
        sub_norms: norms inside the attention (of its output, before the
            output projection) and the MLP (of its hidden units, before the
            second layer): BEiT-3's sub-LN (Wang et al. 2022, "Foundation
            Transformers", section 2.1).
        parallel: the number of branches: with 2 or more, each of the block's
            two residual steps sums that many attentions (or MLPs), each with
            its own norm and scale, as in Touvron et al. 2022, "Three things
            everyone should know about Vision Transformers", section 2.

    Sublayers: `attention_norm`, `attention`, `mlp_norm`, `mlp_dense_1`,
    `mlp_dense_2`, `mlp_gate` with "swiglu", `mlp_sub_norm` with `sub_norms`;
    weights `attention_scale` and `mlp_scale` (hidden,) with `layer_scale`;
    with `parallel` > 1, branch j's are the same names prefixed `branch{j}_`,
    and attention scores come back as every head of every branch.

    Both kinds of block are this one class: Keras' `.keras` and `.weights.h5`
    files keep a layer's weights under its class's name, so a class of its own
    for the parallel block would leave the files saved with this one unreadable.

    >>> block = TransformerBlock(num_heads=2, mlp_dim=16)
    >>> tuple(block(keras.ops.zeros((1, 5, 8))).shape)
    (1, 5, 8)
    """

    def __init__(
        self,
        num_heads,
        mlp_dim,
        dropout_rate=0.0,
        attention_dropout_rate=0.0,
        stochastic_depth_rate=0.0,
        layer_norm_epsilon=1e-6,
        seed=None,
        activation="gelu",
        layer_scale=None,
        qkv_bias=True,
        norm="layer",
        mlp="plain",
        sub_norms=False,
        parallel=1,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.norm = check_norm(norm)
        if not isinstance(sub_norms, bool):
            raise ValueError(f"`sub_norms` must be True or False. Received: sub_norms={sub_norms!r}")
        self.sub_norms = sub_norms
        self.parallel = check_positive_int("parallel", parallel)
        if mlp not in MLPS:
            raise ValueError(f"`mlp` must be one of {MLPS}. Received: mlp={mlp!r}")
        self.mlp = mlp
        mlp_activation(activation)  # Validates it now rather than at build time.
        self.activation = activation
        self.layer_scale = check_layer_scale(layer_scale)
        if not isinstance(qkv_bias, bool):
            raise ValueError(f"`qkv_bias` must be True or False. Received: qkv_bias={qkv_bias!r}")
        self.qkv_bias = qkv_bias
        self.num_heads = check_positive_int("num_heads", num_heads)
        self.mlp_dim = check_positive_int("mlp_dim", mlp_dim)
        self.dropout_rate = check_rate("dropout_rate", dropout_rate)
        self.attention_dropout_rate = check_rate("attention_dropout_rate", attention_dropout_rate)
        self.stochastic_depth_rate = check_rate("stochastic_depth_rate", stochastic_depth_rate)
        self.layer_norm_epsilon = float(layer_norm_epsilon)
        self.seed = seed

    def build(self, input_shape):
        if len(input_shape) != 3 or input_shape[-1] is None:
            raise ValueError(
                f"{type(self).__name__} expects tokens of shape (batch, tokens, hidden) with a static "
                f"hidden width. Received: input_shape={tuple(input_shape)}"
            )
        self.dropout = Dropout(self.dropout_rate, seed=self.seed, dtype=self.dtype_policy)
        self.seed_generator = keras.random.SeedGenerator(self.seed)
        for prefix in self._prefixes():
            self._add_branch(prefix, input_shape)

    def _prefixes(self):
        """The name prefix of each branch's sublayers and scales: branch 0 unprefixed (the paper's block)."""
        return [f"branch{j}_" if j else "" for j in range(self.parallel)]

    def _branches(self):
        """The block's branches, each a `Branch` of its sublayers and scales."""
        return [Branch(**{part: getattr(self, prefix + part) for part in BRANCH_PARTS}) for prefix in self._prefixes()]

    def _add_branch(self, prefix, input_shape):
        """One attention and one MLP with their norms (and scales), built, kept as attributes named
        `prefix` + the part's name (`BRANCH_PARTS`; None where the options leave a part out)."""
        hidden, policy, epsilon = input_shape[-1], self.dtype_policy, self.layer_norm_epsilon
        swiglu = self.mlp == "swiglu"
        branch = Branch(
            attention_norm=make_norm(self.norm, epsilon, dtype=policy, name=prefix + "attention_norm"),
            attention=MultiHeadSelfAttention(
                self.num_heads, dropout_rate=self.attention_dropout_rate, seed=self.seed, qkv_bias=self.qkv_bias,
                sub_norm=self.norm if self.sub_norms else None, norm_epsilon=epsilon, dtype=policy,
                name=prefix + "attention",
            ),
            mlp_norm=make_norm(self.norm, epsilon, dtype=policy, name=prefix + "mlp_norm"),
            mlp_dense_1=Dense(self.mlp_dim, activation=None if swiglu else mlp_activation(self.activation),
                              dtype=policy, name=prefix + "mlp_dense_1"),
            mlp_gate=Dense(self.mlp_dim, activation="silu", dtype=policy, name=prefix + "mlp_gate") if swiglu else None,
            # BEiT-3's sub-LN: a norm of the MLP's hidden units before its second layer.
            mlp_sub_norm=make_norm(self.norm, epsilon, dtype=policy, name=prefix + "mlp_sub_norm") if (
                self.sub_norms) else None,
            mlp_dense_2=Dense(hidden, dtype=policy, name=prefix + "mlp_dense_2"),
        )  # fmt: skip
        if self.layer_scale is not None:
            initial = keras.initializers.Constant(self.layer_scale)
            branch.attention_scale = self.add_weight(name=prefix + "attention_scale", shape=(hidden,),
                                                     initializer=initial)  # fmt: skip
            branch.mlp_scale = self.add_weight(name=prefix + "mlp_scale", shape=(hidden,), initializer=initial)
        for part in BRANCH_PARTS:
            setattr(self, prefix + part, getattr(branch, part))
        hidden_shape = (*input_shape[:-1], self.mlp_dim)
        for layer, shape in (
            (branch.attention_norm, input_shape),
            (branch.attention, input_shape),
            (branch.mlp_norm, input_shape),
            (branch.mlp_dense_1, input_shape),
            (branch.mlp_dense_2, hidden_shape),
            (branch.mlp_gate, input_shape),
            (branch.mlp_sub_norm, hidden_shape),
        ):
            if layer is not None:
                layer.build(shape)

    def call(self, inputs, training=None, return_attention_scores=False):
        if not self.trainable:  # Frozen: inference mode, no dropout and no stochastic depth.
            training = False
        branches = self._branches()
        # Eq. 2: z' = MSA(LN(z)) + z (parallel blocks: the branches' attentions summed).
        x, scores = inputs, []
        for branch in branches:
            attended = branch.attention(
                branch.attention_norm(inputs, training=training),
                training=training,
                return_attention_scores=return_attention_scores,
            )
            if return_attention_scores:
                attended, branch_scores = attended
                scores.append(branch_scores)
            attended = self._scaled(self.dropout(attended, training=training), branch.attention_scale)
            x = x + self._drop_path(attended, training)
        # Eq. 3: z = MLP(LN(z')) + z'.
        outputs = x
        for branch in branches:
            normed = branch.mlp_norm(x, training=training)
            y = branch.mlp_dense_1(normed)
            if branch.mlp_gate is not None:
                y = branch.mlp_gate(normed) * y
            y = self.dropout(y, training=training)
            if branch.mlp_sub_norm is not None:
                y = branch.mlp_sub_norm(y, training=training)
            y = self._scaled(self.dropout(branch.mlp_dense_2(y), training=training), branch.mlp_scale)
            outputs = outputs + self._drop_path(y, training)
        if return_attention_scores:
            # Every head of the layer: the branches' in order.
            return outputs, scores[0] if len(scores) == 1 else ops.concatenate(scores, axis=1)
        return outputs

    def _scaled(self, x, scale):
        """x times a LayerScale weight (per channel), or x itself without one."""
        return x if scale is None else x * ops.cast(scale, x.dtype)

    def _drop_path(self, x, training):
        """Stochastic depth: zero the residual branch of whole samples, scale the rest by 1 / keep."""
        if not training or self.stochastic_depth_rate == 0.0:
            return x
        keep = 1.0 - self.stochastic_depth_rate
        noise = keras.random.uniform((ops.shape(x)[0], 1, 1), seed=self.seed_generator)
        return x * (ops.cast(noise < keep, x.dtype) / ops.cast(keep, x.dtype))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "mlp_dim": self.mlp_dim,
            "dropout_rate": self.dropout_rate,
            "attention_dropout_rate": self.attention_dropout_rate,
            "stochastic_depth_rate": self.stochastic_depth_rate,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "seed": self.seed,
            "activation": self.activation,
            "layer_scale": self.layer_scale,
            "qkv_bias": self.qkv_bias,
            "norm": self.norm,
            "mlp": self.mlp,
            "sub_norms": self.sub_norms,
            "parallel": self.parallel,
        }

    @classmethod
    def from_config(cls, config):
        return super().from_config(read_activation(config))


@dataclasses.dataclass
class Branch:
    """One branch of a block: its sublayers (None where the options leave one out) and LayerScale weights."""

    attention_norm: object
    attention: object
    mlp_norm: object
    mlp_dense_1: object
    mlp_gate: object
    mlp_sub_norm: object
    mlp_dense_2: object
    attention_scale: object = None
    mlp_scale: object = None


BRANCH_PARTS = tuple(field.name for field in dataclasses.fields(Branch))

# The blocks' MLPs: "plain" (Dense -> GELU -> Dense) or "swiglu" (SiLU-gated).
MLPS = ("plain", "swiglu")


def check_layer_scale(value):
    """None, or a LayerScale's initial value: a finite positive float."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"`layer_scale` must be None or a positive number (the scales' initial value). "
                         f"Received: layer_scale={value!r}")  # fmt: skip
    return float(value)


@register
class TokenPooling(keras.layers.Layer):
    """Pools the encoder's tokens into one vector per image (paper eq. 4's z_L^0).

    "token": the token after the first `prefix_tokens` (0: the class token;
    1: DeiT's distillation token); "gap": the mean of the tokens after the
    first `prefix_tokens` (the class and register tokens a model has before
    its patches; models built with classifier "gap" have no class token, and
    register tokens are left out as timm leaves them out); "token_gap": the
    class token and the mean of the tokens after the first `prefix_tokens`
    (the patches'), concatenated: twice the width (DINOv2's linear
    classifier, transformers' `Dinov2ForImageClassification`).

    >>> tuple(TokenPooling("gap")(keras.ops.ones((2, 5, 8))).shape)
    (2, 8)
    """

    METHODS = ("token", "gap", "token_gap")

    def __init__(self, method="token", prefix_tokens=0, **kwargs):
        super().__init__(**kwargs)
        if method not in self.METHODS:
            raise ValueError(f"`method` must be one of {self.METHODS}. Received: method={method!r}")
        self.method = method
        if isinstance(prefix_tokens, bool) or not isinstance(prefix_tokens, int) or prefix_tokens < 0:
            raise ValueError(f"`prefix_tokens` must be an integer >= 0. Received: prefix_tokens={prefix_tokens!r}")
        self.prefix_tokens = prefix_tokens

    def call(self, tokens):
        if self.method == "token":
            return tokens[:, self.prefix_tokens]
        mean = ops.mean(tokens[:, self.prefix_tokens :], axis=1)
        return ops.concatenate([tokens[:, 0], mean], axis=-1) if self.method == "token_gap" else mean

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[-1] * (2 if self.method == "token_gap" else 1))

    def get_config(self):
        return {**super().get_config(), "method": self.method, "prefix_tokens": self.prefix_tokens}

    @classmethod
    def from_config(cls, config):
        return super().from_config(read_renamed(config, "skip", "prefix_tokens"))


@register
class MAPHead(Int8Kernels, keras.layers.Layer):
    """Multi-head attention pooling: a learned probe attends to the tokens.

    big_vision's `MAPHead` (Zhai et al. 2022, "Scaling Vision Transformers";
    the pooling by multi-head attention of Lee et al. 2019), timm's
    `AttentionPoolLatent`:

        y = MHA(query = probe, key = value = tokens)       (one probe token)
        y = y + MLP(LN(y)),  MLP = Dense(mlp_dim) -> GELU -> Dense(hidden)
        output = y[:, 0]

    MHA projects the probe to queries and the tokens to keys and values (with
    biases), computes softmax(q k^T / sqrt(head_dim)) v per head (the softmax
    in float32; how is `keras_vit.kernels.cross_attention`'s choice) and
    projects the heads' outputs back. No class token is
    needed; models with classifier "map" have none.

    Args:
        num_heads: attention heads; the token width must be divisible by it.
        mlp_dim: width of the MLP's hidden layer.
        activation: the MLP's, as `TransformerBlock`'s ("gelu_tanh":
            big_vision's).
        layer_norm_epsilon: 1e-6, as Flax's and timm's LayerNorm.
        norm: the norm's kind, "layer" or "rms" (as timm's attn_pool takes
            the model's norm layer).

    Weights: `probe` (1, 1, hidden), `query_kernel` (hidden, hidden),
    `query_bias` (hidden,), `key_value_kernel` (hidden, 2, hidden) and
    `key_value_bias` (2, hidden) (the key's and the value's stacked, heads x
    head_dim on the last axis, as `MultiHeadSelfAttention`'s), `output_kernel`
    (hidden, hidden), `output_bias` (hidden,); sublayers `norm`, `mlp_dense_1`,
    `mlp_dense_2`. 4 hidden^2 + 2 hidden mlp_dim + mlp_dim + 8 hidden
    parameters, big_vision's count. Quantized to int8, the three kernels are
    int8 with a float `NAME_scale` each (`keras_vit.layers.quantization`).

    >>> head = MAPHead(num_heads=2, mlp_dim=16)
    >>> tuple(head(keras.ops.zeros((3, 5, 8))).shape)
    (3, 8)
    >>> head.count_params() == 4 * 8 * 8 + 2 * 8 * 16 + 16 + 8 * 8
    True
    """

    QUANTIZED_KERNELS = ("query_kernel", "key_value_kernel", "output_kernel")

    def __init__(self, num_heads, mlp_dim, activation="gelu", layer_norm_epsilon=1e-6, norm="layer", **kwargs):
        super().__init__(**kwargs)
        self.norm_kind = check_norm(norm)
        self.num_heads = check_positive_int("num_heads", num_heads)
        self.mlp_dim = check_positive_int("mlp_dim", mlp_dim)
        mlp_activation(activation)
        self.activation = activation
        self.layer_norm_epsilon = float(layer_norm_epsilon)

    def build(self, input_shape):
        if len(input_shape) != 3 or input_shape[-1] is None or input_shape[-1] % self.num_heads:
            raise ValueError(
                "MAPHead expects tokens of shape (batch, tokens, hidden) with a static hidden width "
                f"divisible by `num_heads`. Received: input_shape={tuple(input_shape)}, "
                f"num_heads={self.num_heads}"
            )
        hidden, policy = input_shape[-1], self.dtype_policy
        self.probe = self.add_weight(name="probe", shape=(1, 1, hidden), initializer="glorot_uniform")
        self.query_kernel = self.add_weight(name="query_kernel", shape=(hidden, hidden), initializer="glorot_uniform")
        self.query_bias = self.add_weight(name="query_bias", shape=(hidden,), initializer="zeros")
        self.key_value_kernel, self.key_value_bias = add_stacked_projections(self, "key_value", 2, hidden)
        self.output_kernel = self.add_weight(name="output_kernel", shape=(hidden, hidden), initializer="glorot_uniform")
        self.output_bias = self.add_weight(name="output_bias", shape=(hidden,), initializer="zeros")
        self.norm = make_norm(self.norm_kind, self.layer_norm_epsilon, dtype=policy, name="norm")
        activation = mlp_activation(self.activation)
        self.mlp_dense_1 = Dense(self.mlp_dim, activation=activation, dtype=policy, name="mlp_dense_1")
        self.mlp_dense_2 = Dense(hidden, dtype=policy, name="mlp_dense_2")
        pooled = (input_shape[0], 1, hidden)
        self.norm.build(pooled)
        self.mlp_dense_1.build(pooled)
        self.mlp_dense_2.build((input_shape[0], 1, self.mlp_dim))
        self.build_quantized()

    def call(self, tokens, training=None):
        if not self.trainable:  # Frozen: inference mode.
            training = False
        probe = ops.cast(self.probe, tokens.dtype)
        probe = ops.broadcast_to(probe, (ops.shape(tokens)[0], 1, tokens.shape[-1]))
        query = self.project(probe, "query_kernel", self.query_bias)  # (batch, 1, hidden)
        key_value = self.project(tokens, "key_value_kernel", self.key_value_bias)  # (b, t, 2, hidden)
        attended = kernels.cross_attention(query, key_value, self.num_heads, training=training)
        x = self.project(attended, "output_kernel", self.output_bias)
        x = x + self.mlp_dense_2(self.mlp_dense_1(self.norm(x, training=training)))
        return x[:, 0]

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[-1])

    def get_config(self):
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "mlp_dim": self.mlp_dim,
            "activation": self.activation,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "norm": self.norm_kind,
        }

    @classmethod
    def from_config(cls, config):
        return super().from_config(read_activation(config))
