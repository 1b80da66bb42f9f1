// Model configuration and checkpointing variants, shared by the estimator, the runtime
// and the verifier so that one name means one thing everywhere.
//
// Example:
//   memledger::ModelConfig config;  // the study's defaults: 6 x 128, 4 heads, 16 x 64
//   absl::StatusOr<std::vector<memledger::Variant>> variants =
//       memledger::ParseVariants("none,full,every_k,selective", /*every=*/2,
//                                /*policy=*/"matmul");
#ifndef ESTIMATOR_CONFIG_H_
#define ESTIMATOR_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace memledger {

// ModelConfig is a stack of `layers` pre-LN Transformer blocks of width `width` with
// `heads` heads, trained on fp32 input of shape (batch, seq, width).
// REQUIRES (checked by ValidateConfig): every field >= 1, width % heads == 0.
struct ModelConfig {
  int64_t layers = 6;
  int64_t width = 128;
  int64_t heads = 4;
  int64_t batch = 16;
  int64_t seq = 64;

  friend bool operator==(const ModelConfig& a, const ModelConfig& b) {
    return a.layers == b.layers && a.width == b.width && a.heads == b.heads &&
           a.batch == b.batch && a.seq == b.seq;
  }
};

// ValidateConfig returns InvalidArgument naming the offending flag, e.g.
// "--width 130 is not divisible by --heads 4".
absl::Status ValidateConfig(const ModelConfig& config);

// AttentionMode selects how causal attention is computed and what it keeps.
enum class AttentionMode {
  // PyTorch 2.x CPU flash SDPA contract: keeps q, k, v (views of the QKV output), out
  // and logsumexp; never a (B, H, T, T) matrix. The default.
  kFlash,
  // Plain ops (matmul, scale, masked_fill, softmax, matmul): keeps the T x T matrices.
  kMath,
};

absl::string_view AttentionModeName(AttentionMode mode);  // "flash" or "math"
absl::StatusOr<AttentionMode> ParseAttentionMode(absl::string_view name);

// OpKind names the ops a selective-checkpointing policy can must-save. Their outputs
// (all of them) are cached at forward and reused at recompute.
enum class OpKind {
  kMatmul,     // the four Linear layers' addmm (the study's policy)
  kAttention,  // flash attention: out and logsumexp (flash mode only)
  kLayerNorm,  // native_layer_norm: out, mean, rstd
  kGelu,       // gelu: out
};

absl::string_view OpKindName(OpKind kind);  // "matmul", "attention", ...

// SavePolicy is the set of op kinds a selective variant must-saves.
struct SavePolicy {
  bool matmul = true;
  bool attention = false;
  bool layer_norm = false;
  bool gelu = false;

  bool Saves(OpKind kind) const;
  friend bool operator==(const SavePolicy& a, const SavePolicy& b) {
    return a.matmul == b.matmul && a.attention == b.attention &&
           a.layer_norm == b.layer_norm && a.gelu == b.gelu;
  }
};

// ParseSavePolicy parses a comma-separated list of op kind names ("matmul",
// "matmul,gelu"); an empty list saves nothing (selective then equals full).
absl::StatusOr<SavePolicy> ParseSavePolicy(absl::string_view names);
std::string SavePolicyName(const SavePolicy& policy);  // "matmul,gelu"; "" if empty

// ValidatePolicy rejects op kinds the attention mode lacks: "attention" names the flash
// op, which math mode does not have.
absl::Status ValidatePolicy(const SavePolicy& policy, AttentionMode mode);

// VariantKind is the checkpointing choice.
enum class VariantKind {
  kNone,       // no checkpointing
  kFull,       // every block checkpointed
  kEveryK,     // blocks i with i % k == 0 checkpointed
  kSelective,  // every block checkpointed, policy ops' outputs must-saved
};

// Variant is one checkpointing choice with its parameters.
struct Variant {
  VariantKind kind = VariantKind::kNone;
  int64_t every = 2;  // k, for kEveryK only
  SavePolicy policy;  // for kSelective only

  // Name is the variant's report key: "none", "full", "every_2", "selective".
  std::string Name() const;
  // IsCheckpointed says whether block `index` runs under checkpointing.
  bool IsCheckpointed(int64_t index) const;
};

// ParseVariants parses a comma-separated list of "none", "full", "every_k" (or
// "every_<k>", e.g. "every_3"), "selective". `every` is the k used by "every_k";
// `policy` the selective policy. Duplicate names are an error.
absl::StatusOr<std::vector<Variant>> ParseVariants(absl::string_view names, int64_t every,
                                                   absl::string_view policy);

// The study's four variants: none, full, every_2, selective (matmul).
std::vector<Variant> DefaultVariants();

}  // namespace memledger

#endif  // ESTIMATOR_CONFIG_H_
