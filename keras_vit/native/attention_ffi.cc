// XLA typed-FFI handlers for the host platform: the custom calls that
// attention_ops.cc's XLA kernels emit. Kept apart from the TensorFlow
// translation unit: XLA's public FFI header and its internal one share a
// namespace.
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

#include "attention.h"

namespace keras_vit {
namespace {

namespace ffi = ::xla::ffi;

template <typename Fn>
void ForEachUnitOnPool(ffi::ThreadPool& pool, const AttentionShape& s, const Fn& fn) {
  // num_threads() is 0 where XLA passed no pool: everything runs on the caller.
  ForEachUnit(s, std::max<int64_t>(pool.num_threads(), 0) + 1,
              [&pool](auto task) { pool.Schedule(std::move(task)); }, fn);
}

AttentionShape ShapeFrom(ffi::AnyBuffer::Dimensions qkv, ffi::AnyBuffer::Dimensions logsumexp) {
  const int64_t heads = logsumexp[1];
  return {qkv[0], qkv[1], heads, qkv[2] / (3 * heads)};
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv, ffi::ResultBuffer<ffi::F32> attended,
                   ffi::ResultBuffer<ffi::F32> logsumexp) {
  const AttentionShape s = ShapeFrom(qkv.dimensions(), logsumexp->dimensions());
  const float* in = qkv.typed_data();
  float *out = attended->typed_data(), *lse = logsumexp->typed_data();
  ForEachUnitOnPool(pool, s, [&](Scratch& scratch, int64_t unit) { ForwardUnit(s, unit, in, out, lse, scratch); });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::F32> attended,
                    ffi::Buffer<ffi::F32> logsumexp, ffi::Buffer<ffi::F32> upstream,
                    ffi::ResultBuffer<ffi::F32> qkv_gradient) {
  const AttentionShape s = ShapeFrom(qkv.dimensions(), logsumexp.dimensions());
  const float *in = qkv.typed_data(), *out = attended.typed_data(), *lse = logsumexp.typed_data(),
              *up = upstream.typed_data();
  float* grad = qkv_gradient->typed_data();
  ForEachUnitOnPool(pool, s, [&](Scratch& scratch, int64_t unit) {
    BackwardUnit(s, unit, in, out, lse, up, grad, scratch);
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kForward, Forward,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::ThreadPool>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Ret<ffi::Buffer<ffi::F32>>()
                           .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER(kBackward, Backward,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::ThreadPool>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), "keras_vit_attention_forward", "Host", kForward);
XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), "keras_vit_attention_backward", "Host", kBackward);

}  // namespace
}  // namespace keras_vit
