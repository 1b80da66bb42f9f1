// Segment plans (internal to estimator/step/liveness): one segment graph (a layer, the
// prologue, the head) walked for one config, with what the step simulation's replay
// needs: each op's storages read, each storage's last forward use, what each backward
// node releases, and which ops return their input itself.
//
// Example:
//   absl::StatusOr<std::unique_ptr<SegmentPlan>> plan =
//       MakePlan(graphs->Layer(0), config, /*input_requires_grad=*/true, /*rules=*/nullptr);
#ifndef ESTIMATOR_STEP_SEGMENT_PLAN_H_
#define ESTIMATOR_STEP_SEGMENT_PLAN_H_

#include <array>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "estimator/graph/block_graph.h"
#include "estimator/graph/family.h"
#include "estimator/spec/config.h"
#include "estimator/graph/rules.h"
#include "estimator/saved/walker.h"
#include "estimator/step/op_steps.h"
#include "estimator/step/step_ledger.h"

namespace memledger::liveness_internal {

// SegmentStructure is what the replay needs of a segment beyond its sizes: each op's
// storages read, each storage's last forward use, what each backward node releases, and
// which ops return their input itself. It follows from the graph, the pinned rules, and
// the walk's storages (which tensors share one, which require grad), never from sizes
// alone: configs whose tensors share storages alike share it (MakePlan's memo, as the
// walk's own, estimator/graph/walk_memo.h).
struct SegmentStructure {
  std::vector<std::vector<int>> reads;  // per op: distinct non-parameter storages read
  // frees: per op, the storages it is the last reader of that the forward lets go after
  // it: not the segment's input or output (the caller holds them) nor a model-level
  // tensor.
  std::vector<std::vector<int>> frees;
  std::vector<int> last_use;            // per storage: the last op reading it, -1: none
  // node_keeps: per storage, how many backward nodes keep it (its keepers in the walk
  // but the checkpoint node).
  std::vector<int> node_keeps;
  int input_storage = -1;
  int output_storage = -1;
  // decoder_local: per storage, whether the decoder model's locals hold it past this
  // segment, until the decoder returns (BlockGraph::decoder_locals).
  std::vector<bool> decoder_local;
  // releases: per op, the storages its node's release_variables() lets go, in
  // Functions.h's order (saved inputs by name, then outputs), as the rules keep them.
  std::vector<std::vector<int>> releases;
  // Under a non-reentrant torch.utils.checkpoint every saved tensor goes through its pack
  // hook (checkpoint.py, _checkpoint_hook), except those SavedVariable stores without the
  // hooks (wrapped numbers: saved_variable.cpp, is_wrapped_number()), which the node
  // holds itself. packed_releases and unpacked_releases split `releases` so;
  // unpacked_keeps counts, per storage, its keeps of the second kind.
  std::vector<std::vector<int>> packed_releases;
  std::vector<std::vector<int>> unpacked_releases;
  std::vector<int> unpacked_keeps;
  // node_hold_until: per storage, the op after which the unreachable node of a no_grad
  // op lets it go (BlockGraph::node_held_until), -1: none; node_releases: per op, the
  // storages it so lets go. Only a forward that keeps what the rules say
  // (Pass::Keeps::kAll) holds them.
  std::vector<int> node_hold_until;
  std::vector<std::vector<int>> node_releases;
  // packs: per op, whether its node packs a tensor (a parameter too) into the hook.
  std::vector<bool> packs;
  // packed_tensors: per op with a node, the tensors it packs (parameters and views
  // too), one per SavedVariable in Functions.h's order: under save_on_cpu each is its
  // own host copy, unpacked to a device copy of its own when the node runs.
  std::vector<std::vector<int>> packed_tensors;
  // The recompute's early stop (_StopRecomputationError, raised by the pack that fills
  // the last holder): the last op that packs, and whether its last pack is an output
  // (saved after the kernel ran) or an input (saved before: the kernel never runs).
  int last_pack_op = -1;
  bool last_pack_is_output = false;
  // first_pack_op: the first op that packs; its node is the last in the backward to hold
  // a hook, and the checkpoint's frame dies when it releases its variables.
  int first_pack_op = -1;
  // leaf: a tensor made to require grad by enable_input_require_grads' hook (a hooked
  // prologue's input embeddings, WalkOptions::input_embeddings_hooked), -1: none. The op
  // that makes it has no node; its gradient goes to its AccumulateGrad, which holds it
  // and its .grad until the graph dies.
  int leaf = -1;
  // same_as: for the output of an op that returns its input itself (.to() of the same
  // dtype, contiguous() of a contiguous tensor), that input; -1 otherwise. Such an op
  // makes no backward node: gradients go straight to the input.
  std::vector<int> same_as;
  // split_first: per op, the first part of the split it is a part of (a kSlice with
  // split_part), -1 otherwise; split_parts: under a split's first part, every part in
  // forward order (SplitBackward).
  std::vector<int> split_first;
  std::vector<std::vector<int>> split_parts;
  // composite_ops: by composite call (OpDef::composite), its ops.
  std::vector<std::vector<int>> composite_ops;
  // inert: per op, whether its forward touches no memory in any pass: a view-like op
  // (no temporaries, no workspace) whose outputs are views or parameters, that frees
  // nothing, neither the recompute's stop nor where the decoder returns. Forward skips
  // it.
  std::vector<bool> inert;
  // forward_steps: the ops Forward runs (those not inert), in order, each with its
  // outputs in the order the op makes them (CPU dropout its noise, output 1, first):
  // whether the op makes the output's storage (not a view's, not a parameter's) and
  // whether nothing reads that storage after the op (it dies in the op; the segment's
  // output excepted).
  struct ForwardStep {
    struct Output {
      int tensor = -1;
      int storage = -1;
      bool makes = false;
      bool unread = false;
    };
    int op = 0;
    // An op has at most four outputs: CUDA's fused attention (out, logsumexp, and the
    // philox seed and offset, or flash's rng_state and its unused fourth).
    int n_outputs = 0;
    std::array<Output, 4> outputs{};
  };
  std::vector<ForwardStep> forward_steps;
  // backward_steps: the ops that have a backward node (an output that requires grad,
  // not the input returned as it is), last first: the order the backward visits them.
  // Each names its node (the rules' first) and says who runs it: a split's one node for
  // all its parts (Simulation::SplitBackward), a node that only views its one input's
  // gradient back (a view, reshape, permute, transpose, t or unsqueeze that packs and
  // releases nothing: Simulation::ViewNode), or any other (Simulation::Node).
  struct BackwardStep {
    enum class Kind : uint8_t { kNode, kView, kSplit };
    int op = 0;
    int output = 0;  // the op's output 0, whose gradient reaching it runs the node
    Kind kind = Kind::kNode;
    const char* node = "?";
  };
  std::vector<BackwardStep> backward_steps;
  int parameters = 0;  // the graph's parameters (the step lists them all at once)
};

// SegmentPlan is one segment graph walked for one config, with what the replay needs.
struct SegmentPlan {
  const BlockGraph* graph = nullptr;
  BlockWalk walk;  // with layouts, not checkpointed
  std::shared_ptr<const SegmentStructure> structure;
};

// MakePlan walks `graph` with layouts and derives the plan; Internal for an op with more
// than three inputs (a backward node keeps at most three gradients).
// `layouts`: LayoutBlock(graph, config)'s, if the caller has them (null: made here).
// `input_embeddings_hooked`: a prologue's walk under enable_input_require_grads' hook
// (WalkOptions::input_embeddings_hooked).
absl::StatusOr<std::unique_ptr<SegmentPlan>> MakePlan(const BlockGraph& graph,
                                                      const ValidConfig& config,
                                                      bool input_requires_grad,
                                                      const RuleTable* rules,
                                                      const BlockLayouts* layouts = nullptr,
                                                      bool input_embeddings_hooked = false);

// ModelPlans are a model's segment plans, made once and shared by every variant's
// simulation: the prologue (families), the first layer (whose input needs no gradient in
// the study, or with frozen embeddings), each kind of the other layers and the head.
struct ModelPlans {
  // reductions: a rank's step end (Simulation::RunReduction's stretch), per optimizer
  // and rank (StepSimulator::ForRank shares the plans between a layout's stages), the
  // same for every variant: made once.
  struct Reduction {
    OptimizerSpec optimizer;
    RankStep rank;
    SegmentSummary stretch;
  };
  mutable std::mutex reductions_mutex;
  mutable std::vector<Reduction> reductions;
  // ChunkPasses: a pipeline chunk's passes (tape stretches, layers numbered from the
  // chunk's first): every micro-batch's forward, the first backward and every later one,
  // replayed by the first stage of a layout that runs a chunk of this shape and copied
  // by every later stage whose chunk has the same (Simulation::PipelineSchedule). A
  // pass's stretches depend on what the shape holds, not on the stage: the schedule
  // around it differs.
  struct ChunkShape {
    VariantKind variant = VariantKind::kNone;
    int64_t every = 0;
    SavePolicy policy;
    OptimizerSpec optimizer;
    int64_t layers = 0;        // the real chunk's
    int64_t short_layers = 0;  // replayed
    int64_t phase = 0;  // its first layer mod the period of the layer kinds and every_k
    int64_t shard_elements = 0;  // ZeRO-3: the rank's shard
    friend bool operator==(const ChunkShape&, const ChunkShape&) = default;
  };
  struct ChunkPasses {
    ChunkShape shape;
    RepeatedPass forward;
    std::array<RepeatedPass, 2> backward;  // the first micro-batch's, and a later one's
  };
  mutable std::mutex passes_mutex;
  mutable std::vector<std::shared_ptr<const ChunkPasses>> chunk_passes;
  std::shared_ptr<const ModelGraphs> graphs;
  std::unique_ptr<SegmentPlan> prologue;
  // hooked_prologue: the prologue under enable_input_require_grads' hook, which the
  // variants that checkpoint run (ModelGraphs::HookedPrologueDiffers); null where the
  // hook changes nothing.
  std::unique_ptr<SegmentPlan> hooked_prologue;
  // The model's own tensors' graphs (ModelGraphs::tensors_before_prologue,
  // tensors_after_prologue); null where a graph has no ops.
  std::unique_ptr<SegmentPlan> tensors_before_prologue, tensors_after_prologue;
  // first_without_grad: the first layer's plan where its input needs no gradient (the
  // study's model input; frozen embeddings without the hook); null where it always does.
  std::unique_ptr<SegmentPlan> first_without_grad;
  std::vector<std::unique_ptr<SegmentPlan>> rest;  // by layer kind
  std::unique_ptr<SegmentPlan> head;
  // Prologue and First: the prologue's and the first layer's plans for a variant that
  // checkpoints (`checkpointing`: Variant::CheckpointsAnyLayer) or not.
  const SegmentPlan* Prologue(bool checkpointing) const {
    return checkpointing && hooked_prologue != nullptr ? hooked_prologue.get() : prologue.get();
  }
  const SegmentPlan* First(bool checkpointing) const {
    return graphs->FirstInputRequiresGrad(checkpointing) ? rest[graphs->KindOf(0)].get()
                                                         : first_without_grad.get();
  }
};

}  // namespace memledger::liveness_internal

#endif  // ESTIMATOR_STEP_SEGMENT_PLAN_H_
