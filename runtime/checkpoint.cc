#include "runtime/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <mutex>
#include <optional>
#include <utility>

#include "runtime/autocast.h"
#include "runtime/saved_tensor_recorder.h"

namespace memledger::runtime {
namespace {

namespace ag = torch::autograd;

// CheckpointState is what a checkpoint node keeps besides its saved tensor (the layer
// input): the layer to recompute, the tensors it was called with besides (held, not
// saved: transformers binds them into the checkpointed function), the CPU RNG state of
// its forward (preserve_rng_state) and, for selective checkpointing, the cache of
// must-saved outputs.
struct CheckpointState : torch::CustomClassHolder {
  std::shared_ptr<DecoderLayer> layer;
  AttentionMode mode = AttentionMode::kFlash;
  LayerExtras extras;
  at::Tensor rng_state;
  bool reentrant = false;  // CheckpointImpl::kReentrant
  // The autocast dtype of the forward, restored for the recompute (as PyTorch's
  // checkpoint does), so the recomputed layer casts exactly as the original did.
  std::optional<at::ScalarType> autocast;
  std::optional<SelectiveCache> cache;
};

// CpuRngState is torch.get_rng_state(): the default CPU generator's state, a new
// uint8 tensor (kCpuRngStateBytes).
at::Tensor CpuRngState() {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void SetCpuRngState(const at::Tensor& state) {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

class CheckpointFunction : public ag::Function<CheckpointFunction> {
 public:
  // Runs below autograd (Function::apply disables grad), so the layer builds no graph.
  static at::Tensor forward(ag::AutogradContext* ctx, const at::Tensor& x,
                            at::TensorList /*parameters*/,
                            c10::intrusive_ptr<CheckpointState> state) {
    SelectiveCache* cache = state->cache ? &*state->cache : nullptr;
    // preserve_rng_state: the state before the layer runs (checkpoint.py:251, :1973).
    state->rng_state = CpuRngState();
    at::Tensor y = state->layer->forward(x, state->extras, state->mode, cache);
    ctx->save_for_backward({x});
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return y;
  }

  static ag::variable_list backward(ag::AutogradContext* ctx, ag::variable_list grads) {
    auto state = c10::static_intrusive_pointer_cast<CheckpointState>(
        ctx->saved_data["state"].toCapsule());
    const bool x_needs_grad = ctx->needs_input_grad(0);
    const ag::variable_list saved = ctx->get_saved_variables();
    at::Tensor x = saved[0].detach();
    x.requires_grad_(x_needs_grad);
    const std::vector<at::Tensor> parameters = state->layer->parameters();

    SelectiveCache* cache = nullptr;
    if (state->cache) {
      cache = &*state->cache;
      cache->StartReplay();
    }
    at::Tensor y;
    {
      // torch.random.fork_rng: the current state kept while the recompute runs on the
      // forward's (checkpoint.py:303-308).
      const at::Tensor forked = CpuRngState();
      SetCpuRngState(state->rng_state);
      at::AutoGradMode enable_grad(true);
      ScopedAutocast autocast(state->autocast);
      y = state->layer->forward(x, state->extras, state->mode, cache);
      SetCpuRngState(forked);
    }
    ag::variable_list inputs;
    if (x_needs_grad) inputs.push_back(x);
    inputs.insert(inputs.end(), parameters.begin(), parameters.end());
    ag::variable_list input_grads =
        ag::grad({y}, inputs, {grads[0]}, /*retain_graph=*/false, /*create_graph=*/false,
                 /*allow_unused=*/true);
    if (cache != nullptr) cache->Clear();  // the recompute was the cache's only reader

    // One gradient per forward tensor argument (x, each parameter), then one for the
    // state.
    ag::variable_list result;
    result.reserve(parameters.size() + 2);
    size_t next = 0;
    result.push_back(x_needs_grad ? input_grads[next++] : at::Tensor());
    for (size_t i = 0; i < parameters.size(); ++i) result.push_back(input_grads[next++]);
    result.push_back(at::Tensor());
    // The non-reentrant frame dies with its last saved tensor, in the backward; the
    // reentrant CheckpointFunction keeps its ctx (RNG state, run_function's bound
    // arguments) as long as the graph, until the loss dies (checkpoint.py:241-252).
    if (!state->reentrant) {
      state->extras = LayerExtras();
      state->rng_state = at::Tensor();
    }
    return result;
  }
};

}  // namespace

at::Tensor CheckpointLayer(const std::shared_ptr<DecoderLayer>& layer, const at::Tensor& x,
                           const LayerExtras& extras, AttentionMode mode,
                           CheckpointImpl impl, const SavePolicy* policy,
                           std::vector<at::Tensor>* cached) {
  auto state = c10::make_intrusive<CheckpointState>();
  state->reentrant = impl == CheckpointImpl::kReentrant;
  state->layer = layer;
  state->mode = mode;
  // The position ids are not held: the estimator does not model them (block_graph.cc,
  // BuildLlamaLayer).
  state->extras = extras;
  state->extras.position_ids = at::Tensor();
  state->autocast = CurrentAutocast();
  if (policy != nullptr) state->cache.emplace(*policy);
  const std::vector<at::Tensor> parameters = layer->parameters();
  at::Tensor y = CheckpointFunction::apply(x, at::TensorList(parameters), state);
  if (cached != nullptr && state->cache) {
    const std::vector<at::Tensor>& saved = state->cache->tensors();
    cached->insert(cached->end(), saved.begin(), saved.end());
  }
  return y;
}

ForwardResult ForwardWithVariant(const ModelImpl& model, const at::Tensor& input,
                                 AttentionMode mode, const Variant& variant) {
  const StageRange whole{0, model.num_layers(), /*prologue=*/true, /*head=*/true};
  return ForwardStage(model, whole, at::Tensor(), input, mode, variant);
}

ForwardResult ForwardStage(const ModelImpl& model, const StageRange& stage,
                           const at::Tensor& received, const at::Tensor& input,
                           AttentionMode mode, const Variant& variant, ParameterUnits* units) {
  std::vector<at::Tensor> cached;
  ForwardResult result;
  // ZeRO-3: a unit's parameters exist from its begin to its end; in the backward, the
  // hook on its input (made by the unit before: its node runs after every node and
  // AccumulateGrad of this unit, which come first in the engine's order) hands over to
  // the unit before it. A leaf input (a received one) gets no hook: its AccumulateGrad
  // runs in no set order among the parameters' (a checkpointed layer returns all their
  // gradients at once), so that unit ends when the backward returns (EndBackward).
  int64_t previous = ParameterUnits::kNone;
  auto begin = [&](int64_t unit, const at::Tensor& unit_input) {
    if (units == nullptr) return;
    if (unit_input.defined() && unit_input.requires_grad() && !unit_input.is_leaf()) {
      unit_input.register_hook([units, unit, before = previous](const at::Tensor& /*grad*/) {
        units->BackwardPassed(unit, before);
      });
    }
    units->Gather(unit);
  };
  auto end = [&](int64_t unit) {
    if (units == nullptr) return;
    units->Release(unit);
    previous = unit;
  };
  // The forward, loss included, under autocast when the model trains with it.
  ScopedAutocast autocast(AutocastDtype(model.amp));
  ModelStart start;
  if (stage.prologue) {
    begin(ParameterUnits::kPrologue, at::Tensor());
    start = model.Prologue(input);
    end(ParameterUnits::kPrologue);
  } else {
    start.hidden = received;
    // The model input's length: with sequence parallelism `received` holds T / tp tokens.
    start.extras = model.Extras(input.size(1), received.scalar_type());
  }
  at::Tensor x = std::move(start.hidden);
  for (int64_t i = stage.first_layer; i < stage.first_layer + stage.layers; ++i) {
    begin(i, x);
    if (variant.IsCheckpointed(i)) {
      // A layer with an empty policy is fully recomputed: no selective cache.
      const SavePolicy policy = variant.PolicyAt(i);
      x = CheckpointLayer(model.layer(i), x, start.extras, mode, model.checkpoint_impl,
                          policy.empty() ? nullptr : &policy, &cached);
    } else {
      x = model.layer(i)->forward(x, start.extras, mode, nullptr);
    }
    end(i);
  }
  if (stage.head) {
    begin(ParameterUnits::kHead, x);
    result.loss = model.Epilogue(x, input);
    end(ParameterUnits::kHead);
  } else {
    result.loss = std::move(x);
  }
  result.cache_bytes = UniqueStorageBytes(cached);
  return result;
}

}  // namespace memledger::runtime
