// Megatron's training dropout (p = 0.1) for megatron-gpt, with masks that do not depend
// on how the model is split: a dropout site's mask over the whole model's tensor is a
// fixed function of (site, sequence, element), a counter-based draw (as GPUs draw with
// Philox), so each rank draws its own part (its heads, its tokens) and nothing more. The
// single process and every tensor-parallel, sequence-parallel, data-parallel or
// pipeline rank drop the same elements, so their gradients compare; a checkpointed
// layer's recompute drops the same ones again without saving any RNG state. Like
// native_dropout, a dropout makes its output and its bool mask (one allocation each)
// and keeps only the mask for backward, whose gradient is one new tensor.
//
// Example:
//   SetDropoutPlacement({.first_sequence = 8});  // this micro-batch's place in the batch
//   at::Tensor y = MegatronDropout(x, DropoutSite{layer, DropoutKind::kAttentionOut});
#ifndef RUNTIME_DROPOUT_H_
#define RUNTIME_DROPOUT_H_

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace memledger::runtime {

// kMegatronDropout: Megatron-LM's hidden and attention dropout probability.
inline constexpr double kMegatronDropout = 0.1;

enum class DropoutKind : int64_t {
  kEmbeddings = 0,  // (B, T, D) embeddings
  kAttentionProbs,  // (B, H, T, T) attention probabilities
  kAttentionOut,    // (B, T, D) after the attention's output projection
  kMlpOut,          // (B, T, D) after the MLP
};

struct DropoutSite {
  int64_t layer = -1;  // -1 for the embeddings
  DropoutKind kind = DropoutKind::kEmbeddings;
};

// DropoutPlacement is where the tensors the model now runs sit in the whole model's:
// the global index of the micro-batch's first sequence, and this rank's first head and
// (with sequence parallelism) first token. A process-wide setting: the distributed
// runtime sets it before every micro-batch's forward and backward (recomputes run in
// backward); the default is the single process's.
struct DropoutPlacement {
  int64_t first_sequence = 0;
  int64_t first_head = 0;
  int64_t heads = 0;  // the whole model's heads (0: as many as the tensor has)
  int64_t first_token = 0;
  int64_t tokens = 0;  // the whole sequence (0: as many as the tensor has)
};
void SetDropoutPlacement(const DropoutPlacement& placement);

// MegatronDropout: x * mask / (1 - p), mask the site's (see above); keeps the mask.
// `x` is (B, T_local, D) for hidden states or (B, H_local, T, T) for probabilities.
at::Tensor MegatronDropout(const at::Tensor& x, const DropoutSite& site);

}  // namespace memledger::runtime

#endif  // RUNTIME_DROPOUT_H_
