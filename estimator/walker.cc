#include "estimator/walker.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/family.h"

namespace memledger {
namespace {

struct TensorState {
  Layout layout;
  int storage = -1;
};

struct StorageState {
  int64_t bytes = 0;
  int owner = 0;
  bool is_parameter = false;
  bool is_buffer = false;
  bool is_global = false;
  bool is_weight_copy = false;  // .to() of a parameter (autocast's cast of a weight)
  bool kept = false;    // by autograd or the checkpoint node
  bool cached = false;  // by the selective cache
  bool held = false;    // by a checkpoint's call arguments (KeepReason::kCheckpointHeld)
};

}  // namespace

struct BlockLayouts {
  std::vector<TensorState> tensors;
  std::vector<StorageState> storages;
  std::vector<int> storage_of;  // per tensor: tensors[i].storage, the walk memo's key
};

namespace {

// Walk holds the per-call state; nothing is shared between calls but the layouts it may
// start from.
class Walk {
 public:
  Walk(const BlockGraph& graph, const ModelConfig& config, const WalkOptions& options)
      : graph_(graph), config_(config), options_(options),
        rules_(options.rules != nullptr ? *options.rules : RuleTable::Pinned()) {
    // Only the core attention's recompute asks which op made a tensor.
    if (options.recompute_core_attention) {
      producer_.assign(graph.tensors.size(), -1);
      for (size_t op = 0; op < graph.ops.size(); ++op) {
        for (int out : graph.ops[op].outputs) producer_[out] = static_cast<int>(op);
      }
    }
  }

  // LayoutsOnly runs the layout half of every op and returns the result; null when an
  // op's layout fails or a size overflows.
  std::shared_ptr<const BlockLayouts> LayoutsOnly() {
    tensors_.resize(graph_.tensors.size());
    storages_.reserve(graph_.tensors.size());
    LeafStorages();
    for (size_t op = 0; !overflow_ && op < graph_.ops.size(); ++op) {
      if (!Layouts(graph_.ops[op]).ok()) return nullptr;
    }
    if (overflow_) return nullptr;
    auto layouts = std::make_shared<BlockLayouts>();
    layouts->storage_of.reserve(tensors_.size());
    for (const TensorState& t : tensors_) layouts->storage_of.push_back(t.storage);
    layouts->tensors = std::move(tensors_);
    layouts->storages = std::move(storages_);
    return layouts;
  }

  absl::StatusOr<BlockWalk> Run(const BlockLayouts* layouts) {
    // A reentrant checkpointed block without a policy keeps nothing inside: skip its ops.
    const bool walk_ops = !options_.checkpointed || !options_.policy.empty() ||
                          config_.checkpoint_impl == CheckpointImpl::kNonReentrant;
    laid_out_ = layouts != nullptr && walk_ops;
    if (laid_out_) {
      laid_ = &layouts->tensors;  // read, never copied
      storages_ = layouts->storages;
    } else {
      tensors_.resize(graph_.tensors.size());
      storages_.reserve(graph_.tensors.size());
      LeafStorages();
    }
    // A walk its graph's memo remembers takes the keeps from there (walk_memo.h); any
    // other applies every op, and the memo remembers what it kept.
    WalkMemo* memo = Memoizable() ? graph_.walk_memo.get() : nullptr;
    const WalkMemo::Options memo_options = MemoOptions();
    const WalkMemo::Flags* remembered =
        memo != nullptr ? memo->Find(memo_options, layouts->storage_of) : nullptr;
    if (remembered != nullptr) {
      for (size_t s = 0; s < storages_.size(); ++s) {
        storages_[s].kept = ((*remembered)[s] & WalkMemo::kKept) != 0;
        storages_[s].cached = ((*remembered)[s] & WalkMemo::kCached) != 0;
        storages_[s].held = ((*remembered)[s] & WalkMemo::kHeld) != 0;
      }
    } else {
      if (absl::Status s = ApplyOps(walk_ops); !s.ok()) return s;
      if (memo != nullptr && !overflow_) {
        memo->Remember(memo_options, layouts->storage_of, KeepFlags());
      }
    }
    BlockWalk walk;
    if (!overflow_) walk = Summarize();
    if (overflow_) {
      return absl::OutOfRangeError(absl::StrCat(
          "byte counts overflow int64 for width=", config_.width,
          " heads=", config_.heads, " batch=", config_.batch, " seq=", config_.seq));
    }
    return walk;
  }

 private:
  // ApplyOps keeps what the checkpoint node and then each op (when `walk_ops`) keep.
  absl::Status ApplyOps(bool walk_ops) {
    requires_grad_.assign(graph_.tensors.size(), false);
    for (size_t i = 0; i < graph_.tensors.size(); ++i) {
      const TensorDef& def = graph_.tensors[i];
      const bool is_input = static_cast<int>(i) == graph_.input;
      requires_grad_[i] = def.is_parameter || (is_input && options_.input_requires_grad);
    }
    if (options_.checkpointed) {
      // torch.utils.checkpoint saves the block's positional tensor argument, the hidden
      // states (checkpoint.py, _CheckpointFrame.save_inputs; the reentrant
      // CheckpointFunction's save_for_backward), which saved-tensor hooks see. The
      // model-level tensors the layer is called with (RoPE's cos and sin, position ids)
      // are keyword arguments that transformers binds into the checkpointed function
      // (modeling_layers.py:120, partial(forward, self, **kwargs)): held until the
      // checkpoint's backward, never saved.
      Keep(-1, graph_.input, KeepReason::kCheckpointInput);
      for (size_t i = 0; i < graph_.tensors.size(); ++i) {
        if (graph_.tensors[i].is_global()) {
          Keep(-1, static_cast<int>(i), KeepReason::kCheckpointHeld);
        }
      }
    }
    // Once a size overflows, layouts are meaningless: stop and report the overflow
    // (an "impossible view" then is the overflow's doing, not a graph bug).
    for (size_t op = 0; walk_ops && !overflow_ && op < graph_.ops.size(); ++op) {
      absl::Status s = Apply(static_cast<int>(op));
      if (!s.ok() && !overflow_) return s;
    }
    return absl::OkStatus();
  }

  // KeepFlags: each storage's keeps, as the memo holds them.
  std::vector<uint8_t> KeepFlags() const {
    std::vector<uint8_t> flags(storages_.size());
    for (size_t s = 0; s < storages_.size(); ++s) {
      flags[s] = static_cast<uint8_t>((storages_[s].kept ? WalkMemo::kKept : 0) |
                                      (storages_[s].cached ? WalkMemo::kCached : 0) |
                                      (storages_[s].held ? WalkMemo::kHeld : 0));
    }
    return flags;
  }

  // Memoizable: whether this walk may read or feed its graph's memo. It must start
  // from layouts (its storages known before any op) and apply every op with the pinned
  // rules, recording nothing per op (records name ops, which a memo does not keep).
  bool Memoizable() const {
    return graph_.walk_memo != nullptr && laid_out_ && !options_.record_storages &&
           !options_.record_layouts &&
           (options_.rules == nullptr || options_.rules == &RuleTable::Pinned());
  }

  const SymbolValues& Symbols() {
    if (!symbols_.has_value()) symbols_.emplace(config_);
    return *symbols_;
  }

  WalkMemo::Options MemoOptions() const {
    return {options_.checkpointed, options_.input_requires_grad,
            options_.recompute_core_attention,
            config_.checkpoint_impl == CheckpointImpl::kNonReentrant, options_.policy};
  }

  // LeafStorages makes the storages of the parameters, model-level tensors and input.
  void LeafStorages() {
    for (size_t i = 0; i < graph_.tensors.size(); ++i) {
      const TensorDef& def = graph_.tensors[i];
      if (def.is_parameter || def.is_buffer || def.is_global() ||
          static_cast<int>(i) == graph_.input) {
        NewStorage(static_cast<int>(i), Evaluate(def.shape), def.dtype, def.is_parameter);
        storages_.back().is_global = def.is_global();
        storages_.back().is_buffer = def.is_buffer;
      }
    }
  }

  Layout Evaluate(const std::vector<SymDim>& shape) {
    int64_t sizes[Layout::kMaxDims];
    for (size_t i = 0; i < shape.size(); ++i) {
      CheckedInt64 dim = shape[i].Evaluate(Symbols());
      overflow_ = overflow_ || dim.overflowed();
      sizes[i] = dim.value();
    }
    return Layout::Contiguous(sizes, static_cast<int>(shape.size()), &overflow_);
  }

  void NewStorage(int tensor, const Layout& layout, DType dtype, bool is_parameter) {
    // A host tensor of a CUDA step holds no device bytes.
    const bool off_device = config_.device == Device::kCuda && graph_.tensors[tensor].host;
    CheckedInt64 bytes = layout.Numel() * (off_device ? 0 : ElementSizeBytes(dtype));
    overflow_ = overflow_ || bytes.overflowed();
    StorageState storage;
    storage.bytes = bytes.value();
    storage.owner = tensor;
    storage.is_parameter = is_parameter;
    storages_.push_back(std::move(storage));
    tensors_[tensor].layout = layout;
    tensors_[tensor].storage = static_cast<int>(storages_.size()) - 1;
  }

  void NewContiguous(int tensor, const int64_t* sizes, int ndim) {
    NewStorage(tensor, Layout::Contiguous(sizes, ndim, &overflow_),
               graph_.tensors[tensor].dtype, false);
  }

  // NewDenseLike: a new tensor laid out as ATen lays out one made like `like`.
  void NewDenseLike(int tensor, const Layout& like) {
    NewStorage(tensor, Layout::DenseLike(like), graph_.tensors[tensor].dtype, false);
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
        Layout target = Evaluate(op.attributes.shape);
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
          view.sizes[i] = in.sizes[op.attributes.permutation[i]];
          view.strides[i] = in.strides[op.attributes.permutation[i]];
        }
        ViewOf(out, op.inputs[0], view);
        return absl::OkStatus();
      }
      case OpType::kTranspose:
      case OpType::kT: {
        Layout view = in;
        int d0 = op.type == OpType::kT ? 0 : op.attributes.dim;
        int d1 = op.type == OpType::kT ? 1 : op.attributes.dim1;
        std::swap(view.sizes[d0], view.sizes[d1]);
        std::swap(view.strides[d0], view.strides[d1]);
        ViewOf(out, op.inputs[0], view);
        return absl::OkStatus();
      }
      case OpType::kSelect: {
        Layout view;
        view.ndim = in.ndim - 1;
        for (int i = 0, j = 0; i < in.ndim; ++i) {
          if (i == op.attributes.dim) continue;
          view.sizes[j] = in.sizes[i];
          view.strides[j++] = in.strides[i];
        }
        ViewOf(out, op.inputs[0], view);
        return absl::OkStatus();
      }
      case OpType::kExpand: {
        // Size-1 dimensions broadcast with stride 0; the others must match.
        Layout target = Evaluate(op.attributes.shape);
        if (target.ndim != in.ndim) return Internal(op, "expand cannot add dimensions here");
        Layout view = in;
        for (int i = 0; i < in.ndim; ++i) {
          if (in.sizes[i] == target.sizes[i]) continue;
          if (in.sizes[i] != 1) return Internal(op, "expand of a dimension that is not 1");
          view.sizes[i] = target.sizes[i];
          view.strides[i] = 0;
        }
        ViewOf(out, op.inputs[0], view);
        return absl::OkStatus();
      }
      case OpType::kUnsqueeze: {
        const int dim = op.attributes.dim;
        Layout view;
        view.ndim = in.ndim + 1;
        for (int i = 0, j = 0; i < view.ndim; ++i) {
          if (i == dim) {
            view.sizes[i] = 1;
            view.strides[i] = dim < in.ndim ? in.sizes[dim] * in.strides[dim] : 1;
          } else {
            view.sizes[i] = in.sizes[j];
            view.strides[i] = in.strides[j++];
          }
        }
        ViewOf(out, op.inputs[0], view);
        return absl::OkStatus();
      }
      case OpType::kSlice: {
        // narrow(dim, start, length): same strides, a shorter dimension (the storage
        // offset does not change what the storage holds).
        Layout view = in;
        const CheckedInt64 length = op.attributes.length.Evaluate(Symbols());
        overflow_ = overflow_ || length.overflowed();
        view.sizes[op.attributes.dim] = length.value();
        ViewOf(out, op.inputs[0], view);
        return absl::OkStatus();
      }
      case OpType::kToDtype:
        // Same dtype: .to() returns the tensor itself (no node, no copy).
        if (graph_.tensors[op.inputs[0]].dtype == graph_.tensors[out].dtype) {
          ViewOf(out, op.inputs[0], in);
        } else {
          // _to_copy with preserve_format: the input's memory order.
          NewDenseLike(out, in);
          storages_.back().is_weight_copy = graph_.tensors[op.inputs[0]].is_parameter;
        }
        return absl::OkStatus();
      case OpType::kContiguous:
        if (in.IsContiguous()) {
          ViewOf(out, op.inputs[0], in);
        } else {
          NewContiguous(out, in.sizes.data(), in.ndim);
        }
        return absl::OkStatus();
      case OpType::kEmbedding: {
        const Layout& weight = tensors_[op.inputs[0]].layout;
        const Layout& indices = tensors_[op.inputs[1]].layout;
        int64_t sizes[Layout::kMaxDims];
        std::copy(indices.sizes.begin(), indices.sizes.begin() + indices.ndim, sizes);
        sizes[indices.ndim] = weight.sizes[1];
        NewContiguous(out, sizes, indices.ndim + 1);
        return absl::OkStatus();
      }
      case OpType::kMm: {
        const Layout& mat2 = tensors_[op.inputs[1]].layout;
        const int64_t sizes[] = {in.sizes[0], mat2.sizes[1]};
        NewContiguous(out, sizes, 2);
        return absl::OkStatus();
      }
      case OpType::kMulTensor:
      case OpType::kAdd: {
        // Broadcast, right-aligned; the output laid out by TensorIterator.
        const Layout& a = tensors_[op.inputs[0]].layout;
        const Layout& b = tensors_[op.inputs[1]].layout;
        const int ndim = std::max(a.ndim, b.ndim);
        int64_t sizes[Layout::kMaxDims];
        for (int i = 0; i < ndim; ++i) {
          const int ai = i - (ndim - a.ndim), bi = i - (ndim - b.ndim);
          const int64_t as = ai >= 0 ? a.sizes[ai] : 1, bs = bi >= 0 ? b.sizes[bi] : 1;
          if (as != bs && as != 1 && bs != 1) return Internal(op, "shapes do not broadcast");
          sizes[i] = std::max(as, bs);
        }
        NewStorage(out, Layout::Elementwise({&a, &b}, sizes, ndim, &overflow_),
                   graph_.tensors[out].dtype, false);
        return absl::OkStatus();
      }
      case OpType::kCat: {
        const Layout& b = tensors_[op.inputs[1]].layout;
        int64_t sizes[Layout::kMaxDims];
        std::copy(in.sizes.begin(), in.sizes.begin() + in.ndim, sizes);
        sizes[in.ndim - 1] += b.sizes[b.ndim - 1];
        NewContiguous(out, sizes, in.ndim);
        return absl::OkStatus();
      }
      case OpType::kMeanDim: {
        int64_t sizes[Layout::kMaxDims];
        std::copy(in.sizes.begin(), in.sizes.begin() + in.ndim, sizes);
        sizes[in.ndim - 1] = 1;  // keepdim
        NewContiguous(out, sizes, in.ndim);
        return absl::OkStatus();
      }
      case OpType::kConstantPad: {
        int64_t sizes[Layout::kMaxDims];
        std::copy(in.sizes.begin(), in.sizes.begin() + in.ndim, sizes);
        sizes[in.ndim - 1] += 1;  // pad (0, 1)
        NewContiguous(out, sizes, in.ndim);
        return absl::OkStatus();
      }
      case OpType::kNllLoss:
        NewContiguous(op.outputs[0], nullptr, 0);  // the mean loss
        NewContiguous(op.outputs[1], nullptr, 0);  // total_weight
        return absl::OkStatus();
      case OpType::kVocabParallelEmbedding: {
        // (weight, ids): the rows looked up, then the masked ids and the mask, of ids'
        // shape.
        const Layout& weight = in;
        const Layout& ids = tensors_[op.inputs[1]].layout;
        int64_t sizes[Layout::kMaxDims];
        std::copy(ids.sizes.begin(), ids.sizes.begin() + ids.ndim, sizes);
        sizes[ids.ndim] = weight.sizes[1];
        NewContiguous(out, sizes, ids.ndim + 1);
        NewContiguous(op.outputs[1], ids.sizes.data(), ids.ndim);
        NewContiguous(op.outputs[2], ids.sizes.data(), ids.ndim);
        return absl::OkStatus();
      }
      case OpType::kVocabParallelCrossEntropy: {
        // (logits (N, V / tp), labels (N)): the mean loss, the masked targets, the mask.
        const Layout& labels = tensors_[op.inputs[1]].layout;
        NewContiguous(out, nullptr, 0);
        NewContiguous(op.outputs[1], labels.sizes.data(), labels.ndim);
        NewContiguous(op.outputs[2], labels.sizes.data(), labels.ndim);
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
      case OpType::kSdpaBoolMask:
        // where's output, contiguous over the expanded (B, 1, T, T) mask.
        NewContiguous(out, in.sizes.data(), in.ndim);
        return absl::OkStatus();
      case OpType::kFlashAttentionMasked:
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
      case OpType::kCudnnAttention: {
        // The output made like q (alloc_with_matching_layout), logsumexp (B, H, T, 1)
        // fp32, philox seed and offset () int64 on the device (attention.cu,
        // _cudnn_attention_forward; meta__scaled_dot_product_cudnn_attention).
        NewDenseLike(out, in);
        const int64_t lse_sizes[] = {in.sizes[0], in.sizes[1], in.sizes[2], 1};
        NewContiguous(op.outputs[1], lse_sizes, 4);
        NewContiguous(op.outputs[2], nullptr, 0);
        NewContiguous(op.outputs[3], nullptr, 0);
        return absl::OkStatus();
      }
      case OpType::kCudaFlashAttention: {
        // q is (B, H, T, d_head). The output is made like q (flash_api.cpp:497,
        // empty_like of its (1, 2) transpose; alloc_with_matching_layout in the meta
        // kernel), logsumexp (B, H, T) fp32 (:512), rng_state (2,) and unused () uint64
        // on the device even without dropout (:548-549).
        NewDenseLike(out, in);
        const int64_t lse_sizes[] = {in.sizes[0], in.sizes[1], in.sizes[2]};
        NewContiguous(op.outputs[1], lse_sizes, 3);
        const int64_t seed_sizes[] = {2};
        NewContiguous(op.outputs[2], seed_sizes, 1);
        NewContiguous(op.outputs[3], nullptr, 0);
        return absl::OkStatus();
      }
      case OpType::kEfficientAttentionMasked:  // the same outputs
      case OpType::kEfficientAttention: {
        // The output allocated (B, T, H, d_head) and returned (1, 2)-transposed;
        // logsumexp (B, H, T rounded up to 32) fp32; philox seed and offset () int64
        // (meta__scaled_dot_product_efficient_attention; attention.cu,
        // _efficient_attention_forward).
        const int64_t out_sizes[] = {in.sizes[0], in.sizes[2], in.sizes[1], in.sizes[3]};
        NewContiguous(out, out_sizes, 4);
        std::swap(tensors_[out].layout.sizes[1], tensors_[out].layout.sizes[2]);
        std::swap(tensors_[out].layout.strides[1], tensors_[out].layout.strides[2]);
        const int64_t lse_sizes[] = {in.sizes[0], in.sizes[1], (in.sizes[2] + 31) / 32 * 32};
        NewContiguous(op.outputs[1], lse_sizes, 3);
        NewContiguous(op.outputs[2], nullptr, 0);
        NewContiguous(op.outputs[3], nullptr, 0);
        return absl::OkStatus();
      }
      case OpType::kCausalMask: {
        Layout target = Evaluate(op.attributes.shape);
        NewStorage(out, target, graph_.tensors[out].dtype, false);
        return absl::OkStatus();
      }
      case OpType::kMulWrapped: {
        NewContiguous(out, in.sizes.data(), in.ndim);
        // The wrapped number: a 0-dim float64 tensor.
        NewContiguous(op.outputs[1], nullptr, 0);
        return absl::OkStatus();
      }
      case OpType::kMulScalar:
        // TensorIterator: the output in the input's memory order (q * scale of a
        // transposed q is transposed too).
        NewDenseLike(out, in);
        return absl::OkStatus();
      case OpType::kDropout:
        // empty_like(input) for the noise, TensorIterator's mul for the output.
        NewDenseLike(out, in);
        NewDenseLike(op.outputs[1], in);
        return absl::OkStatus();
      case OpType::kAddInplace:
        ViewOf(out, op.inputs[0], in);  // add_ returns self
        return absl::OkStatus();
      case OpType::kKvCacheCat:
        // cat's output is contiguous (the empty tensor is skipped; the keys' memory
        // format, suggest_memory_format of a transposed view, is contiguous).
        NewContiguous(out, in.sizes.data(), in.ndim);
        return absl::OkStatus();
      case OpType::kSdpaCausalMask: {
        Layout target = Evaluate(op.attributes.shape);
        NewStorage(out, target, graph_.tensors[out].dtype, false);
        return absl::OkStatus();
      }
      case OpType::kTanh:
      case OpType::kGelu:
      case OpType::kPow:
      case OpType::kAddScalar:
      case OpType::kRsqrt:
      case OpType::kSilu:
      case OpType::kNeg:
        // Unary TensorIterator ops: the input's memory order (neg of a slice of a
        // transposed tensor is transposed too).
        NewStorage(out, Layout::Elementwise({&in}, in.sizes.data(), in.ndim, &overflow_),
                   graph_.tensors[out].dtype, false);
        return absl::OkStatus();
      case OpType::kSafeSoftmax:
      case OpType::kMaskedFill:
      case OpType::kSoftmax:
      case OpType::kFusedCausalSoftmax:
      case OpType::kLogSoftmax:
        // Contiguous whatever the input: masked_fill fills a contiguous clone, softmax
        // writes into empty_like(input, LEGACY_CONTIGUOUS_MEMORY_FORMAT).
        NewContiguous(out, in.sizes.data(), in.ndim);
        return absl::OkStatus();
      case OpType::kMean:
        NewContiguous(out, nullptr, 0);  // a scalar
        return absl::OkStatus();
      case OpType::kNativeDropout:
        // The output and a bool mask, both of the input's shape.
        NewContiguous(out, in.sizes.data(), in.ndim);
        NewContiguous(op.outputs[1], in.sizes.data(), in.ndim);
        return absl::OkStatus();
      case OpType::kTopK: {
        // values and indices of the input's sizes but the last, k.
        int64_t sizes[Layout::kMaxDims];
        std::copy(in.sizes.begin(), in.sizes.begin() + in.ndim, sizes);
        const CheckedInt64 k = op.attributes.length.Evaluate(Symbols());
        overflow_ = overflow_ || k.overflowed();
        sizes[in.ndim - 1] = k.value();
        NewContiguous(out, sizes, in.ndim);
        NewContiguous(op.outputs[1], sizes, in.ndim);
        return absl::OkStatus();
      }
      case OpType::kSumDim: {
        int64_t sizes[Layout::kMaxDims];
        int ndim = 0;
        for (int i = 0; i < in.ndim; ++i) {
          if (i != op.attributes.dim) {
            sizes[ndim++] = in.sizes[i];
          } else if (op.attributes.keepdim) {
            sizes[ndim++] = 1;
          }
        }
        NewContiguous(out, sizes, ndim);
        return absl::OkStatus();
      }
      case OpType::kDivInplace:
        ViewOf(out, op.inputs[0], in);  // div_ returns self
        NewDenseLike(op.outputs[1], in);  // self.clone(), before the kernel
        return absl::OkStatus();
      case OpType::kSort:
        NewContiguous(out, in.sizes.data(), in.ndim);
        NewContiguous(op.outputs[1], in.sizes.data(), in.ndim);
        return absl::OkStatus();
      case OpType::kFloorDivide:
      case OpType::kCumsum:
      case OpType::kInversePermutation:
        NewContiguous(out, in.sizes.data(), in.ndim);
        return absl::OkStatus();
      case OpType::kIndexRows: {
        // (len(indices), self's other sizes), contiguous.
        const Layout& indices = tensors_[op.inputs[1]].layout;
        int64_t sizes[Layout::kMaxDims];
        std::copy(in.sizes.begin(), in.sizes.begin() + in.ndim, sizes);
        sizes[0] = indices.sizes[0];
        NewContiguous(out, sizes, in.ndim);
        return absl::OkStatus();
      }
      case OpType::kZerosLike:
        NewContiguous(out, in.sizes.data(), in.ndim);
        return absl::OkStatus();
      case OpType::kOneHot: {
        int64_t sizes[Layout::kMaxDims];
        std::copy(in.sizes.begin(), in.sizes.begin() + in.ndim, sizes);
        sizes[in.ndim] = config_.moe.experts + 1;  // num_classes = E + 1
        NewContiguous(out, sizes, in.ndim + 1);
        return absl::OkStatus();
      }
      case OpType::kEqScalar:
        NewContiguous(out, nullptr, 0);
        return absl::OkStatus();
      case OpType::kExpertHits:
      case OpType::kNonzero: {
        const Layout target = Evaluate(op.attributes.shape);
        NewContiguous(out, target.sizes.data(), target.ndim);
        return absl::OkStatus();
      }
      case OpType::kIndexPair: {
        // (len(index0), self's sizes after the two indexed dims), contiguous.
        const Layout& indices = tensors_[op.inputs[1]].layout;
        int64_t sizes[Layout::kMaxDims];
        sizes[0] = indices.sizes[0];
        for (int i = 2; i < in.ndim; ++i) sizes[i - 1] = in.sizes[i];
        NewContiguous(out, sizes, in.ndim - 1);
        return absl::OkStatus();
      }
      case OpType::kIndexAddInplace:
        ViewOf(out, op.inputs[0], in);  // index_add_ returns self
        return absl::OkStatus();
      case OpType::kHistc: {
        const Layout target = Evaluate(op.attributes.shape);
        NewContiguous(out, target.sizes.data(), target.ndim);
        return absl::OkStatus();
      }
      case OpType::kGroupedMm: {
        const Layout& mat2 = tensors_[op.inputs[1]].layout;  // (E, in, out)
        const int64_t sizes[] = {in.sizes[0], mat2.sizes[2]};
        NewContiguous(out, sizes, 2);
        return absl::OkStatus();
      }
      case OpType::kGatherLinear:
      case OpType::kReduceScatter:
      case OpType::kScatter: {
        // Megatron's collectives: a new tensor of the target shape (the gathered input
        // of a gather-linear is a buffer of the call, freed inside it).
        const Layout target = Evaluate(op.attributes.shape);
        NewContiguous(out, target.sizes.data(), target.ndim);
        return absl::OkStatus();
      }
    }
    return Internal(op, "unknown op");
  }

  absl::Status Apply(int op_index) {
    const OpDef& op = graph_.ops[op_index];
    if (!laid_out_) {
      if (absl::Status s = Layouts(op); !s.ok()) return s;
    }
    const OpSemantics& semantics = rules_.Of(op.type);

    bool has_grad_fn = false;
    for (int i : semantics.differentiable_inputs) {
      has_grad_fn = has_grad_fn || requires_grad_[op.inputs[i]];
    }
    // Integer and bool outputs (topk's indices, a mask) never require grad.
    for (int out : op.outputs) {
      const DType dtype = graph_.tensors[out].dtype;
      requires_grad_[out] = has_grad_fn && dtype != DType::kInt64 && dtype != DType::kInt32 &&
                            dtype != DType::kBool;
    }

    if (options_.checkpointed) {
      // Inside a checkpointed block autograd keeps nothing; the policy's ops put their
      // outputs in the selective cache instead. A non-reentrant checkpoint runs the
      // block with grad, its saved tensors packed into empty holders, but for those
      // SavedVariable stores without the hooks (wrapped numbers), which the nodes hold.
      if (op.policy_kind.has_value() && options_.policy.Saves(*op.policy_kind)) {
        for (int out : op.outputs) Keep(op_index, out, KeepReason::kSelectiveCache);
      }
      if (config_.checkpoint_impl == CheckpointImpl::kNonReentrant && has_grad_fn) {
        for (const KeepRule& rule : semantics.keeps) {
          if (!rule.wrapped_number) continue;
          Keep(op_index, rule.is_output ? op.outputs[rule.index] : op.inputs[rule.index],
               KeepReason::kWrappedNumber);
        }
      }
      return absl::OkStatus();
    }
    if (!has_grad_fn) return absl::OkStatus();  // no backward node, nothing saved
    if (options_.recompute_core_attention && op.core_attention) {
      // Recomputed in the backward from its inputs: the core keeps what it reads from
      // outside itself (q, k, v), as a checkpoint keeps its input.
      for (int input : op.inputs) {
        const int producer = producer_[input];
        if (producer >= 0 && graph_.ops[producer].core_attention) continue;
        if (!graph_.tensors[input].is_parameter) Keep(op_index, input, KeepReason::kCheckpointInput);
      }
      return absl::OkStatus();
    }
    for (const KeepRule& rule : semantics.keeps) {
      if (rule.needs_grad_of_input >= 0 &&
          !requires_grad_[op.inputs[rule.needs_grad_of_input]]) {
        continue;
      }
      Keep(op_index, rule.is_output ? op.outputs[rule.index] : op.inputs[rule.index],
           rule.wrapped_number ? KeepReason::kWrappedNumber : KeepReason::kAutograd);
    }
    return absl::OkStatus();
  }

  void Keep(int op, int tensor, KeepReason reason) {
    StorageState& storage = storages_[(*laid_)[tensor].storage];
    if (options_.record_layouts && reason != KeepReason::kSelectiveCache) {
      kept_by_.resize(storages_.size());
      kept_by_[(*laid_)[tensor].storage].push_back(op);
    }
    if (storage.is_parameter) return;  // parameters are accounted elsewhere
    const bool held =
        reason == KeepReason::kCheckpointHeld || reason == KeepReason::kWrappedNumber;
    bool& flag = reason == KeepReason::kSelectiveCache ? storage.cached
                 : held                                ? storage.held
                                                       : storage.kept;
    if (flag) return;
    flag = true;
    if (options_.record_storages) {
      storages_recorded_.push_back(
          KeptStorage{op, tensor, storage.owner, (*laid_)[tensor].layout, storage.bytes, reason});
    }
  }

  BlockWalk Summarize() {
    BlockWalk walk;
    const int input_storage = graph_.input >= 0 ? (*laid_)[graph_.input].storage : -1;
    const int output_storage = (*laid_)[graph_.output].storage;
    walk.keeps_input = input_storage >= 0 && storages_[input_storage].kept;
    walk.keeps_output = output_storage >= 0 && storages_[output_storage].kept;
    const int boundary_storage = input_storage >= 0 ? input_storage : output_storage;
    walk.boundary_bytes = storages_[boundary_storage].bytes;
    walk.boundary_dtype = graph_.tensors[storages_[boundary_storage].owner].dtype;
    CheckedInt64 inner = 0, cache = 0;
    for (int s = 0; s < static_cast<int>(storages_.size()); ++s) {
      const StorageState& storage = storages_[s];
      const DType dtype = graph_.tensors[storage.owner].dtype;
      if (storage.cached) {
        cache += storage.bytes;
        walk.cache_by_dtype[static_cast<int>(dtype)] += storage.bytes;
      }
      if (storage.is_global && (storage.kept || storage.held)) {
        walk.kept_globals.push_back(KeptGlobal{graph_.tensors[storage.owner].global,
                                               storage.bytes, dtype, !storage.kept});
        continue;
      }
      if (storage.held && !storage.kept && !storage.is_global) walk.held_bytes += storage.bytes;
      if (!storage.kept || s == input_storage || s == output_storage) continue;
      inner += storage.bytes;
      walk.inner_by_dtype[static_cast<int>(dtype)] += storage.bytes;
      if (storage.is_weight_copy) walk.weight_copy_bytes += storage.bytes;
      if (storage.is_buffer) walk.buffer_bytes += storage.bytes;
    }
    walk.inner_bytes = inner.value();
    walk.cache_bytes = cache.value();
    overflow_ = overflow_ || inner.overflowed() || cache.overflowed();
    walk.storages = std::move(storages_recorded_);
    if (options_.record_layouts) {
      walk.tensor_layouts.reserve(laid_->size());
      for (size_t i = 0; i < laid_->size(); ++i) {
        const TensorState& t = (*laid_)[i];
        walk.tensor_layouts.push_back(
            WalkedTensor{t.storage, t.layout, static_cast<bool>(requires_grad_[i])});
      }
      walk.storage_list.reserve(storages_.size());
      kept_by_.resize(storages_.size());
      for (size_t i = 0; i < storages_.size(); ++i) {
        const StorageState& s = storages_[i];
        walk.storage_list.push_back(WalkedStorage{s.bytes, s.owner, s.is_parameter,
                                                  s.is_buffer, s.is_global, s.is_weight_copy,
                                                  std::move(kept_by_[i]), s.cached});
      }
    }
    return walk;
  }

  const BlockGraph& graph_;
  const ModelConfig& config_;
  const WalkOptions& options_;
  const RuleTable& rules_;
  // symbols_: the config's sizes, made on first use (a walk from layouts needs none).
  std::optional<SymbolValues> symbols_;
  std::vector<TensorState> tensors_;  // what Layouts makes, unless laid out already
  // laid_: the tensors' layouts the walk reads: tensors_, or a BlockLayouts' own.
  const std::vector<TensorState>* laid_ = &tensors_;
  std::vector<char> requires_grad_;  // per tensor
  std::vector<int> producer_;  // per tensor: the op that made it, -1: none
  std::vector<StorageState> storages_;
  // kept_by_: with record_layouts, per storage, every op that kept it (-1: checkpoint).
  std::vector<std::vector<int>> kept_by_;
  std::vector<KeptStorage> storages_recorded_;
  bool overflow_ = false;
  bool laid_out_ = false;  // the layouts came from a BlockLayouts: Apply skips them
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
    case KeepReason::kCheckpointHeld:
      return "checkpoint_held";
    case KeepReason::kWrappedNumber:
      return "wrapped_number";
  }
  return "?";
}

std::shared_ptr<const BlockLayouts> LayoutBlock(const BlockGraph& graph,
                                                const ModelConfig& config) {
  if (!ValidateConfig(config).ok()) return nullptr;
  return Walk(graph, config, WalkOptions()).LayoutsOnly();
}

absl::StatusOr<BlockWalk> WalkBlock(const BlockGraph& graph, const ModelConfig& config,
                                    const WalkOptions& options, const BlockLayouts* layouts) {
  if (absl::Status s = ValidateConfig(config); !s.ok()) return s;
  return Walk(graph, config, options).Run(layouts);
}

}  // namespace memledger
