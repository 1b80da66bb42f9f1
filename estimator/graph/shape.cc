#include "estimator/graph/shape.h"

#include <algorithm>

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"

namespace memledger {

int64_t SymbolValue(Symbol symbol, const ModelConfig& config) {
  switch (symbol) {
    case Symbol::kBatch:
      return config.batch;
    case Symbol::kSeq:
      return config.seq;
    case Symbol::kWidth:
      return config.width;
    // A tensor-parallel rank holds heads, kv heads, MLP columns and vocabulary rows / tp
    // (ValidateConfig makes the divisions exact); a head keeps its width.
    case Symbol::kHeads:
      return config.heads / config.shard.tp;
    case Symbol::kKvHeads:
      return config.KvHeads() / config.shard.tp;
    case Symbol::kHeadDim:
      return config.HeadDim();
    case Symbol::kIntermediate:
      return config.Intermediate() / config.shard.tp;
    case Symbol::kVocab:
      return config.vocab / config.shard.tp;
    case Symbol::kPositions:
      return config.max_positions;
    case Symbol::kSeqShard:
      return config.shard.sp ? config.seq / config.shard.tp : config.seq;
    case Symbol::kExperts:
      return config.moe.experts;
    case Symbol::kTopK:
      return config.moe.top_k;
    case Symbol::kExpertWidth:
      return config.moe.intermediate;
    case Symbol::kLocalExperts:  // ValidateConfig makes the division exact
      return config.moe.experts / config.shard.ep;
  }
  return 0;
}

SymbolValues::SymbolValues(const ModelConfig& config) {
  for (int s = 0; s < kNumSymbols; ++s) values[s] = SymbolValue(static_cast<Symbol>(s), config);
}

CheckedInt64 SymDim::Evaluate(const ModelConfig& config) const {
  return Evaluate(SymbolValues(config));
}

CheckedInt64 SymDim::Evaluate(const SymbolValues& symbols) const {
  // Multiply first, then divide: every division the graphs use is exact.
  CheckedInt64 value = coeff;
  int64_t divide_by = divisor;
  for (unsigned set = this->symbols; set != 0; set &= set - 1) {
    const int s = __builtin_ctz(set);
    for (int i = 0; i < powers[s]; ++i) value *= symbols.values[s];
    for (int i = 0; i > powers[s]; --i) divide_by *= symbols.values[s];
  }
  return divide_by == 1 ? value : value.DividedBy(divide_by);
}

SymDim Sym(int64_t constant) {
  SymDim dim;
  dim.coeff = constant;
  return dim;
}

SymDim operator/(SymDim a, int64_t divisor) {
  a.divisor *= divisor;
  return a;
}

SymDim operator/(SymDim a, SymDim b) {
  a.divisor *= b.coeff;
  a.coeff *= b.divisor;
  for (int s = 0; s < kNumSymbols; ++s) a.powers[s] = static_cast<int8_t>(a.powers[s] - b.powers[s]);
  a.symbols |= b.symbols;
  return a;
}

SymDim operator*(SymDim a, SymDim b) {
  a.coeff *= b.coeff;
  a.divisor *= b.divisor;
  for (int s = 0; s < kNumSymbols; ++s) a.powers[s] = static_cast<int8_t>(a.powers[s] + b.powers[s]);
  a.symbols |= b.symbols;
  return a;
}

SymDim operator*(int64_t coeff, SymDim a) {
  a.coeff *= coeff;
  return a;
}

namespace {

// StableSortDims sorts order[0, n) by `less`, keeping equal dimensions in their order: an
// insertion sort, as std::stable_sort would, without its temporary buffer (n <= 6, on
// every layout the walker makes).
template <typename Less>
void StableSortDims(std::array<int, Layout::kMaxDims>& order, int n, Less less) {
  for (int i = 1; i < n; ++i) {
    const int dim = order[i];
    int j = i;
    for (; j > 0 && less(dim, order[j - 1]); --j) order[j] = order[j - 1];
    order[j] = dim;
  }
}

}  // namespace

Layout Layout::DenseLike(const Layout& like) {
  // The dimensions from the outermost stride to the innermost (a stable sort, so equal
  // strides, as size-1 dimensions may have, keep their order), then contiguous strides
  // in that order. A non-overlapping dense layout maps to itself.
  std::array<int, kMaxDims> order{};
  for (int i = 0; i < like.ndim; ++i) order[i] = i;
  StableSortDims(order, like.ndim,
                 [&](int a, int b) { return like.strides[a] > like.strides[b]; });
  Layout out = like;
  int64_t stride = 1;
  for (int i = like.ndim - 1; i >= 0; --i) {
    out.strides[order[i]] = stride;
    stride *= like.sizes[order[i]];
  }
  return out;
}

Layout Layout::Elementwise(std::initializer_list<const Layout*> inputs, const int64_t* sizes,
                           int ndim, bool* overflow) {
  // compute_fast_setup_type: only when every input has the output's shape (the dense
  // strides asked only when not all are contiguous).
  bool same_shape = true, contiguous = true;
  for (const Layout* input : inputs) {
    same_shape = same_shape && input->ndim == ndim &&
                 std::equal(sizes, sizes + ndim, input->sizes.begin());
    contiguous = contiguous && input->IsContiguous();
  }
  if (same_shape && contiguous) return Contiguous(sizes, ndim, overflow);
  if (same_shape) {
    bool same_dense_strides = true;
    for (const Layout* input : inputs) {
      same_dense_strides = same_dense_strides && input->IsNonOverlappingAndDense() &&
                           input->strides == (*inputs.begin())->strides;
    }
    if (same_dense_strides) return **inputs.begin();
  }
  // compute_strides: each input's strides broadcast to `sizes`, 0 where it broadcasts.
  std::array<std::array<int64_t, kMaxDims>, 3> strides{};
  int n = 0;
  for (const Layout* input : inputs) {
    if (n == static_cast<int>(strides.size())) break;  // REQUIRES: at most 3
    for (int i = 0; i < ndim; ++i) {
      const int j = i - (ndim - input->ndim);
      strides[n][i] = j >= 0 && !(input->sizes[j] == 1 && sizes[i] != 1) ? input->strides[j] : 0;
    }
    ++n;
  }
  // reorder_dimensions: perm[0] is the innermost dimension; an insertion sort whose
  // comparison asks the inputs in order, skipping any that broadcasts either dimension.
  auto should_swap = [&](int dim0, int dim1) {
    for (int t = 0; t < n; ++t) {
      const int64_t stride0 = strides[t][dim0], stride1 = strides[t][dim1];
      if (stride0 == 0 || stride1 == 0) continue;
      if (stride0 < stride1) return -1;
      if (stride0 > stride1) return 1;
      if (sizes[dim0] > sizes[dim1]) return 1;  // equal strides: the smaller size inner
    }
    return 0;
  };
  std::array<int, kMaxDims> perm{};
  for (int i = 0; i < ndim; ++i) perm[i] = ndim - 1 - i;
  for (int i = 1; i < ndim; ++i) {
    int dim1 = i;
    for (int dim0 = i - 1; dim0 >= 0; --dim0) {
      const int comparison = should_swap(perm[dim0], perm[dim1]);
      if (comparison > 0) {
        std::swap(perm[dim0], perm[dim1]);
        dim1 = dim0;
      } else if (comparison < 0) {
        break;
      }
    }
  }
  Layout out;
  out.ndim = ndim;
  CheckedInt64 stride = 1;
  for (int i = 0; i < ndim; ++i) {
    out.sizes[perm[i]] = sizes[perm[i]];
    out.strides[perm[i]] = stride.value();
    stride *= sizes[perm[i]];
  }
  *overflow = *overflow || stride.overflowed();
  return out;
}

bool Layout::IsNonOverlappingAndDense() const {
  if (ndim == 1) return sizes[0] < 2 || strides[0] == 1;
  std::array<int, kMaxDims> order{};
  for (int i = 0; i < ndim; ++i) order[i] = i;
  // Size-1 dimensions last; the others by increasing stride.
  StableSortDims(order, ndim, [&](int a, int b) {
    if (sizes[a] < 2) return false;
    if (sizes[b] < 2) return true;
    return strides[a] < strides[b];
  });
  int64_t require = 1;
  for (int i = 0; i < ndim; ++i) {
    const int dim = order[i];
    if (sizes[dim] == 1) continue;
    if (strides[dim] != require) return false;
    require *= sizes[dim];
  }
  return true;
}

std::string Layout::ShapeString() const {
  return absl::StrCat("(", absl::StrJoin(absl::MakeConstSpan(sizes.data(), ndim), ", "),
                      ")");
}

bool ViewStrides(const Layout& old, const int64_t* new_sizes, int new_ndim,
                 Layout* result, bool* overflow) {
  // A transcription of ATen's computeStride (TensorUtils.cpp): walk the old dimensions
  // from the innermost, grouping runs that are contiguous with each other ("chunks");
  // each chunk must be covered exactly by consecutive new dimensions.
  result->ndim = new_ndim;
  for (int i = 0; i < new_ndim; ++i) result->sizes[i] = new_sizes[i];
  if (old.ndim == 0) {
    for (int i = 0; i < new_ndim; ++i) result->strides[i] = 1;
    return true;
  }
  int view_d = new_ndim - 1;
  CheckedInt64 chunk_base_stride = old.strides[old.ndim - 1];
  CheckedInt64 tensor_numel = 1;
  CheckedInt64 view_numel = 1;
  for (int tensor_d = old.ndim - 1; tensor_d >= 0; --tensor_d) {
    tensor_numel *= old.sizes[tensor_d];
    if (tensor_d == 0 ||
        (old.sizes[tensor_d - 1] != 1 &&
         old.strides[tensor_d - 1] != (tensor_numel * chunk_base_stride).value())) {
      while (view_d >= 0 &&
             (view_numel.value() < tensor_numel.value() || new_sizes[view_d] == 1)) {
        result->strides[view_d] = (view_numel * chunk_base_stride).value();
        view_numel *= new_sizes[view_d];
        --view_d;
      }
      if (view_numel.value() != tensor_numel.value()) return false;
      if (tensor_d > 0) {
        chunk_base_stride = old.strides[tensor_d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  *overflow = *overflow || tensor_numel.overflowed() || view_numel.overflowed() ||
              chunk_base_stride.overflowed();
  return view_d == -1;
}

}  // namespace memledger
