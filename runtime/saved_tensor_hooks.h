// Default saved-tensor hooks for C++, the stand-in for Python's
// torch.autograd.graph.saved_tensors_hooks. LibTorch 2.15 still has no C++ API for them:
// at::SavedTensorDefaultHooks holds c10::SafePyObject pack/unpack functions, for Python
// only.
//
// Every SavedVariable asks the default autograd Engine for hooks when it is made
// (SavedVariable::get_default_hooks() calls the virtual
// Engine::get_default_saved_variable_hooks(), as Python's engine does to install its
// own). While any ScopedSavedTensorHooks is alive the default engine is one whose hooks
// come from the innermost scope of the calling thread, as Python's stack of hooks is
// thread-local and only its top applies. SavedVariable calls no hook for a wrapped
// number (saved_variable.cpp), here as in Python.
//
// Example:
//   {
//     ScopedSavedTensorHooks hooks([] { return std::make_unique<MyHooks>(); });
//     y = layer->forward(x);  // every tensor its nodes save goes through a MyHooks
//   }
#ifndef RUNTIME_SAVED_TENSOR_HOOKS_H_
#define RUNTIME_SAVED_TENSOR_HOOKS_H_

#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <functional>
#include <memory>

namespace memledger::runtime {

// MakeSavedVariableHooks makes the hooks of one SavedVariable (null: none for it).
using MakeSavedVariableHooks =
    std::function<std::unique_ptr<torch::autograd::SavedVariableHooks>()>;

// ScopedSavedTensorHooks pushes `make` onto the calling thread's stack of default hooks
// until the scope ends (also when unwinding). The first live scope installs the hooks
// engine as the default; the last one restores the engine that was the default before.
// Scopes nest in stack order.
class ScopedSavedTensorHooks {
 public:
  explicit ScopedSavedTensorHooks(MakeSavedVariableHooks make);
  ~ScopedSavedTensorHooks();

  ScopedSavedTensorHooks(const ScopedSavedTensorHooks&) = delete;
  ScopedSavedTensorHooks& operator=(const ScopedSavedTensorHooks&) = delete;
};

}  // namespace memledger::runtime

#endif  // RUNTIME_SAVED_TENSOR_HOOKS_H_
