#include "runtime/dropout.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/custom_function.h>

#include <vector>

namespace memledger::runtime {
namespace {

namespace ag = torch::autograd;

DropoutPlacement& Placement() {
  static DropoutPlacement placement;
  return placement;
}

// SequenceMask is the whole model's keep-mask of one site for one global sequence:
// (T, D) for hidden states, (H, T, T) for probabilities.
at::Tensor SequenceMask(const DropoutSite& site, int64_t sequence,
                        const std::vector<int64_t>& shape) {
  // A seed per (site, sequence), mixed so that nearby ones are unrelated streams.
  uint64_t seed = 0x9E3779B97F4A7C15ULL;
  for (uint64_t v : {static_cast<uint64_t>(site.layer + 1), static_cast<uint64_t>(site.kind),
                     static_cast<uint64_t>(sequence)}) {
    seed ^= v + 0x9E3779B97F4A7C15ULL + (seed << 6) + (seed >> 2);
  }
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::empty(shape, at::kFloat).bernoulli_(1.0 - kMegatronDropout, generator).to(at::kBool);
}

// KeepMask: the mask of x's elements, cut from each sequence's whole mask.
at::Tensor KeepMask(const at::Tensor& x, const DropoutSite& site) {
  const DropoutPlacement& p = Placement();
  const bool probs = site.kind == DropoutKind::kAttentionProbs;
  std::vector<at::Tensor> masks;
  for (int64_t b = 0; b < x.size(0); ++b) {
    at::Tensor whole;
    if (probs) {
      const int64_t heads = p.heads > 0 ? p.heads : x.size(1);
      whole = SequenceMask(site, p.first_sequence + b, {heads, x.size(2), x.size(3)})
                  .narrow(0, p.first_head, x.size(1));
    } else {
      const int64_t tokens = p.tokens > 0 ? p.tokens : x.size(1);
      whole = SequenceMask(site, p.first_sequence + b, {tokens, x.size(2)})
                  .narrow(0, p.first_token, x.size(1));
    }
    masks.push_back(whole);
  }
  return at::stack(masks);
}

// MaskedDropout: x * mask * scale; keeps the mask (as native_dropout keeps result1).
struct MaskedDropout : ag::Function<MaskedDropout> {
  static at::Tensor forward(ag::AutogradContext* ctx, const at::Tensor& x, const at::Tensor* mask) {
    ctx->save_for_backward({*mask});
    return x * *mask * (1.0 / (1.0 - kMegatronDropout));
  }
  static ag::variable_list backward(ag::AutogradContext* ctx, ag::variable_list grads) {
    const at::Tensor mask = ctx->get_saved_variables()[0];
    return {grads[0] * mask * (1.0 / (1.0 - kMegatronDropout)), at::Tensor()};
  }
};

}  // namespace

void SetDropoutPlacement(const DropoutPlacement& placement) { Placement() = placement; }

at::Tensor MegatronDropout(const at::Tensor& x, const DropoutSite& site) {
  const at::Tensor mask = KeepMask(x, site);
  return MaskedDropout::apply(x, &mask);
}

}  // namespace memledger::runtime
