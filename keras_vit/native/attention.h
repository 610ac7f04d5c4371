// Multi-head self-attention forward and backward for one (image, head) pair at a
// time, on the fused projection's layout: no transposes in or out.
//
//   qkv       (batch, tokens, 3 * heads * head_dim): queries, keys, values,
//             each (heads, head_dim) per token (keras_vit.layers'
//             MultiHeadSelfAttention projection output).
//   attended  (batch, tokens, heads * head_dim): softmax(q k^T / sqrt(d)) v,
//             the layout the output projection takes.
//   logsumexp (batch, heads, tokens): log of each softmax row's normaliser
//             (scaled logits), kept for the backward pass, which recomputes
//             the probabilities from it instead of storing them.
//
// Backward (FlashAttention's identities, Dao et al. 2022):
//   P = exp(S - logsumexp), dV = P^T dO, dP = dO V^T,
//   dS = P * (dP - rowsum(dO * O)), dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d).
//
// The products are Eigen's matrix products on strided maps of the inputs;
// each (image, head) pair is a unit of work and the units are shared out over
// the caller's thread pool.
#ifndef KERAS_VIT_NATIVE_ATTENTION_H_
#define KERAS_VIT_NATIVE_ATTENTION_H_

#include <Eigen/Core>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

namespace keras_vit {

struct AttentionShape {
  int64_t batch, tokens, heads, head_dim;
  int64_t units() const { return batch * heads; }
  int64_t hidden() const { return heads * head_dim; }
};

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Vector = Eigen::VectorXf;
using RowsMap = Eigen::Map<Matrix, Eigen::Unaligned, Eigen::OuterStride<>>;
using ConstRowsMap = Eigen::Map<const Matrix, Eigen::Unaligned, Eigen::OuterStride<>>;

// Pointers of one (image, head) pair's rows in the two layouts.
struct Unit {
  int64_t image, head;
  Unit(const AttentionShape& s, int64_t unit) : image(unit / s.heads), head(unit % s.heads) {}
  // part 0, 1, 2: query, key, value within (batch, tokens, 3 * hidden).
  int64_t qkv_offset(const AttentionShape& s, int part) const {
    return image * s.tokens * 3 * s.hidden() + part * s.hidden() + head * s.head_dim;
  }
  int64_t attended_offset(const AttentionShape& s) const {
    return image * s.tokens * s.hidden() + head * s.head_dim;
  }
  int64_t logsumexp_offset(const AttentionShape& s) const { return (image * s.heads + head) * s.tokens; }
};

// One (image, head) pair's query, key and value rows within qkv.
struct QueryKeyValue {
  ConstRowsMap query, key, value;
  QueryKeyValue(const AttentionShape& s, const Unit& u, const float* qkv)
      : query(qkv + u.qkv_offset(s, 0), s.tokens, s.head_dim, Eigen::OuterStride<>(3 * s.hidden())),
        key(qkv + u.qkv_offset(s, 1), s.tokens, s.head_dim, Eigen::OuterStride<>(3 * s.hidden())),
        value(qkv + u.qkv_offset(s, 2), s.tokens, s.head_dim, Eigen::OuterStride<>(3 * s.hidden())) {}
};

// Work space of one thread: the (tokens, tokens) scores and their gradient and
// the scaled queries.
struct Scratch {
  Matrix scores, scores_gradient, scaled_query;
  explicit Scratch(const AttentionShape& s)
      : scores(s.tokens, s.tokens), scores_gradient(s.tokens, s.tokens), scaled_query(s.tokens, s.head_dim) {}
};

inline float Scale(const AttentionShape& s) { return 1.0f / std::sqrt(static_cast<float>(s.head_dim)); }

inline void ForwardUnit(const AttentionShape& s, int64_t unit, const float* qkv, float* attended,
                        float* logsumexp, Scratch& scratch) {
  const Unit u(s, unit);
  const QueryKeyValue in(s, u, qkv);
  const ConstRowsMap &query = in.query, &key = in.key, &value = in.value;
  const Eigen::OuterStride<> attended_rows(s.hidden());
  RowsMap out(attended + u.attended_offset(s), s.tokens, s.head_dim, attended_rows);
  Eigen::Map<Vector> lse(logsumexp + u.logsumexp_offset(s), s.tokens);

  Matrix& scores = scratch.scores;
  scratch.scaled_query.noalias() = query * Scale(s);
  scores.noalias() = scratch.scaled_query * key.transpose();
  const Vector row_max = scores.rowwise().maxCoeff();
  scores.array().colwise() -= row_max.array();
  scores.array() = scores.array().exp();
  const Vector row_sum = scores.rowwise().sum();
  out.noalias() = scores * value;
  out.array().colwise() /= row_sum.array();
  lse.array() = row_max.array() + row_sum.array().log();
}

inline void BackwardUnit(const AttentionShape& s, int64_t unit, const float* qkv, const float* attended,
                         const float* logsumexp, const float* upstream, float* qkv_gradient, Scratch& scratch) {
  const Unit u(s, unit);
  const QueryKeyValue in(s, u, qkv);
  const ConstRowsMap &query = in.query, &key = in.key, &value = in.value;
  const Eigen::OuterStride<> qkv_rows(3 * s.hidden()), attended_rows(s.hidden());
  ConstRowsMap out(attended + u.attended_offset(s), s.tokens, s.head_dim, attended_rows);
  ConstRowsMap d_out(upstream + u.attended_offset(s), s.tokens, s.head_dim, attended_rows);
  Eigen::Map<const Vector> lse(logsumexp + u.logsumexp_offset(s), s.tokens);
  RowsMap d_query(qkv_gradient + u.qkv_offset(s, 0), s.tokens, s.head_dim, qkv_rows);
  RowsMap d_key(qkv_gradient + u.qkv_offset(s, 1), s.tokens, s.head_dim, qkv_rows);
  RowsMap d_value(qkv_gradient + u.qkv_offset(s, 2), s.tokens, s.head_dim, qkv_rows);

  const float scale = Scale(s);
  Matrix& probs = scratch.scores;
  Matrix& d_scores = scratch.scores_gradient;
  scratch.scaled_query.noalias() = query * scale;
  probs.noalias() = scratch.scaled_query * key.transpose();
  probs.array().colwise() -= lse.array();
  probs.array() = probs.array().exp();
  d_value.noalias() = probs.transpose() * d_out;
  d_scores.noalias() = d_out * value.transpose();
  const Vector offset = (d_out.array() * out.array()).rowwise().sum();
  d_scores.array().colwise() -= offset.array();
  d_scores.array() *= probs.array();
  d_query.noalias() = d_scores * key;
  d_query *= scale;
  d_key.noalias() = d_scores.transpose() * scratch.scaled_query;
}

// Runs fn(scratch, unit) for unit in [0, units) on the caller and on up to
// `threads - 1` tasks given to `schedule`. Units are claimed from a shared
// counter, so a task that starts late finds nothing left and returns; the
// caller waits only for claimed units, never for a task to start.
template <typename Schedule, typename Fn>
void ForEachUnit(const AttentionShape& s, int64_t threads, Schedule&& schedule, const Fn& fn) {
  struct State {
    std::atomic<int64_t> next{0};
    int64_t finished = 0;
    std::mutex mutex;
    std::condition_variable all_finished;
  };
  const int64_t units = s.units();
  auto state = std::make_shared<State>();
  auto work = [state, units, &s, &fn] {
    std::unique_ptr<Scratch> scratch;
    int64_t done = 0;
    for (int64_t unit = state->next++; unit < units; unit = state->next++) {
      if (!scratch) scratch = std::make_unique<Scratch>(s);
      fn(*scratch, unit);
      ++done;
    }
    if (done == 0) return;
    std::lock_guard<std::mutex> lock(state->mutex);
    state->finished += done;
    if (state->finished == units) state->all_finished.notify_all();
  };
  const int64_t helpers = std::min(threads, units) - 1;
  for (int64_t i = 0; i < helpers; ++i) schedule(work);
  work();
  std::unique_lock<std::mutex> lock(state->mutex);
  state->all_finished.wait(lock, [&] { return state->finished == units; });
}

}  // namespace keras_vit

#endif  // KERAS_VIT_NATIVE_ATTENTION_H_
