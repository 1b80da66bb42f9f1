// The study's model in LibTorch: a stack of pre-LN blocks (BlockImpl, runtime/model.h)
// on a (B, T, d) input, loss x.pow(2).mean() (../shared/seed/22_memory_accounting.py).
#include <functional>
#include <memory>

#include "runtime/family.h"

namespace memledger::runtime {
namespace {

// StudyModel: the study's blocks on hidden-state input, loss x.pow(2).mean().
class StudyModel : public ModelImpl {
 public:
  explicit StudyModel(const ModelConfig& config) {
    layers = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < config.layers; ++i) {
      layers->push_back(std::make_shared<BlockImpl>(config.width, config.heads));
    }
  }

  ModelStart Prologue(const at::Tensor& input) const override { return {input, {}, {}}; }

  at::Tensor Epilogue(at::Tensor hidden, const at::Tensor& /*input*/,
                      const std::function<void()>& decoder_returns) const override {
    decoder_returns();  // the study's layers have no model-level locals
    return StudyLoss(hidden);
  }
};

}  // namespace

const RuntimeFamily& StudyRuntimeFamily() {
  static const RuntimeFamily kDef = {
      .id = Family::kStudy,
      .make_model = [](const ModelConfig& c) -> std::shared_ptr<ModelImpl> {
        return std::make_shared<StudyModel>(c);
      },
      .shard_of = nullptr,  // no tensor parallelism
      .gradient_is_partial = nullptr,
      .prologue_prefixes = {},  // no prologue
  };
  return kDef;
}

}  // namespace memledger::runtime
