#include "estimator/predict.h"

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "estimator/checked_math.h"

namespace memledger {
namespace {

// BlockWalks memoizes the walks of one Predict call: a block's walk depends only on
// whether it is checkpointed (and with which policy) and whether it is the first.
class BlockWalks {
 public:
  BlockWalks(const BlockGraph& graph, const ModelConfig& config, bool breakdown,
             const RuleTable* rules)
      : graph_(graph), config_(config), breakdown_(breakdown), rules_(rules) {
    // At most 6 kinds (plain, full and one policy; first or not): pointers stay valid.
    entries_.reserve(8);
  }

  absl::StatusOr<const BlockWalk*> Get(bool checkpointed, const SavePolicy& policy,
                                       bool first) {
    for (Entry& entry : entries_) {
      if (entry.checkpointed == checkpointed && entry.first == first &&
          (!checkpointed || entry.policy == policy)) {
        return &entry.walk;
      }
    }
    WalkOptions options;
    options.checkpointed = checkpointed;
    options.input_requires_grad = !first;
    options.policy = policy;
    options.record_storages = breakdown_;
    options.rules = rules_;
    absl::StatusOr<BlockWalk> walk = WalkBlock(graph_, config_, options);
    if (!walk.ok()) return walk.status();
    entries_.push_back(Entry{checkpointed, first, policy, *std::move(walk)});
    return &entries_.back().walk;
  }

 private:
  struct Entry {
    bool checkpointed;
    bool first;
    SavePolicy policy;
    BlockWalk walk;
  };
  const BlockGraph& graph_;
  const ModelConfig& config_;
  bool breakdown_;
  const RuleTable* rules_;
  std::vector<Entry> entries_;
};

// Multiples returns how many i in [lo, hi] have i % k == 0 (lo >= 1).
int64_t Multiples(int64_t lo, int64_t hi, int64_t k) {
  return hi < lo ? 0 : hi / k - (lo - 1) / k;
}

// PredictVariant adds up the model's kept storages for one variant. Blocks 1..L-1 are
// of two kinds at most (checkpointed or not, by i % k), so the sum over layers is a sum
// over kinds and over the kinds of adjacent pairs, whose shared storage (one block's
// output, the next one's input) counts once.
absl::StatusOr<VariantPrediction> PredictVariant(const Variant& variant,
                                                 const ModelConfig& config,
                                                 const BlockWalk& loss, bool breakdown,
                                                 BlockWalks& walks) {
  const int64_t layers = config.layers;
  // Full and selective checkpoint every block: k = 1. `none` checkpoints none.
  const bool checkpoints = variant.kind != VariantKind::kNone;
  const int64_t k = variant.kind == VariantKind::kEveryK ? variant.every : 1;
  const SavePolicy policy = variant.kind == VariantKind::kSelective
                                ? variant.policy
                                : WalkOptions::NoSavePolicy();

  absl::StatusOr<const BlockWalk*> first = walks.Get(checkpoints, policy, /*first=*/true);
  absl::StatusOr<const BlockWalk*> plain = walks.Get(false, policy, /*first=*/false);
  absl::StatusOr<const BlockWalk*> ckpt = walks.Get(checkpoints, policy, /*first=*/false);
  for (const auto* s : {&first, &plain, &ckpt}) {
    if (!s->ok()) return s->status();
  }
  // Blocks 1..L-1: checkpointed iff i % k == 0 (never for `none`).
  const int64_t n_ckpt = checkpoints ? Multiples(1, layers - 1, k) : 0;
  const int64_t n_plain = (layers - 1) - n_ckpt;
  const BlockWalk& f = **first;
  const BlockWalk& p = **plain;
  const BlockWalk& c = **ckpt;

  auto block_bytes = [](const BlockWalk& w) {
    return CheckedInt64(w.inner_bytes) + w.cache_bytes;
  };
  auto kind_of = [&](int64_t i) -> const BlockWalk& {
    if (i == 0) return f;
    return variant.IsCheckpointed(i) ? c : p;
  };
  auto shared_kept = [](const BlockWalk& before, const BlockWalk& after) {
    return before.keeps_output || after.keeps_input;
  };

  CheckedInt64 saved = block_bytes(f) + CheckedInt64(n_ckpt) * block_bytes(c) +
                       CheckedInt64(n_plain) * block_bytes(p);
  CheckedInt64 cache = CheckedInt64(f.cache_bytes) + CheckedInt64(n_ckpt) * c.cache_bytes +
                       CheckedInt64(n_plain) * p.cache_bytes;
  // Boundary storages: 0 is the model input, L the last output (the loss's input).
  int64_t kept_boundaries = f.keeps_input ? 1 : 0;
  if (layers >= 2) {
    kept_boundaries += shared_kept(f, kind_of(1)) ? 1 : 0;
    // Boundaries j = 2..L-1 sit between two non-first blocks.
    const int64_t ckpt_before = checkpoints ? Multiples(1, layers - 2, k) : 0;
    const int64_t ckpt_after = checkpoints ? Multiples(2, layers - 1, k) : 0;
    const int64_t pairs = layers - 2;
    if (k == 1 && checkpoints) {
      kept_boundaries += shared_kept(c, c) ? pairs : 0;
    } else {
      kept_boundaries += (shared_kept(c, p) ? ckpt_before : 0) +
                         (shared_kept(p, c) ? ckpt_after : 0) +
                         (shared_kept(p, p) ? pairs - ckpt_before - ckpt_after : 0);
    }
  }
  kept_boundaries += shared_kept(kind_of(layers - 1), loss) ? 1 : 0;
  saved += CheckedInt64(kept_boundaries) * f.boundary_bytes;
  saved += loss.inner_bytes;

  if (saved.overflowed() || cache.overflowed()) {
    return absl::OutOfRangeError(absl::StrCat(
        "saved bytes of variant ", variant.Name(), " overflow int64 at layers=", layers));
  }
  VariantPrediction prediction;
  prediction.variant = variant;
  prediction.saved_bytes = saved.value();
  prediction.cache_bytes = cache.value();
  if (breakdown) {
    prediction.blocks.push_back(BlockKind{checkpoints, false, 1, f});
    if (n_ckpt > 0) prediction.blocks.push_back(BlockKind{true, true, n_ckpt, c});
    if (n_plain > 0) prediction.blocks.push_back(BlockKind{false, true, n_plain, p});
    prediction.loss = loss;
  }
  return prediction;
}

// ParameterCount sums the block graph's parameters: 12 d^2 + 13 d for one block.
CheckedInt64 ParameterCount(const BlockGraph& graph, const ModelConfig& config) {
  CheckedInt64 count = 0;
  for (const TensorDef& tensor : graph.tensors) {
    if (!tensor.is_parameter) continue;
    CheckedInt64 numel = 1;
    for (const SymDim& dim : tensor.shape) numel *= dim.Evaluate(config);
    count += numel;
  }
  return count;
}

}  // namespace

absl::StatusOr<Prediction> Predict(const ModelConfig& config,
                                   const PredictOptions& options) {
  if (absl::Status s = ValidateConfig(config); !s.ok()) return s;
  if (options.variants.empty()) {
    return absl::InvalidArgumentError("--variants must name at least one variant");
  }
  for (const Variant& variant : options.variants) {
    if (variant.kind == VariantKind::kEveryK && variant.every < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--every must be >= 1, got ", variant.every));
    }
    if (variant.kind == VariantKind::kSelective) {
      if (absl::Status s = ValidatePolicy(variant.policy, options.attention); !s.ok()) {
        return s;
      }
    }
  }

  Prediction prediction;
  prediction.config = config;
  prediction.attention = options.attention;
  prediction.block_graph = &BlockGraphFor(options.attention);
  prediction.loss_graph = &LossGraph();

  const int64_t d = config.width;
  CheckedInt64 n_params = CheckedInt64(config.layers) * ParameterCount(*prediction.block_graph, config);
  // The analytic identity: per block 2 LayerNorms (2d each), QKV (3d^2 + 3d), proj
  // (d^2 + d), fc1 (4d^2 + 4d), fc2 (4d^2 + d).
  CheckedInt64 identity = CheckedInt64(config.layers) * (CheckedInt64(12) * d * d + CheckedInt64(13) * d);
  CheckedInt64 param_bytes = n_params * 4;
  CheckedInt64 adamw_bytes = param_bytes * 2;
  if (param_bytes.overflowed() || adamw_bytes.overflowed() || identity.overflowed()) {
    return absl::OutOfRangeError(absl::StrCat(
        "parameter bytes overflow int64 at layers=", config.layers, " width=", d));
  }
  if (n_params.value() != identity.value()) {
    return absl::InternalError(absl::StrCat("block graph has ", n_params.value(),
                                            " parameters, expected layers*(12d^2+13d) = ",
                                            identity.value()));
  }
  prediction.n_params = n_params.value();
  prediction.param_bytes = param_bytes.value();
  prediction.grad_bytes = param_bytes.value();
  prediction.adamw_state_bytes = adamw_bytes.value();

  WalkOptions loss_options;
  loss_options.record_storages = options.breakdown;
  loss_options.rules = options.rules;
  absl::StatusOr<BlockWalk> loss = WalkBlock(LossGraph(), config, loss_options);
  if (!loss.ok()) return loss.status();

  BlockWalks walks(*prediction.block_graph, config, options.breakdown, options.rules);
  Variant none;
  absl::StatusOr<VariantPrediction> reference =
      PredictVariant(none, config, *loss, /*breakdown=*/false, walks);
  if (!reference.ok()) return reference.status();
  prediction.saved_bytes_none = reference->saved_bytes;

  for (const Variant& variant : options.variants) {
    absl::StatusOr<VariantPrediction> v =
        PredictVariant(variant, config, *loss, options.breakdown, walks);
    if (!v.ok()) return v.status();
    v->saved_ratio_vs_none =
        static_cast<double>(v->saved_bytes) / static_cast<double>(prediction.saved_bytes_none);
    prediction.variants.push_back(*std::move(v));
  }

  CheckedInt64 korthikanti = CheckedInt64(config.layers) * 4 * 16 * config.batch * config.seq * d;
  if (options.attention == AttentionMode::kMath) {
    korthikanti += CheckedInt64(config.layers) * 8 * config.batch * config.heads * config.seq *
                   config.seq;
  }
  if (korthikanti.overflowed()) {
    return absl::OutOfRangeError("Korthikanti's prediction overflows int64");
  }
  prediction.korthikanti_saved_bytes_none = korthikanti.value();
  prediction.saved_none_over_korthikanti =
      static_cast<double>(prediction.saved_bytes_none) / static_cast<double>(korthikanti.value());
  return prediction;
}

}  // namespace memledger
