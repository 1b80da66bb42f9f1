// The step simulation of a pipeline rank: its steps in order (estimator/step/
// pipeline_steps.h) and the passes it copies rather than replays, from an earlier
// micro-batch or from another stage whose chunk has the same shape.
#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <utility>
#include <vector>

#include "estimator/step/simulation.h"

namespace memledger::liveness_internal {

// PipelineSchedule executes a pipeline rank's steps (estimator/step/pipeline_steps.h): each
// chunk's forwards and backwards in order, and the point-to-point operations between
// them: receives allocate their buffers (input, then output gradient); then what was
// sent is freed (the last forward's output; the last backward's input gradient and the
// received input it belongs to).
absl::Status Simulation::PipelineSchedule(const ModelPlans& plans,
                                          const std::vector<PipelineStep>& steps,
                                          const std::vector<int>& inputs) {
  const size_t chunks = chunks_.size();
  std::vector<std::deque<Handle>> received(chunks), output_grads(chunks);
  std::vector<std::deque<InFlight>> in_flight(chunks);
  std::vector<size_t> forwards(chunks, 0), backwards(chunks, 0);
  // On a model chunk every micro-batch's forward repeats the first's stretch for
  // stretch, and every backward after the first the second's (Run's `simulated` rests on
  // the same fact), which the first backward's shadow pass gives (Memory::BeginShadow):
  // where the step's peak is composed from the tape, only the first micro-batch is
  // replayed and the rest copied. On the head's chunk the first loss stays and the
  // others' are added into it and freed: the shadow frees it too (Memory::ShadowFrees).
  const bool copies = tape_ != nullptr && !memory_.allocator() && !options_.record_events;
  std::vector<ModelPlans::ChunkPasses> own(chunks);  // this rank's, as replayed
  // The passes are shared with later stages whose chunks have the same shape
  // (ModelPlans::chunk_passes): a rank all of whose chunks an earlier stage replayed
  // copies every pass; otherwise it replays them and offers its own.
  std::vector<std::optional<ModelPlans::ChunkShape>> shapes(chunks);
  std::vector<std::shared_ptr<const ModelPlans::ChunkPasses>> donated(chunks);
  bool all_donated = copies;
  if (copies) {
    std::lock_guard<std::mutex> lock(plans.passes_mutex);
    for (size_t c = 0; c < chunks; ++c) {
      shapes[c] = ShapeOf(c);
      for (const auto& passes : plans.chunk_passes) {
        if (shapes[c].has_value() && passes->shape == *shapes[c]) donated[c] = passes;
      }
      all_donated = all_donated && donated[c] != nullptr;
    }
  }
  if (!all_donated) donated.assign(chunks, nullptr);
  Handle last_output, last_input_grad, last_received;
  auto receive = [&]() {
    Handle h = hidden_;
    h.storage = memory_.Alloc(NumelOf(h.layout) * ElementSizeBytes(h.dtype),
                              MemoryCategory::kTemporary);
    return h;
  };
  auto free = [&](Handle& h) {
    if (h.defined()) memory_.Unref(h.storage);
    h = Handle();
  };
  memory_.SetPhase(StepPhase::kForward);
  for (const PipelineStep& step : steps) {
    switch (step.kind) {
      case PipelineStep::Kind::kForward: {
        InFlight f;
        f.range = chunks_[step.chunk];
        const size_t j = forwards[step.chunk]++;
        if (j >= inputs.size()) {
          return absl::InternalError("a pipeline step past the micro-batches");
        }
        f.input_id = inputs[j];
        if (!f.range.prologue) {
          if (received[step.chunk].empty()) {
            return absl::InternalError("a pipeline forward without its received input");
          }
          f.received = received[step.chunk].front();
          received[step.chunk].pop_front();
        }
        if (donated[step.chunk] != nullptr) {
          f.repeated = true;
          f.output = Repeat(donated[step.chunk]->forward, f.range.first_layer);
        } else if (copies && j >= 1) {
          f.repeated = true;
          f.output = Repeat(own[step.chunk].forward);
        } else {
          if (absl::Status s = CapturedForward(plans, f, copies, &own[step.chunk].forward);
              !s.ok()) {
            return s;
          }
        }
        last_output = f.output;
        f.output = Handle();
        in_flight[step.chunk].push_back(std::move(f));
        break;
      }
      case PipelineStep::Kind::kBackward: {
        if (in_flight[step.chunk].empty()) {
          return absl::InternalError("a pipeline backward before its forward");
        }
        InFlight& f = in_flight[step.chunk].front();
        std::optional<Handle> output_grad;
        if (!f.range.head) {
          if (output_grads[step.chunk].empty()) {
            return absl::InternalError("a pipeline backward without its output's gradient");
          }
          output_grad = output_grads[step.chunk].front();
          output_grads[step.chunk].pop_front();
        }
        const size_t j = backwards[step.chunk]++;
        if (f.repeated) {
          // The backward it repeats freed its output's gradient.
          if (output_grad.has_value()) memory_.Forget(output_grad->storage);
          const ModelPlans::ChunkPasses* passes =
              donated[step.chunk] != nullptr ? donated[step.chunk].get() : &own[step.chunk];
          const int64_t shift = donated[step.chunk] != nullptr ? f.range.first_layer : 0;
          f.input_grad = Repeat(passes->backward[std::min<size_t>(j, 1)], shift);
        } else {
          // The first micro-batch's (a later one's forward was copied): its shadow pass is
          // the second's. Under DDP the chunk's last backward syncs (Run replays no copies
          // then).
          data_parallel_->LastBackward(j + 1 == inputs.size());
          if (absl::Status s = CapturedBackward(plans, f, output_grad, copies,
                                                &own[step.chunk].backward);
              !s.ok()) {
            return s;
          }
          data_parallel_->LastBackward(false);
        }
        last_input_grad = f.input_grad;
        last_received = f.received;
        in_flight[step.chunk].pop_front();
        break;
      }
      case PipelineStep::Kind::kCommunicate:
        memory_.SetOp(Special(Where::kHead, Where::Activity::kPointToPoint));
        if (step.receive_input >= 0) received[step.receive_input].push_back(receive());
        if (step.receive_output_grad >= 0) {
          output_grads[step.receive_output_grad].push_back(receive());
        }
        if (step.send_output) free(last_output);
        if (step.send_input_grad) {
          free(last_input_grad);
          free(last_received);
        }
        break;
    }
  }
  for (size_t c = 0; c < chunks; ++c) {
    // Offered once the first micro-batch's backward (and with it its shadow) has run.
    if (!shapes[c].has_value() || donated[c] != nullptr || backwards[c] < 1) continue;
    auto passes = std::make_shared<ModelPlans::ChunkPasses>();
    passes->shape = *shapes[c];
    const int64_t first_layer = chunks_[c].first_layer;
    passes->forward = Shifted(std::move(own[c].forward), -first_layer);
    for (size_t j = 0; j < 2; ++j) {
      passes->backward[j] = Shifted(std::move(own[c].backward[j]), -first_layer);
    }
    std::lock_guard<std::mutex> lock(plans.passes_mutex);
    bool known = false;
    for (const auto& other : plans.chunk_passes) known = known || other->shape == passes->shape;
    if (!known) plans.chunk_passes.push_back(std::move(passes));
  }
  return absl::OkStatus();
}

std::optional<ModelPlans::ChunkShape> Simulation::ShapeOf(size_t c) const {
  const StageRange& chunk = chunks_[c];
  // The embedding's and the head's chunks are one stage's each; a plan's layers differ.
  if (chunk.prologue || chunk.head || variant_.kind == VariantKind::kPlan) return std::nullopt;
  // What the passes depend on of the rank's data-parallel program (ZeRO-3's shard).
  const std::optional<int64_t> shard = data_parallel_->ChunkShard(chunks_.size());
  if (!shard.has_value()) return std::nullopt;
  const bool every_k = variant_.kind == VariantKind::kEveryK;
  const int64_t every = every_k ? std::max<int64_t>(1, variant_.every) : 1;
  const int64_t period = std::lcm(every, graphs_->Period());
  ModelPlans::ChunkShape shape;
  shape.variant = variant_.kind;
  shape.every = every_k ? variant_.every : 0;
  shape.policy = variant_.kind == VariantKind::kSelective ? variant_.policy : SavePolicy();
  shape.optimizer = optimizer_;
  shape.layers = model_chunks_.empty() ? chunk.layers : model_chunks_[c].layers;
  shape.short_layers = chunk.layers;
  shape.phase = chunk.first_layer % period;
  shape.shard_elements = *shard;
  return shape;
}

RepeatedPass Simulation::Shifted(RepeatedPass pass, int64_t by) {
  for (TapeStretch& s : pass.stretches) {
    if (s.layer >= 0) s.layer += by;
    if (s.summary.where.segment >= 0) s.summary.where.segment += by;
  }
  return pass;
}

absl::Status Simulation::CapturedForward(const ModelPlans& plans, InFlight& f, bool capture,
                                         RepeatedPass* pass) {
  const size_t begin = BeginCapture(capture);
  if (absl::Status s = ForwardPass(plans, f); !s.ok()) return s;
  if (capture) *pass = Capture(begin, f.output);
  return absl::OkStatus();
}

absl::Status Simulation::CapturedBackward(const ModelPlans& plans, InFlight& f,
                                          std::optional<Handle> output_grad, bool capture,
                                          std::array<RepeatedPass, 2>* passes) {
  const size_t begin = BeginCapture(capture);
  if (capture) memory_.BeginShadow();
  if (absl::Status s = BackwardPass(plans, f, output_grad); !s.ok()) return s;
  if (!capture) return absl::OkStatus();
  (*passes)[0] = Capture(begin, f.input_grad);
  (*passes)[1] = (*passes)[0];
  (*passes)[1].stretches = memory_.EndShadow();
  return absl::OkStatus();
}

size_t Simulation::BeginCapture(bool capture) {
  if (!capture) return 0;
  memory_.BeginSegment();  // ends what was open: the pass's stretches come next
  return memory_.tape_size();
}

RepeatedPass Simulation::Capture(size_t begin, const Handle& handle) {
  memory_.BeginSegment();  // ends the pass's last stretch
  RepeatedPass pass;
  pass.stretches.assign(tape_->begin() + static_cast<std::ptrdiff_t>(begin), tape_->end());
  pass.handle = handle;
  if (handle.defined()) {
    pass.bytes = memory_.bytes(handle.storage);
    pass.category = memory_.category(handle.storage);
  }
  return pass;
}

Handle Simulation::Repeat(const RepeatedPass& pass, int64_t shift) {
  std::vector<TapeStretch> stretches =
      shift != 0 ? Shifted(pass, shift).stretches : pass.stretches;
  std::map<int64_t, int64_t> renumbered;  // each of its passes a new one, in order
  for (TapeStretch& s : stretches) {
    if (s.pass < 0) continue;
    auto [it, added] = renumbered.emplace(s.pass, passes_);
    if (added) ++passes_;
    s.pass = it->second;
  }
  memory_.Replay(stretches);
  Handle handle = pass.handle;
  if (handle.defined()) handle.storage = memory_.Adopt(pass.bytes, pass.category);
  return handle;
}

}  // namespace memledger::liveness_internal
