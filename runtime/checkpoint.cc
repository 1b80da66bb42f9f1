#include "runtime/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "runtime/autocast.h"
#include "runtime/saved_tensor_hooks.h"
#include "runtime/saved_tensor_recorder.h"

namespace memledger::runtime {
namespace {

namespace ag = torch::autograd;

// CheckpointState is what a checkpoint keeps besides its saved tensor (the layer
// input): the layer to recompute, the tensors it was called with besides (held, not
// saved: transformers binds them into the checkpointed function), the CPU RNG state of
// its forward (preserve_rng_state) and, for selective checkpointing, the cache of
// must-saved outputs.
struct CheckpointState : torch::CustomClassHolder {
  std::shared_ptr<DecoderLayer> layer;
  AttentionMode mode = AttentionMode::kFlash;
  LayerExtras extras;
  at::Tensor rng_state;
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

// CheckpointFunction is the reentrant checkpoint (use_reentrant=True).
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
    // state. The ctx (RNG state, run_function's bound arguments) lives as long as the
    // graph, until the loss dies (checkpoint.py:241-252).
    ag::variable_list result;
    result.reserve(parameters.size() + 2);
    size_t next = 0;
    result.push_back(x_needs_grad ? input_grads[next++] : at::Tensor());
    for (size_t i = 0; i < parameters.size(); ++i) result.push_back(input_grads[next++]);
    result.push_back(at::Tensor());
    return result;
  }
};

// The non-reentrant checkpoint (use_reentrant=False), as torch/utils/checkpoint.py's
// _checkpoint_without_reentrant_generator runs it. The layer runs with grad, in the
// outer graph, under a pack hook that saves nothing: each saved tensor becomes an empty
// holder. The first node to unpack one recomputes the layer from its input (kept by a
// _NoopSaveInputs node) under the forward's RNG state, filling the holders in pack order
// and stopping as the last is filled (_StopRecomputationError); each node takes its
// tensors out of the frame as it unpacks them, so they die as its apply() returns. The
// frame (input, call arguments, RNG state, selective cache) is owned by the holders and
// dies with the last of them, when its node releases its variables.
struct Frame {
  CheckpointState state;
  at::Tensor input;
  // input_saver: _NoopSaveInputs' output, whose node saves the input (a pack the
  // hooks outside the checkpoint see).
  at::Tensor input_saver;
  // Per holder, in pack order: still owned by a SavedVariable, and the packed tensor's
  // sizes and dtype (check_recomputed_tensors_match).
  std::vector<bool> alive;
  std::vector<std::pair<std::vector<int64_t>, at::ScalarType>> metadata;
  std::unordered_map<size_t, at::Tensor> recomputed;
  bool recompute_done = false;
};

// StopRecomputation is _StopRecomputationError.
struct StopRecomputation : std::exception {
  const char* what() const noexcept override { return "checkpoint: recomputation stopped"; }
};

void Recompute(Frame& frame);

// HolderHooks: the forward's pack hook (checkpoint.py, _checkpoint_hook).
class HolderHooks : public ag::SavedVariableHooks {
 public:
  explicit HolderHooks(std::shared_ptr<Frame> frame) : frame_(std::move(frame)) {}
  ~HolderHooks() override {
    if (index_ < frame_->alive.size()) frame_->alive[index_] = false;
  }

  void call_pack_hook(const at::Tensor& tensor) override {
    index_ = frame_->alive.size();
    frame_->alive.push_back(true);
    frame_->metadata.emplace_back(tensor.sizes().vec(), tensor.scalar_type());
  }
  at::Tensor call_unpack_hook() override {
    if (!frame_->recompute_done) Recompute(*frame_);
    auto it = frame_->recomputed.find(index_);
    TORCH_CHECK(it != frame_->recomputed.end(),
                "checkpoint: a saved tensor unpacked twice, or never recomputed");
    at::Tensor tensor = std::move(it->second);
    frame_->recomputed.erase(it);  // holder.handles[gid] = None
    return tensor;
  }

 private:
  std::shared_ptr<Frame> frame_;
  size_t index_ = static_cast<size_t>(-1);
};

// RecomputeHooks: the recompute's pack hook (checkpoint.py, _recomputation_hook): the
// tensor goes to its holder and stays saved in the recompute's own graph.
class RecomputeHooks : public ag::SavedVariableHooks {
 public:
  RecomputeHooks(Frame* frame, size_t* counter) : frame_(frame), counter_(counter) {}

  void call_pack_hook(const at::Tensor& tensor) override {
    packed_ = tensor.detach();
    const size_t index = (*counter_)++;
    TORCH_CHECK(index < frame_->alive.size(),
                "checkpoint: the recompute saved more tensors than the forward");
    TORCH_CHECK(frame_->metadata[index].first == tensor.sizes().vec() &&
                    frame_->metadata[index].second == tensor.scalar_type(),
                "checkpoint: recomputed tensor ", index, " (", tensor.sizes(), " ",
                tensor.scalar_type(), ") differs from the forward's (",
                at::IntArrayRef(frame_->metadata[index].first), " ",
                frame_->metadata[index].second, ")");
    if (frame_->alive[index]) frame_->recomputed[index] = packed_;
    if (*counter_ == frame_->alive.size()) throw StopRecomputation();
  }
  at::Tensor call_unpack_hook() override { return packed_; }

 private:
  Frame* frame_;
  size_t* counter_;
  at::Tensor packed_;
};

void Recompute(Frame& frame) {
  frame.recompute_done = true;
  CheckpointState& state = frame.state;
  SelectiveCache* cache = nullptr;
  if (state.cache) {
    cache = &*state.cache;
    cache->StartReplay();
  }
  // recompute_fn runs under torch.random.fork_rng: the current state kept while the
  // recompute runs on the forward's.
  const at::Tensor forked = CpuRngState();
  SetCpuRngState(state.rng_state);
  size_t counter = 0;
  try {
    at::AutoGradMode enable_grad(true);
    ScopedAutocast autocast(state.autocast);
    ScopedSavedTensorHooks hooks(
        [&frame, &counter] { return std::make_unique<RecomputeHooks>(&frame, &counter); });
    state.layer->forward(frame.input, state.extras, state.mode, cache);
  } catch (const StopRecomputation&) {
  }
  SetCpuRngState(forked);
}

// NoopSaveInputs is checkpoint.py's _NoopSaveInputs: it saves the layer input and
// returns an empty tensor, whose node keeps it.
class NoopSaveInputs : public ag::Function<NoopSaveInputs> {
 public:
  static at::Tensor forward(ag::AutogradContext* ctx, const at::Tensor& /*dummy*/,
                            const at::Tensor& x) {
    ctx->save_for_backward({x});
    return at::empty({0}, x.options());
  }
  static ag::variable_list backward(ag::AutogradContext* /*ctx*/, ag::variable_list /*grads*/) {
    return {at::Tensor(), at::Tensor()};
  }
};

// NonReentrantCheckpoint runs the layer; `frame` is its frame, for the caller to read
// before the holders become its only owners.
at::Tensor NonReentrantCheckpoint(CheckpointState state, const at::Tensor& x,
                                  std::shared_ptr<Frame>* frame_out) {
  auto frame = std::make_shared<Frame>();
  *frame_out = frame;
  frame->state = std::move(state);
  // preserve_rng_state: the state before the layer runs (checkpoint.py:1973).
  frame->state.rng_state = CpuRngState();
  frame->input = x;
  const at::Tensor dummy = at::empty({0}, x.options()).requires_grad_(true);
  frame->input_saver = NoopSaveInputs::apply(dummy, x);
  SelectiveCache* cache = frame->state.cache ? &*frame->state.cache : nullptr;
  std::weak_ptr<Frame> weak = frame;
  ScopedSavedTensorHooks hooks([weak] { return std::make_unique<HolderHooks>(weak.lock()); });
  at::Tensor y = frame->state.layer->forward(x, frame->state.extras, frame->state.mode, cache);
  return y;
}

}  // namespace

at::Tensor CheckpointLayer(const std::shared_ptr<DecoderLayer>& layer, const at::Tensor& x,
                           const LayerExtras& extras, AttentionMode mode,
                           CheckpointImpl impl, const SavePolicy* policy,
                           std::vector<at::Tensor>* cached) {
  CheckpointState state;
  state.layer = layer;
  state.mode = mode;
  state.extras = extras;
  state.autocast = CurrentAutocast();
  if (policy != nullptr) state.cache.emplace(*policy);
  auto note_cached = [cached](const std::optional<SelectiveCache>& cache) {
    if (cached == nullptr || !cache) return;
    cached->insert(cached->end(), cache->tensors().begin(), cache->tensors().end());
  };
  if (impl == CheckpointImpl::kNonReentrant) {
    std::shared_ptr<Frame> frame;
    at::Tensor y = NonReentrantCheckpoint(std::move(state), x, &frame);
    note_cached(frame->state.cache);
    return y;
  }
  auto reentrant = c10::make_intrusive<CheckpointState>(std::move(state));
  const std::vector<at::Tensor> parameters = layer->parameters();
  at::Tensor y = CheckpointFunction::apply(x, at::TensorList(parameters), reentrant);
  note_cached(reentrant->cache);
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
  model.hook_input_embeddings = variant.CheckpointsAnyLayer();
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
  // What the layers are called with (a checkpointed one holds it all).
  LayerExtras layer_extras = start.extras;
  if (!model.CallsLayersWithPositionIds()) layer_extras[ModelTensor::kPositionIds] = at::Tensor();
  // transformers' use_cache, which gradient checkpointing turns off: without checkpointed
  // layers the model's DynamicCache holds every layer's keys and values until the
  // forward returns (destroyed before the autocast scope ends).
  std::vector<at::Tensor> kv_cache;
  bool keeps_cache = model.use_cache;
  for (int64_t i = stage.first_layer; i < stage.first_layer + stage.layers; ++i) {
    keeps_cache = keeps_cache && !variant.IsCheckpointed(i);
  }
  LayerExtras plain_extras = start.extras;
  if (keeps_cache) {
    plain_extras.kv_cache = &kv_cache;
    if (stage.prologue) kv_cache = model.CacheLayers();
  }
  at::Tensor x = std::move(start.hidden);
  for (int64_t i = stage.first_layer; i < stage.first_layer + stage.layers; ++i) {
    begin(i, x);
    if (variant.IsCheckpointed(i)) {
      // A layer with an empty policy is fully recomputed: no selective cache.
      const SavePolicy policy = variant.PolicyAt(i);
      x = CheckpointLayer(model.layer(i), x, model.ExtrasOf(i, layer_extras), mode,
                          model.checkpoint_impl, policy.empty() ? nullptr : &policy, &cached);
    } else {
      x = model.layer(i)->forward(x, model.ExtrasOf(i, plain_extras), mode, nullptr);
    }
    end(i);
  }
  if (stage.head) {
    begin(ParameterUnits::kHead, x);
    // The decoder model's locals (position ids, RoPE tables: every copy here) die where
    // its forward returns.
    result.loss = model.Epilogue(std::move(x), input, [&] {
      start.decoder_locals.clear();
      start.extras = layer_extras = plain_extras = LayerExtras();
    });
    end(ParameterUnits::kHead);
    if (units != nullptr) units->LossMade(result.loss);
  } else {
    result.loss = std::move(x);
  }
  result.cache_bytes = UniqueStorageBytes(cached);
  return result;
}

}  // namespace memledger::runtime
