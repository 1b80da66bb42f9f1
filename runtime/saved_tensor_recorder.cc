#include "runtime/saved_tensor_recorder.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <atomic>
#include <memory>
#include <utility>

#include "runtime/saved_tensor_hooks.h"

namespace memledger::runtime {
namespace {

namespace ag = torch::autograd;

// The recorder of the live scope; null outside any scope.
std::atomic<SavedTensorRecorder*> active_recorder{nullptr};

// RecordingHooks reports the packed tensor and hands it back unchanged on unpack.
class RecordingHooks : public ag::SavedVariableHooks {
 public:
  explicit RecordingHooks(SavedTensorRecorder* recorder) : recorder_(recorder) {}

  void call_pack_hook(const at::Tensor& tensor) override {
    recorder_->Record(tensor);
    // detach(): the saved tensor may be the node's own output, whose grad_fn would
    // otherwise point back at the node that owns this hook (a reference cycle).
    // SavedVariable restores the autograd metadata on unpack.
    packed_ = tensor.detach();
  }
  at::Tensor call_unpack_hook() override { return packed_; }

 private:
  SavedTensorRecorder* recorder_;
  at::Tensor packed_;
};

}  // namespace

const void* StorageKey(const at::Tensor& tensor) { return tensor.storage().data(); }

int64_t StorageBytes(const at::Tensor& tensor) {
  return static_cast<int64_t>(tensor.storage().nbytes());
}

int64_t UniqueStorageBytes(const std::vector<at::Tensor>& tensors) {
  std::unordered_set<const void*> seen;
  int64_t bytes = 0;
  for (const at::Tensor& t : tensors) {
    if (!t.defined()) continue;
    if (seen.insert(StorageKey(t)).second) bytes += StorageBytes(t);
  }
  return bytes;
}

SavedTensorRecorder::SavedTensorRecorder(std::unordered_set<const void*> excluded_storages)
    : excluded_storages_(std::move(excluded_storages)) {}

void SavedTensorRecorder::Record(const at::Tensor& tensor) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++num_packs_;
  if (!tensor.defined() || !tensor.has_storage()) return;
  const void* key = StorageKey(tensor);
  if (excluded_storages_.count(key) > 0) return;
  auto [it, inserted] = storages_.emplace(key, StorageBytes(tensor));
  if (inserted) bytes_ += it->second;
}

int64_t SavedTensorRecorder::bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return bytes_;
}

int64_t SavedTensorRecorder::num_storages() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(storages_.size());
}

int64_t SavedTensorRecorder::num_packs() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return num_packs_;
}

ScopedSavedTensorRecording::ScopedSavedTensorRecording(SavedTensorRecorder* recorder) {
  TORCH_CHECK(recorder != nullptr, "ScopedSavedTensorRecording: null recorder");
  SavedTensorRecorder* expected = nullptr;
  TORCH_CHECK(active_recorder.compare_exchange_strong(expected, recorder),
              "ScopedSavedTensorRecording: another recording scope is alive");
  hooks_ = std::make_unique<ScopedSavedTensorHooks>(
      [recorder] { return std::make_unique<RecordingHooks>(recorder); });
}

ScopedSavedTensorRecording::~ScopedSavedTensorRecording() {
  hooks_.reset();
  active_recorder.store(nullptr);
}

bool IsRecording() { return active_recorder.load() != nullptr; }

}  // namespace memledger::runtime
