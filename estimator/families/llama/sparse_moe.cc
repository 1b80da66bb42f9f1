#include "estimator/families/llama/sparse_moe.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace memledger {
namespace {

// Router is Qwen3MoeTopKRouter.forward / MixtralTopKRouter.forward on the (N, d) hidden
// states: router_logits = F.linear(h, weight), an fp32 softmax, topk, the top weights
// renormalised in place (Mixtral always, Qwen3-MoE with norm_topk_prob) and, for Qwen3-MoE,
// cast back to the logits' dtype.
struct RouterOut {
  int logits, scores, indices;
};
RouterOut Router(GraphBuilder& g, const ModelConfig& config, int flat, int weight) {
  const MoeSpec& moe = config.moe;
  // hidden_states.reshape(-1, hidden_dim): a view. F.linear of a 2-D input without bias is
  // mm(h, weight.t()); autocast casts the weight, then the input.
  int h = g.Op1(OpType::kReshape, "gate.flatten", {flat}, {.shape = {kB * kT, kD}});
  weight = g.Lower("gate.weight", weight);
  h = g.Lower("gate.input", h);
  const int weight_t = g.Op1(OpType::kT, "gate.weight_t", {weight});
  const int logits = g.Op1(OpType::kMm, "gate", {h, weight_t}, {}, OpKind::kMatmul);
  // softmax(logits, dtype=torch.float) / softmax(logits.float()): the same fp32 copy
  // (none for fp32 logits), then _softmax.
  const int logits32 = g.ToDtype("gate.logits_float", logits, DType::kFloat32);
  const int probs = g.Op1(OpType::kSoftmax, "gate.softmax", {logits32});
  const std::vector<int> top =
      g.Op(OpType::kTopK, "gate.topk", {probs}, {"values", "indices"}, {.length = kK});
  g.SetDType(top[1], DType::kInt64);
  int values = top[0];
  if (moe.block == MoeBlock::kMixtral || moe.norm_topk_prob) {
    // router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    const int sum = g.Op1(OpType::kSumDim, "gate.topk_sum", {values}, {.dim = 1, .keepdim = true});
    values = g.Op(OpType::kDivInplace, "gate.renormalise", {values, sum}, {"out", "self_clone"})[0];
  }
  // Qwen3-MoE: router_top_value.to(router_logits.dtype); Mixtral keeps fp32 scores.
  const int scores = moe.block == MoeBlock::kQwen3Moe
                         ? g.ToDtype("gate.scores", values, g.DTypeOf(logits))
                         : values;
  return {logits, scores, top[1]};
}

// ExpertsRows is what an experts module runs on: N tokens, each routed to k of its
// `experts` experts. Without expert parallelism the model's B x T tokens, k and E; with
// it the R rows a rank received, top-1, over its E / ep experts (`expert_parallel`:
// MoEParamShard sets the module's _is_expert_parallel).
struct ExpertsRows {
  SymDim tokens = kB * kT;
  SymDim top_k = kK;
  SymDim experts = kE;
  bool expert_parallel = false;
};

// GroupedMmExperts is integrations/moe.py's grouped_mm_experts_forward on the (N, d)
// hidden states, for the S = N x k (token, expert) pairs: sorted by expert, gathered,
// gate_up and down through torch._grouped_mm (run in the weights' dtype, outside
// autocast's lists), weighted, unsorted and summed per token. Every size is the
// routing's total, never one expert's. An expert-parallel module masks its sentinel
// rows (ids >= num_experts) before and after each grouped_mm.
int GroupedMmExperts(GraphBuilder& g, int flat, const RouterOut& r, int gate_up, int down,
                     const ExpertsRows& rows = {}) {
  const SymDim pairs = rows.tokens * rows.top_k;
  const int sample_weights = g.Op1(OpType::kReshape, "experts.sample_weights", {r.scores},
                                   {.shape = {pairs}});
  const int expert_ids = g.Op1(OpType::kReshape, "experts.expert_ids", {r.indices},
                               {.shape = {pairs}});
  const std::vector<int> sorted =
      g.Op(OpType::kSort, "experts.sort", {expert_ids}, {"values", "indices"});
  const int ids_sorted = sorted[0], perm = sorted[1];
  // hidden_states[perm // num_top_k]: the quotient is a temporary the index keeps.
  const int token_of_pair = g.Op1(OpType::kFloorDivide, "experts.token_of_pair", {perm});
  int gathered = g.Op1(OpType::kIndexRows, "experts.gather", {flat, token_of_pair});
  const int weights_sorted =
      g.Op1(OpType::kIndexRows, "experts.gather_weights", {sample_weights, perm});
  // histc of the sorted ids as floats on the CPU, as int32 on CUDA (`expert_ids_g.float()
  // if device.type in ("cpu", "mps") else expert_ids_g.int()`), cumsum to int32 offsets
  // (the CPU's histc converted first: CumsumInt32).
  const int histc_input = g.ToDtype("experts.histc_input", ids_sorted,
                                    g.Cuda() ? DType::kInt32 : DType::kFloat32);
  const int per_expert = g.Op1(OpType::kHistc, "experts.tokens_per_expert", {histc_input},
                               {.shape = {rows.experts}});
  const int offsets = g.Op1(OpType::kCumsum, "experts.offsets", {per_expert}, {}, std::nullopt,
                            DType::kInt32);
  // With expert parallelism: sentinel_mask = (expert_ids_g >= num_experts).unsqueeze(-1);
  // expert_ids_g.clamp_(max=...) works in place on the integer ids (nothing allocated,
  // no graph op); selected_hidden_states_g.masked_fill_(sentinel_mask, 0.0), in place.
  int sentinel = -1;
  if (rows.expert_parallel) {
    const int ge = g.Op1(OpType::kGeScalar, "experts.sentinel", {ids_sorted}, {}, std::nullopt,
                         DType::kBool);
    sentinel = g.Op1(OpType::kUnsqueeze, "experts.sentinel_mask", {ge}, {.dim = 1});
    gathered = g.Op1(OpType::kMaskedFillInplace, "experts.premask", {gathered, sentinel});
  }
  // proj_out = proj_out.masked_fill(sentinel_mask, 0.0) after each grouped_mm: a new
  // tensor, the grouped_mm's output dying with the rebinding.
  auto postmask = [&](const std::string& name, int out) {
    return sentinel < 0 ? out : g.Op1(OpType::kMaskedFill, name, {out, sentinel});
  };
  // _grouped_linear(x, weight, offs): _grouped_mm(x.to(weight.dtype), weight.transpose(-2,
  // -1), offs); the .to() is x itself in the weights' dtype.
  auto grouped_linear = [&](const std::string& name, int x, int weight) {
    x = g.ToDtype(name + ".input", x, g.DTypeOf(weight));
    const int weight_t = g.Op1(OpType::kTranspose, name + ".weight_t", {weight},
                               {.dim = 1, .dim1 = 2});
    return g.Op1(OpType::kGroupedMm, name, {x, weight_t, offsets});
  };
  const int gate_up_out =
      postmask("experts.gate_up_mask", grouped_linear("experts.gate_up", gathered, gate_up));
  // _default_apply_gate: gate, up = chunk(2, dim=-1); act_fn(gate) * up.
  const int gate = g.Op1(OpType::kSlice, "experts.gate", {gate_up_out},
                         {.dim = 1, .start = Sym(0), .length = kFe, .split_part = true});
  const int up = g.Op1(OpType::kSlice, "experts.up", {gate_up_out},
                       {.dim = 1, .start = kFe, .length = kFe, .split_part = true});
  const int act = g.Op1(OpType::kSilu, "experts.act_fn", {gate}, {}, OpKind::kSilu);
  const int product = g.Op1(OpType::kMulTensor, "experts.mul", {act, up});
  const int down_out =
      postmask("experts.down_mask", grouped_linear("experts.down", product, down));
  const int weights_column =
      g.Op1(OpType::kUnsqueeze, "experts.weights_column", {weights_sorted}, {.dim = 1});
  const int weighted = g.Op1(OpType::kMulTensor, "experts.weighted", {down_out, weights_column});
  const int inverse = g.Op1(OpType::kInversePermutation, "experts.inverse_perm", {perm});
  const int unsorted = g.Op1(OpType::kIndexRows, "experts.unsort", {weighted, inverse});
  const int per_token = g.Op1(OpType::kView, "experts.per_token", {unsorted},
                              {.shape = {rows.tokens, rows.top_k, kD}});
  const int summed = g.Op1(OpType::kSumDim, "experts.sum", {per_token}, {.dim = 1});
  const int out = g.ToDtype("experts.out", summed, g.DTypeOf(flat));
  // The function's locals, to its return: expert_ids_g, perm, selected_hidden_states_g,
  // sample_weights_g, histc_input, tokens_per_expert, offsets, proj_out (down's output),
  // weighted_out (rebound to the unsorted rows), inv_perm, final_hidden_states.
  g.HeldThroughHere({ids_sorted, perm, gathered, weights_sorted, histc_input, per_expert,
                     offsets, down_out, unsorted, inverse, summed});
  if (sentinel >= 0) g.HeldThroughHere({sentinel});
  return out;
}

// Linear2D is nn.functional.linear of a 2-D input without bias: mm(x, weight.t()), the
// weight cast first under autocast.
int Linear2D(GraphBuilder& g, const std::string& name, int x, int weight) {
  weight = g.Lower(name + ".weight", weight);
  x = g.Lower(name + ".input", x);
  const int weight_t = g.Op1(OpType::kT, name + ".weight_t", {weight});
  return g.Op1(OpType::kMm, name, {x, weight_t}, {}, OpKind::kMatmul);
}

// EagerExperts is the experts class's own forward (Qwen3MoeExperts.forward,
// MixtralExperts.forward in transformers 5.23) on the (N, d) hidden states: zeros for
// the result; under no_grad the (N, k, E + 1) one-hot expert mask, permuted, and the
// experts hit; then for each expert hit, in id order, with `load[e]` tokens: its
// (token, slot) pairs (torch.where), its tokens gathered, its own slices of the 3-D
// weights (select views) through two linears, the gate, its routing weights gathered,
// and index_add_ into the result. Every expert's tensors have its share of the routing.
// `load` has one count per expert the module holds (num_experts).
int EagerExperts(GraphBuilder& g, int flat, const RouterOut& r, int gate_up, int down,
                 const std::vector<int64_t>& load) {
  int64_t hit = 0;
  for (int64_t n : load) hit += n > 0;
  int result = g.Op1(OpType::kZerosLike, "experts.final_hidden_states", {flat});
  const int mask = g.Op1(OpType::kOneHot, "experts.expert_mask", {r.indices});
  const int mask_t = g.Op1(OpType::kPermute, "experts.expert_mask_t", {mask},
                           {.permutation = {2, 1, 0}});
  const int hits = g.Op1(OpType::kExpertHits, "experts.expert_hit", {mask_t},
                         {.shape = {Sym(hit), Sym(1)}});
  // top_k_weights[token_idx, top_k_pos, None] unsqueezes first, once per expert.
  int weighted_before = -1;  // current_hidden_states of the expert before, to its rebinding
  for (int64_t e = 0; e < static_cast<int64_t>(load.size()); ++e) {
    const int64_t n = load[static_cast<size_t>(e)];
    if (n == 0) continue;
    const std::string p = absl::StrCat("experts.", e);
    // if expert_idx == self.num_experts: continue (the padding class).
    g.Op(OpType::kEqScalar, p + ".is_padding", {hits}, {"out"}, {}, std::nullopt, DType::kBool);
    const int rows = g.Op1(OpType::kSelect, p + ".mask", {mask_t}, {.dim = 0, .index = e});
    const int pairs =
        g.Op1(OpType::kNonzero, p + ".where", {rows}, {.shape = {Sym(n), Sym(2)}});
    const int top_k_pos = g.Op1(OpType::kSelect, p + ".top_k_pos", {pairs}, {.dim = 1, .index = 0});
    const int token_idx = g.Op1(OpType::kSelect, p + ".token_idx", {pairs}, {.dim = 1, .index = 1});
    const int current = g.Op1(OpType::kIndexRows, p + ".current_state", {flat, token_idx});
    const int gate_up_e =
        g.Op1(OpType::kSelect, p + ".gate_up_proj", {gate_up}, {.dim = 0, .index = e});
    const int gate_up_out = Linear2D(g, p + ".gate_up", current, gate_up_e);
    const int gate = g.Op1(OpType::kSlice, p + ".gate", {gate_up_out},
                           {.dim = 1, .start = Sym(0), .length = kFe, .split_part = true});
    const int up = g.Op1(OpType::kSlice, p + ".up", {gate_up_out},
                         {.dim = 1, .start = kFe, .length = kFe, .split_part = true});
    const int act = g.Op1(OpType::kSilu, p + ".act_fn", {gate}, {}, OpKind::kSilu);
    const int product = g.Op1(OpType::kMulTensor, p + ".mul", {act, up});
    // current_hidden_states = act_fn(gate) * up rebinds the last expert's weighted rows.
    if (weighted_before >= 0) g.HeldThroughHere({weighted_before});
    const int down_e = g.Op1(OpType::kSelect, p + ".down_proj", {down}, {.dim = 0, .index = e});
    const int down_out = Linear2D(g, p + ".down", product, down_e);
    const int weights3 = g.Op1(OpType::kUnsqueeze, p + ".weights_3d", {r.scores}, {.dim = 2});
    const int weights = g.Op1(OpType::kIndexPair, p + ".weights", {weights3, token_idx, top_k_pos});
    const int weighted = g.Op1(OpType::kMulTensor, p + ".weighted", {down_out, weights});
    const int source = g.ToDtype(p + ".source", weighted, g.DTypeOf(result));
    result = g.Op1(OpType::kIndexAddInplace, p + ".index_add", {result, token_idx, source});
    weighted_before = weighted;
  }
  // The forward's locals, to its return: expert_mask, expert_hit, the last expert's
  // current_hidden_states.
  g.HeldThroughHere({mask, hits});
  if (weighted_before >= 0) g.HeldThroughHere({weighted_before});
  return result;
}

// AllToAllEp is transformers 5.23's expert-parallel experts module in training
// (distributed/expert_parallel.py: EpDispatchExpertsParallel's ep_forward, AutoEP picking
// AllToAllEP whenever the hidden states require grad) on the (N, d) hidden states, without
// tensor parallelism. `received` is the tokens each of this rank's experts gets from
// every rank (ModelConfig::ReceivedLoad), R of them in all; S = N x k pairs are sent.
int AllToAllEp(GraphBuilder& g, const ModelConfig& config, int flat, const RouterOut& r,
               int gate_up, int down, const std::vector<int64_t>& received) {
  const MoeSpec& moe = config.moe;
  int64_t rows = 0;
  for (int64_t n : received) rows += n;
  const SymDim pairs = kB * kT * kK;
  // _dispatch_tokens: expert_ids = top_k_index.reshape(-1); order = argsort(expert_ids),
  // which is sort's indices (Sorting.cpp), its values dying with the call.
  const int expert_ids = g.Op1(OpType::kReshape, "ep.expert_ids", {r.indices}, {.shape = {pairs}});
  const int order = g.Op(OpType::kSort, "ep.argsort", {expert_ids}, {"values", "indices"})[1];
  // send_tokens = hidden_states[order // num_top_k]: the quotient is the index's saved
  // indices.
  const int token_of_pair = g.Op1(OpType::kFloorDivide, "ep.token_of_pair", {order});
  const int send_tokens = g.Op1(OpType::kIndexRows, "ep.send_tokens", {flat, token_of_pair});
  // send_counts = zeros(E, long).scatter_add_(0, expert_ids, ones_like(expert_ids)), viewed
  // (ep, E / ep); recv_counts = empty_like(send_counts), filled in place by c10d's
  // all_to_all_single (Gloo writes into it: no ATen allocation).
  int send_counts = g.Op1(OpType::kZeros, "ep.send_counts", {}, {.shape = {kE}}, std::nullopt,
                          DType::kInt64);
  const int ones = g.Op1(OpType::kOnesLike, "ep.ones", {expert_ids});
  send_counts = g.Op1(OpType::kScatterAddInplace, "ep.count", {send_counts, expert_ids, ones});
  const int recv_counts = g.Op1(OpType::kZerosLike, "ep.recv_counts", {send_counts});
  // torch.stack([send_counts.sum(dim=1), recv_counts.sum(dim=1)]).tolist(): two (ep)
  // sums and their (2, ep) stack, read back to the host and freed.
  const SymDim ranks = Sym(config.shard.ep);
  const int send_grid = g.Op1(OpType::kView, "ep.send_grid", {send_counts},
                              {.shape = {ranks, kEl}});
  const int recv_grid = g.Op1(OpType::kView, "ep.recv_grid", {recv_counts},
                              {.shape = {ranks, kEl}});
  const int send_sizes = g.Op1(OpType::kSumDim, "ep.send_sizes", {send_grid}, {.dim = 1});
  const int recv_sizes = g.Op1(OpType::kSumDim, "ep.recv_sizes", {recv_grid}, {.dim = 1});
  g.Op1(OpType::kStack, "ep.split_sizes", {send_sizes, recv_sizes}, {.shape = {Sym(2), ranks}});
  // recv_tokens = all_to_all_single_autograd(send_tokens, recv_sizes, send_sizes): a new
  // (R, d) tensor (_c10d_functional.all_to_all_single); _WaitTensor returns it as is.
  const int recv_tokens = g.Op1(OpType::kAllToAll, "ep.dispatch", {send_tokens},
                                {.shape = {Sym(rows), kD}});
  // recv_expert_ids = arange(E / ep).repeat(ep).repeat_interleave(recv_counts.reshape(-1),
  // output_size=R).unsqueeze(-1); recv_weights = ones_like(it, dtype=recv_tokens.dtype).
  const int local_ids = g.Op1(OpType::kArange, "ep.local_ids", {}, {.shape = {kEl}},
                              std::nullopt, DType::kInt64);
  const int repeated = g.Op1(OpType::kRepeat, "ep.local_ids_repeat", {local_ids},
                             {.shape = {kE}});
  const int per_row = g.Op1(OpType::kRepeatInterleave, "ep.recv_expert_ids",
                            {repeated, recv_counts}, {.shape = {Sym(rows)}});
  const int recv_ids =
      g.Op1(OpType::kUnsqueeze, "ep.recv_expert_ids_column", {per_row}, {.dim = 1});
  const int recv_weights = g.Op1(OpType::kOnesLike, "ep.recv_weights", {recv_ids}, {},
                                 std::nullopt, g.DTypeOf(recv_tokens));
  // _dispatch_tokens' locals die at its return: send_tokens (all_to_all keeps nothing)
  // and the counts.
  g.HeldThroughHere({send_tokens, send_counts, recv_counts});
  // The experts run top-1 on the received rows with unit weights (their own forward,
  // num_experts = E / ep). A rank that received none runs them on one fake row, kept
  // in the graph so that the reverse exchange still runs: tokens.sum(dim=0,
  // keepdim=True) routed to its expert 0 with weight 1 (expert_ids.new_zeros((1, 1)),
  // weights.new_ones((1, 1)): new_ones allocates as zeros does), the output sliced [:0].
  int experts_in = recv_tokens;
  RouterOut local{-1, recv_weights, recv_ids};
  std::vector<int64_t> load = received;
  int64_t run_rows = rows;
  if (rows == 0) {
    experts_in = g.Op1(OpType::kSumDim, "ep.fake_row", {recv_tokens}, {.dim = 0, .keepdim = true});
    local.indices = g.Op1(OpType::kZeros, "ep.fake_id", {}, {.shape = {Sym(1), Sym(1)}},
                          std::nullopt, DType::kInt64);
    local.scores = g.Op1(OpType::kZeros, "ep.fake_weight", {}, {.shape = {Sym(1), Sym(1)}},
                         std::nullopt, g.DTypeOf(recv_tokens));
    load.assign(load.size(), 0);
    load[0] = 1;
    run_rows = 1;
  }
  int expert_output =
      moe.impl == ExpertsImpl::kEager
          ? EagerExperts(g, experts_in, local, gate_up, down, load)
          : GroupedMmExperts(g, experts_in, local, gate_up, down,
                             {Sym(run_rows), Sym(1), kEl, /*expert_parallel=*/true});
  if (rows == 0) {
    expert_output = g.Op1(OpType::kSlice, "ep.no_rows", {expert_output},
                          {.dim = 0, .start = Sym(0), .length = Sym(0)});
  }
  // _combine_tokens: recv_out = all_to_all_single_autograd(expert_output, send_sizes,
  // recv_sizes), (S, d); token_outputs = empty_like(recv_out); token_outputs[order] =
  // recv_out (index_put_, IndexPutBackward0 keeping order); viewed (N, k, d), times the
  // routing weights, summed over k.
  const int recv_out = g.Op1(OpType::kAllToAll, "ep.combine", {expert_output},
                             {.shape = {pairs, kD}});
  int token_outputs = g.Op1(OpType::kZerosLike, "ep.token_outputs", {recv_out});
  token_outputs = g.Op1(OpType::kIndexPutInplace, "ep.unsort", {token_outputs, order, recv_out});
  const int per_token = g.Op1(OpType::kView, "ep.per_token", {token_outputs},
                              {.shape = {kB * kT, kK, kD}});
  const int weights = g.Op1(OpType::kUnsqueeze, "ep.weights", {r.scores}, {.dim = 2});
  const int weighted = g.Op1(OpType::kMulTensor, "ep.weighted", {per_token, weights});
  const int summed = g.Op1(OpType::kSumDim, "ep.sum", {weighted}, {.dim = 1});
  // _combine_tokens' locals, to its return: recv_out and token_outputs.
  g.HeldThroughHere({recv_out, token_outputs});
  // ep_forward: output.to(hidden_states.dtype).
  const int out = g.ToDtype("ep.out", summed, g.DTypeOf(flat));
  // AllToAllEP.__call__'s locals, to its return: the received rows, ids and weights,
  // the state (order) and the experts' output.
  g.HeldThroughHere({recv_tokens, per_row, recv_weights, order, expert_output});
  return out;
}

}  // namespace

std::vector<std::string> SparseMoeRegistration(const ModelConfig& config) {
  // Qwen3MoeSparseMoeBlock.__init__ registers experts, then gate; MixtralSparseMoeBlock
  // gate, then experts.
  if (config.moe.block == MoeBlock::kMixtral) {
    return {"gate", "experts.gate_up_proj", "experts.down_proj"};
  }
  return {"experts.gate_up_proj", "experts.down_proj", "gate"};
}

int SparseMoeBlock(GraphBuilder& g, const ModelConfig& config, int x,
                   const std::vector<int64_t>& load) {
  // The experts' 3-D parameters (E, 2 F_e, d) and (E, d, F_e), and the router's (E, d).
  // An expert-parallel rank holds E / ep of the experts (MoEParamShard's Shard(0)).
  const bool sharded = config.shard.ep > 1;
  auto expert_param = [&](const std::string& name, std::vector<SymDim> shape) {
    return sharded ? g.ExpertShardParam(name, std::move(shape)) : g.Param(name, std::move(shape));
  };
  const int gate_up = expert_param("experts.gate_up_proj", {sharded ? kEl : kE, 2 * kFe, kD});
  const int down = expert_param("experts.down_proj", {sharded ? kEl : kE, kD, kFe});
  const int router = g.Param("gate.weight", {kE, kD});
  // hidden_states.view(-1, hidden_dim)
  const int flat = g.Op1(OpType::kView, "moe.flatten", {x}, {.shape = {kB * kT, kD}});
  const RouterOut r = Router(g, config, flat, router);
  const int experts = config.shard.ep > 1 ? AllToAllEp(g, config, flat, r, gate_up, down, load)
                      : config.moe.impl == ExpertsImpl::kEager
                          ? EagerExperts(g, flat, r, gate_up, down, load)
                          : GroupedMmExperts(g, flat, r, gate_up, down);
  const int out = g.Op1(OpType::kView, "moe.unflatten", {experts}, {.shape = {kB, kT, kD}});
  // SparseMoeBlock.forward's locals, to its return: the flattened hidden states, the
  // router's logits (bound to `_`), weights and indices, the experts' output.
  g.HeldThroughHere({flat, r.logits, r.scores, r.indices, experts});
  return out;
}

}  // namespace memledger
