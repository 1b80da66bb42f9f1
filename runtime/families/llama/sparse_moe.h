// transformers 5.23's sparse mixture-of-experts MLP in LibTorch (Qwen3MoeSparseMoeBlock,
// MixtralSparseMoeBlock) with the grouped_mm experts or the eager ones, op for op as the
// estimator's graph (estimator/families/llama/sparse_moe.cc) describes it.
#ifndef RUNTIME_FAMILIES_LLAMA_SPARSE_MOE_H_
#define RUNTIME_FAMILIES_LLAMA_SPARSE_MOE_H_

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <vector>

#include "estimator/spec/config.h"
#include "runtime/selective_ops.h"

namespace memledger::runtime {

// MoeExpertsImpl holds the experts' 3-D parameters, as transformers 5.23 does:
// gate_up_proj (E, 2 F_e, d) and down_proj (E, d, F_e).
class MoeExpertsImpl : public torch::nn::Module {
 public:
  explicit MoeExpertsImpl(const MoeSpec& moe, int64_t width);
  at::Tensor gate_up_proj, down_proj;
};
TORCH_MODULE(MoeExperts);

// SparseMoeImpl is the block: its router ("gate", a bias-free Linear(d, E)) and experts,
// registered in the model's order (Qwen3-MoE: experts, then gate; Mixtral: gate, then
// experts), so torch.optim steps them as transformers' model does.
class SparseMoeImpl : public torch::nn::Module {
 public:
  SparseMoeImpl(const MoeSpec& moe, int64_t width);
  // forward on the (B, T, d) post-attention norm output; the router's matmul and the
  // experts' silu go through `cache` (selective checkpointing) as the graph's op kinds.
  at::Tensor forward(const at::Tensor& x, SelectiveCache* cache);
  // routing: with the eager experts, the tokens each expert received in the latest
  // forward (its row of predict's --routing file); empty before one, or with grouped_mm.
  const std::vector<int64_t>& routing() const { return routing_; }

  torch::nn::Linear gate{nullptr};
  MoeExperts experts{nullptr};

 private:
  // The experts on the (N, d) hidden states, with the router's (N, k) choices and
  // weights: the eager loop over the experts hit (which records routing_), or
  // grouped_mm.
  at::Tensor EagerExperts(const at::Tensor& hidden_states, const at::Tensor& top_k_index,
                          const at::Tensor& top_k_weights, SelectiveCache* cache);
  at::Tensor GroupedMmExperts(const at::Tensor& flat, const at::Tensor& indices,
                              const at::Tensor& scores, SelectiveCache* cache);

  MoeSpec moe_;
  std::vector<int64_t> routing_;
};
TORCH_MODULE(SparseMoe);

// MeasuredRouting: the routing of the latest forward through `model`'s eager-experts
// blocks, one row per sparse layer in layer order (predict's --routing file's "layers");
// empty when no block ran the eager experts.
std::vector<std::vector<int64_t>> MeasuredRouting(const torch::nn::Module& model);

}  // namespace memledger::runtime

#endif  // RUNTIME_FAMILIES_LLAMA_SPARSE_MOE_H_
