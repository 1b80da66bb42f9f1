// Symbolic shapes in the model's sizes (B, T, d, H, kv heads, d_head, F, V) and the concrete tensor layouts
// (sizes, strides) that the walker derives from them, with ATen's view rules.
#ifndef ESTIMATOR_GRAPH_SHAPE_H_
#define ESTIMATOR_GRAPH_SHAPE_H_

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "estimator/spec/checked_math.h"
#include "estimator/spec/config.h"

namespace memledger {

// Symbol names one size of the model or its input; SymbolValue gives its value for a
// config.
enum class Symbol : uint8_t {
  kBatch,         // B
  kSeq,           // T
  kWidth,         // d, the hidden size
  kHeads,         // H
  kKvHeads,       // key/value heads
  kHeadDim,       // d_head
  kIntermediate,  // F, the MLP width
  kVocab,         // V
  kPositions,     // GPT-2's learned positions (max_positions)
  kSeqShard,      // T where sequence parallelism shards it: T / tp with --sp, else T
  kExperts,       // E, a sparse MLP's experts
  kTopK,          // k, the experts each token is routed to
  kExpertWidth,   // an expert's MLP width
  kLocalExperts,  // the experts one expert-parallel rank holds: E / ep
};
inline constexpr int kNumSymbols = static_cast<int>(Symbol::kLocalExperts) + 1;
static_assert(kNumSymbols <= 16, "SymDim::symbols is a 16-bit set");
int64_t SymbolValue(Symbol symbol, const ModelConfig& config);

// SymbolValues holds every symbol's value for one config, looked up once per walk.
struct SymbolValues {
  explicit SymbolValues(const ModelConfig& config);
  std::array<int64_t, kNumSymbols> values{};
};

// SymDim is one dimension as a monomial coeff * prod(symbol ^ power) / divisor, e.g.
// 3 * H * d_head, d_head / 2 or H / kv_heads (power -1); ValidateConfig makes every
// division the graphs use exact.
struct SymDim {
  int64_t coeff = 1;
  int64_t divisor = 1;
  std::array<int8_t, kNumSymbols> powers{};
  // symbols: bit s set where powers[s] may be nonzero (a product whose powers cancel
  // keeps its bits), so Evaluate visits only those.
  uint16_t symbols = 0;

  // Evaluate returns the dimension for `config`; overflow is sticky in the result.
  CheckedInt64 Evaluate(const ModelConfig& config) const;
  CheckedInt64 Evaluate(const SymbolValues& symbols) const;
};

// SymOf is the dimension `symbol` (power 1).
constexpr SymDim SymOf(Symbol symbol) {
  SymDim dim;
  dim.powers[static_cast<int>(symbol)] = 1;
  dim.symbols = static_cast<uint16_t>(1u << static_cast<int>(symbol));
  return dim;
}

// Symbols for writing shapes: {kB, kT, 3 * kD} is (B, T, 3d).
inline constexpr SymDim kB = SymOf(Symbol::kBatch);
inline constexpr SymDim kT = SymOf(Symbol::kSeq);
inline constexpr SymDim kD = SymOf(Symbol::kWidth);
inline constexpr SymDim kH = SymOf(Symbol::kHeads);
inline constexpr SymDim kKv = SymOf(Symbol::kKvHeads);
inline constexpr SymDim kDHead = SymOf(Symbol::kHeadDim);
inline constexpr SymDim kF = SymOf(Symbol::kIntermediate);
inline constexpr SymDim kV = SymOf(Symbol::kVocab);
inline constexpr SymDim kP = SymOf(Symbol::kPositions);
inline constexpr SymDim kTs = SymOf(Symbol::kSeqShard);
inline constexpr SymDim kE = SymOf(Symbol::kExperts);
inline constexpr SymDim kK = SymOf(Symbol::kTopK);
inline constexpr SymDim kFe = SymOf(Symbol::kExpertWidth);
inline constexpr SymDim kEl = SymOf(Symbol::kLocalExperts);
SymDim Sym(int64_t constant);
SymDim operator*(SymDim a, SymDim b);
SymDim operator*(int64_t coeff, SymDim a);
SymDim operator/(SymDim a, int64_t divisor);
SymDim operator/(SymDim a, SymDim b);  // H / kv heads: negative powers divide exactly

// Layout is a concrete strided tensor: sizes and strides in elements, no heap.
struct Layout {
  static constexpr int kMaxDims = 6;
  int ndim = 0;
  std::array<int64_t, kMaxDims> sizes{};
  std::array<int64_t, kMaxDims> strides{};

  // Contiguous returns the row-major layout of `sizes`.
  static Layout Contiguous(const int64_t* sizes, int ndim, bool* overflow);
  // DenseLike is the dense layout ATen gives a new tensor made "like" `like`: its strides
  // when it is non-overlapping and dense, else contiguous strides in the order of its
  // strides (TensorIterator's output of one input, and empty_like / _to_copy with
  // preserve_format: infer_dense_strides in TensorUtils.cpp). A transposed view of a
  // (B, T, H, d) tensor gives a (B, T, H, d)-ordered result.
  static Layout DenseLike(const Layout& like);
  // Elementwise is the layout TensorIterator gives the new output of an elementwise op
  // (add, mul, neg, pow, silu, ...) on `inputs`, broadcast to their common `sizes`
  // (TensorIterator.cpp): contiguous when every input is; an input's strides when all
  // have the same shape and the same non-overlapping dense strides; else the
  // dimensions ordered by the inputs' strides, the first input with a strict opinion
  // deciding each pair (reorder_dimensions), with contiguous strides in that order.
  // So x * cos of a transposed (B, T, H, d) x with a broadcast cos is (B, T, H, d)-ordered.
  // REQUIRES: 1 to 3 inputs (unary, binary and ternary ops).
  static Layout Elementwise(std::initializer_list<const Layout*> inputs, const int64_t* sizes,
                            int ndim, bool* overflow);
  CheckedInt64 Numel() const;
  // IsContiguous follows ATen: dimensions of size 1 do not constrain strides.
  bool IsContiguous() const;
  // IsNonOverlappingAndDense: a permutation of a contiguous layout (ATen's
  // compute_non_overlapping_and_dense).
  bool IsNonOverlappingAndDense() const;
  std::string ShapeString() const;  // "(16, 64, 128)"
};

// Contiguous, Numel and IsContiguous run thousands of times a prediction (the walks'
// layouts, the step simulation's gradients): inline, where the callers' loops are.
inline Layout Layout::Contiguous(const int64_t* sizes, int ndim, bool* overflow) {
  Layout layout;
  layout.ndim = ndim;
  CheckedInt64 stride = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    layout.sizes[i] = sizes[i];
    layout.strides[i] = stride.value();
    stride *= sizes[i];
  }
  *overflow = *overflow || stride.overflowed();
  return layout;
}

inline CheckedInt64 Layout::Numel() const {
  CheckedInt64 numel = 1;
  for (int i = 0; i < ndim; ++i) numel *= sizes[i];
  return numel;
}

inline bool Layout::IsContiguous() const {
  int64_t expected = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (sizes[i] == 1) continue;
    if (strides[i] != expected) return false;
    expected *= sizes[i];
  }
  return true;
}

// ViewStrides computes the strides of `new_sizes` viewing `old` without a copy, as
// ATen's computeStride does for view()/reshape(); returns false if no such view exists.
bool ViewStrides(const Layout& old, const int64_t* new_sizes, int new_ndim,
                 Layout* result, bool* overflow);

}  // namespace memledger

#endif  // ESTIMATOR_GRAPH_SHAPE_H_
