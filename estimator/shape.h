// Symbolic shapes in the model's sizes (B, T, d, H) and the concrete tensor layouts
// (sizes, strides) that the walker derives from them, with ATen's view rules.
#ifndef ESTIMATOR_SHAPE_H_
#define ESTIMATOR_SHAPE_H_

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "estimator/checked_math.h"
#include "estimator/config.h"

namespace memledger {

enum class DType : uint8_t { kFloat32, kBool };

int64_t ElementSizeBytes(DType dtype);
const char* DTypeName(DType dtype);  // "float32", "bool"

// SymDim is one dimension as a monomial coeff * B^b * T^t * d^w * H^h, where h may be
// -1 (d / H = d_head, exact because ValidateConfig requires d % H == 0).
struct SymDim {
  int64_t coeff = 1;
  int8_t b = 0, t = 0, w = 0, h = 0;

  // Evaluate returns the dimension for `config`; overflow is sticky in the result.
  CheckedInt64 Evaluate(const ModelConfig& config) const;
};

// Symbols for writing shapes: {kB, kT, 3 * kD} is (B, T, 3d).
inline constexpr SymDim kB{1, 1, 0, 0, 0};
inline constexpr SymDim kT{1, 0, 1, 0, 0};
inline constexpr SymDim kD{1, 0, 0, 1, 0};
inline constexpr SymDim kH{1, 0, 0, 0, 1};
inline constexpr SymDim kDHead{1, 0, 0, 1, -1};  // d / H
SymDim Sym(int64_t constant);
SymDim operator*(SymDim a, SymDim b);
SymDim operator*(int64_t coeff, SymDim a);

// Layout is a concrete strided tensor: sizes and strides in elements, no heap.
struct Layout {
  static constexpr int kMaxDims = 6;
  int ndim = 0;
  std::array<int64_t, kMaxDims> sizes{};
  std::array<int64_t, kMaxDims> strides{};

  // Contiguous returns the row-major layout of `sizes`.
  static Layout Contiguous(const int64_t* sizes, int ndim, bool* overflow);
  CheckedInt64 Numel() const;
  // IsContiguous follows ATen: dimensions of size 1 do not constrain strides.
  bool IsContiguous() const;
  std::string ShapeString() const;  // "(16, 64, 128)"
};

// ViewStrides computes the strides of `new_sizes` viewing `old` without a copy, as
// ATen's computeStride does for view()/reshape(); returns false if no such view exists.
bool ViewStrides(const Layout& old, const int64_t* new_sizes, int new_ndim,
                 Layout* result, bool* overflow);

}  // namespace memledger

#endif  // ESTIMATOR_SHAPE_H_
