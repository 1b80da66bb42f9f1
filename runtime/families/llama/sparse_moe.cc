#include "runtime/families/llama/sparse_moe.h"

#include <ATen/TensorIndexing.h>

#include <memory>
#include <tuple>
#include <vector>

#include "runtime/last_use.h"

namespace memledger::runtime {

MoeExpertsImpl::MoeExpertsImpl(const MoeSpec& moe, int64_t width) {
  // transformers' _init_weights: normal(0, initializer_range 0.02).
  gate_up_proj = register_parameter(
      "gate_up_proj", at::randn({moe.experts, 2 * moe.intermediate, width}) * 0.02);
  down_proj =
      register_parameter("down_proj", at::randn({moe.experts, width, moe.intermediate}) * 0.02);
}

SparseMoeImpl::SparseMoeImpl(const MoeSpec& moe, int64_t width) : moe_(moe) {
  auto router = [&] {
    gate = register_module(
        "gate", torch::nn::Linear(torch::nn::LinearOptions(width, moe.experts).bias(false)));
  };
  if (moe.block == MoeBlock::kMixtral) router();
  experts = register_module("experts", MoeExperts(moe, width));
  if (moe.block != MoeBlock::kMixtral) router();
}

at::Tensor SparseMoeImpl::forward(const at::Tensor& x, SelectiveCache* cache) {
  // One statement per last use (Last, runtime/last_use.h); the Python locals the graph
  // holds to a function's return live to the end of their C++ scope.
  const int64_t b = x.size(0), t = x.size(1), d = x.size(2), k = moe_.top_k;
  const at::Tensor flat = x.view({-1, d});  // hidden_states.view(-1, hidden_dim)
  // The router: F.linear(h, weight), an fp32 softmax, topk, renormalised in place, and
  // for Qwen3-MoE cast back to the logits' dtype.
  at::Tensor logits, scores, indices;
  {
    at::Tensor h = flat.reshape({-1, d});
    logits = LinearOp(*gate, Last(h), cache);
    at::Tensor logits32 = logits.to(at::kFloat);
    at::Tensor probs = at::softmax(Last(logits32), -1);
    at::Tensor values;
    std::tie(values, indices) = at::topk(Last(probs), k, -1);
    if (moe_.block == MoeBlock::kMixtral || moe_.norm_topk_prob) {
      at::Tensor sum = values.sum(-1, /*keepdim=*/true);
      values.div_(Last(sum));
    }
    scores = moe_.block == MoeBlock::kQwen3Moe ? Last(values).to(logits.scalar_type())
                                               : Last(values);
  }
  at::Tensor out = moe_.impl == ExpertsImpl::kEager
                       ? EagerExperts(flat, indices, scores, cache)
                       : GroupedMmExperts(flat, indices, scores, cache);
  at::Tensor result = Last(out).view({b, t, d});
  return result;
}

at::Tensor SparseMoeImpl::EagerExperts(const at::Tensor& hidden_states,
                                       const at::Tensor& top_k_index,
                                       const at::Tensor& top_k_weights, SelectiveCache* cache) {
  // Qwen3MoeExperts.forward / MixtralExperts.forward (transformers 5.23), statement by
  // statement. The loop's Python locals are rebound each iteration, so each lives until
  // its next assignment (declared here, outside the loop, they do the same).
  const int64_t num_experts = moe_.experts;
  at::Tensor final_hidden_states = at::zeros_like(hidden_states);
  at::Tensor expert_mask, expert_hit;
  {
    at::NoGradGuard no_grad;
    expert_mask = at::one_hot(top_k_index, num_experts + 1);
    expert_mask = expert_mask.permute({2, 1, 0});
    expert_hit = at::gt(expert_mask.sum({-1, -2}), 0).nonzero();
  }
  routing_.assign(static_cast<size_t>(num_experts), 0);
  at::Tensor top_k_pos, token_idx, current_state, gate, up, current_hidden_states;
  // `for expert_idx in expert_hit`: Tensor.__iter__ is iter(self.unbind(0)).
  for (at::Tensor expert_idx : expert_hit.unbind(0)) {
    expert_idx = expert_idx.select(0, 0);  // expert_idx[0]
    if (at::eq(expert_idx, num_experts).item<bool>()) continue;  // the padding class
    // A 0-dim integer index selects (python_variable_indexing.cpp, applySlicing).
    const int64_t e = expert_idx.item<int64_t>();
    {
      std::vector<at::Tensor> pair = at::where(expert_mask.select(0, e));
      top_k_pos = pair[0];
      token_idx = pair[1];
    }
    routing_[static_cast<size_t>(e)] = token_idx.size(0);
    current_state = hidden_states.index({token_idx});
    {
      std::vector<at::Tensor> halves =
          FunctionalLinearOp(experts->gate_up_proj.select(0, e), at::Tensor(), current_state,
                             cache)
              .chunk(2, -1);
      gate = halves[0];
      up = halves[1];
    }
    at::Tensor act = SiluOp(gate, cache);
    current_hidden_states = Last(act) * up;
    current_hidden_states =
        FunctionalLinearOp(experts->down_proj.select(0, e), at::Tensor(),
                           current_hidden_states, cache);
    current_hidden_states =
        current_hidden_states *
        top_k_weights.index({token_idx, top_k_pos, at::indexing::None});
    final_hidden_states.index_add_(0, token_idx,
                                   current_hidden_states.to(final_hidden_states.scalar_type()));
  }
  return final_hidden_states;
}

at::Tensor SparseMoeImpl::GroupedMmExperts(const at::Tensor& flat, const at::Tensor& indices,
                                           const at::Tensor& scores, SelectiveCache* cache) {
  const int64_t k = moe_.top_k, d = flat.size(1);
  // grouped_mm_experts_forward (integrations/moe.py): the (token, expert) pairs sorted by
  // expert, gathered, two _grouped_mm calls, weighted, unsorted and summed per token.
  at::Tensor out;
  {
    const at::Tensor sample_weights = scores.reshape({-1});
    const at::Tensor expert_ids = indices.reshape({-1});
    at::Tensor ids_sorted, perm;
    std::tie(ids_sorted, perm) = at::sort(expert_ids);
    at::Tensor token_of_pair = at::floor_divide(perm, k);
    const at::Tensor gathered = flat.index({Last(token_of_pair)});
    const at::Tensor weights_sorted = sample_weights.index({perm});
    const at::Tensor histc_input = ids_sorted.to(at::kFloat);
    const at::Tensor per_expert = at::histc(histc_input, moe_.experts, 0, moe_.experts - 1);
    const at::Tensor offsets = at::cumsum(per_expert, 0, at::kInt);
    auto grouped_linear = [&](const at::Tensor& input, const at::Tensor& weight) {
      return at::_grouped_mm(input.to(weight.scalar_type()), weight.transpose(-2, -1),
                             offsets);
    };
    at::Tensor gate_up_out = grouped_linear(gathered, experts->gate_up_proj);
    std::vector<at::Tensor> halves = Last(gate_up_out).chunk(2, -1);
    at::Tensor act = SiluOp(halves[0], cache);
    at::Tensor product = Last(act) * halves[1];
    halves.clear();
    const at::Tensor down_out = grouped_linear(Last(product), experts->down_proj);
    at::Tensor weighted = down_out * weights_sorted.unsqueeze(-1);
    at::Tensor inverse = at::empty_like(perm);
    inverse.index_put_({perm}, at::arange(perm.size(0), perm.options()));
    const at::Tensor unsorted = Last(weighted).index({inverse});
    const at::Tensor summed = unsorted.view({-1, k, d}).sum(1);
    out = summed.to(flat.scalar_type());
  }
  return out;
}

std::vector<std::vector<int64_t>> MeasuredRouting(const torch::nn::Module& model) {
  std::vector<std::vector<int64_t>> rows;
  // modules() is depth first in registration order: the layers' blocks in layer order.
  for (const std::shared_ptr<torch::nn::Module>& module : model.modules()) {
    if (const auto block = std::dynamic_pointer_cast<SparseMoeImpl>(module)) {
      if (!block->routing().empty()) rows.push_back(block->routing());
    }
  }
  return rows;
}

}  // namespace memledger::runtime
