// Fuzzes Predict on random specs: every family, size, dtype, autocast, attention mode,
// variant and policy, use_cache and GPT-2's dropouts drawn from the input bytes. Predict
// must return (a prediction, or InvalidArgument / OutOfRange for bad or overflowing
// specs), a prediction's segments and dtype split must add up to its total, and a
// recorded step must replay to its peak and write as a memory snapshot.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "estimator/spec/config.h"
#include "estimator/report/memory_snapshot.h"
#include "estimator/predict/predict.h"

namespace {

// Bytes reads the input as little numbers, 0 when exhausted.
class Bytes {
 public:
  Bytes(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint64_t Next(int bytes) {
    uint64_t value = 0;
    for (int i = 0; i < bytes; ++i) value = value << 8 | (pos_ < size_ ? data_[pos_++] : 0);
    return value;
  }
  // Size is a dimension: mostly small, sometimes huge (to reach overflow), sometimes 0.
  int64_t Size() {
    const uint64_t kind = Next(1) % 8;
    if (kind == 0) return static_cast<int64_t>(Next(1)) - 8;  // around zero and negative
    if (kind == 7) return static_cast<int64_t>(Next(8) >> 1);  // anything
    return 1 + static_cast<int64_t>(Next(2) % 4096);
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memledger;
  Bytes in(data, size);
  ModelConfig c;
  c.family = static_cast<Family>(in.Next(1) % 3);
  c.layers = in.Size();
  c.width = in.Size();
  c.heads = in.Size();
  c.batch = in.Size();
  c.seq = in.Size();
  c.kv_heads = in.Next(1) % 2 ? in.Size() : 0;
  c.head_dim = in.Next(1) % 2 ? in.Size() : 0;
  c.intermediate = in.Next(1) % 2 ? in.Size() : 0;
  c.vocab = in.Size();
  c.max_positions = in.Size();
  c.tie_embeddings = in.Next(1) % 2;
  const uint64_t attention_bits = in.Next(1);
  c.qkv_bias = attention_bits & 1;
  c.qk_norm = attention_bits >> 1 & 1;
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  c.dtype = dtypes[in.Next(1) % 3];
  c.amp = dtypes[in.Next(1) % 3];
  PredictOptions options;
  options.attention = in.Next(1) % 2 ? AttentionMode::kFlash : AttentionMode::kMath;
  options.optimizer.kind = static_cast<OptimizerKind>(in.Next(1) % 3);
  options.optimizer.momentum = static_cast<double>(in.Next(1) % 3) / 2;
  options.optimizer.master_weights = in.Next(1) % 2;
  options.variants.clear();
  const int n = 1 + static_cast<int>(in.Next(1) % 4);
  for (int i = 0; i < n; ++i) {
    Variant v;
    v.kind = static_cast<VariantKind>(in.Next(1) % 4);
    v.every = static_cast<int64_t>(in.Next(1) % 9);
    v.policy = SavePolicy();
    const uint64_t kinds = in.Next(1);
    for (int k = 0; k < kNumOpKinds; ++k) {
      if (kinds >> k & 1) v.policy.Add(static_cast<OpKind>(k));
    }
    options.variants.push_back(v);
  }
  // transformers' use_cache and GPT-2's dropouts; a small enough step is also recorded
  // and written as a PyTorch memory snapshot.
  c.use_cache = in.Next(1) % 2;
  const uint64_t drops = in.Next(1);
  c.dropout = {.resid = drops & 1 ? 0.1 : 0, .embd = drops & 2 ? 0.1 : 0,
               .attn = drops & 4 ? 0.1 : 0};
  options.timeline = in.Next(1) % 2 && c.layers <= 8 && c.width <= 256 && c.heads <= 16 &&
                     c.batch <= 8 && c.seq <= 256 && c.vocab <= 4096 &&
                     c.intermediate <= 1024;
  absl::StatusOr<Prediction> p = Predict(c, options);
  if (!p.ok()) {
    const absl::StatusCode code = p.status().code();
    if (code != absl::StatusCode::kInvalidArgument && code != absl::StatusCode::kOutOfRange) {
      std::fprintf(stderr,
                   "unexpected status: %s\nfamily %d layers %lld width %lld heads %lld "
                   "batch %lld seq %lld kv %lld head_dim %lld F %lld V %lld P %lld\n",
                   p.status().ToString().c_str(), static_cast<int>(c.family),
                   static_cast<long long>(c.layers), static_cast<long long>(c.width),
                   static_cast<long long>(c.heads), static_cast<long long>(c.batch),
                   static_cast<long long>(c.seq), static_cast<long long>(c.kv_heads),
                   static_cast<long long>(c.head_dim), static_cast<long long>(c.intermediate),
                   static_cast<long long>(c.vocab), static_cast<long long>(c.max_positions));
      __builtin_trap();  // an Internal error is a bug
    }
    return 0;
  }
  for (const VariantPrediction& v : p->variants) {
    int64_t by_dtype = 0;
    for (int64_t bytes : v.saved_by_dtype) by_dtype += bytes;
    if (v.embedding_bytes + v.layers_bytes + v.head_loss_bytes != v.saved_bytes ||
        by_dtype != v.saved_bytes || v.saved_bytes < 0) {
      std::fprintf(stderr, "inconsistent %s: %lld = %lld + %lld + %lld, by dtype %lld\n",
                   v.variant.Name().c_str(), static_cast<long long>(v.saved_bytes),
                   static_cast<long long>(v.embedding_bytes),
                   static_cast<long long>(v.layers_bytes),
                   static_cast<long long>(v.head_loss_bytes),
                   static_cast<long long>(by_dtype));
      __builtin_trap();
    }
    if (v.timeline != nullptr) {
      // Every free of the recorded step matches an allocation (the snapshot checks), and
      // the events replay to the peak.
      absl::StatusOr<std::string> snapshot = MemorySnapshotPickle(*v.timeline);
      int64_t live = v.timeline->resident_bytes, peak = live;
      for (const TimelineEvent& e : v.timeline->events) {
        live += e.bytes;
        peak = std::max(peak, live);
      }
      if (!snapshot.ok() || !v.peak.has_value() || peak != v.peak->bytes) {
        std::fprintf(stderr, "snapshot of %s: %s, replayed peak %lld\n",
                     v.variant.Name().c_str(), snapshot.status().ToString().c_str(),
                     static_cast<long long>(peak));
        __builtin_trap();
      }
    }
  }
  return 0;
}
