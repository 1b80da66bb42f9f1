#include "runtime/families/sparse_moe.h"

#include <tuple>

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
    const at::Tensor summed = unsorted.view({b * t, k, d}).sum(1);
    out = summed.to(flat.scalar_type());
  }
  at::Tensor result = Last(out).view({b, t, d});
  return result;
}

}  // namespace memledger::runtime
