#include "runtime/checkpoint.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <optional>
#include <utility>

#include "runtime/saved_tensor_recorder.h"

namespace memledger::runtime {
namespace {

namespace ag = torch::autograd;

// CheckpointState is what a checkpoint node keeps besides x: the block to recompute
// and, for selective checkpointing, the cache of must-saved outputs.
struct CheckpointState : torch::CustomClassHolder {
  std::shared_ptr<BlockImpl> block;
  AttentionMode mode = AttentionMode::kFlash;
  std::optional<SelectiveCache> cache;
};

class CheckpointFunction : public ag::Function<CheckpointFunction> {
 public:
  // Runs below autograd (Function::apply disables grad), so the block builds no graph.
  static at::Tensor forward(ag::AutogradContext* ctx, const at::Tensor& x,
                            at::TensorList /*parameters*/,
                            c10::intrusive_ptr<CheckpointState> state) {
    SelectiveCache* cache = state->cache ? &*state->cache : nullptr;
    at::Tensor y = state->block->forward(x, state->mode, cache);
    ctx->save_for_backward({x});
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return y;
  }

  static ag::variable_list backward(ag::AutogradContext* ctx, ag::variable_list grads) {
    auto state = c10::static_intrusive_pointer_cast<CheckpointState>(
        ctx->saved_data["state"].toCapsule());
    const bool x_needs_grad = ctx->needs_input_grad(0);
    at::Tensor x = ctx->get_saved_variables()[0].detach();
    x.requires_grad_(x_needs_grad);
    const std::vector<at::Tensor> parameters = state->block->parameters();

    SelectiveCache* cache = nullptr;
    if (state->cache) {
      cache = &*state->cache;
      cache->StartReplay();
    }
    at::Tensor y;
    {
      at::AutoGradMode enable_grad(true);
      y = state->block->forward(x, state->mode, cache);
    }
    ag::variable_list inputs;
    if (x_needs_grad) inputs.push_back(x);
    inputs.insert(inputs.end(), parameters.begin(), parameters.end());
    ag::variable_list input_grads =
        ag::grad({y}, inputs, {grads[0]}, /*retain_graph=*/false, /*create_graph=*/false,
                 /*allow_unused=*/true);
    if (cache != nullptr) cache->Clear();  // the recompute was the cache's only reader

    // One gradient per forward argument: x, each parameter, then the state.
    ag::variable_list result;
    result.reserve(parameters.size() + 2);
    size_t next = 0;
    result.push_back(x_needs_grad ? input_grads[next++] : at::Tensor());
    for (size_t i = 0; i < parameters.size(); ++i) result.push_back(input_grads[next++]);
    result.push_back(at::Tensor());
    return result;
  }
};

}  // namespace

at::Tensor CheckpointBlock(const std::shared_ptr<BlockImpl>& block, const at::Tensor& x,
                           AttentionMode mode, const SavePolicy* policy,
                           std::vector<at::Tensor>* cached) {
  auto state = c10::make_intrusive<CheckpointState>();
  state->block = block;
  state->mode = mode;
  if (policy != nullptr) state->cache.emplace(*policy);
  const std::vector<at::Tensor> parameters = block->parameters();
  at::Tensor y = CheckpointFunction::apply(x, at::TensorList(parameters), state);
  if (cached != nullptr && state->cache) {
    const std::vector<at::Tensor>& saved = state->cache->tensors();
    cached->insert(cached->end(), saved.begin(), saved.end());
  }
  return y;
}

ForwardResult ForwardWithVariant(const ModelImpl& model, const at::Tensor& input,
                                 AttentionMode mode, const Variant& variant) {
  const SavePolicy* policy =
      variant.kind == VariantKind::kSelective ? &variant.policy : nullptr;
  std::vector<at::Tensor> cached;
  at::Tensor x = input;
  for (int64_t i = 0; i < model.num_blocks(); ++i) {
    if (variant.IsCheckpointed(i)) {
      x = CheckpointBlock(model.block(i), x, mode, policy, &cached);
    } else {
      x = model.block(i)->forward(x, mode);
    }
  }
  ForwardResult result;
  result.loss = Loss(x);
  result.cache_bytes = UniqueStorageBytes(cached);
  return result;
}

}  // namespace memledger::runtime
