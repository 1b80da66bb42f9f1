#include "estimator/walker.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace memledger {
namespace {

struct TensorState {
  Layout layout;
  int storage = -1;
  bool requires_grad = false;
};

struct StorageState {
  int64_t bytes = 0;
  int owner = 0;
  bool is_parameter = false;
  bool kept = false;    // by autograd or the checkpoint node
  bool cached = false;  // by the selective cache
};

// Walk holds the per-call state; nothing is shared between calls.
class Walk {
 public:
  Walk(const BlockGraph& graph, const ModelConfig& config, const WalkOptions& options)
      : graph_(graph), config_(config), options_(options),
        rules_(options.rules != nullptr ? *options.rules : RuleTable::Pinned()),
        tensors_(graph.tensors.size()) {
    storages_.reserve(graph.tensors.size());
  }

  absl::StatusOr<BlockWalk> Run() {
    for (size_t i = 0; i < graph_.tensors.size(); ++i) {
      const TensorDef& def = graph_.tensors[i];
      if (def.is_parameter || static_cast<int>(i) == graph_.input) {
        bool is_input = static_cast<int>(i) == graph_.input;
        NewStorage(static_cast<int>(i), Evaluate(def.shape), def.dtype, !is_input);
        tensors_[i].requires_grad = is_input ? options_.input_requires_grad : true;
      }
    }
    if (options_.checkpointed) Keep(-1, graph_.input, KeepReason::kCheckpointInput);
    // A checkpointed block without a policy keeps nothing inside: skip its ops.
    const bool walk_ops = !options_.checkpointed || !(options_.policy == WalkOptions::NoSavePolicy());
    for (size_t op = 0; walk_ops && op < graph_.ops.size(); ++op) {
      if (absl::Status s = Apply(static_cast<int>(op)); !s.ok()) return s;
    }
    BlockWalk walk = Summarize();
    if (overflow_) {
      return absl::OutOfRangeError(absl::StrCat(
          "byte counts overflow int64 for width=", config_.width,
          " heads=", config_.heads, " batch=", config_.batch, " seq=", config_.seq));
    }
    return walk;
  }

 private:
  Layout Evaluate(const std::vector<SymDim>& shape) {
    int64_t sizes[Layout::kMaxDims];
    for (size_t i = 0; i < shape.size(); ++i) {
      CheckedInt64 dim = shape[i].Evaluate(config_);
      overflow_ = overflow_ || dim.overflowed();
      sizes[i] = dim.value();
    }
    return Layout::Contiguous(sizes, static_cast<int>(shape.size()), &overflow_);
  }

  void NewStorage(int tensor, const Layout& layout, DType dtype, bool is_parameter) {
    CheckedInt64 bytes = layout.Numel() * ElementSizeBytes(dtype);
    overflow_ = overflow_ || bytes.overflowed();
    storages_.push_back(StorageState{bytes.value(), tensor, is_parameter, false, false});
    tensors_[tensor].layout = layout;
    tensors_[tensor].storage = static_cast<int>(storages_.size()) - 1;
  }

  void NewContiguous(int tensor, const int64_t* sizes, int ndim) {
    NewStorage(tensor, Layout::Contiguous(sizes, ndim, &overflow_),
               graph_.tensors[tensor].dtype, false);
  }

  void ViewOf(int tensor, int base, const Layout& layout) {
    tensors_[tensor].layout = layout;
    tensors_[tensor].storage = tensors_[base].storage;
  }

  absl::Status Internal(const OpDef& op, absl::string_view what) {
    return absl::InternalError(absl::StrCat("estimator graph op '", op.name, "' (",
                                            OpTypeName(op.type), "): ", what));
  }

  // Layouts derives each output's layout and storage from the inputs, as ATen does.
  absl::Status Layouts(const OpDef& op) {
    const Layout& in = tensors_[op.inputs.empty() ? 0 : op.inputs[0]].layout;
    const int out = op.outputs[0];
    switch (op.type) {
      case OpType::kNativeLayerNorm: {
        NewContiguous(out, in.sizes.data(), in.ndim);
        int64_t stat_sizes[Layout::kMaxDims];
        std::copy(in.sizes.begin(), in.sizes.begin() + in.ndim, stat_sizes);
        stat_sizes[in.ndim - 1] = 1;  // mean and rstd are (B, T, 1)
        NewContiguous(op.outputs[1], stat_sizes, in.ndim);
        NewContiguous(op.outputs[2], stat_sizes, in.ndim);
        return absl::OkStatus();
      }
      case OpType::kView:
      case OpType::kReshape:
      case OpType::kUnsafeView: {
        Layout target = Evaluate(op.shape);
        Layout view;
        if (target.Numel().value() != in.Numel().value()) {
          return Internal(op, "element count changes");
        }
        if (ViewStrides(in, target.sizes.data(), target.ndim, &view, &overflow_)) {
          ViewOf(out, op.inputs[0], view);
        } else if (op.type == OpType::kReshape) {
          NewStorage(out, target, graph_.tensors[out].dtype, false);  // reshape copies
        } else {
          return Internal(op, "input cannot be viewed with this shape");
        }
        return absl::OkStatus();
      }
      case OpType::kPermute: {
        Layout view;
        view.ndim = in.ndim;
        for (int i = 0; i < in.ndim; ++i) {
          view.sizes[i] = in.sizes[op.dims[i]];
          view.strides[i] = in.strides[op.dims[i]];
        }
        ViewOf(out, op.inputs[0], view);
        return absl::OkStatus();
      }
      case OpType::kTranspose:
      case OpType::kT: {
        Layout view = in;
        int d0 = op.type == OpType::kT ? 0 : op.dims[0];
        int d1 = op.type == OpType::kT ? 1 : op.dims[1];
        std::swap(view.sizes[d0], view.sizes[d1]);
        std::swap(view.strides[d0], view.strides[d1]);
        ViewOf(out, op.inputs[0], view);
        return absl::OkStatus();
      }
      case OpType::kSelect: {
        Layout view;
        view.ndim = in.ndim - 1;
        for (int i = 0, j = 0; i < in.ndim; ++i) {
          if (i == op.dims[0]) continue;
          view.sizes[j] = in.sizes[i];
          view.strides[j++] = in.strides[i];
        }
        ViewOf(out, op.inputs[0], view);
        return absl::OkStatus();
      }
      case OpType::kExpand: {
        Layout target = Evaluate(op.shape);
        if (target.ndim != in.ndim ||
            !std::equal(in.sizes.begin(), in.sizes.begin() + in.ndim, target.sizes.begin())) {
          return Internal(op, "only same-size expand is modelled");
        }
        ViewOf(out, op.inputs[0], in);
        return absl::OkStatus();
      }
      case OpType::kAddmm: {
        const Layout& mat1 = tensors_[op.inputs[1]].layout;
        const Layout& mat2 = tensors_[op.inputs[2]].layout;
        const int64_t sizes[] = {mat1.sizes[0], mat2.sizes[1]};
        NewContiguous(out, sizes, 2);
        return absl::OkStatus();
      }
      case OpType::kBmm: {
        const Layout& mat2 = tensors_[op.inputs[1]].layout;
        const int64_t sizes[] = {in.sizes[0], in.sizes[1], mat2.sizes[2]};
        NewContiguous(out, sizes, 3);
        return absl::OkStatus();
      }
      case OpType::kFlashAttention: {
        // q is (B, H, T, d_head). PyTorch allocates out as (B, T, H, d_head) and
        // logsumexp as (B, T, H), and returns their (1, 2)-transposed views.
        const int64_t out_sizes[] = {in.sizes[0], in.sizes[2], in.sizes[1], in.sizes[3]};
        NewContiguous(out, out_sizes, 4);
        std::swap(tensors_[out].layout.sizes[1], tensors_[out].layout.sizes[2]);
        std::swap(tensors_[out].layout.strides[1], tensors_[out].layout.strides[2]);
        const int lse = op.outputs[1];
        const int64_t lse_sizes[] = {in.sizes[0], in.sizes[2], in.sizes[1]};
        NewContiguous(lse, lse_sizes, 3);
        std::swap(tensors_[lse].layout.sizes[1], tensors_[lse].layout.sizes[2]);
        std::swap(tensors_[lse].layout.strides[1], tensors_[lse].layout.strides[2]);
        return absl::OkStatus();
      }
      case OpType::kCausalMask: {
        Layout target = Evaluate(op.shape);
        NewStorage(out, target, graph_.tensors[out].dtype, false);
        return absl::OkStatus();
      }
      case OpType::kMulScalar:
      case OpType::kMaskedFill:
      case OpType::kSoftmax:
      case OpType::kAdd:
      case OpType::kGelu:
      case OpType::kPow:
        NewContiguous(out, in.sizes.data(), in.ndim);  // elementwise, same shape
        return absl::OkStatus();
      case OpType::kMean:
        NewContiguous(out, nullptr, 0);  // a scalar
        return absl::OkStatus();
    }
    return Internal(op, "unknown op");
  }

  absl::Status Apply(int op_index) {
    const OpDef& op = graph_.ops[op_index];
    if (absl::Status s = Layouts(op); !s.ok()) return s;
    const OpSemantics& semantics = rules_.Of(op.type);

    bool has_grad_fn = false;
    for (int i : semantics.differentiable_inputs) {
      has_grad_fn = has_grad_fn || tensors_[op.inputs[i]].requires_grad;
    }
    for (int out : op.outputs) tensors_[out].requires_grad = has_grad_fn;

    if (options_.checkpointed) {
      // Inside a checkpointed block autograd keeps nothing; the policy's ops put their
      // outputs in the selective cache instead.
      if (op.policy_kind.has_value() && options_.policy.Saves(*op.policy_kind)) {
        for (int out : op.outputs) Keep(op_index, out, KeepReason::kSelectiveCache);
      }
      return absl::OkStatus();
    }
    if (!has_grad_fn) return absl::OkStatus();  // no backward node, nothing saved
    for (const KeepRule& rule : semantics.keeps) {
      if (rule.needs_grad_of_input >= 0 &&
          !tensors_[op.inputs[rule.needs_grad_of_input]].requires_grad) {
        continue;
      }
      Keep(op_index, rule.is_output ? op.outputs[rule.index] : op.inputs[rule.index],
           KeepReason::kAutograd);
    }
    return absl::OkStatus();
  }

  void Keep(int op, int tensor, KeepReason reason) {
    StorageState& storage = storages_[tensors_[tensor].storage];
    if (storage.is_parameter) return;  // parameters are accounted elsewhere
    bool& flag = reason == KeepReason::kSelectiveCache ? storage.cached : storage.kept;
    if (flag) return;
    flag = true;
    if (options_.record_storages) {
      storages_recorded_.push_back(
          KeptStorage{op, tensor, storage.owner, tensors_[tensor].layout, storage.bytes, reason});
    }
  }

  BlockWalk Summarize() {
    BlockWalk walk;
    const int input_storage = tensors_[graph_.input].storage;
    const int output_storage = tensors_[graph_.output].storage;
    walk.keeps_input = storages_[input_storage].kept;
    walk.keeps_output = output_storage >= 0 && storages_[output_storage].kept;
    walk.boundary_bytes = storages_[input_storage].bytes;
    CheckedInt64 inner = 0, cache = 0;
    for (int s = 0; s < static_cast<int>(storages_.size()); ++s) {
      if (storages_[s].cached) cache += storages_[s].bytes;
      if (storages_[s].kept && s != input_storage && s != output_storage) {
        inner += storages_[s].bytes;
      }
    }
    walk.inner_bytes = inner.value();
    walk.cache_bytes = cache.value();
    overflow_ = overflow_ || inner.overflowed() || cache.overflowed();
    walk.storages = std::move(storages_recorded_);
    return walk;
  }

  const BlockGraph& graph_;
  const ModelConfig& config_;
  const WalkOptions& options_;
  const RuleTable& rules_;
  std::vector<TensorState> tensors_;
  std::vector<StorageState> storages_;
  std::vector<KeptStorage> storages_recorded_;
  bool overflow_ = false;
};

}  // namespace

const char* KeepReasonName(KeepReason reason) {
  switch (reason) {
    case KeepReason::kAutograd:
      return "autograd";
    case KeepReason::kCheckpointInput:
      return "checkpoint";
    case KeepReason::kSelectiveCache:
      return "cache";
  }
  return "?";
}

absl::StatusOr<BlockWalk> WalkBlock(const BlockGraph& graph, const ModelConfig& config,
                                    const WalkOptions& options) {
  if (absl::Status s = ValidateConfig(config); !s.ok()) return s;
  return Walk(graph, config, options).Run();
}

}  // namespace memledger
