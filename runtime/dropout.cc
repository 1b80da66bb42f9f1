#include "runtime/dropout.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>

namespace memledger::runtime {
namespace {

namespace ag = torch::autograd;

DropoutPlacement& Placement() {
  static DropoutPlacement placement;
  return placement;
}

// Keeps: whether the whole model's element `index` of a site's tensor for one global
// sequence survives dropout: a counter-based draw (splitmix64 of a per-(site, sequence)
// seed and the index, as GPUs draw with Philox), so any rank computes any element's
// draw without the others'.
uint64_t SiteSeed(const DropoutSite& site, int64_t sequence) {
  uint64_t seed = 0x9E3779B97F4A7C15ULL;
  for (uint64_t v : {static_cast<uint64_t>(site.layer + 1), static_cast<uint64_t>(site.kind),
                     static_cast<uint64_t>(sequence)}) {
    seed ^= v + 0x9E3779B97F4A7C15ULL + (seed << 6) + (seed >> 2);
  }
  return seed;
}
bool Keeps(uint64_t seed, uint64_t index) {
  uint64_t z = seed + (index + 1) * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  const double uniform = static_cast<double>(z >> 11) * 0x1.0p-53;  // [0, 1)
  return uniform >= kMegatronDropout;
}

// KeepMask: the keep-mask of x's elements (bool, x's shape; one allocation), each
// element's draw by its place in the whole model's tensor of its sequence: (T, D) for
// hidden states, (H, T, T) for probabilities.
at::Tensor KeepMask(const at::Tensor& x, const DropoutSite& site) {
  const DropoutPlacement& p = Placement();
  const bool probs = site.kind == DropoutKind::kAttentionProbs;
  at::Tensor mask = at::empty(x.sizes(), x.options().dtype(at::kBool));
  bool* keep = mask.data_ptr<bool>();
  // Each sequence's part: rows of `row_length` elements, the first of them whole-model
  // row `first_row`.
  const int64_t rows = probs ? x.size(1) * x.size(2) : x.size(1);
  const int64_t row_length = probs ? x.size(3) : x.size(2);
  const int64_t first_row = probs ? p.first_head * x.size(2) : p.first_token;
  for (int64_t b = 0; b < x.size(0); ++b) {
    const uint64_t seed = SiteSeed(site, p.first_sequence + b);
    for (int64_t r = 0; r < rows; ++r) {
      const uint64_t row = static_cast<uint64_t>((first_row + r) * row_length);
      for (int64_t c = 0; c < row_length; ++c) *keep++ = Keeps(seed, row + c);
    }
  }
  return mask;
}

// Masked is x * mask * scale into one new tensor (x contiguous), in plain loops: the
// forward's output and the backward's gradient, as native_dropout and its backward
// make them.
at::Tensor Masked(const at::Tensor& x, const at::Tensor& mask) {
  TORCH_CHECK(x.is_contiguous() && x.sizes() == mask.sizes(),
              "MegatronDropout: a contiguous tensor of the mask's shape");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float scale = static_cast<float>(1.0 / (1.0 - kMegatronDropout));
  const bool* keep = mask.data_ptr<bool>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "Masked", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    for (int64_t i = 0; i < x.numel(); ++i) {
      o[i] = keep[i] ? static_cast<scalar_t>(static_cast<float>(in[i]) * scale) : scalar_t(0);
    }
  });
  return out;
}

// MaskedDropout: x * mask * scale; keeps the mask (as native_dropout keeps result1).
struct MaskedDropout : ag::Function<MaskedDropout> {
  static at::Tensor forward(ag::AutogradContext* ctx, const at::Tensor& x, const at::Tensor* mask) {
    ctx->save_for_backward({*mask});
    return Masked(x, *mask);
  }
  static ag::variable_list backward(ag::AutogradContext* ctx, ag::variable_list grads) {
    const at::Tensor mask = ctx->get_saved_variables()[0];
    return {Masked(grads[0], mask), at::Tensor()};
  }
};

}  // namespace

void SetDropoutPlacement(const DropoutPlacement& placement) { Placement() = placement; }

at::Tensor MegatronDropout(const at::Tensor& x, const DropoutSite& site) {
  const at::Tensor mask = KeepMask(x, site);
  return MaskedDropout::apply(x, &mask);
}

}  // namespace memledger::runtime
