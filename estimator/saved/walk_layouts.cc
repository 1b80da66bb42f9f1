// Walk::Layouts: each op's outputs laid out as ATen lays them out, and whether they view
// an input's storage or get their own (estimator/saved/walk.h).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/saved/walk.h"

namespace memledger {
namespace walk_internal {

absl::Status Walk::Layouts(const OpDef& op) {
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
    case OpType::kAdd:
    case OpType::kDivTensor:
    case OpType::kSub:
    case OpType::kGt:
    case OpType::kLe:
    case OpType::kBitwiseAnd: {
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
    case OpType::kAddWrappedInt:
    case OpType::kDivScalar:
    case OpType::kPowScalarBase:
    case OpType::kCos:
    case OpType::kSin:
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
      // num_classes = num_experts + 1: the experts the module holds (E / ep with expert
      // parallelism) and the padding class.
      sizes[in.ndim] = config_.moe.experts / config_.shard.ep + 1;
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
    case OpType::kOnesLike:
    case OpType::kGeScalar:
      NewContiguous(out, in.sizes.data(), in.ndim);
      return absl::OkStatus();
    case OpType::kMaskedFillInplace:
    case OpType::kScatterAddInplace:
    case OpType::kIndexPutInplace:
      ViewOf(out, op.inputs[0], in);  // in place: the result is self
      return absl::OkStatus();
    case OpType::kScalarDivide:
      NewDenseLike(out, in);  // empty_like(self), preserve_format
      return absl::OkStatus();
    case OpType::kEye: {
      const Layout n = Evaluate(op.attributes.shape);
      const int64_t sizes[] = {n.sizes[0], n.sizes[0]};
      NewContiguous(out, sizes, 2);
      return absl::OkStatus();
    }
    case OpType::kLinalgVectorNorm:  // over dim 1, without keepdim
      NewContiguous(out, in.sizes.data(), 1);
      return absl::OkStatus();
    case OpType::kOuter: {
      const Layout& b = tensors_[op.inputs[1]].layout;
      const int64_t sizes[] = {in.sizes[0], b.sizes[0]};
      NewContiguous(out, sizes, 2);
      return absl::OkStatus();
    }
    case OpType::kOnes:
    case OpType::kZeros:
    case OpType::kArange:
    case OpType::kRepeat:
    case OpType::kRepeatInterleave:
    case OpType::kStack:
    case OpType::kAllToAll:
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

}  // namespace walk_internal
}  // namespace memledger
