// The step simulation's ledger (internal to estimator/step/liveness): the tensors it holds
// (Handle), what runs (Where), the stretches it summarizes (SegmentSummary) and Memory,
// the storages with reference counts, live bytes by category, events and the peak.
//
// Example (as simulation.h's Simulation uses it):
//   Memory memory(&timeline, /*record=*/true, optimizer);
//   memory.Begin();
//   const int id = memory.Alloc(bytes, MemoryCategory::kTemporary);
//   memory.Unref(id);
#ifndef ESTIMATOR_STEP_STEP_LEDGER_H_
#define ESTIMATOR_STEP_STEP_LEDGER_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "estimator/graph/block_graph.h"
#include "estimator/spec/config.h"
#include "estimator/step/cuda_allocator.h"
#include "estimator/step/liveness.h"
#include "estimator/graph/shape.h"

namespace memledger::liveness_internal {

// Handle is one tensor the simulation holds: a reference to a storage, and its layout.
struct Handle {
  int storage = -1;
  Layout layout;
  DType dtype = DType::kFloat32;
  // is_view: made by a view op in the backward, so its base tensor is alive with it and
  // the storage has two users (the engine never accumulates into it in place).
  bool is_view = false;
  bool defined() const { return storage >= 0; }
};

inline int64_t NumelOf(const Layout& layout) { return layout.Numel().value(); }

inline Layout ContiguousOf(const Layout& layout) {
  bool overflow = false;
  return Layout::Contiguous(layout.sizes.data(), layout.ndim, &overflow);
}

inline bool SameSizes(const Layout& a, const Layout& b) {
  if (a.ndim != b.ndim) return false;
  for (int i = 0; i < a.ndim; ++i) {
    if (a.sizes[i] != b.sizes[i]) return false;
  }
  return true;
}

inline bool SameLayout(const Layout& a, const Layout& b) {
  if (!SameSizes(a, b)) return false;
  for (int i = 0; i < a.ndim; ++i) {
    if (a.sizes[i] != 1 && a.strides[i] != b.strides[i]) return false;
  }
  return true;
}

// NonOverlappingAndDense is ATen's is_non_overlapping_and_dense: some order of the
// dimensions makes the layout contiguous.
inline bool NonOverlappingAndDense(const Layout& layout) {
  // Most are contiguous: then, without an empty dimension, the order by stride is the
  // dimensions' own (inner ones' strides are smaller), and the answer is yes.
  bool contiguous = true;
  int64_t next = 1;
  for (int i = layout.ndim - 1; i >= 0 && contiguous; --i) {
    if (layout.sizes[i] == 1) continue;
    contiguous = layout.sizes[i] > 1 && layout.strides[i] == next;
    next *= layout.sizes[i];
  }
  if (contiguous) return true;
  // The dimensions by stride, a stable insertion sort (at most kMaxDims; no heap).
  std::array<int, Layout::kMaxDims> dims{};
  for (int i = 0; i < layout.ndim; ++i) {
    int j = i;
    for (; j > 0 && layout.strides[dims[j - 1]] > layout.strides[i]; --j) dims[j] = dims[j - 1];
    dims[j] = i;
  }
  int64_t expected = 1;
  for (int n = 0; n < layout.ndim; ++n) {
    const int d = dims[n];
    if (layout.sizes[d] == 1) continue;
    if (layout.strides[d] != expected) return false;
    expected *= layout.sizes[d];
  }
  return true;
}

inline Layout Permuted(const Layout& layout, const std::vector<int>& permutation) {
  Layout out;
  out.ndim = layout.ndim;
  for (int i = 0; i < layout.ndim; ++i) {
    out.sizes[i] = layout.sizes[permutation[i]];
    out.strides[i] = layout.strides[permutation[i]];
  }
  return out;
}

inline Layout Transposed(const Layout& layout, int d0, int d1) {
  Layout out = layout;
  std::swap(out.sizes[d0], out.sizes[d1]);
  std::swap(out.strides[d0], out.strides[d1]);
  return out;
}

// Where is what runs, cheap to set at every op; it becomes text ("layer 3 fc2
// (AddmmBackward0)") only for recorded events and the peak.
struct Where {
  enum class Activity : uint8_t {
    kOp, kCheckpointNode, kLossBackward, kOptimizerStep, kDynamicCache, kGradientReduction,
    kPointToPoint, kParameterGather, kUnitReduction };
  static constexpr int64_t kHead = -1;
  static constexpr int64_t kPrologue = -2;
  const BlockGraph* graph = nullptr;
  int64_t segment = 0;  // layer index (a composed peak's may pass 2^31), or kHead
  const char* node = nullptr;  // the backward node; null in the forward
  int32_t op = -1;
  bool recompute = false;
  Activity activity = Activity::kOp;
  friend bool operator==(const Where& a, const Where& b) {
    return a.graph == b.graph && a.segment == b.segment && a.op == b.op && a.node == b.node &&
           a.recompute == b.recompute && a.activity == b.activity;
  }
};

// WhereText: "layer 3 fc2 (AddmmBackward0)", "adamw.step()", ...
std::string WhereText(const Where& where, const OptimizerSpec& optimizer);

// SegmentSummary is one stretch of the step (a layer's forward, a layer's backward, ...):
// its net bytes by category and its own highest point, relative to where it started.
// Identical layers have identical stretches, so a long model's peak can be composed from
// a short model's stretches (ComposePeak).
struct SegmentSummary {
  std::array<int64_t, kNumMemoryCategories> net{};
  bool has_rise = false;  // some moment of it rose above its start
  int64_t rise = 0;       // the highest total minus the start's
  std::array<int64_t, kNumMemoryCategories> at_rise{};  // live minus the start's, then
  StepPhase phase = StepPhase::kForward;
  Where where;
  // freed_at_forward_end: of a layer's forward, what it leaves that only autocast's cast
  // cache holds (casts of weights in a checkpointed layer), by category. The cache is
  // cleared at the head's forward end, so a composed model's head_forward frees its own
  // layers' sum, not the short model's.
  std::array<int64_t, kNumMemoryCategories> freed_at_forward_end{};
};

// TapeStretch is one stretch of a step cut into consecutive stretches (Memory::SetTape):
// a layer's forward or backward in one pass, the optimizer's step (with the gradients'
// reduction), or anything else between them.
struct TapeStretch {
  enum class Kind : uint8_t { kOther, kLayerForward, kLayerBackward, kOptimizer };
  Kind kind = Kind::kOther;
  int64_t layer = -1;  // the layer's index (kLayerForward, kLayerBackward)
  int64_t pass = -1;   // which forward or backward pass of the step
  SegmentSummary summary;
};

// RepeatedPass is a micro-batch's forward or backward as tape stretches, and the
// handle it leaves its caller (the output to send, the input's gradient): a later
// micro-batch's pass that repeats it byte for byte is these stretches again
// (Simulation::Repeat).
struct RepeatedPass {
  std::vector<TapeStretch> stretches;
  Handle handle;  // undefined: none
  int64_t bytes = 0;
  MemoryCategory category = MemoryCategory::kTemporary;
};

// Memory is the ledger: storages with reference counts, live bytes by category, the
// events and the peak.
class Memory {
 public:
  // cuda: the step runs on a CUDA device: what lives on the host (HostAlloc) holds no
  // bytes, and each storage is counted as `blocks` says (StepOptions::cuda_blocks): its
  // block of PyTorch's caching allocator (estimator/step/cuda_allocator.h), or its request
  // rounded to the allocator's 512 B.
  // expandable_segments: the allocator's (estimator/step/cuda_allocator.h).
  // cublas_workspace_bytes: on CUDA, each GEMM's cuBLAS workspace (CublasWorkspace).
  Memory(StepTimeline* out, bool record, const OptimizerSpec& optimizer, bool cuda = false,
         bool expandable_segments = false, CudaBlocks blocks = CudaBlocks::kAllocator,
         int64_t cublas_workspace_bytes = 0)
      : out_(out), record_(record), cuda_(cuda),
        cublas_workspace_bytes_(cublas_workspace_bytes), optimizer_(optimizer) {
    if (cuda && blocks == CudaBlocks::kAllocator) allocator_.emplace(expandable_segments);
    // A step makes thousands of storages: this thread's vector of the last step, its
    // pages already faulted in, serves again (its room kept, count_ from 0).
    storages_.swap(SparedStorages());
  }
  ~Memory() {
    if (storages_.size() > SparedStorages().size()) storages_.swap(SparedStorages());
  }
  Memory(const Memory&) = delete;
  Memory& operator=(const Memory&) = delete;

  // Begin starts the step from the resident bytes (StepTimeline::resident). On CUDA the
  // resident tensors (StepTimeline::resident_tensors, the inputs last) are allocated
  // first, in order, and count as their blocks.
  void Begin() {
    if (cuda_) {
      std::array<int64_t, kNumMemoryCategories> blocks{};
      for (ResidentTensor& tensor : out_->resident_tensors) {
        int block = -1;
        if (allocator_.has_value()) {
          block = Malloc(tensor.bytes);
          tensor.bytes = BlockBytes(block);  // the snapshot's block
        } else {
          tensor.bytes = RequestBytes(tensor.bytes);
        }
        blocks[static_cast<int>(tensor.category)] += tensor.bytes;
        if (tensor.category == MemoryCategory::kInput) {
          inputs_.push_back(Input{block, tensor.bytes});
        }
      }
      out_->resident = blocks;
    }
    live_ = out_->resident;
    total_ = 0;
    for (int64_t bytes : live_) total_ += bytes;
    out_->resident_bytes = total_;
    out_->peak.bytes = total_;
    out_->peak.by_category = live_;
  }

  void SetPhase(StepPhase phase) { phase_ = phase; }

  // SetOp says what runs now; SetOpIndex, that another op of the same graph and
  // activity does.
  void SetOp(const Where& where) { where_ = where; }
  void SetOpIndex(int op) { where_.op = op; }

  // BeginSegment and EndSegment bracket a stretch of the step and summarize it. With a
  // tape, each also ends the stretch open before it and records it there: the tape then
  // covers every event of the step, in order.
  void BeginSegment(TapeStretch::Kind kind = TapeStretch::Kind::kOther, int64_t layer = -1,
                    int64_t pass = -1) {
    if (tape_ != nullptr) Record();
    segment_ = SegmentSummary();
    segment_start_ = live_;
    segment_start_total_ = total_;
    if (shadowing_) ResetShadowSegment();
    tag_ = TapeStretch{kind, layer, pass, {}};
  }
  SegmentSummary EndSegment() {
    if (overflow_) return Closed(segment_, segment_start_);
    for (int c = 0; c < kNumMemoryCategories; ++c) segment_.net[c] = live_[c] - segment_start_[c];
    if (tape_ == nullptr) return Closed(segment_, segment_start_);
    const SegmentSummary ended = Closed(segment_, segment_start_);
    BeginSegment();  // records this one; what follows is another
    return ended;
  }
  // SetTape: from now on cut the step into `tape`'s stretches (opening one here).
  void SetTape(std::vector<TapeStretch>* tape) {
    tape_ = nullptr;
    BeginSegment();  // from here, recording nothing before
    tape_ = tape;
  }
  // Replay appends stretches recorded before, as if they happened again now: what they
  // leave is live from here. Only with a tape, whose stretches the step's peak is then
  // composed from (this ledger's own peak does not see them).
  void Replay(const std::vector<TapeStretch>& stretches) {
    Record();
    for (const TapeStretch& s : stretches) {
      tape_->push_back(s);
      for (int c = 0; c < kNumMemoryCategories; ++c) {
        overflow_ = overflow_ || __builtin_add_overflow(live_[c], s.summary.net[c], &live_[c]) ||
                    __builtin_add_overflow(total_, s.summary.net[c], &total_);
      }
    }
    tag_ = TapeStretch();
    segment_ = SegmentSummary();
    segment_start_ = live_;
    segment_start_total_ = total_;
  }
  // Forget drops a reference to `s` whose freeing stretches replayed (Replay) counted.
  void Forget(int s) { --storages_[s].refs; }
  // FinishTape records the stretch still open, if anything happened in it.
  void FinishTape() {
    if (tape_ != nullptr) Record();
  }
  // tape_size: the stretches recorded so far (the next one's index).
  size_t tape_size() const { return tape_ != nullptr ? tape_->size() : 0; }

  // PeakText names what ran at the peak.
  std::string PeakText() const {
    return peak_where_.has_value() ? WhereText(*peak_where_, optimizer_) : "";
  }

  // Alloc makes a storage with one reference; on CUDA a block of the allocator, on
  // `stream` (CudaStream: the default stream, or one of FSDP2's collectives').
  int Alloc(int64_t bytes, MemoryCategory category, int stream = kDefaultStream) {
    if (on_host_ && cuda_) bytes = 0;  // OnHost: no device bytes
    int block = -1;
    if (allocator_.has_value()) {
      block = Malloc(bytes, stream);
      bytes = BlockBytes(block);
    } else if (cuda_) {
      bytes = RequestBytes(bytes);
    }
    const int s = NewStorage(Storage{bytes, category, category, 1, 0, block});
    Event(s, bytes, category);
    return s;
  }
  // HostAlloc is a storage that a CUDA step keeps in host memory (a Python number
  // wrapped for an op, an RNG state): on the CPU an Alloc, on CUDA no device bytes.
  int HostAlloc(int64_t bytes, MemoryCategory category) {
    return Alloc(cuda_ ? 0 : bytes, category);
  }
  bool cuda() const { return cuda_; }
  // CublasWorkspace: on CUDA, the cuBLAS workspace a GEMM allocates from the caching
  // allocator after its output and frees when it is done. Without
  // TORCH_CUBLAS_WORKSPACE_CACHE=1 the wheel allocates it per operation
  // (aten/src/ATen/cuda/CublasHandlePool.cpp, getCurrentCUDABlasHandleWithWorkspace);
  // CUBLAS_WORKSPACE_CONFIG=:0:0 asks for none, and then nothing is allocated.
  void CublasWorkspace() {
    if (cuda_ && cublas_workspace_bytes_ > 0) Transient(cublas_workspace_bytes_);
  }
  // SetOnHost: from here on a CUDA step's allocations are the host's (FSDP2's
  // CPUOffloadPolicy steps the optimizer on CPU tensors), until SetOnHost(false).
  void SetOnHost(bool on) { on_host_ = on; }
  // allocator: the caching allocator's blocks are simulated (CudaBlocks::kAllocator).
  bool allocator() const { return allocator_.has_value(); }
  // itemized: every transient is allocated one by one, as recorded events or as CUDA
  // blocks (each rounded, host numbers none), rather than peeked at as a sum.
  bool itemized() const { return record_ || cuda_; }
  // reserved_peak: the allocator's segments at most (0 on the CPU).
  int64_t reserved_peak() const {
    return allocator_.has_value() ? allocator_->stats().reserved.peak : 0;
  }

  void Ref(int s) { ++storages_[s].refs; }

  void Unref(int s) {
    Storage& storage = storages_[s];
    if (--storage.refs > 0) return;
    Event(s, -storage.bytes, storage.category);
    if (allocator_.has_value() && storage.block >= 0) {
      allocator_->Free(storage.block);
      if (record_) out_->allocator_calls.push_back({storage.block, 0});
    }
  }

  int refs(int s) const { return storages_[s].refs; }
  int64_t bytes(int s) const { return storages_[s].bytes; }
  MemoryCategory category(int s) const { return storages_[s].category; }

  // Keep: a backward node (or the checkpoint node, or the cache) now holds `s`; while any
  // does it is an activation. Release undoes one Keep.
  void Keep(int s) {
    Storage& storage = storages_[s];
    ++storage.refs;
    if (storage.keeps++ == 0) Recategorize(s, MemoryCategory::kActivation);
  }
  void Release(int s) {
    Storage& storage = storages_[s];
    if (--storage.keeps == 0 && storage.refs > 1) Recategorize(s, storage.base);
    Unref(s);
  }

  // MakeGradient: the storage is now a parameter's .grad. `once`: only the first
  // micro-batch's backward makes it; the shadow pass (BeginShadow) frees it instead.
  void MakeGradient(int s, bool once = false) {
    storages_[s].base = MemoryCategory::kGradient;
    const MemoryCategory was = storages_[s].category;
    skip_shadow_ = once;
    Recategorize(s, MemoryCategory::kGradient);
    skip_shadow_ = false;
    if (once) ShadowEvent(-storages_[s].bytes, was);
  }
  // AllocOnce: a storage only the first micro-batch's backward makes (a .grad, ZeRO-3's
  // shard gradient): the shadow pass skips it.
  int AllocOnce(int64_t bytes, MemoryCategory category, int stream = kDefaultStream) {
    skip_shadow_ = true;
    const int s = Alloc(bytes, category, stream);
    skip_shadow_ = false;
    return s;
  }

  // The shadow pass: while a chunk's first micro-batch's backward runs, its events as the
  // second micro-batch's backward sees them. Where the first makes a .grad, the second
  // finds it made and adds into it in place, freeing the gradient it got (torch's
  // AccumulateGrad): the shadow skips what only the first makes (MakeGradient and
  // AllocOnce with `once`) and sees the rest. EndShadow returns its stretches, cut where
  // the tape's are: the second backward's, without replaying it.
  void BeginShadow() {
    shadowing_ = true;
    shadow_live_ = live_;
    shadow_total_ = total_;
    shadow_tape_.clear();
    ResetShadowSegment();
  }
  std::vector<TapeStretch> EndShadow() {
    shadowing_ = false;
    return std::move(shadow_tape_);
  }
  // ShadowFrees: the shadow pass frees `s` here, which the first micro-batch keeps (the
  // head's first loss, which later ones are added into).
  void ShadowFrees(int s) {
    if (storages_[s].refs == 1) ShadowEvent(-storages_[s].bytes, storages_[s].category);
  }

  // Adopt registers a storage that is already live (counted in the resident bytes), with
  // one reference.
  int Adopt(int64_t bytes, MemoryCategory category) {
    int block = -1;
    if (cuda_ && category == MemoryCategory::kInput && !inputs_.empty()) {
      block = inputs_.front().block;  // Begin's, one per micro-batch, in order
      bytes = inputs_.front().bytes;
      inputs_.pop_front();
    }
    return NewStorage(Storage{bytes, category, category, 1, 0, block});
  }

  // Peek: would `bytes` more (of `category`) now be a new peak? Records it if so. For
  // transients whose events nobody records (the optimizer's per-parameter temporaries).
  void Peek(int64_t bytes, MemoryCategory category) {
    if (overflow_ || total_ > INT64_MAX - bytes) {
      overflow_ = true;
      return;
    }
    std::array<int64_t, kNumMemoryCategories> live = live_;
    live[static_cast<int>(category)] += bytes;
    NoteRise(live, total_ + bytes);
    if (shadowing_) {
      std::array<int64_t, kNumMemoryCategories> shadow = shadow_live_;
      shadow[static_cast<int>(category)] += bytes;
      NoteRiseIn(shadow_segment_, shadow_start_total_, shadow, shadow_total_ + bytes);
    }
    if (total_ + bytes <= out_->peak.bytes) return;
    out_->peak.bytes = total_ + bytes;
    out_->peak.phase = phase_;
    out_->peak.by_category = live_;
    out_->peak.by_category[static_cast<int>(category)] += bytes;
    out_->peak.event = event_count_;
    peak_where_ = where_;
  }
  bool recording() const { return record_; }
  // overflowed: some sum of live bytes left int64; every number after it is meaningless.
  bool overflowed() const { return overflow_; }

  // A Scalar operand of an ATen op is wrapped as an 8-byte double tensor and converted to
  // the op's dtype (4 B in fp32, 2 B in bf16); both live until the op is done (Drop).
  struct Wrapped {
    int wrapped = -1;
    int converted = -1;
  };
  // Both are host tensors beside a CUDA tensor (TensorIterator reads CPU scalars).
  Wrapped WrapScalar(DType dtype) {
    Wrapped w;
    w.wrapped = HostAlloc(ElementSizeBytes(DType::kFloat64), MemoryCategory::kTemporary);
    w.converted = HostAlloc(ElementSizeBytes(dtype), MemoryCategory::kTemporary);
    return w;
  }
  void Drop(const Wrapped& w) {
    Unref(w.converted);
    Unref(w.wrapped);
  }
  // ScalarOp is an in-place op with a Scalar operand: its wrapping comes and goes.
  void ScalarOp(DType dtype) { Drop(WrapScalar(dtype)); }

  // Transient allocates and frees a workspace around nothing else.
  void Transient(int64_t bytes) { Unref(Alloc(bytes, MemoryCategory::kTemporary)); }

 private:
  struct Storage {
    int64_t bytes = 0;
    MemoryCategory category;  // now
    MemoryCategory base;      // when nothing keeps it
    int refs = 0;
    int keeps = 0;
    int block = -1;  // on CUDA its allocator block (-1: none, 0 bytes)
  };
  // NewStorage appends a storage: its id. Inline but for the growth (a push_back's call
  // and its spills cost more than the store, thousands of times a step).
  int NewStorage(const Storage& storage) {
    if (count_ == storages_.size()) Grow();
    storages_[count_] = storage;
    return static_cast<int>(count_++);
  }
  [[gnu::noinline]] void Grow() { storages_.resize(std::max<size_t>(1024, 2 * count_)); }
  static std::vector<Storage>& SparedStorages() {
    static thread_local std::vector<Storage> spared;
    return spared;
  }
  int64_t BlockBytes(int block) const {
    return block < 0 ? 0 : allocator_->BlockSize(block);
  }
  // RequestBytes: a request as the allocator rounds it (malloc of 0 bytes: no block).
  static int64_t RequestBytes(int64_t bytes) { return bytes <= 0 ? 0 : CudaRoundSize(bytes); }
  // Malloc: a request to the allocator, logged (its handle names the allocation).
  int Malloc(int64_t bytes, int stream = kDefaultStream) {
    const int block = allocator_->Malloc(bytes, stream);
    if (record_ && block >= 0) out_->allocator_calls.push_back({block, bytes, stream});
    return block;
  }

  void Recategorize(int s, MemoryCategory category) {
    Storage& storage = storages_[s];
    if (storage.category == category || storage.category == MemoryCategory::kInput) return;
    // Its two events (out of one category, into the other) end where they began: no new
    // peak or rise, once the open stretches have a rise (a stretch's first moment is
    // its rise, even a fall). Unrecorded, only the bytes move.
    if (!record_ && !overflow_ && storage.bytes != 0 && segment_.has_rise &&
        (!shadowing_ || skip_shadow_ || shadow_segment_.has_rise)) {
      live_[static_cast<int>(storage.category)] -= storage.bytes;
      live_[static_cast<int>(category)] += storage.bytes;
      event_count_ += 2;
      if (shadowing_ && !skip_shadow_) {
        shadow_live_[static_cast<int>(storage.category)] -= storage.bytes;
        shadow_live_[static_cast<int>(category)] += storage.bytes;
      }
      storage.category = category;
      return;
    }
    Event(s, -storage.bytes, storage.category, /*relabel=*/true);
    storage.category = category;
    Event(s, storage.bytes, category, /*relabel=*/true);
  }

  [[gnu::always_inline]] void Event(int s, int64_t bytes, MemoryCategory category,
                                    bool relabel = false) {
    if (bytes == 0 || overflow_) return;  // after an overflow nothing is meaningful
    // Each storage's size fits int64 (the walk checked); their sum may not.
    overflow_ = overflow_ ||
                __builtin_add_overflow(live_[static_cast<int>(category)], bytes,
                                       &live_[static_cast<int>(category)]) ||
                __builtin_add_overflow(total_, bytes, &total_);
    if (overflow_) return;
    if (record_) RecordEvent(s, bytes, category, relabel);
    ++event_count_;
    if (total_ > out_->peak.bytes) {
      out_->peak.bytes = total_;
      out_->peak.phase = phase_;
      out_->peak.by_category = live_;
      out_->peak.event = event_count_ - 1;
      peak_where_ = where_;
    }
    NoteRise(live_, total_);
    if (shadowing_ && !skip_shadow_) ShadowEvent(bytes, category);
  }

  // RecordEvent appends the event (and its op's label) to the timeline: out of Event's
  // line, which runs thousands of times a step without recording.
  [[gnu::noinline]] void RecordEvent(int s, int64_t bytes, MemoryCategory category,
                                     bool relabel) {
    // Consecutive events of one op share its label.
    if (!labelled_.has_value() || !(*labelled_ == where_)) {
      out_->op_labels.push_back(WhereText(where_, optimizer_));
      labelled_ = where_;
    }
    out_->events.push_back(TimelineEvent{bytes, category, phase_,
                                         static_cast<int32_t>(out_->op_labels.size()) - 1,
                                         relabel, static_cast<int32_t>(s)});
  }

  // ShadowEvent: `bytes` more (fewer) of `category` in the shadow pass.
  [[gnu::noinline]] void ShadowEvent(int64_t bytes, MemoryCategory category) {
    if (!shadowing_) return;
    shadow_live_[static_cast<int>(category)] += bytes;
    shadow_total_ += bytes;
    NoteRiseIn(shadow_segment_, shadow_start_total_, shadow_live_, shadow_total_);
  }
  void ResetShadowSegment() {
    shadow_segment_ = SegmentSummary();
    shadow_start_ = shadow_live_;
    shadow_start_total_ = shadow_total_;
  }

  // Record appends the open stretch to the tape unless nothing happened in it.
  void Record() {
    for (int c = 0; c < kNumMemoryCategories; ++c) segment_.net[c] = live_[c] - segment_start_[c];
    bool moved = segment_.has_rise;
    for (int64_t bytes : segment_.net) moved = moved || bytes != 0;
    if (!moved && tag_.kind == TapeStretch::Kind::kOther) return;
    tag_.summary = Closed(segment_, segment_start_);
    tape_->push_back(tag_);
    if (shadowing_) {
      TapeStretch shadow = tag_;
      shadow.summary = Closed(shadow_segment_, shadow_start_);
      for (int c = 0; c < kNumMemoryCategories; ++c) {
        shadow.summary.net[c] = shadow_live_[c] - shadow_start_[c];
      }
      shadow_tape_.push_back(shadow);
      ResetShadowSegment();
    }
    tag_ = TapeStretch();
    segment_ = SegmentSummary();
    segment_start_ = live_;
    segment_start_total_ = total_;
  }

  void NoteRise(const std::array<int64_t, kNumMemoryCategories>& live, int64_t total) {
    NoteRiseIn(segment_, segment_start_total_, live, total);
  }
  // Closed is an open stretch as its summary says it: the live bytes its rise recorded
  // (NoteRiseIn, which runs at most events and so leaves the subtraction to here) less
  // those at its start.
  static SegmentSummary Closed(SegmentSummary segment,
                               const std::array<int64_t, kNumMemoryCategories>& start) {
    if (!segment.has_rise) return segment;
    for (int c = 0; c < kNumMemoryCategories; ++c) segment.at_rise[c] -= start[c];
    return segment;
  }
  // NoteRiseIn: `segment` (started at `start_total` bytes) with a moment of `live` bytes.
  void NoteRiseIn(SegmentSummary& segment, int64_t start_total,
                  const std::array<int64_t, kNumMemoryCategories>& live, int64_t total) const {
    const int64_t rise = total - start_total;
    if (segment.has_rise && rise <= segment.rise) return;
    segment.has_rise = true;
    segment.rise = rise;
    segment.at_rise = live;  // made relative to `start` when the stretch closes (Closed)
    segment.phase = phase_;
    segment.where = where_;
  }

 private:
  StepTimeline* out_;
  bool record_;
  bool cuda_;
  int64_t cublas_workspace_bytes_;
  bool on_host_ = false;
  std::optional<CudaAllocatorSim> allocator_;  // on CUDA, with CudaBlocks::kAllocator
  struct Input {
    int block = -1;
    int64_t bytes = 0;
  };
  std::deque<Input> inputs_;  // on CUDA the inputs' blocks or requests, for Adopt
  // The storages by id: the first count_ of storages_ (its size is their room, kept
  // from the thread's last step: SparedStorages).
  std::vector<Storage> storages_;
  size_t count_ = 0;
  std::array<int64_t, kNumMemoryCategories> live_{};
  int64_t total_ = 0;
  bool overflow_ = false;
  StepPhase phase_ = StepPhase::kForward;
  const OptimizerSpec& optimizer_;
  Where where_;
  std::optional<Where> labelled_;    // the last label recorded
  std::optional<Where> peak_where_;
  int64_t event_count_ = 0;
  SegmentSummary segment_;
  std::array<int64_t, kNumMemoryCategories> segment_start_{};
  int64_t segment_start_total_ = 0;
  std::vector<TapeStretch>* tape_ = nullptr;
  TapeStretch tag_;  // the open stretch's kind
  // The shadow pass (BeginShadow): its live bytes, its open stretch, its stretches.
  bool shadowing_ = false;
  bool skip_shadow_ = false;  // the event under way is the first micro-batch's alone
  std::array<int64_t, kNumMemoryCategories> shadow_live_{};
  int64_t shadow_total_ = 0;
  SegmentSummary shadow_segment_;
  std::array<int64_t, kNumMemoryCategories> shadow_start_{};
  int64_t shadow_start_total_ = 0;
  std::vector<TapeStretch> shadow_tape_;
};

}  // namespace memledger::liveness_internal

#endif  // ESTIMATOR_STEP_STEP_LEDGER_H_
