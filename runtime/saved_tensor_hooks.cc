#include "runtime/saved_tensor_hooks.h"

#include <torch/csrc/autograd/engine.h>

#include <mutex>
#include <utility>
#include <vector>

namespace memledger::runtime {
namespace {

namespace ag = torch::autograd;

// The calling thread's stack of hooks, innermost last.
std::vector<MakeSavedVariableHooks>& ThreadStack() {
  thread_local std::vector<MakeSavedVariableHooks> stack;
  return stack;
}

// HooksEngine differs from the base engine only in its saved-variable hooks.
class HooksEngine : public ag::Engine {
 public:
  HooksEngine() = default;
  ~HooksEngine() override { stop(); }

  std::unique_ptr<ag::SavedVariableHooks> get_default_saved_variable_hooks() override {
    std::vector<MakeSavedVariableHooks>& stack = ThreadStack();
    if (stack.empty()) return nullptr;
    return stack.back()();
  }
};

ag::Engine& GetHooksEngine() {
  // Leaked on purpose: an Engine must outlive every autograd graph, including ones
  // destroyed during static destruction.
  static HooksEngine* engine = new HooksEngine();
  return *engine;
}

// Live scopes on every thread, and the default engine from before the first.
std::mutex scopes_mutex;
int live_scopes = 0;
ag::Engine* previous_engine = nullptr;

ag::Engine& GetPreviousEngine() { return *previous_engine; }

}  // namespace

ScopedSavedTensorHooks::ScopedSavedTensorHooks(MakeSavedVariableHooks make) {
  ThreadStack().push_back(std::move(make));
  std::lock_guard<std::mutex> lock(scopes_mutex);
  if (live_scopes++ == 0) {
    previous_engine = &ag::Engine::get_default_engine();
    ag::set_default_engine_stub(&GetHooksEngine);
  }
}

ScopedSavedTensorHooks::~ScopedSavedTensorHooks() {
  ThreadStack().pop_back();
  std::lock_guard<std::mutex> lock(scopes_mutex);
  if (--live_scopes > 0) return;
  // Restore the exact stub when it was the base engine's, the usual case.
  if (previous_engine == &ag::Engine::get_base_engine()) {
    ag::set_default_engine_stub(&ag::Engine::get_base_engine);
  } else {
    ag::set_default_engine_stub(&GetPreviousEngine);
  }
}

}  // namespace memledger::runtime
