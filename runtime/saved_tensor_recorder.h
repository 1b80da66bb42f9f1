// Records which tensor storages autograd saves for backward, as the study's
// saved_tensors_hooks do in Python: while a ScopedSavedTensorRecording is alive, a pack
// hook (runtime/saved_tensor_hooks.h) reports each saved tensor's storage to a recorder.
// Like Python's, the hook is the innermost one of its thread: a non-reentrant
// checkpoint's own hooks shadow it inside the checkpointed layer.
//
// Example:
//   SavedTensorRecorder recorder(/*excluded_storages=*/ParameterStorages(params));
//   {
//     ScopedSavedTensorRecording recording(&recorder);
//     loss = Forward(model, input);
//   }
//   int64_t saved_bytes = recorder.bytes();
#ifndef RUNTIME_SAVED_TENSOR_RECORDER_H_
#define RUNTIME_SAVED_TENSOR_RECORDER_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace memledger::runtime {

// StorageKey identifies a storage by its data pointer: views share their base's.
const void* StorageKey(const at::Tensor& tensor);

// StorageBytes is the size of the whole storage behind `tensor`, not of the view.
int64_t StorageBytes(const at::Tensor& tensor);

// UniqueStorageBytes sums StorageBytes over the distinct storages of `tensors`.
int64_t UniqueStorageBytes(const std::vector<at::Tensor>& tensors);

// SavedTensorRecorder accumulates the unique storages autograd packs for backward.
// Storages in `excluded_storages` (the parameters') are seen but not counted.
class SavedTensorRecorder {
 public:
  explicit SavedTensorRecorder(std::unordered_set<const void*> excluded_storages = {});

  SavedTensorRecorder(const SavedTensorRecorder&) = delete;
  SavedTensorRecorder& operator=(const SavedTensorRecorder&) = delete;

  // Record notes one packed tensor. Called by the recording pack hook; thread-safe.
  void Record(const at::Tensor& tensor);

  // bytes is the sum of nbytes over the unique, non-excluded storages recorded.
  int64_t bytes() const;
  // num_storages counts those storages; num_packs counts every Record call.
  int64_t num_storages() const;
  int64_t num_packs() const;

 private:
  mutable std::mutex mutex_;
  std::unordered_set<const void*> excluded_storages_;
  std::unordered_map<const void*, int64_t> storages_;  // data pointer -> nbytes
  int64_t bytes_ = 0;
  int64_t num_packs_ = 0;
};

class ScopedSavedTensorHooks;

// ScopedSavedTensorRecording makes `recorder` see every tensor autograd saves on this
// thread until the scope ends. On destruction (also when unwinding) it removes its hook
// and detaches the recorder, so nothing is recorded afterwards. Run only the forward
// inside the scope: backward would be recorded too.
// REQUIRES: no other ScopedSavedTensorRecording is alive; `recorder` outlives the scope.
class ScopedSavedTensorRecording {
 public:
  explicit ScopedSavedTensorRecording(SavedTensorRecorder* recorder);
  ~ScopedSavedTensorRecording();

  ScopedSavedTensorRecording(const ScopedSavedTensorRecording&) = delete;
  ScopedSavedTensorRecording& operator=(const ScopedSavedTensorRecording&) = delete;

 private:
  std::unique_ptr<ScopedSavedTensorHooks> hooks_;
};

// IsRecording says whether a ScopedSavedTensorRecording is alive.
bool IsRecording();

}  // namespace memledger::runtime

#endif  // RUNTIME_SAVED_TENSOR_RECORDER_H_
