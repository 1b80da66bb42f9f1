// The symbolic graph of one pre-LN Transformer block (and of the loss) as the pinned
// PyTorch (estimator/rules.h) executes it: every ATen op the forward runs, with symbolic
// shapes in (B, T, d, H). What each op views and keeps is in estimator/rules.h.
//
// Example:
//   const BlockGraph& block = BlockGraphFor(AttentionMode::kFlash);
//   for (const OpDef& op : block.ops) ...  // in execution order
#ifndef ESTIMATOR_BLOCK_GRAPH_H_
#define ESTIMATOR_BLOCK_GRAPH_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "estimator/config.h"
#include "estimator/rules.h"
#include "estimator/shape.h"

namespace memledger {

// TensorDef is one tensor of the graph; its layout is derived during a walk.
struct TensorDef {
  std::string name;  // "ln1.out", "qkv.weight"
  DType dtype = DType::kFloat32;
  bool is_parameter = false;
  std::vector<SymDim> shape;  // parameters and the graph input only
};

// OpDef is one op in execution order.
struct OpDef {
  OpType type;
  std::string name;  // where it sits in the block: "qkv", "attention.scores"
  std::vector<int> inputs;
  std::vector<int> outputs;
  std::vector<SymDim> shape;  // target shape of view/reshape/_unsafe_view/expand
  std::vector<int> dims;      // permute order; transpose (dim0, dim1); select (dim, index)
  // policy_kind says which selective-checkpointing op kind this op belongs to.
  std::optional<OpKind> policy_kind;
};

// BlockGraph is one block (input x of shape (B, T, d) -> output) or the loss.
struct BlockGraph {
  std::vector<TensorDef> tensors;
  std::vector<OpDef> ops;
  int input = 0;
  int output = 0;
};

// BlockGraphFor returns the block graph for `mode`; built once, immutable, thread-safe.
const BlockGraph& BlockGraphFor(AttentionMode mode);
// LossGraph returns x.pow(2).mean() on the last block's output.
const BlockGraph& LossGraph();

}  // namespace memledger

#endif  // ESTIMATOR_BLOCK_GRAPH_H_
