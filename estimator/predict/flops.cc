#include "estimator/predict/flops.h"

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/graph/block_graph.h"
#include "estimator/spec/checked_math.h"
#include "estimator/graph/family.h"
#include "estimator/graph/rules.h"
#include "estimator/saved/walker.h"

namespace memledger {
namespace {

// OpFlops are one op's forward and backward FLOPs.
struct OpFlops {
  CheckedInt64 forward = 0;
  CheckedInt64 backward = 0;
};

OpFlops FlopsOf(const OpDef& op, const std::vector<WalkedTensor>& tensors) {
  auto size = [&](int tensor, int dim) -> int64_t {
    const Layout& layout = tensors[tensor].layout;
    return layout.sizes[dim < 0 ? layout.ndim + dim : dim];
  };
  auto numel = [&](int tensor) { return tensors[tensor].layout.Numel(); };
  // A product's backward computes a gradient only for an operand that requires grad (a
  // frozen weight's is not: --freeze): one product of the forward's cost each.
  auto operands = [&](int a, int b) {
    return CheckedInt64((tensors[op.inputs[a]].requires_grad ? 1 : 0) +
                        (tensors[op.inputs[b]].requires_grad ? 1 : 0));
  };
  OpFlops f;
  switch (op.type) {
    case OpType::kAddmm: {  // (bias, mat1 (M, K), mat2 (K, N))
      const CheckedInt64 m = size(op.inputs[1], 0), k = size(op.inputs[1], 1),
                         n = size(op.inputs[2], 1);
      f.forward = CheckedInt64(2) * m * k * n + m * n;
      f.backward = CheckedInt64(2) * m * k * n * operands(1, 2) +
                   (tensors[op.inputs[0]].requires_grad ? m * n : CheckedInt64(0));
      return f;
    }
    case OpType::kMm: {  // (M, K) x (K, N)
      const CheckedInt64 m = size(op.inputs[0], 0), k = size(op.inputs[0], 1),
                         n = size(op.inputs[1], 1);
      f.forward = CheckedInt64(2) * m * k * n;
      f.backward = operands(0, 1) * f.forward;
      return f;
    }
    case OpType::kBmm: {  // (b, M, K) x (b, K, N)
      const CheckedInt64 b = size(op.inputs[0], 0), m = size(op.inputs[0], 1),
                         k = size(op.inputs[0], 2), n = size(op.inputs[1], 2);
      f.forward = CheckedInt64(2) * b * m * k * n;
      f.backward = operands(0, 1) * f.forward;
      return f;
    }
    case OpType::kGroupedMm: {  // rows (S, K), each times one expert's (K, N)
      const CheckedInt64 m = size(op.inputs[0], 0), k = size(op.inputs[0], 1),
                         n = size(op.inputs[1], 2);
      f.forward = CheckedInt64(2) * m * k * n;
      f.backward = operands(0, 1) * f.forward;
      return f;
    }
    case OpType::kGatherLinear: {  // (B, T, out) from an input of width in
      const CheckedInt64 rows = numel(op.outputs[0]).value() / size(op.outputs[0], -1);
      const CheckedInt64 k = size(op.inputs[0], -1), n = size(op.outputs[0], -1);
      f.forward = CheckedInt64(2) * rows * k * n;
      f.backward = operands(0, 1) * f.forward;
      return f;
    }
    case OpType::kFlashAttentionMasked:  // the kernel computes every block, masked or not
    case OpType::kFlashAttention:        // q (B, H, T, d)
    // The CUDA kernels (FlashAttention-2, the memory-efficient one, cuDNN's) skip the
    // blocks above the causal diagonal as the CPU kernel does.
    case OpType::kCudaFlashAttention:
    case OpType::kEfficientAttention:
    case OpType::kEfficientAttentionMasked:
    case OpType::kCudnnAttention: {
      const CheckedInt64 b = size(op.inputs[0], 0), h = size(op.inputs[0], 1),
                         t = size(op.inputs[0], 2), d = size(op.inputs[0], 3);
      f.forward = CheckedInt64(2) * b * h * d * t * (t + 1);
      const CheckedInt64 five = f.forward * 5;
      f.backward = five.overflowed() ? five : CheckedInt64(five.value() / 2);
      return f;
    }
    case OpType::kNativeLayerNorm:
    case OpType::kSoftmax:
    case OpType::kSafeSoftmax:
    case OpType::kFusedCausalSoftmax:
    case OpType::kLogSoftmax:
      f.forward = CheckedInt64(5) * numel(op.outputs[0]);
      break;
    case OpType::kVocabParallelCrossEntropy:
      // In place on the (N, V / tp) logits: max, subtract, exp, sum, divide.
      f.forward = CheckedInt64(5) * numel(op.inputs[0]);
      break;
    case OpType::kNllLoss:
      // One row per target: the log-probability picked and the mean.
      f.forward = CheckedInt64(5) * (numel(op.inputs[0]).value() / size(op.inputs[0], -1));
      break;
    case OpType::kMulScalar:
    case OpType::kAdd:
    case OpType::kGelu:
    case OpType::kPow:
    case OpType::kMulTensor:
    case OpType::kDivTensor:
    case OpType::kSub:
    case OpType::kAddScalar:
    case OpType::kRsqrt:
    case OpType::kSilu:
    case OpType::kNeg:
    case OpType::kMaskedFill:
    case OpType::kMaskedFillInplace:
    case OpType::kAddInplace:
    case OpType::kTanh:
    case OpType::kMulWrapped:
    case OpType::kDropout:        // the product (drawing and scaling the noise are no FLOPs)
    case OpType::kNativeDropout:  // x * mask * scale, one pass
      f.forward = numel(op.outputs[0]);
      break;
    case OpType::kMean:
    case OpType::kMeanDim:
    case OpType::kSumDim:
      f.forward = numel(op.inputs[0]);
      break;
    case OpType::kLinalgVectorNorm:  // a square and a sum per element
      f.forward = CheckedInt64(2) * numel(op.inputs[0]);
      break;
    case OpType::kDivInplace:      // the router's renormalised top-k weights
    case OpType::kIndexAddInplace:  // an expert's weighted rows added into the result
      f.forward = numel(op.inputs[op.type == OpType::kDivInplace ? 0 : 2]);
      break;
    // No arithmetic: views, copies and casts, concatenation, embeddings and lookups,
    // masks, padding, collectives, integer bookkeeping (routing, sorting, counting).
    case OpType::kView:
    case OpType::kReshape:
    case OpType::kUnsafeView:
    case OpType::kPermute:
    case OpType::kTranspose:
    case OpType::kSelect:
    case OpType::kExpand:
    case OpType::kT:
    case OpType::kCausalMask:
    case OpType::kEmbedding:
    case OpType::kSlice:
    case OpType::kCat:
    case OpType::kUnsqueeze:
    case OpType::kConstantPad:
    case OpType::kContiguous:
    case OpType::kToDtype:
    case OpType::kReduceScatter:
    case OpType::kScatter:
    case OpType::kVocabParallelEmbedding:
    case OpType::kSdpaCausalMask:
    case OpType::kKvCacheCat:
    case OpType::kTopK:
    case OpType::kSort:
    case OpType::kFloorDivide:
    case OpType::kIndexRows:
    case OpType::kHistc:
    case OpType::kCumsum:
    case OpType::kInversePermutation:
    case OpType::kZerosLike:
    case OpType::kOneHot:
    case OpType::kExpertHits:
    case OpType::kEqScalar:
    case OpType::kNonzero:
    case OpType::kIndexPair:
    case OpType::kSdpaBoolMask:
    case OpType::kZeros:
    case OpType::kOnesLike:
    case OpType::kArange:
    case OpType::kRepeat:
    case OpType::kRepeatInterleave:
    case OpType::kStack:
    case OpType::kScatterAddInplace:
    case OpType::kIndexPutInplace:
    case OpType::kAllToAll:
    case OpType::kGeScalar:
    case OpType::kEye:
      return f;
    // The model's own tensors (position ids, rotary tables, masks): made without grad,
    // one operation per element, in no segment the step's FLOPs sum.
    case OpType::kAddWrappedInt:
    case OpType::kDivScalar:
    case OpType::kPowScalarBase:
    case OpType::kScalarDivide:
    case OpType::kOuter:
    case OpType::kCos:
    case OpType::kSin:
    case OpType::kGt:
    case OpType::kLe:
    case OpType::kBitwiseAnd:
      f.forward = numel(op.outputs[0]);
      return f;
    case OpType::kOnes:
      return f;
  }
  f.backward = CheckedInt64(2) * f.forward;
  return f;
}

// SegmentFlops sums a segment's ops; `skip(op)` leaves an op out.
template <typename Skip>
absl::StatusOr<OpFlops> SegmentFlops(const BlockGraph& graph, const ValidConfig& config,
                                     Skip skip) {
  WalkOptions options;
  options.record_layouts = true;
  absl::StatusOr<BlockWalk> walk = WalkBlock(graph, config, options);
  if (!walk.ok()) return walk.status();
  OpFlops sum;
  for (const OpDef& op : graph.ops) {
    if (skip(op)) continue;
    const OpFlops f = FlopsOf(op, walk->tensor_layouts);
    sum.forward += f.forward;
    if (!op.no_grad) sum.backward += f.backward;  // no node: no backward
  }
  if (sum.forward.overflowed() || sum.backward.overflowed()) {
    return absl::OutOfRangeError("the step's FLOPs overflow int64");
  }
  return sum;
}

// RangeRecompute is what `variant` recomputes over layers [first, first + count): each
// distinct (kind, choice) pair's FLOPs counted once, then summed over the layers.
absl::StatusOr<int64_t> RangeRecompute(const ValidConfig& config, AttentionMode attention,
                                       const ModelGraphs& graphs, const Variant& variant,
                                       int64_t first, int64_t count);
absl::StatusOr<StepFlops> CountValidStepFlops(const ValidConfig& valid, AttentionMode attention);
absl::StatusOr<int64_t> ValidRecomputeFlops(const ValidConfig& valid, AttentionMode attention,
                                            const LayerChoice& choice, int64_t layer);

}  // namespace

// Each entry validates its config once (ValidConfig::Of); the walks under it take the proof.
absl::StatusOr<StepFlops> CountStepFlops(const ModelConfig& config, AttentionMode attention) {
  absl::StatusOr<ValidConfig> valid = ValidConfig::Of(config);
  if (!valid.ok()) return valid.status();
  return CountValidStepFlops(*valid, attention);
}

absl::StatusOr<StepFlops> CountStepFlops(const ValidConfig& config, AttentionMode attention) {
  return CountValidStepFlops(config, attention);
}

namespace {

absl::StatusOr<StepFlops> CountValidStepFlops(const ValidConfig& valid, AttentionMode attention) {
  const ModelConfig& config = *valid;
  std::shared_ptr<const ModelGraphs> graphs = ModelGraphsFor(config, attention);
  auto all = [](const OpDef&) { return false; };
  // Every layer kind's, times its count.
  CheckedInt64 layers_total = 0;
  std::optional<OpFlops> layer;
  for (size_t kind = 0; kind < graphs->layer_kinds.size(); ++kind) {
    absl::StatusOr<OpFlops> flops = SegmentFlops(graphs->layer_kinds[kind], valid, all);
    if (!flops.ok()) return flops.status();
    if (static_cast<int>(kind) == graphs->KindOf(0)) layer = *flops;
    layers_total += CheckedInt64(graphs->LayersOfKind(static_cast<int>(kind), 0, config.layers)) *
                    (flops->forward + flops->backward);
  }
  absl::StatusOr<OpFlops> head = SegmentFlops(graphs->epilogue, valid, all);
  if (!head.ok()) return head.status();
  OpFlops other = *head;
  if (graphs->prologue.has_value()) {
    absl::StatusOr<OpFlops> prologue = SegmentFlops(*graphs->prologue, valid, all);
    if (!prologue.ok()) return prologue.status();
    other.forward += prologue->forward;
    other.backward += prologue->backward;
  }
  const CheckedInt64 total = layers_total + other.forward + other.backward;
  if (total.overflowed() || other.forward.overflowed() || other.backward.overflowed()) {
    return absl::OutOfRangeError(
        absl::StrCat("the step's FLOPs overflow int64 at layers=", config.layers));
  }
  StepFlops flops;
  flops.layer_forward = layer->forward.value();
  flops.layer_backward = layer->backward.value();
  flops.other_forward = other.forward.value();
  flops.other_backward = other.backward.value();
  flops.total = total.value();
  return flops;
}

absl::StatusOr<int64_t> ValidRecomputeFlops(const ValidConfig& valid, AttentionMode attention,
                                            const LayerChoice& choice, int64_t layer) {
  if (!choice.checkpointed) return 0;
  std::shared_ptr<const ModelGraphs> graphs = ModelGraphsFor(*valid, attention);
  absl::StatusOr<OpFlops> recompute =
      SegmentFlops(graphs->Layer(layer), valid, [&](const OpDef& op) {
        return op.policy_kind.has_value() && choice.policy.Saves(*op.policy_kind);
      });
  if (!recompute.ok()) return recompute.status();
  return recompute->forward.value();
}

}  // namespace

absl::StatusOr<int64_t> RecomputeFlops(const ModelConfig& config, AttentionMode attention,
                                       const LayerChoice& choice, int64_t layer) {
  if (!choice.checkpointed) return 0;
  absl::StatusOr<ValidConfig> valid = ValidConfig::Of(config);
  if (!valid.ok()) return valid.status();
  return ValidRecomputeFlops(*valid, attention, choice, layer);
}

absl::StatusOr<int64_t> RecomputeFlops(const ValidConfig& config, AttentionMode attention,
                                       const LayerChoice& choice, int64_t layer) {
  return ValidRecomputeFlops(config, attention, choice, layer);
}

absl::StatusOr<VariantRecompute> RecomputeOf(const ModelConfig& config, AttentionMode attention,
                                             const Variant& variant) {
  absl::StatusOr<ValidConfig> valid = ValidConfig::Of(config);
  if (!valid.ok()) return valid.status();
  return RecomputeOf(*valid, attention, variant);
}

absl::StatusOr<VariantRecompute> RecomputeOf(const ValidConfig& valid, AttentionMode attention,
                                             const Variant& variant) {
  const ModelConfig& config = *valid;
  absl::StatusOr<StepFlops> step = CountValidStepFlops(valid, attention);
  if (!step.ok()) return step.status();
  // Layers of one kind and choice cost the same: each distinct pair counted once.
  std::shared_ptr<const ModelGraphs> graphs = ModelGraphsFor(config, attention);
  absl::StatusOr<int64_t> recompute =
      RangeRecompute(valid, attention, *graphs, variant, 0, config.layers);
  if (!recompute.ok()) return recompute.status();
  VariantRecompute out;
  out.recompute_flops = *recompute;
  out.step_flops = step->total;
  out.overhead = step->total > 0 ? (static_cast<double>(step->total) +
                                    static_cast<double>(out.recompute_flops)) /
                                       static_cast<double>(step->total)
                                 : 1;
  return out;
}

absl::StatusOr<StageFlopsCount> StageFlops(const ModelConfig& config, AttentionMode attention,
                                           const Variant& variant, const StageRange& stage) {
  absl::StatusOr<ValidConfig> valid = ValidConfig::Of(config);
  if (!valid.ok()) return valid.status();
  return StageFlops(*valid, attention, variant, stage);
}

absl::StatusOr<StageFlopsCount> StageFlops(const ValidConfig& valid, AttentionMode attention,
                                           const Variant& variant, const StageRange& stage) {
  const ModelConfig& config = *valid;
  std::shared_ptr<const ModelGraphs> graphs = ModelGraphsFor(config, attention);
  auto all = [](const OpDef&) { return false; };
  CheckedInt64 forward = 0, backward = 0, recompute = 0;
  for (size_t kind = 0; kind < graphs->layer_kinds.size(); ++kind) {
    const int64_t count =
        graphs->LayersOfKind(static_cast<int>(kind), stage.first_layer, stage.layers);
    if (count == 0) continue;
    absl::StatusOr<OpFlops> flops = SegmentFlops(graphs->layer_kinds[kind], valid, all);
    if (!flops.ok()) return flops.status();
    forward += flops->forward * count;
    backward += flops->backward * count;
  }
  absl::StatusOr<int64_t> recomputed =
      RangeRecompute(valid, attention, *graphs, variant, stage.first_layer, stage.layers);
  if (!recomputed.ok()) return recomputed.status();
  recompute += *recomputed;
  std::vector<const BlockGraph*> ends;
  if (stage.prologue && graphs->prologue.has_value()) ends.push_back(&*graphs->prologue);
  if (stage.head) ends.push_back(&graphs->epilogue);
  for (const BlockGraph* graph : ends) {
    absl::StatusOr<OpFlops> flops = SegmentFlops(*graph, valid, all);
    if (!flops.ok()) return flops.status();
    forward += flops->forward;
    backward += flops->backward;
  }
  if (forward.overflowed() || backward.overflowed() || recompute.overflowed()) {
    return absl::OutOfRangeError("the stage's FLOPs overflow int64");
  }
  return StageFlopsCount{forward.value(), backward.value(), recompute.value()};
}

namespace {

absl::StatusOr<int64_t> RangeRecompute(const ValidConfig& config, AttentionMode attention,
                                       const ModelGraphs& graphs, const Variant& variant,
                                       int64_t first, int64_t count) {
  std::vector<std::pair<std::pair<int, LayerChoice>, int64_t>> seen;
  CheckedInt64 recompute = 0;
  for (int64_t i = first; i < first + count; ++i) {
    const std::pair<int, LayerChoice> key = {graphs.KindOf(i), variant.At(i)};
    auto it = std::find_if(seen.begin(), seen.end(),
                           [&](const auto& entry) { return entry.first == key; });
    if (it == seen.end()) {
      absl::StatusOr<int64_t> flops = ValidRecomputeFlops(config, attention, key.second, i);
      if (!flops.ok()) return flops.status();
      seen.emplace_back(key, *flops);
      it = std::prev(seen.end());
    }
    recompute += it->second;
  }
  if (recompute.overflowed()) return absl::OutOfRangeError("the recompute FLOPs overflow int64");
  return recompute.value();
}

}  // namespace
}  // namespace memledger
