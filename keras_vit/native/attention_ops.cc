// TensorFlow ops KerasVitAttention and KerasVitAttentionGrad (see attention.h):
// CPU kernels, and XLA kernels that lower each op to a custom call of the
// handlers in attention_ffi.cc, so the ops also run inside XLA-compiled
// functions (jit_compile=True) on a CPU.
#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"
#include "tensorflow/compiler/tf2xla/xla_op_registry.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "xla/hlo/builder/xla_builder.h"
#include "xla/shape_util.h"

#include "attention.h"

namespace keras_vit {
namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// (batch, tokens, 3 * hidden) and the head count -> the attention's shape, or
// an error that names what was received.
// Each thread keeps two (tokens, tokens) float32 blocks: 2 x 8192^2 x 4 bytes = 512 MiB at most.
constexpr int64_t kMaxTokens = 8192;

absl::Status ShapeOf(const TensorShape& qkv, int64_t heads, AttentionShape* shape) {
  // heads <= width / 3 before multiplying, so 3 * heads cannot overflow; head_dim >= 1.
  if (qkv.dims() != 3 || heads <= 0 || heads > qkv.dim_size(2) / 3 || qkv.dim_size(2) % (3 * heads) != 0) {
    return absl::InvalidArgumentError(
        "KerasVitAttention expects qkv of shape (batch, tokens, 3 * heads * head_dim) with num_heads >= 1 and "
        "head_dim >= 1; received qkv of shape " + qkv.DebugString() + " and num_heads=" + std::to_string(heads));
  }
  if (qkv.dim_size(1) > kMaxTokens) {
    return absl::InvalidArgumentError("KerasVitAttention takes at most " + std::to_string(kMaxTokens) +
                                      " tokens; received qkv of shape " + qkv.DebugString());
  }
  *shape = {qkv.dim_size(0), qkv.dim_size(1), heads, qkv.dim_size(2) / (3 * heads)};
  return absl::OkStatus();
}

absl::Status CheckSameShape(const char* name, const TensorShape& got, const TensorShape& expected) {
  if (got == expected) return absl::OkStatus();
  return absl::InvalidArgumentError(std::string("KerasVitAttentionGrad: ") + name + " has shape " +
                                    got.DebugString() + ", expected " + expected.DebugString());
}

TensorShape AttendedShape(const AttentionShape& s) { return TensorShape({s.batch, s.tokens, s.hidden()}); }
TensorShape LogsumexpShape(const AttentionShape& s) { return TensorShape({s.batch, s.heads, s.tokens}); }

// KerasVitAttentionGrad's inputs (qkv, attended, logsumexp, upstream) -> the attention's shape.
absl::Status GradShapeOf(const TensorShape& qkv, const TensorShape& attended, const TensorShape& logsumexp,
                         const TensorShape& upstream, int64_t heads, AttentionShape* s) {
  TF_RETURN_IF_ERROR(ShapeOf(qkv, heads, s));
  TF_RETURN_IF_ERROR(CheckSameShape("attended", attended, AttendedShape(*s)));
  TF_RETURN_IF_ERROR(CheckSameShape("logsumexp", logsumexp, LogsumexpShape(*s)));
  return CheckSameShape("upstream", upstream, AttendedShape(*s));
}

absl::Status ForwardShapes(InferenceContext* c) {
  ShapeHandle qkv;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &qkv));
  int64_t heads;
  TF_RETURN_IF_ERROR(c->GetAttr("num_heads", &heads));
  DimensionHandle hidden;
  TF_RETURN_IF_ERROR(c->Divide(c->Dim(qkv, 2), 3, /*evenly_divisible=*/true, &hidden));
  c->set_output(0, c->MakeShape({c->Dim(qkv, 0), c->Dim(qkv, 1), hidden}));
  c->set_output(1, c->MakeShape({c->Dim(qkv, 0), c->MakeDim(heads), c->Dim(qkv, 1)}));
  return absl::OkStatus();
}

REGISTER_OP("KerasVitAttention")
    .Input("qkv: float")
    .Output("attended: float")
    .Output("logsumexp: float")
    .Attr("num_heads: int >= 1")
    .SetShapeFn(ForwardShapes)
    .Doc("softmax(q k^T / sqrt(head_dim)) v per head, from and to keras_vit's projection layouts.");

REGISTER_OP("KerasVitAttentionGrad")
    .Input("qkv: float")
    .Input("attended: float")
    .Input("logsumexp: float")
    .Input("upstream: float")
    .Output("qkv_gradient: float")
    .Attr("num_heads: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      return absl::OkStatus();
    })
    .Doc("Gradient of KerasVitAttention with respect to qkv.");

// A kernel class (OpKernel or XlaOpKernel) with the ops' num_heads attribute read.
template <typename Kernel>
class WithHeads : public Kernel {
 public:
  explicit WithHeads(OpKernelConstruction* c) : Kernel(c) { OP_REQUIRES_OK(c, c->GetAttr("num_heads", &heads_)); }

 protected:
  int64_t heads_;
};

template <typename Fn>
void ForEachUnitOnDevice(OpKernelContext* ctx, const AttentionShape& s, const Fn& fn) {
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  ForEachUnit(s, pool->NumThreads() + 1, [pool](std::function<void()> task) { pool->Schedule(std::move(task)); },
              fn);
}

class AttentionOp : public WithHeads<OpKernel> {
 public:
  using WithHeads::WithHeads;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& qkv = ctx->input(0);
    AttentionShape s;
    OP_REQUIRES_OK(ctx, ShapeOf(qkv.shape(), heads_, &s));
    Tensor *attended, *logsumexp;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, AttendedShape(s), &attended));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, LogsumexpShape(s), &logsumexp));
    const float* in = qkv.flat<float>().data();
    float* out = attended->flat<float>().data();
    float* lse = logsumexp->flat<float>().data();
    ForEachUnitOnDevice(ctx, s, [&](Scratch& scratch, int64_t unit) { ForwardUnit(s, unit, in, out, lse, scratch); });
  }
};

class AttentionGradOp : public WithHeads<OpKernel> {
 public:
  using WithHeads::WithHeads;

  void Compute(OpKernelContext* ctx) override {
    const Tensor &qkv = ctx->input(0), &attended = ctx->input(1), &logsumexp = ctx->input(2),
                 &upstream = ctx->input(3);
    AttentionShape s;
    OP_REQUIRES_OK(ctx, GradShapeOf(qkv.shape(), attended.shape(), logsumexp.shape(), upstream.shape(), heads_, &s));
    Tensor* gradient;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, qkv.shape(), &gradient));
    const float *in = qkv.flat<float>().data(), *out = attended.flat<float>().data(),
                *lse = logsumexp.flat<float>().data(), *up = upstream.flat<float>().data();
    float* grad = gradient->flat<float>().data();
    ForEachUnitOnDevice(ctx, s, [&](Scratch& scratch, int64_t unit) {
      BackwardUnit(s, unit, in, out, lse, up, grad, scratch);
    });
  }
};

REGISTER_KERNEL_BUILDER(Name("KerasVitAttention").Device(::tensorflow::DEVICE_CPU), AttentionOp);
REGISTER_KERNEL_BUILDER(Name("KerasVitAttentionGrad").Device(::tensorflow::DEVICE_CPU), AttentionGradOp);

// XLA: one custom call per op, to the typed-FFI handlers registered for the
// host platform in attention_ffi.cc; the head count travels in the shapes
// (logsumexp is (batch, heads, tokens)). Registered for the CPU JIT device only.
xla::Shape F32(const TensorShape& shape) {
  return xla::ShapeUtil::MakeShape(xla::F32, shape.dim_sizes());
}

// A typed-FFI custom call of `handler` (attention_ffi.cc) on `operands`, returning `shape`.
xla::XlaOp CallHandler(::tensorflow::XlaOpKernelContext* ctx, const char* handler, std::vector<xla::XlaOp> operands,
                       const xla::Shape& shape) {
  return xla::CustomCall(ctx->builder(), handler, operands, shape, /*opaque=*/"", /*has_side_effect=*/false,
                         /*output_operand_aliasing=*/{}, /*literal=*/nullptr, xla::CustomCallSchedule::SCHEDULE_NONE,
                         xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
}

class AttentionXlaOp : public WithHeads<::tensorflow::XlaOpKernel> {
 public:
  using WithHeads::WithHeads;

  void Compile(::tensorflow::XlaOpKernelContext* ctx) override {
    AttentionShape s;
    OP_REQUIRES_OK(ctx, ShapeOf(ctx->InputShape(0), heads_, &s));
    xla::XlaOp call = CallHandler(ctx, "keras_vit_attention_forward", {ctx->Input(0)},
                                  xla::ShapeUtil::MakeTupleShape({F32(AttendedShape(s)), F32(LogsumexpShape(s))}));
    ctx->SetOutput(0, xla::GetTupleElement(call, 0));
    ctx->SetOutput(1, xla::GetTupleElement(call, 1));
  }
};

class AttentionGradXlaOp : public WithHeads<::tensorflow::XlaOpKernel> {
 public:
  using WithHeads::WithHeads;

  void Compile(::tensorflow::XlaOpKernelContext* ctx) override {
    AttentionShape s;
    OP_REQUIRES_OK(ctx, GradShapeOf(ctx->InputShape(0), ctx->InputShape(1), ctx->InputShape(2), ctx->InputShape(3),
                                    heads_, &s));
    ctx->SetOutput(0, CallHandler(ctx, "keras_vit_attention_backward",
                                  {ctx->Input(0), ctx->Input(1), ctx->Input(2), ctx->Input(3)},
                                  F32(ctx->InputShape(0))));
  }
};

// Registered as plain kernels of the XLA CPU JIT device rather than through
// REGISTER_XLA_OP: XlaOpRegistry turns its registrations into kernels once per
// process, the first time anything is compiled, and a library loaded after
// that (tf.load_op_library) would never get its XLA kernels.
REGISTER_KERNEL_BUILDER(Name("KerasVitAttention").Device(::tensorflow::DEVICE_CPU_XLA_JIT), AttentionXlaOp);
REGISTER_KERNEL_BUILDER(Name("KerasVitAttentionGrad").Device(::tensorflow::DEVICE_CPU_XLA_JIT), AttentionGradXlaOp);

}  // namespace
}  // namespace keras_vit
