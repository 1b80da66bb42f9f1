// Last hands over a tensor for its last use. The runtime's model code releases every
// intermediate right after its last reader, as Python's reference counting does in the
// equivalent PyTorch module (docs/DESIGN.md, "Peak memory"); a named C++ local would otherwise
// keep its storage alive until the end of its scope, and the step's peak would depend on
// C++ scoping.
//
// Example:
//   at::Tensor a = Attention(...);
//   at::Tensor projected = proj(Last(a).transpose(1, 2));  // a's storage may die here
#ifndef RUNTIME_LAST_USE_H_
#define RUNTIME_LAST_USE_H_

#include <ATen/core/Tensor.h>

#include <utility>

namespace memledger::runtime {

// Last leaves `t` undefined and returns its value as a temporary, which dies at the end
// of the caller's full expression.
inline at::Tensor Last(at::Tensor& t) { return std::move(t); }

}  // namespace memledger::runtime

#endif  // RUNTIME_LAST_USE_H_
