#include "runtime/distributed.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/native/Resize.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <unordered_set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "estimator/pipeline_steps.h"
#include "runtime/checkpoint.h"
#include "runtime/counting_allocator.h"
#include "runtime/dropout.h"
#include "runtime/model.h"
#include "runtime/optimizer_runner.h"
#include "runtime/saved_tensor_recorder.h"
#include "runtime/threads.h"

extern char** environ;

namespace memledger::runtime {
namespace {

using GroupPtr = c10::intrusive_ptr<c10d::ProcessGroupGloo>;

// ---- Layout ----------------------------------------------------------------------

// ChunksOf: pipeline rank `stage`'s model chunks, in order: chunk c is model chunk
// g = c x pp + stage of pp x virtual_stages equal ones; g = 0 has the embedding, the
// last the head.
std::vector<StageRange> ChunksOf(const ModelConfig& config, const ParallelSpec& parallel,
                                 int64_t stage) {
  const int64_t chunks = parallel.pp * parallel.virtual_stages;
  const int64_t per_chunk = config.layers / chunks;
  std::vector<StageRange> ranges;
  for (int64_t c = 0; c < parallel.virtual_stages; ++c) {
    const int64_t g = c * parallel.pp + stage;
    ranges.push_back(StageRange{g * per_chunk, per_chunk, /*prologue=*/g == 0,
                                /*head=*/g == chunks - 1});
  }
  return ranges;
}

// ScheduleStep is one forward or backward of one micro-batch through one local chunk.
struct ScheduleStep {
  bool forward = true;
  int64_t micro_batch = 0;
  int64_t chunk = 0;
};

// MegatronOrder is pipeline rank `stage`'s order of steps, as Megatron-LM's
// forward_backward_pipelining_without_interleaving and ..._with_interleaving run them:
// warm-up forwards, then one forward before each backward, then the remaining
// backwards. 1F1B warms up with min(pp - stage - 1, m) forwards; interleaved with
// (pp - stage - 1) x 2 + (v - 1) x pp (all m x v when m == pp), and forward k runs
// chunk (k mod pp v) / pp of micro-batch (k / pp v) x pp + k mod pp, backward k the
// chunks in reverse.
std::vector<ScheduleStep> MegatronOrder(const ParallelSpec& p, int64_t stage) {
  const int64_t m = p.micro_batches, v = p.virtual_stages, pp = p.pp;
  const int64_t group = pp * v, total = m * v;
  int64_t warmup = 0;
  if (p.schedule == PipelineSchedule::k1F1B) {
    warmup = std::min(pp - stage - 1, m);
  } else {
    warmup = m == pp ? total : std::min((pp - stage - 1) * 2 + (v - 1) * pp, total);
  }
  auto micro_batch = [&](int64_t k) { return (k / group) * pp + k % pp; };
  auto forward = [&](int64_t k) { return ScheduleStep{true, micro_batch(k), (k % group) / pp}; };
  auto backward = [&](int64_t k) {
    return ScheduleStep{false, micro_batch(k), v - 1 - (k % group) / pp};
  };
  std::vector<ScheduleStep> order;
  for (int64_t k = 0; k < warmup; ++k) order.push_back(forward(k));
  for (int64_t k = 0; k < total - warmup; ++k) {
    order.push_back(forward(warmup + k));
    order.push_back(backward(k));
  }
  for (int64_t k = total - warmup; k < total; ++k) order.push_back(backward(k));
  return order;
}

// The whole batch every rank draws: dp x micro_batches x batch sequences, so that the
// parameters (drawn first) and the data are the single-process reference's.
ModelConfig WholeBatch(const ModelConfig& config, const ParallelSpec& parallel) {
  ModelConfig whole = config;
  whole.batch = config.batch * parallel.dp * parallel.micro_batches;
  whole.use_cache = false;  // ranks keep no DynamicCache (estimator/ranks.cc, PredictRanks)
  return whole;
}

// SingleProcessConfig: the single-process model of the whole batch, whose parameters every
// tensor-parallel shard is cut from.
ModelConfig SingleProcessConfig(const ModelConfig& config, const ParallelSpec& parallel) {
  ModelConfig whole = WholeBatch(config, parallel);
  whole.tp = 1;
  return whole;
}

std::vector<Variant> WithReference(const std::vector<Variant>& variants) {
  std::vector<Variant> all = {Variant()};
  for (const Variant& v : variants) {
    if (v.kind != VariantKind::kNone) all.push_back(v);
  }
  return all;
}

absl::Status ValidateDistributed(const ModelConfig& config, const ParallelSpec& parallel,
                                 const DistributedRequest& request) {
  if (absl::Status s = ValidateRun(config, request.attention, request.variants, request.optimizer);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = ValidateParallel(config, parallel); !s.ok()) return s;
  for (const Variant& v : request.variants) {
    if (v.kind == VariantKind::kCoreAttention) {
      return absl::UnimplementedError("the runtime has no core_attention recompute yet");
    }
  }
  if (!config.megatron && config.dropout.Any()) {
    // Each rank would draw its own masks from its own generator, so its gradients would
    // not compare with the single process's (megatron-gpt's dropout is rank-invariant).
    return absl::InvalidArgumentError(
        "the rank runtime needs GPT-2's dropouts at 0 (resid_pdrop, embd_pdrop, "
        "attn_pdrop in the config.json; predict answers with them)");
  }
  if (request.timeout_s < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rank_timeout_s must be >= 1, got ", request.timeout_s));
  }
  if (!request.fault.empty()) {
    const std::vector<std::string> parts = absl::StrSplit(request.fault, ':');
    int64_t rank = -1;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &rank) || rank < 0 ||
        rank >= WorldSize(config.tp, parallel) || (parts[1] != "exit" && parts[1] != "hang")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--rank_fault must be RANK:exit or RANK:hang with RANK below the world size, got '",
          request.fault, "'"));
    }
  }
  if (WorldSize(config.tp, parallel) > kMaxRanks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "verify runs at most ", kMaxRanks, " rank processes on this machine, --tp x --dp x --pp ",
        "asks for ", WorldSize(config.tp, parallel), " (predict answers for any size)"));
  }
  return absl::OkStatus();
}

// ---- Flat buffers (ZeRO's view of a stage's parameters) --------------------------

// Flat concatenates the tensors, flattened, into one buffer of `padded` elements (the
// tail zeros), in the first tensor's dtype.
at::Tensor Flat(const std::vector<at::Tensor>& tensors, int64_t padded) {
  std::vector<at::Tensor> pieces;
  int64_t n = 0;
  for (const at::Tensor& t : tensors) {
    pieces.push_back(t.detach().reshape({-1}));
    n += t.numel();
  }
  if (padded > n) pieces.push_back(at::zeros({padded - n}, tensors.front().options()));
  return at::cat(pieces);
}

// Unflatten copies flat's first elements back into the tensors, in order.
void Unflatten(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) {
  at::NoGradGuard no_grad;
  int64_t offset = 0;
  for (const at::Tensor& t : tensors) {
    t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
}

int64_t ShardElements(int64_t n, int64_t dp) { return (n + dp - 1) / dp; }

// ---- Result files ------------------------------------------------------------------

std::string RankFile(const std::string& dir, int64_t rank, absl::string_view what) {
  return absl::StrCat(dir, "/rank", rank, ".", what);
}

// A piece of a stage's flat buffer, as fp32 on disk.
struct Piece {
  int64_t offset = 0;
  int64_t length = 0;  // within the stage's n_params (padding excluded)
};

Piece WritePiece(const std::string& path, const at::Tensor& values, int64_t offset,
                 int64_t n_params) {
  Piece piece{offset, std::max<int64_t>(0, std::min(values.numel(), n_params - offset))};
  at::Tensor fp32 = values.detach().narrow(0, 0, piece.length).to(at::kFloat).contiguous();
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(fp32.data_ptr()),
            static_cast<std::streamsize>(piece.length * sizeof(float)));
  TORCH_CHECK(out.good(), "cannot write ", path);
  return piece;
}

at::Tensor ReadPiece(const std::string& path, int64_t length) {
  at::Tensor values = at::empty({length}, at::kFloat);
  std::ifstream in(path, std::ios::binary);
  in.read(static_cast<char*>(values.data_ptr()),
          static_cast<std::streamsize>(length * sizeof(float)));
  TORCH_CHECK(in.good(), "cannot read ", length, " floats from ", path);
  return values;
}

// ---- One rank ------------------------------------------------------------------------

GroupPtr MakeGroup(const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix,
                   int64_t rank, int64_t size, std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(
      c10::make_intrusive<c10d::PrefixStore>(prefix, store), static_cast<int>(rank),
      static_cast<int>(size), options);
}

// ---- Tensor parallelism over a Gloo group -----------------------------------------------

namespace ag = torch::autograd;

c10d::ProcessGroupGloo* GroupOf(ag::AutogradContext* ctx) {
  return reinterpret_cast<c10d::ProcessGroupGloo*>(ctx->saved_data["group"].toInt());
}

// Complete waits for a collective and then for Gloo's worker thread to drop its
// reference to it: the work holds the tensors it was given, and a counted step must
// see them freed when the caller lets go of them, not whenever that thread gets to it.
void Complete(const c10::intrusive_ptr<c10d::Work>& work) {
  work->wait();
  while (work.use_count() > 1) std::this_thread::yield();
}

void AllReduce(c10d::ProcessGroupGloo* group, at::Tensor& t,
               c10d::ReduceOp op = c10d::ReduceOp::SUM) {
  std::vector<at::Tensor> buffer = {t};
  c10d::AllreduceOptions options;
  options.reduceOp = op;
  Complete(group->allreduce(buffer, options));
}

// CopyToTensorParallel is Megatron's f: identity forward, all-reduced gradient.
struct CopyToTensorParallel : ag::Function<CopyToTensorParallel> {
  static at::Tensor forward(ag::AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return x;
  }
  static ag::variable_list backward(ag::AutogradContext* ctx, ag::variable_list grads) {
    // In place, as Megatron's _CopyToModelParallelRegion: the gradient of f's output is
    // the column-parallel linear's input gradient, which nothing else holds.
    at::Tensor grad = grads[0];
    AllReduce(GroupOf(ctx), grad);
    return {grad, at::Tensor()};
  }
};

// ReduceFromTensorParallel is Megatron's g: the partial sums all-reduced in place and
// returned (unless `reduced`: already summed), identity gradient.
struct ReduceFromTensorParallel : ag::Function<ReduceFromTensorParallel> {
  static at::Tensor forward(ag::AutogradContext* /*ctx*/, const at::Tensor& x, int64_t group,
                            bool reduced) {
    if (!reduced) {
      at::Tensor sum = x;
      AllReduce(reinterpret_cast<c10d::ProcessGroupGloo*>(group), sum);
    }
    return x;
  }
  static ag::variable_list backward(ag::AutogradContext* /*ctx*/, ag::variable_list grads) {
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

// VocabTargets are Megatron's masked ids and mask for a rank's vocabulary rows [start,
// start + rows): `local` is an id's row in the shard (0 for another rank's token, -1 for
// an ignored label, -100), `own` whether the shard holds it. Made by plain loops: two
// allocations, of ids' shape.
struct VocabTargets {
  at::Tensor local, own;  // int64, bool
};
VocabTargets VocabTargetsOf(const at::Tensor& ids, int64_t start, int64_t rows) {
  TORCH_CHECK(ids.is_contiguous() && ids.scalar_type() == at::kLong, "ids: contiguous int64");
  VocabTargets t{at::empty(ids.sizes(), ids.options()), at::empty(ids.sizes(), at::kBool)};
  const int64_t* id = ids.data_ptr<int64_t>();
  int64_t* local = t.local.data_ptr<int64_t>();
  bool* own = t.own.data_ptr<bool>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    own[i] = id[i] >= start && id[i] < start + rows;
    local[i] = own[i] ? id[i] - start : (id[i] == -100 ? -1 : 0);
  }
  return t;
}

// ZeroRows zeroes the rows of a contiguous (N, ...) tensor where keep[i] is false.
void ZeroRows(at::Tensor& rows, const at::Tensor& keep) {
  TORCH_CHECK(rows.is_contiguous(), "ZeroRows: contiguous rows");
  const int64_t n = keep.numel(), row_bytes = rows.numel() / n * rows.element_size();
  const bool* k = keep.data_ptr<bool>();
  char* data = static_cast<char*>(rows.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    if (!k[i]) std::memset(data + i * row_bytes, 0, row_bytes);
  }
}

// VocabParallelEmbedding is Megatron's VocabParallelEmbedding: this rank's rows looked
// up (zeros for other ranks' tokens), all-reduced in place; keeps the masked ids and the
// mask. Backward: the gradient masked into a copy, then embedding_dense_backward.
struct VocabParallelEmbedding : ag::Function<VocabParallelEmbedding> {
  static at::Tensor forward(ag::AutogradContext* ctx, const at::Tensor& ids,
                            const at::Tensor& weight, int64_t start, int64_t group) {
    ctx->saved_data["rows"] = weight.size(0);
    VocabTargets t = VocabTargetsOf(ids, start, weight.size(0));
    at::Tensor out = at::embedding(weight, t.local);
    ZeroRows(out, t.own);
    AllReduce(reinterpret_cast<c10d::ProcessGroupGloo*>(group), out);
    ctx->save_for_backward({t.local, t.own});
    return out;
  }
  static ag::variable_list backward(ag::AutogradContext* ctx, ag::variable_list grads) {
    const ag::variable_list saved = ctx->get_saved_variables();
    at::Tensor grad = grads[0].clone(at::MemoryFormat::Contiguous);
    ZeroRows(grad, saved[1]);
    at::Tensor grad_weight =
        at::embedding_dense_backward(grad, saved[0], ctx->saved_data["rows"].toInt(), -1, false);
    return {at::Tensor(), grad_weight, at::Tensor(), at::Tensor()};
  }
};

// VocabParallelCrossEntropy is Megatron's vocab_parallel_cross_entropy, averaged over the
// labels that are not -100: in place on the (N, V / tp) fp32 logits, as Megatron does
// (the max subtracted, exp, divided by the sum: the shard's softmax, which it keeps with
// the masked targets and their mask); the max, the target logits and the sums of exp
// (N each) all-reduced. Backward subtracts 1 at the targets and scales, in place: the
// kept softmax becomes the logits' gradient.
struct VocabParallelCrossEntropy : ag::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(ag::AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& labels, int64_t start, int64_t group) {
    auto* g = reinterpret_cast<c10d::ProcessGroupGloo*>(group);
    TORCH_CHECK(logits.is_contiguous() && logits.scalar_type() == at::kFloat,
                "VocabParallelCrossEntropy: contiguous fp32 logits");
    const int64_t n = logits.size(0), columns = logits.size(1);
    at::Tensor softmax = logits;  // the same storage, turned into the softmax
    {
      at::Tensor max = at::amax(softmax, {1});
      AllReduce(g, max, c10d::ReduceOp::MAX);
      softmax.sub_(max.unsqueeze(1));
    }
    VocabTargets t = VocabTargetsOf(labels, start, columns);
    at::Tensor target = at::empty({n}, softmax.options());  // the target's shifted logit
    {
      const float* row = softmax.data_ptr<float>();
      const int64_t* local = t.local.data_ptr<int64_t>();
      const bool* own = t.own.data_ptr<bool>();
      float* out = target.data_ptr<float>();
      for (int64_t i = 0; i < n; ++i) out[i] = own[i] ? row[i * columns + local[i]] : 0.0F;
    }
    AllReduce(g, target);
    softmax.exp_();
    at::Tensor sum = softmax.sum(1);
    AllReduce(g, sum);
    // The mean over the labels that count of log(sum of exp) - target logit.
    double total = 0;
    int64_t count = 0;
    const int64_t* local = t.local.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      if (local[i] < 0) continue;
      total += std::log(static_cast<double>(sum.data_ptr<float>()[i])) -
               static_cast<double>(target.data_ptr<float>()[i]);
      ++count;
    }
    at::Tensor loss = at::empty({}, softmax.options());
    *loss.data_ptr<float>() = count > 0 ? static_cast<float>(total / static_cast<double>(count)) : 0.0F;
    softmax.div_(sum.unsqueeze(1));
    ctx->saved_data["count"] = count;
    ctx->save_for_backward({softmax, t.local, t.own});
    return loss;
  }
  static ag::variable_list backward(ag::AutogradContext* ctx, ag::variable_list grads) {
    const ag::variable_list saved = ctx->get_saved_variables();
    at::Tensor grad = saved[0];  // the softmax, turned into the gradient in place
    const int64_t n = grad.size(0), columns = grad.size(1);
    const int64_t count = ctx->saved_data["count"].toInt();
    const double scale = count > 0 ? grads[0].item<double>() / static_cast<double>(count) : 0.0;
    float* row = grad.data_ptr<float>();
    const int64_t* local = saved[1].data_ptr<int64_t>();
    const bool* own = saved[2].data_ptr<bool>();
    for (int64_t i = 0; i < n; ++i, row += columns) {
      // d loss / d logits = (softmax - onehot(target)) / count x grad, 0 for ignored rows.
      const float s = local[i] < 0 ? 0.0F : static_cast<float>(scale);
      if (own[i]) row[local[i]] -= 1.0F;
      for (int64_t j = 0; j < columns; ++j) row[j] *= s;
    }
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Sequence-parallel collectives on (B, T, ...) hidden states, along T: each rank holds
// T / size consecutive tokens, in rank order. Gloo's all_gather and reduce_scatter copy
// their buffers on the CPU, which NCCL's do not, so both are done as in-place
// all-reduces: the bytes held are a GPU rank's.

// GatherSequence: a new (B, T, ...) tensor, zeros with this rank's tokens copied in,
// all-reduced.
at::Tensor GatherSequence(c10d::ProcessGroupGloo* group, int64_t rank, int64_t size,
                          const at::Tensor& x) {
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes[1] *= size;
  at::Tensor buffer = at::zeros(sizes, x.options());
  buffer.narrow(1, rank * x.size(1), x.size(1)).copy_(x);
  AllReduce(group, buffer);
  return buffer;
}

// ReduceScatterSequence: the ranks' partial (B, T, ...) sums all-reduced in x itself
// (unless `reduced`: already), then a copy of this rank's tokens.
at::Tensor ReduceScatterSequence(c10d::ProcessGroupGloo* group, int64_t rank, int64_t size,
                                 at::Tensor x, bool reduced) {
  if (!reduced) AllReduce(group, x);
  const int64_t tokens = x.size(1) / size;
  return x.narrow(1, rank * tokens, tokens).clone(at::MemoryFormat::Contiguous);
}

c10d::ProcessGroupGloo* GroupOf(int64_t handle) {
  return reinterpret_cast<c10d::ProcessGroupGloo*>(handle);
}

// SequenceGroup is what the sequence-parallel Functions keep of their group.
void SaveGroup(ag::AutogradContext* ctx, int64_t group, int64_t rank, int64_t size) {
  ctx->saved_data["group"] = group;
  ctx->saved_data["rank"] = rank;
  ctx->saved_data["size"] = size;
}
at::Tensor GatherSaved(ag::AutogradContext* ctx, const at::Tensor& x) {
  return GatherSequence(GroupOf(ctx), ctx->saved_data["rank"].toInt(),
                        ctx->saved_data["size"].toInt(), x);
}

// ScatterToSequenceParallel: this rank's tokens, a new tensor; backward all-gathers.
struct ScatterToSequenceParallel : ag::Function<ScatterToSequenceParallel> {
  static at::Tensor forward(ag::AutogradContext* ctx, const at::Tensor& x, int64_t group,
                            int64_t rank, int64_t size) {
    SaveGroup(ctx, group, rank, size);
    const int64_t tokens = x.size(1) / size;
    return x.narrow(1, rank * tokens, tokens).clone(at::MemoryFormat::Contiguous);
  }
  static ag::variable_list backward(ag::AutogradContext* ctx, ag::variable_list grads) {
    return {GatherSaved(ctx, grads[0]), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// ReduceScatterToSequenceParallel: this rank's tokens of the ranks' summed partials;
// backward all-gathers.
struct ReduceScatterToSequenceParallel : ag::Function<ReduceScatterToSequenceParallel> {
  static at::Tensor forward(ag::AutogradContext* ctx, const at::Tensor& x, int64_t group,
                            int64_t rank, int64_t size, bool reduced) {
    SaveGroup(ctx, group, rank, size);
    return ReduceScatterSequence(GroupOf(group), rank, size, x, reduced);
  }
  static ag::variable_list backward(ag::AutogradContext* ctx, ag::variable_list grads) {
    return {GatherSaved(ctx, grads[0]), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// GatherLinearFunction is Megatron's LinearWithGradAccumulationAndAsyncCommunication
// with sequence parallelism: all-gather x along the sequence, times the weight, plus b;
// keeps x (not the gathered buffer) and the weight; backward gathers x again for the
// weight's gradient and reduce-scatters x's. `parameters` is {W} or {W, b} (an undefined
// tensor cannot be an autograd input), W (out, in), or (in, out) with `conv1d`; with
// `cached`, the forward returns it (selective recompute).
struct GatherLinearFunction : ag::Function<GatherLinearFunction> {
  static at::Tensor forward(ag::AutogradContext* ctx, const at::Tensor& x,
                            at::TensorList parameters, bool conv1d, const at::Tensor* cached,
                            int64_t group, int64_t rank, int64_t size) {
    ctx->save_for_backward({x, parameters[0]});
    SaveGroup(ctx, group, rank, size);
    ctx->saved_data["has_bias"] = parameters.size() > 1;
    ctx->saved_data["conv1d"] = conv1d;
    if (cached != nullptr) return cached->detach();
    const at::Tensor weight = conv1d ? parameters[0] : parameters[0].t();  // (in, out)
    at::Tensor gathered = GatherSequence(GroupOf(group), rank, size, x);
    at::Tensor rows = gathered.view({-1, weight.size(0)});
    at::Tensor out =
        parameters.size() > 1 ? at::addmm(parameters[1], rows, weight) : rows.mm(weight);
    // Not a view (as matmul's fold): the vocabulary-parallel cross-entropy works on the
    // head's logits in place.
    return at::_unsafe_view(out, {gathered.size(0), gathered.size(1), weight.size(1)});
  }
  static ag::variable_list backward(ag::AutogradContext* ctx, ag::variable_list grads) {
    const ag::variable_list saved = ctx->get_saved_variables();
    const bool conv1d = ctx->saved_data["conv1d"].toBool();
    const at::Tensor weight = conv1d ? saved[1] : saved[1].t();  // (in, out)
    at::Tensor gathered = GatherSaved(ctx, saved[0]);
    at::Tensor rows = gathered.view({-1, weight.size(0)});
    at::Tensor grad = grads[0].reshape({-1, weight.size(1)});
    at::Tensor grad_input = grad.mm(weight.t()).view(gathered.sizes());
    ag::variable_list result = {
        ReduceScatterSequence(GroupOf(ctx), ctx->saved_data["rank"].toInt(),
                              ctx->saved_data["size"].toInt(), grad_input, false),
        // In the weight's own layout, as Megatron's grad_output.t().matmul(input).
        conv1d ? rows.t().mm(grad) : grad.t().mm(rows)};
    if (ctx->saved_data["has_bias"].toBool()) result.push_back(grad.sum(0));
    // None for conv1d, cached, group, rank and size.
    result.insert(result.end(), 5, at::Tensor());
    return result;
  }
};

// GlooTensorParallel is TensorParallel over one tensor-parallel Gloo group.
class GlooTensorParallel : public TensorParallel {
 public:
  GlooTensorParallel(GroupPtr group, int64_t rank, int64_t size, bool sequence_parallel)
      : group_(std::move(group)), rank_(rank), size_(size), sequence_parallel_(sequence_parallel) {}
  at::Tensor CopyIn(const at::Tensor& x) override {
    return CopyToTensorParallel::apply(x, Handle());
  }
  at::Tensor ReduceOut(const at::Tensor& x, bool reduced) override {
    return ReduceFromTensorParallel::apply(x, Handle(), reduced);
  }
  at::Tensor VocabEmbedding(const at::Tensor& ids, const at::Tensor& weight) override {
    return VocabParallelEmbedding::apply(ids, weight, rank_ * weight.size(0), Handle());
  }
  at::Tensor VocabCrossEntropy(const at::Tensor& logits, const at::Tensor& labels) override {
    return VocabParallelCrossEntropy::apply(logits, labels, rank_ * logits.size(1), Handle());
  }
  bool SequenceParallel() const override { return sequence_parallel_; }
  at::Tensor Scatter(const at::Tensor& x) override {
    return ScatterToSequenceParallel::apply(x, Handle(), rank_, size_);
  }
  at::Tensor ReduceScatter(const at::Tensor& x, bool reduced) override {
    return ReduceScatterToSequenceParallel::apply(x, Handle(), rank_, size_, reduced);
  }
  at::Tensor GatherLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                          bool conv1d, const at::Tensor* cached) override {
    std::vector<at::Tensor> parameters = {weight};
    if (bias.defined()) parameters.push_back(bias);
    return GatherLinearFunction::apply(x, at::TensorList(parameters), conv1d, cached, Handle(),
                                       rank_, size_);
  }

 private:
  // The group as an autograd-context integer (it outlives every graph of the run).
  int64_t Handle() const { return reinterpret_cast<int64_t>(group_.get()); }
  GroupPtr group_;
  int64_t rank_, size_;
  bool sequence_parallel_;
};

// ScheduleStats: what one variant's schedule held.
struct ScheduleStats {
  int64_t held_bytes = 0;
  int64_t in_flight = 0;
};

// CountedStep is one whole step counted by the allocator (Rank::MeasureStep).
struct CountedStep {
  int64_t resident_bytes = 0;  // what exists before it
  int64_t peak_bytes = 0;      // resident_bytes + the step's largest live bytes
  PeakPoint peak;              // where; its bytes are the step's own
  double unit_grad_diff = -1;  // ZeRO-3 (RankVariantMeasurement::unit_grad_diff)
};

// MaxAbsDiff is max |a - b| over two tensors of one shape and dtype, in plain loops: it
// allocates nothing (a counted step calls it).
double MaxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.numel() == b.numel() &&
                  a.scalar_type() == b.scalar_type(),
              "MaxAbsDiff: two contiguous tensors of one shape and dtype");
  double worst = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "MaxAbsDiff", [&] {
    const scalar_t* x = a.data_ptr<scalar_t>();
    const scalar_t* y = b.data_ptr<scalar_t>();
    for (int64_t i = 0; i < a.numel(); ++i) {
      const double d = std::abs(static_cast<double>(x[i]) - static_cast<double>(y[i]));
      if (!(d <= worst)) worst = d;  // a NaN stays
    }
  });
  return worst;
}

// PipelineRun is how Rank::RunPipeline runs a schedule: the verified one records each
// forward's saved bytes and scales each loss by 1 / micro-batches; the counted one marks
// the allocator's phases.
struct PipelineRun {
  ScopedCountingAllocator* counting = nullptr;
  bool record_saved = false;
  bool scale_loss = false;
  ParameterUnits* units = nullptr;  // ZeRO-3's gathering (the counted step)
};

struct PipelineResult {
  ScheduleStats stats;    // with record_saved
  at::Tensor total_loss;  // the losses' sum, on the rank with the model's last chunk
};

// UnitOf names the ZeRO-3 unit (ParameterUnits) a parameter belongs to: its layer, the
// prologue's embeddings or the head (the final norm, the LM head).
int64_t UnitOf(const std::string& name) {
  if (absl::StartsWith(name, "layers.")) {
    int64_t layer = 0;
    const std::string index = name.substr(7, name.find('.', 7) - 7);
    TORCH_CHECK(absl::SimpleAtoi(index, &layer), "no layer index in ", name);
    return layer;
  }
  if (absl::StartsWith(name, "embed_tokens.") || absl::StartsWith(name, "wte.") ||
      absl::StartsWith(name, "wpe.")) {
    return ParameterUnits::kPrologue;
  }
  return ParameterUnits::kHead;
}

// GatheredUnits is ZeRO-3 as DeepSpeed's stage 3 and FSDP run it, one unit at a time:
// the rank holds its shard of the stage's flat parameters (padded to a multiple of dp);
// a unit's parameters are views of one flat buffer whose storage exists only while the
// unit runs (resized to 0 bytes otherwise, as FSDP frees it: every view, the ones the
// graph saved included, sees it come back). Gather fills it (the others' parts zeroed,
// this rank's copied in, all-reduced in place: Gloo's all-gather copies); after the
// unit's backward its .grads are flattened into a bucket and freed, the bucket
// all-reduced in place and this rank's part added into the shard's gradient (made on
// first use), then the bucket freed and the unit released. With sequence parallelism
// the partial gradients are all-reduced over the tensor-parallel group first. A tied
// embedding (one stage only) keeps its unit gathered from the prologue's forward to the
// end of the backward, as FSDP keeps its root unit: the head reads its weight, whose
// gradient the head's backward starts and the prologue's completes.
class GatheredUnits : public ParameterUnits {
 public:
  struct Context {
    const ModelConfig* config = nullptr;
    c10d::ProcessGroupGloo* dp_group = nullptr;
    c10d::ProcessGroupGloo* tp_group = nullptr;
    int64_t dp_rank = 0;
    int64_t shard = 0;           // elements per rank
    const at::Tensor* shard_param = nullptr;
  };

  // `owned` in the stage's flat order (grouped by unit), with their names and sizes (a
  // ZeRO-3 rank's parameters hold no elements between steps).
  GatheredUnits(Context context, const std::vector<at::Tensor>& owned,
                const std::vector<std::string>& names,
                const std::vector<std::vector<int64_t>>& sizes)
      : context_(context) {
    at::NoGradGuard no_grad;
    int64_t offset = 0;
    for (size_t i = 0; i < owned.size(); ++i) {
      const int64_t unit = UnitOf(names[i]);
      if (units_.empty() || units_.back().id != unit) {
        Unit u;
        u.id = unit;
        u.offset = offset;
        units_.push_back(std::move(u));
      }
      Unit& u = units_.back();
      const int64_t numel = c10::multiply_integers(sizes[i]);
      u.parameters.push_back(owned[i]);
      u.names.push_back(names[i]);
      u.sizes.push_back(sizes[i]);
      u.length += numel;
      offset += numel;
    }
    for (Unit& u : units_) {
      u.flat = at::empty({u.length}, owned.front().options());
      int64_t at = 0;
      for (size_t i = 0; i < u.parameters.size(); ++i) {
        const int64_t numel = c10::multiply_integers(u.sizes[i]);
        at::Tensor p = u.parameters[i];  // set_data changes every handle's variable
        p.set_data(u.flat.narrow(0, at, numel).view(u.sizes[i]));
        at += numel;
      }
      Resize(u, 0);
    }
  }

  void Gather(int64_t unit) override {
    Unit* u = Find(unit);
    if (u == nullptr || u->gathered) return;
    at::NoGradGuard no_grad;
    Resize(*u, u->length);
    u->flat.zero_();
    const Overlap mine = Mine(*u);
    if (mine.length > 0) {
      u->flat.narrow(0, mine.in_unit, mine.length)
          .copy_(context_.shard_param->detach().narrow(0, mine.in_shard, mine.length));
    }
    AllReduce(context_.dp_group, u->flat);
  }

  // Release after a forward; a tied embedding's unit (the head reads its weight too)
  // stays gathered until its gradients are reduced, after the prologue's backward.
  void Release(int64_t unit) override {
    if (unit == kPrologue && context_.config->tie_embeddings) return;
    if (Unit* u = Find(unit); u != nullptr) Resize(*u, 0);
  }
  // GatherAll and ReleaseAll: every unit at once (a step without ZeRO-3's gathering).
  void GatherAll() {
    for (const Unit& u : units_) Gather(u.id);
  }
  void ReleaseAll() {
    for (Unit& u : units_) Resize(u, 0);
  }

  void BeginBackward(int64_t last) override {
    pending_ = last;
    Gather(last);
  }

  void BackwardPassed(int64_t unit, int64_t previous) override {
    TORCH_CHECK(unit == pending_, "ZeRO-3: unit ", unit, "'s backward ended, expected ", pending_);
    ReduceScatter(unit);
    pending_ = previous;
    if (previous != kNone) Gather(previous);
  }

  void EndBackward() override {
    if (pending_ != kNone) ReduceScatter(pending_);
    pending_ = kNone;
  }

  // TakeGradient: the shard's gradient, summed over the micro-batches' backwards.
  at::Tensor TakeGradient() { return std::move(shard_grad_); }

 private:
  struct Unit {
    int64_t id = kNone;
    int64_t offset = 0;  // in the stage's flat parameters
    int64_t length = 0;
    std::vector<at::Tensor> parameters;
    std::vector<std::string> names;
    std::vector<std::vector<int64_t>> sizes;
    at::Tensor flat;
    bool gathered = false;  // its storage holds the parameters
  };
  // Where this rank's shard meets a unit: offsets in the unit and in the shard.
  struct Overlap {
    int64_t in_unit = 0, in_shard = 0, length = 0;
  };

  Unit* Find(int64_t unit) {
    for (Unit& u : units_) {
      if (u.id == unit) return &u;
    }
    return nullptr;
  }
  Overlap Mine(const Unit& u) const {
    const int64_t start = context_.dp_rank * context_.shard;
    const int64_t lo = std::max(start, u.offset);
    const int64_t hi = std::min(start + context_.shard, u.offset + u.length);
    if (hi <= lo) return {};
    return {lo - u.offset, lo - start, hi - lo};
  }
  // Resize sets the unit's storage to `elements`, allocating through the CPU allocator
  // of the moment (a counted step's), not the one it was made with.
  static void Resize(Unit& u, int64_t elements) {
    c10::StorageImpl* storage = u.flat.storage().unsafeGetStorageImpl();
    storage->set_allocator(c10::GetCPUAllocator());
    at::native::resize_bytes_cpu(storage, static_cast<size_t>(elements * u.flat.element_size()));
    u.gathered = elements > 0;
  }

  void ReduceScatter(int64_t unit) {
    Unit* u = Find(unit);
    if (u == nullptr) return;
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> grads;
    for (size_t i = 0; i < u->parameters.size(); ++i) {
      at::Tensor grad = u->parameters[i].grad();
      TORCH_CHECK(grad.defined(), "ZeRO-3: no gradient for ", u->names[i]);
      if (context_.tp_group != nullptr && GradientIsPartial(*context_.config, u->names[i])) {
        AllReduce(context_.tp_group, grad);
      }
      grads.push_back(grad);
    }
    at::Tensor bucket = Flat(grads, u->length);
    grads.clear();
    for (at::Tensor& p : u->parameters) p.mutable_grad() = at::Tensor();
    AllReduce(context_.dp_group, bucket);
    if (!shard_grad_.defined()) shard_grad_ = at::zeros({context_.shard}, bucket.options());
    const Overlap mine = Mine(*u);
    if (mine.length > 0) {
      shard_grad_.narrow(0, mine.in_shard, mine.length)
          .add_(bucket.narrow(0, mine.in_unit, mine.length));
    }
    bucket = at::Tensor();
    Resize(*u, 0);
  }

  Context context_;
  std::vector<Unit> units_;
  int64_t pending_ = kNone;
  at::Tensor shard_grad_;
};

// Rank is one rank's state for the whole run.
class Rank {
 public:
  Rank(const ModelConfig& config, const ParallelSpec& parallel, const DistributedRequest& request,
       std::string dir, int64_t rank)
      : config_(config),
        parallel_(parallel),
        request_(request),
        dir_(std::move(dir)),
        position_(PositionOf(rank, config.tp, parallel)),
        chunks_(ChunksOf(config, parallel, position_.stage)),
        first_(chunks_.front().prologue),
        last_(chunks_.back().head) {}

  void Run() {
    at::set_num_threads(1);  // every rank shares this machine's cores
    UseNativeKernels();
    BuildShard();
    parameters_ = built_.model->parameters();
    for (const at::Tensor& p : parameters_) parameter_storages_.insert(StorageKey(p));
    MakeGroups();
    if (config_.tp > 1) {
      tensor_parallel_ = std::make_unique<GlooTensorParallel>(tp_group_, position_.tp_rank,
                                                              config_.tp, config_.sp);
      built_.model->SetTensorParallel(tensor_parallel_.get());
    }
    InjectFault();

    std::ostringstream result;
    const std::vector<Variant> variants = WithReference(request_.variants);
    for (size_t v = 0; v < variants.size(); ++v) {
      for (const at::Tensor& p : parameters_) p.mutable_grad() = at::Tensor();
      Progress(absl::StrCat(variants[v].Name(), ": pipeline schedule"));
      const ScheduleStats stats = RunSchedule(variants[v]);
      if (v == 0) {
        FindOwned();
        HomeParameters();
      }
      AllReducePartialGradients();
      Progress(absl::StrCat(variants[v].Name(), ": reducing gradients"));
      ExchangeTiedGradients();
      const Piece piece =
          ReduceGradients(v == 0, RankFile(dir_, position_.rank, absl::StrCat("grad", v)));
      result << "variant " << v << " " << stats.held_bytes << " " << stats.in_flight << " "
             << piece.offset << " " << piece.length << "\n";
    }
    Progress("optimizer step");
    const Piece params = Step();
    if (RankStepModelled(config_, parallel_).ok()) {
      for (size_t v = 0; v < variants.size(); ++v) {
        Progress(absl::StrCat(variants[v].Name(), ": the whole step, counted"));
        const CountedStep step = MeasureStep(variants[v]);
        result << "peak " << v << " " << step.peak_bytes << " " << step.peak.phase << " "
               << step.peak.op << "\n";
        if (step.unit_grad_diff != -1) {
          result << "unit_grad_diff " << v << " " << step.unit_grad_diff << "\n";
        }
      }
    }
    result << "n_params " << n_params_ << "\nparam_bytes " << param_bytes_ << "\ngrad_bytes "
           << grad_bytes_ << "\noptimizer_state_bytes " << optimizer_state_bytes_
           << "\nadamw_state_bytes " << adamw_state_bytes_ << "\nparams " << params.offset << " "
           << params.length << "\n";
    for (const std::string& name : owned_names_) result << "owned " << name << "\n";
    // Written whole, then renamed: the parent reads it only after a clean exit anyway.
    const std::string path = RankFile(dir_, position_.rank, "txt");
    {
      std::ofstream out(path + ".tmp");
      out << result.str();
      TORCH_CHECK(out.good(), "cannot write ", path);
    }
    std::filesystem::rename(path + ".tmp", path);
  }

 private:
  // Progress goes to the rank's log: the parent names a hung rank's last line.
  void Progress(absl::string_view what) const {
    std::cerr << "memledger rank " << position_.rank << ": " << what << std::endl;
  }

  // BuildShard: the whole seeded model and batch, as the single-process reference
  // draws them; with tensor parallelism, this rank's shard of the model (ShardOf) takes
  // its parameters from it.
  void BuildShard() {
    built_ = BuildModel(SingleProcessConfig(config_, parallel_), request_.seed);
    if (config_.tp == 1) return;
    ModelAndInput shard = BuildModel(WholeBatch(config_, parallel_), request_.seed);
    std::map<std::string, at::Tensor> source;
    for (const auto& item : built_.model->named_parameters()) source[item.key()] = item.value();
    at::NoGradGuard no_grad;
    for (const auto& item : shard.model->named_parameters()) {
      item.value().copy_(
          TakeShard(source.at(item.key()), ShardOf(config_, item.key(), position_.tp_rank)));
    }
    built_.model = shard.model;  // the input stays the whole model's draw
  }

  // MakeGroups: Megatron's groups, each over a PrefixStore of one FileStore: tensor
  // parallel (same dp rank and stage), data parallel (same tp rank and stage), pipeline
  // (same tp and dp rank).
  void MakeGroups() {
    Progress("joining the process groups");
    const auto timeout = std::chrono::milliseconds(request_.timeout_s * 2000);
    store_ = c10::make_intrusive<c10d::FileStore>(
        dir_ + "/store", static_cast<int>(WorldSize(config_.tp, parallel_)));
    const RankPosition& p = position_;
    if (config_.tp > 1) {
      tp_group_ = MakeGroup(store_, absl::StrCat("tp/", p.dp_rank, "/", p.stage), p.tp_rank,
                            config_.tp, timeout);
    }
    if (parallel_.dp > 1) {
      dp_group_ = MakeGroup(store_, absl::StrCat("dp/", p.tp_rank, "/", p.stage), p.dp_rank,
                            parallel_.dp, timeout);
    }
    if (parallel_.pp > 1) {
      pp_group_ = MakeGroup(store_, absl::StrCat("pp/", p.tp_rank, "/", p.dp_rank), p.stage,
                            parallel_.pp, timeout);
    }
    // Megatron's embedding group: the first and the last stage, which both hold a tied
    // embedding.
    if (parallel_.pp > 1 && config_.tie_embeddings && (first_ || last_)) {
      embedding_group_ = MakeGroup(store_, absl::StrCat("embedding/", p.tp_rank, "/", p.dp_rank),
                                   first_ ? 0 : 1, 2, timeout);
    }
  }

  void InjectFault() {
    if (request_.fault.empty()) return;
    std::vector<std::string> parts = absl::StrSplit(request_.fault, ':');
    int64_t rank = -1;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &rank) || rank != position_.rank) {
      return;
    }
    std::cerr << "memledger rank " << rank << ": injected fault " << parts[1] << std::endl;
    if (parts[1] == "exit") std::_Exit(7);
    if (parts[1] == "hang") {
      for (;;) pause();
    }
  }

  // The micro-batch j of this rank's data-parallel slice: a tensor of its own, as a
  // data loader hands it over (a view would count the whole batch where it is saved).
  at::Tensor MicroBatch(int64_t j) const {
    const int64_t first = (position_.dp_rank * parallel_.micro_batches + j) * config_.batch;
    return built_.input.narrow(0, first, config_.batch).clone();
  }

  // Place: where micro-batch j's tensors sit in the whole batch, for Megatron's dropout
  // masks.
  void Place(int64_t j) const {
    DropoutPlacement placement;
    placement.first_sequence = (position_.dp_rank * parallel_.micro_batches + j) * config_.batch;
    placement.heads = config_.heads;
    placement.first_head = position_.tp_rank * (config_.heads / config_.tp);
    placement.tokens = config_.seq;
    placement.first_token = config_.sp ? position_.tp_rank * (config_.seq / config_.tp) : 0;
    SetDropoutPlacement(placement);
  }

  // RunSchedule runs every micro-batch through every local model chunk, forward and
  // backward (RunPipeline), each loss scaled by 1 / micro-batches (Megatron's mean), and
  // counts the saved bytes of the chunk micro-batches in flight.
  ScheduleStats RunSchedule(const Variant& variant) {
    std::vector<at::Tensor> inputs;
    for (int64_t j = 0; j < parallel_.micro_batches; ++j) inputs.push_back(MicroBatch(j));
    PipelineRun run;
    run.record_saved = true;
    run.scale_loss = true;
    return RunPipeline(variant, inputs, run).stats;
  }

  // FindOwned: the stage's parameters are those its forward used (they have
  // gradients after the first backward), in the model's order.
  void FindOwned() {
    for (const auto& item : built_.model->named_parameters()) {
      if (!item.value().grad().defined()) continue;
      owned_.push_back(item.value());
      owned_names_.push_back(item.key());
      owned_sizes_.push_back(item.value().sizes().vec());
      n_params_ += item.value().numel();
    }
  }

  // AllReducePartialGradients: with sequence parallelism, the replicated parameters used
  // on this rank's tokens only have partial gradients, which Megatron all-reduces over
  // the tensor-parallel group (GradientIsPartial).
  void AllReducePartialGradients() {
    for (size_t i = 0; i < owned_.size(); ++i) {
      if (!GradientIsPartial(config_, owned_names_[i])) continue;
      at::Tensor grad = owned_[i].grad();
      AllReduce(tp_group_.get(), grad);
    }
  }

  // ExchangeTiedGradients: with a tied embedding and more than one stage, the first and
  // the last stage each hold the weight and add each other's gradients (Megatron's
  // embedding group). The shared names come through the store.
  void ExchangeTiedGradients() {
    if (parallel_.pp < 2 || (!first_ && !last_)) return;
    if (!tied_found_) {
      tied_found_ = true;
      const std::string prefix =
          absl::StrCat("owned/", position_.tp_rank, "/", position_.dp_rank, "/");
      const std::string own_key = absl::StrCat(prefix, position_.stage);
      const std::string joined = absl::StrJoin(owned_names_, ",");
      store_->set(own_key, std::vector<uint8_t>(joined.begin(), joined.end()));
      const int64_t peer_stage = first_ ? parallel_.pp - 1 : 0;
      const std::vector<uint8_t> peer = store_->get(absl::StrCat(prefix, peer_stage));
      const std::vector<std::string> peer_names =
          absl::StrSplit(std::string(peer.begin(), peer.end()), ',');
      for (size_t i = 0; i < owned_names_.size(); ++i) {
        if (std::find(peer_names.begin(), peer_names.end(), owned_names_[i]) != peer_names.end()) {
          tied_.push_back(owned_[i]);
        }
      }
    }
    // All-reduced in place over the embedding group, as Megatron's
    // _allreduce_embedding_grads: no buffer.
    for (const at::Tensor& weight : tied_) {
      at::Tensor grad = weight.grad();
      AllReduce(embedding_group_.get(), grad);
    }
  }

  std::vector<at::Tensor> OwnedGrads() const {
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : owned_) grads.push_back(p.grad());
    return grads;
  }

  int64_t Shard() const { return ShardElements(n_params_, parallel_.dp); }

  // HomeParameters: with ZeRO-1 and -2 the stage's parameters become views of one flat
  // buffer, padded to a multiple of dp, as Megatron's distributed optimizer keeps them;
  // the optimizer steps this rank's shard of it in place (a view too), and the
  // all-gather after the step writes the others' shards into it. ZeRO-3 keeps only a
  // shard of its own (Step).
  void HomeParameters() {
    if (parallel_.zero != 1 && parallel_.zero != 2) return;
    flat_params_ = Flat(owned_, Shard() * parallel_.dp);
    int64_t offset = 0;
    for (const at::Tensor& p : owned_) {
      at::Tensor param = p;  // set_data changes the variable shared by every handle
      param.set_data(flat_params_.narrow(0, offset, p.numel()).view(p.sizes()));
      offset += p.numel();
    }
    shard_param_ =
        flat_params_.narrow(0, position_.dp_rank * Shard(), Shard()).requires_grad_(true);
    // The recorder skips the parameters' storages: the old ones are freed (their
    // addresses may come back as activations).
    parameter_storages_.clear();
    for (const at::Tensor& p : parameters_) parameter_storages_.insert(StorageKey(p));
  }

  // CheckGathered: ZeRO-3's gathered parameters are every rank's shard as Gloo's own
  // all-gather assembles them (x + 0 is exact: equal bit for bit).
  void CheckGathered() const {
    at::NoGradGuard no_grad;
    std::vector<std::vector<at::Tensor>> shards(1);
    for (int64_t r = 0; r < parallel_.dp; ++r) shards[0].push_back(at::empty_like(shard_param_));
    std::vector<at::Tensor> mine = {shard_param_.detach()};
    Complete(dp_group_->allgather(shards, mine));
    const at::Tensor whole = at::cat(shards[0]).narrow(0, 0, n_params_);
    TORCH_CHECK(at::equal(whole, Flat(owned_, n_params_)),
                "ZeRO-3: the gathered parameters differ from the ranks' shards");
  }

  // Bucket: the gradients copied into one flat buffer (padded to a multiple of dp), the
  // buffer a reduction over the data-parallel group sends and receives in place.
  at::Tensor Bucket() const { return Flat(OwnedGrads(), Shard() * parallel_.dp); }

  // ReduceScatter: this rank's shard of the bucket summed over the data-parallel group,
  // divided by `divisor`: a copy of its shard of the all-reduced bucket. (Gloo's reduce_scatter
  // first clones its whole input on the CPU, a copy NCCL's does not make: the bucket
  // and the shard are what a reduce-scatter holds.)
  at::Tensor ReduceScatter(at::Tensor& bucket, int64_t divisor) const {
    std::vector<at::Tensor> buffer = {bucket};
    Complete(dp_group_->allreduce(buffer));
    at::Tensor mine = bucket.narrow(0, position_.dp_rank * Shard(), Shard()).clone();
    mine.div_(static_cast<double>(divisor));
    return mine;
  }

  // AllReduceBucket: the bucket summed over the data-parallel group, divided by
  // `divisor`, in place.
  void AllReduceBucket(at::Tensor& bucket, int64_t divisor) const {
    std::vector<at::Tensor> buffer = {bucket};
    Complete(dp_group_->allreduce(buffer));
    bucket.div_(static_cast<double>(divisor));
  }

  // GatherShards: every rank's updated shard into the flat parameters, in place: the
  // others' shards zeroed, then summed over the group (x + 0 is exact). Gloo's
  // all_gather allocates two output-sized buffers on the CPU; NCCL's in-place
  // all-gather, as Megatron's distributed optimizer runs it, none.
  void GatherShards() {
    at::NoGradGuard no_grad;
    const int64_t offset = position_.dp_rank * Shard();
    flat_params_.narrow(0, 0, offset).zero_();
    const int64_t after = offset + Shard();
    flat_params_.narrow(0, after, flat_params_.numel() - after).zero_();
    std::vector<at::Tensor> buffer = {flat_params_};
    Complete(dp_group_->allreduce(buffer));
  }

  // ReduceGradients averages the gradients over the data-parallel group: an all-reduce
  // of the whole flat buffer (ZeRO 0, 1) or a reduce-scatter into this rank's shard
  // (ZeRO 2, 3, after which the full gradients are freed). Writes what the rank holds
  // to `path`; with `for_step` keeps it for the optimizer and records grad_bytes.
  Piece ReduceGradients(bool for_step, const std::string& path) {
    at::Tensor flat = Bucket();
    Piece piece;
    if (parallel_.zero >= 2) {
      at::Tensor mine = ReduceScatter(flat, parallel_.dp);
      flat = at::Tensor();
      for (const at::Tensor& p : owned_) p.mutable_grad() = at::Tensor();
      piece = WritePiece(path, mine, position_.dp_rank * Shard(), n_params_);
      if (for_step) {
        step_grads_ = mine;
        grad_bytes_ = TensorBytes(mine);
      }
    } else {
      if (parallel_.dp > 1) {
        AllReduceBucket(flat, parallel_.dp);
        Unflatten(flat, OwnedGrads());
      }
      piece = WritePiece(path, flat, 0, n_params_);
      if (for_step) {
        step_grads_ = flat;
        grad_bytes_ = 0;
        for (const at::Tensor& g : OwnedGrads()) grad_bytes_ += TensorBytes(g);
      }
    }
    return piece;
  }

  // StepShard steps this rank's ZeRO shard on `grad` (which it releases), then
  // all-gathers the updated shards into the flat parameters (ZeRO 1, 2).
  void StepShard(at::Tensor grad) {
    shard_param_.mutable_grad() = std::move(grad);
    optimizer_->Step();
    shard_param_.mutable_grad() = at::Tensor();
    if (parallel_.zero != 3) GatherShards();
  }

  // Step runs the optimizer on `none`'s reduced gradients: on every owned parameter
  // (ZeRO 0), or on this rank's shard of the flat parameters, all-gathered back into
  // the parameters (ZeRO 1, 2) or kept as all the rank holds (ZeRO 3, which frees the
  // parameters). The optimizer lives on for the counted steps (MeasureStep). Writes the
  // rank's updated parameters.
  Piece Step() {
    const std::string path = RankFile(dir_, position_.rank, "params");
    if (parallel_.zero == 0) {
      for (const at::Tensor& p : owned_) p.mutable_grad() = at::zeros_like(p);
      Unflatten(step_grads_, OwnedGrads());
      step_grads_ = at::Tensor();
      optimizer_ = std::make_unique<OptimizerRunner>(request_.optimizer, owned_);
      optimizer_->Step();
      RecordOptimizer();
      for (const at::Tensor& p : owned_) param_bytes_ += TensorBytes(p);
      return WritePiece(path, Flat(owned_, n_params_), 0, n_params_);
    }
    const int64_t offset = position_.dp_rank * Shard();
    if (parallel_.zero == 3) {
      shard_param_ = Flat(owned_, Shard() * parallel_.dp)
                         .narrow(0, offset, Shard())
                         .clone()
                         .requires_grad_(true);
    }
    at::Tensor grad = parallel_.zero >= 2 ? step_grads_
                                          : step_grads_.narrow(0, offset, Shard()).clone();
    step_grads_ = at::Tensor();
    for (const at::Tensor& p : owned_) p.mutable_grad() = at::Tensor();
    optimizer_ =
        std::make_unique<OptimizerRunner>(request_.optimizer, std::vector<at::Tensor>{shard_param_});
    StepShard(std::move(grad));
    RecordOptimizer();
    const Piece piece = WritePiece(path, shard_param_, offset, n_params_);
    if (parallel_.zero == 3) {
      // The rank keeps only its shard; a forward would all-gather the parameters again.
      for (const at::Tensor& p : owned_) p.set_data(at::empty({0}, p.options()));
      param_bytes_ = TensorBytes(shard_param_);
    }
    for (const at::Tensor& p : owned_) param_bytes_ += TensorBytes(p);
    return piece;
  }

  // RunPipeline runs the rank's micro-batches as PipelineSteps lists them
  // (estimator/pipeline_steps.h: Megatron-LM's 1F1B or interleaved order, with its p2p
  // operations posted and waited together; with one stage, each forward then its
  // backward), checked against this runtime's own MegatronOrder. Every receive
  // allocates a new buffer; a sent output is freed once the paired operations complete
  // (deallocate_output_tensor: the graph lives on through its grad_fn's edge, from
  // which the backward runs); a received input is a leaf whose .grad is sent back after
  // its backward, then both are freed. On the model's last chunk each loss, after its
  // backward, is added into the first (a running total, as a training loop reports the
  // step's loss) and freed; the total is returned (undefined on other ranks).
  PipelineResult RunPipeline(const Variant& variant, const std::vector<at::Tensor>& inputs,
                             const PipelineRun& run) {
    const int64_t pp = parallel_.pp;
    const int64_t chunks = pp * parallel_.virtual_stages;  // model chunks in all
    const int next_rank = static_cast<int>((position_.stage + 1) % pp);
    const int previous_rank = static_cast<int>((position_.stage + pp - 1) % pp);
    // The hidden states between chunks: this rank's T / tp tokens with sequence
    // parallelism, in the parameters' dtype (autocast casts inside the layers).
    const int64_t tokens = config_.sp ? config_.seq / config_.tp : config_.seq;
    const std::vector<int64_t> hidden_shape = {config_.batch, tokens, config_.width};
    const at::TensorOptions hidden_options = parameters_.front().options();
    // Tags name (micro-batch, model chunk g, direction): the activation entering chunk
    // g, or the gradient leaving it backwards.
    auto tag = [&](int64_t j, int64_t g, bool gradient) {
      return static_cast<int>((j * chunks + g) * 2 + (gradient ? 1 : 0));
    };
    auto global = [&](int64_t c) { return c * pp + position_.stage; };
    struct InFlight {
      int64_t micro_batch = 0;
      at::Tensor received;                // a later chunk's input leaf
      torch::autograd::Edge output_edge;  // a chunk without the head: its output's grad_fn
      at::Tensor loss;                    // the model's last chunk's, until its backward
      int64_t saved_bytes = 0;            // with PipelineRun::record_saved
    };
    PipelineResult result;
    int64_t held = 0, held_micro_batches = 0;
    const size_t local = chunks_.size();
    std::vector<std::deque<at::Tensor>> received(local), output_grads(local);
    std::vector<std::deque<InFlight>> in_flight(local);
    std::vector<int64_t> forwards(local, 0), inputs_received(local, 0), grads_received(local, 0);
    at::Tensor last_output, last_input_grad, last_received;
    int64_t last_output_chunk = 0, last_output_micro_batch = 0;
    int64_t last_grad_chunk = 0, last_grad_micro_batch = 0;
    std::vector<c10::intrusive_ptr<c10d::Work>> pending;
    std::vector<ScheduleStep> order;  // what ran, for the check against MegatronOrder
    for (const PipelineStep& step : PipelineSteps(parallel_, position_.stage)) {
      switch (step.kind) {
        case PipelineStep::Kind::kForward: {
          const StageRange& chunk = chunks_[step.chunk];
          InFlight f;
          f.micro_batch = forwards[step.chunk]++;
          order.push_back({true, f.micro_batch, step.chunk});
          if (!chunk.prologue) {
            TORCH_CHECK(!received[step.chunk].empty(), "a forward without its received input");
            f.received = received[step.chunk].front().requires_grad_(true);
            received[step.chunk].pop_front();
          }
          Place(f.micro_batch);
          if (run.counting != nullptr) run.counting->MarkPhase("forward");
          at::Tensor output;
          {
            SavedTensorRecorder recorder(parameter_storages_);
            std::optional<ScopedSavedTensorRecording> recording;
            if (run.record_saved) recording.emplace(&recorder);
            ForwardResult forward = ForwardStage(*built_.model, chunk, f.received,
                                                 inputs[f.micro_batch], request_.attention,
                                                 variant, run.units);
            output = std::move(forward.loss);
            if (run.record_saved) {
              f.saved_bytes = recorder.bytes() + forward.cache_bytes;
              held += f.saved_bytes;
              ++held_micro_batches;
              if (held > result.stats.held_bytes) {
                result.stats.held_bytes = held;
                result.stats.in_flight = held_micro_batches;
              }
            }
          }
          if (chunk.head) {
            // The verified schedule takes the step's mean over micro-batches here, as
            // Megatron does; the counted step divides the reduced gradients instead.
            f.loss = run.scale_loss ? output / static_cast<double>(parallel_.micro_batches)
                                    : std::move(output);
          } else {
            f.output_edge = torch::autograd::impl::gradient_edge(output);
            last_output = std::move(output);
            last_output_chunk = step.chunk;
            last_output_micro_batch = f.micro_batch;
          }
          in_flight[step.chunk].push_back(std::move(f));
          break;
        }
        case PipelineStep::Kind::kBackward: {
          const StageRange& chunk = chunks_[step.chunk];
          TORCH_CHECK(!in_flight[step.chunk].empty(), "a backward before its forward");
          InFlight f = std::move(in_flight[step.chunk].front());
          in_flight[step.chunk].pop_front();
          order.push_back({false, f.micro_batch, step.chunk});
          Place(f.micro_batch);
          if (run.counting != nullptr) run.counting->MarkPhase("backward");
          held -= f.saved_bytes;
          --held_micro_batches;
          if (run.units != nullptr) {
            run.units->BeginBackward(chunk.head ? ParameterUnits::kHead
                                                : chunk.first_layer + chunk.layers - 1);
          }
          if (chunk.head) {
            f.loss.backward();
            if (run.units != nullptr) run.units->EndBackward();
            // As values: a loss's graph would keep a received leaf (and its .grad)
            // alive through the leaf's AccumulateGrad node.
            if (result.total_loss.defined()) {
              result.total_loss.add_(f.loss.detach());
            } else {
              result.total_loss = f.loss.detach();
            }
            f.loss = at::Tensor();
          } else {
            TORCH_CHECK(!output_grads[step.chunk].empty(), "a backward without its gradient");
            at::Tensor output_grad = std::move(output_grads[step.chunk].front());
            output_grads[step.chunk].pop_front();
            torch::autograd::Engine::get_default_engine().execute(
                {f.output_edge}, {output_grad}, /*keep_graph=*/false, /*create_graph=*/false,
                /*accumulate_grad=*/true, /*outputs=*/{});
            if (run.units != nullptr) run.units->EndBackward();
            f.output_edge = torch::autograd::Edge();
          }
          if (!chunk.prologue) {
            last_input_grad = f.received.grad();
            last_received = std::move(f.received);
            last_grad_chunk = step.chunk;
            last_grad_micro_batch = f.micro_batch;
          }
          break;
        }
        case PipelineStep::Kind::kCommunicate: {
          auto post_receive = [&](int peer, int t) {
            std::vector<at::Tensor> buffer = {at::empty(hidden_shape, hidden_options)};
            pending.push_back(pp_group_->recv(buffer, peer, t));
            return buffer[0];
          };
          auto post_send = [&](const at::Tensor& t, int peer, int tag_value) {
            std::vector<at::Tensor> buffer = {t};
            pending.push_back(pp_group_->send(buffer, peer, tag_value));
          };
          if (step.send_output) {
            post_send(last_output.detach(), next_rank,
                      tag(last_output_micro_batch, global(last_output_chunk) + 1, false));
          }
          if (step.send_input_grad) {
            post_send(last_input_grad, previous_rank,
                      tag(last_grad_micro_batch, global(last_grad_chunk), true));
          }
          if (step.receive_input >= 0) {
            const int64_t c = step.receive_input;
            received[c].push_back(
                post_receive(previous_rank, tag(inputs_received[c]++, global(c), false)));
          }
          if (step.receive_output_grad >= 0) {
            const int64_t c = step.receive_output_grad;
            output_grads[c].push_back(
                post_receive(next_rank, tag(grads_received[c]++, global(c) + 1, true)));
          }
          for (const auto& work : pending) Complete(work);
          pending.clear();
          if (step.send_output) last_output = at::Tensor();
          if (step.send_input_grad) {
            last_input_grad = at::Tensor();
            last_received = at::Tensor();
          }
          break;
        }
      }
    }
    const std::vector<ScheduleStep> megatron = MegatronOrder(parallel_, position_.stage);
    TORCH_CHECK(order.size() == megatron.size(), "the schedule ran ", order.size(),
                " forwards and backwards, Megatron's order has ", megatron.size());
    for (size_t i = 0; i < order.size(); ++i) {
      TORCH_CHECK(order[i].forward == megatron[i].forward &&
                      order[i].micro_batch == megatron[i].micro_batch &&
                      order[i].chunk == megatron[i].chunk,
                  "the schedule's step ", i, " differs from Megatron's order");
    }
    return result;
  }

  // MeasureStep runs one more whole step of `variant` (RankStepModelled: no tensor
  // parallelism, ZeRO 0-2) under a counting allocator, as the single-process
  // runtime's MeasureStep does with the data-parallel reduction in the optimizer phase
  // (the simulation's RankStep): zero_grad(set_to_none); the stage's micro-batches in
  // Megatron's order (RunPipeline), gradients accumulating; the tied embedding's
  // gradients all-reduced in place between the first and last stage; the
  // gradients copied into the bucket and all-reduced (ZeRO 0, 1) or reduce-scattered
  // (ZeRO 2) and divided by dp x micro-batches (the mean, which the verified schedule
  // takes by scaling each loss instead); the .grads freed (ZeRO 1, 2) or overwritten
  // with the average (ZeRO 0); the optimizer's step; the updated shards all-gathered.
  // Before it: the parameters (the padded flat buffer with ZeRO), the optimizer's state
  // and the micro-batches.
  CountedStep MeasureStep(const Variant& variant) {
    for (const at::Tensor& p : parameters_) p.mutable_grad() = at::Tensor();
    // The micro-batches' inputs, on a stage that reads them (the embedding's; the
    // families' head makes its labels from the ids). A middle stage reads only their
    // length: an empty stand-in.
    const bool reads_input = first_ || (last_ && config_.family != Family::kStudy);
    std::vector<at::Tensor> inputs;
    for (int64_t j = 0; j < parallel_.micro_batches; ++j) {
      inputs.push_back(reads_input ? MicroBatch(j)
                                   : at::empty({config_.batch, config_.seq, 0}, at::kLong));
    }
    if (parallel_.zero == 3 && units_ == nullptr) {
      // The parameters become views of their units' flat buffers, released (0 bytes).
      GatheredUnits::Context context;
      context.config = &config_;
      context.dp_group = dp_group_.get();
      context.tp_group = config_.tp > 1 ? tp_group_.get() : nullptr;
      context.dp_rank = position_.dp_rank;
      context.shard = Shard();
      context.shard_param = &shard_param_;
      units_ = std::make_unique<GatheredUnits>(context, owned_, owned_names_, owned_sizes_);
    }
    // ZeRO-3's reference: the same step's shard gradient with every unit gathered at
    // once and one reduction at the end, on the same parameters (not counted).
    at::Tensor whole_step_grad;
    if (units_ != nullptr) {
      units_->GatherAll();
      CheckGathered();
      RunPipeline(variant, inputs, PipelineRun());
      AllReducePartialGradients();
      at::Tensor bucket = Bucket();
      AllReduce(dp_group_.get(), bucket);
      whole_step_grad = bucket.narrow(0, position_.dp_rank * Shard(), Shard()).clone();
      for (const at::Tensor& p : owned_) p.mutable_grad() = at::Tensor();
      units_->ReleaseAll();
    }
    CountedStep step;
    step.resident_bytes = (flat_params_.defined() ? TensorBytes(flat_params_) : param_bytes_) +
                          optimizer_state_bytes_;
    // The model's buffers (RoPE's inverse frequencies), which every rank's model holds.
    for (const at::Tensor& b : built_.model->buffers()) step.resident_bytes += TensorBytes(b);
    for (const at::Tensor& input : inputs) step.resident_bytes += TensorBytes(input);
    ScopedCountingAllocator counting(ScopedCountingAllocator::Record::kTimeline);
    counting.MarkPhase("forward");
    PipelineRun run;
    run.counting = &counting;
    run.units = units_.get();
    const at::Tensor total_loss = RunPipeline(variant, inputs, run).total_loss;
    if (units_ == nullptr) {
      AllReducePartialGradients();  // in place
      ExchangeTiedGradients();      // in place
    }
    counting.MarkPhase("optimizer");
    const int64_t divisor = parallel_.dp * parallel_.micro_batches;
    if (units_ != nullptr) {
      // ZeRO-3: the shard's gradient, reduced unit by unit in the backward.
      at::Tensor mine = units_->TakeGradient();
      step.unit_grad_diff = MaxAbsDiff(mine, whole_step_grad);  // allocates nothing
      mine.div_(static_cast<double>(divisor));
      StepShard(std::move(mine));
    } else if (parallel_.dp == 1) {
      optimizer_->Step();
    } else {
      at::Tensor bucket = Bucket();
      if (parallel_.zero == 2) {
        at::Tensor mine = ReduceScatter(bucket, divisor);
        bucket = at::Tensor();
        for (const at::Tensor& p : owned_) p.mutable_grad() = at::Tensor();
        StepShard(std::move(mine));
      } else {
        AllReduceBucket(bucket, divisor);
        if (parallel_.zero == 0) {
          Unflatten(bucket, OwnedGrads());
          bucket = at::Tensor();
          optimizer_->Step();
        } else {
          for (const at::Tensor& p : owned_) p.mutable_grad() = at::Tensor();
          at::Tensor mine = bucket.narrow(0, position_.dp_rank * Shard(), Shard());
          bucket = at::Tensor();
          StepShard(std::move(mine));
        }
      }
    }
    step.peak = counting.peak();
    step.peak_bytes = step.resident_bytes + step.peak.bytes;
    return step;
  }

  void RecordOptimizer() {
    const OptimizerStateBytes state = optimizer_->StateBytes();
    optimizer_state_bytes_ = state.total;
    adamw_state_bytes_ = request_.optimizer.kind == OptimizerKind::kAdamW ? state.moments : 0;
  }

  const ModelConfig config_;
  const ParallelSpec parallel_;
  const DistributedRequest request_;
  const std::string dir_;
  const RankPosition position_;
  const std::vector<StageRange> chunks_;  // its model chunks, in order
  const bool first_;                      // runs the embedding (the first pipeline rank)
  const bool last_;                       // runs the head and loss (the last pipeline rank)

  ModelAndInput built_;
  std::vector<at::Tensor> parameters_;
  std::unordered_set<const void*> parameter_storages_;
  c10::intrusive_ptr<c10d::Store> store_;
  GroupPtr tp_group_, dp_group_, pp_group_, embedding_group_;
  std::unique_ptr<TensorParallel> tensor_parallel_;
  std::unique_ptr<GatheredUnits> units_;  // ZeRO-3's, for the counted steps
  std::vector<at::Tensor> owned_;
  std::vector<std::string> owned_names_;
  std::vector<std::vector<int64_t>> owned_sizes_;
  bool tied_found_ = false;
  std::vector<at::Tensor> tied_;
  at::Tensor step_grads_;
  at::Tensor flat_params_;  // ZeRO 1, 2: the parameters' flat buffer (HomeParameters)
  at::Tensor shard_param_;  // ZeRO 1-3: what this rank's optimizer steps
  std::unique_ptr<OptimizerRunner> optimizer_;
  int64_t n_params_ = 0, param_bytes_ = 0, grad_bytes_ = 0;
  int64_t optimizer_state_bytes_ = 0, adamw_state_bytes_ = 0;
};

// ---- The parent ------------------------------------------------------------------------

std::string LastLine(const std::string& path) {
  std::ifstream in(path);
  std::string line, last;
  while (std::getline(in, line)) {
    if (!line.empty()) last = line;
  }
  return last.empty() ? "(no output)" : last;
}

// RankProcesses owns the rank processes: killed and reaped if still running when it
// goes out of scope.
class RankProcesses {
 public:
  // kSettle: how long after a rank's failure the others may take to fail with it.
  static constexpr std::chrono::seconds kSettle{1};

  ~RankProcesses() { KillAll(); }

  absl::Status Start(const std::vector<std::string>& argv, const std::string& log) {
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    pid_t pid = 0;
    const int error = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (error != 0) {
      return absl::InternalError(absl::StrCat("cannot start a rank process: ", strerror(error)));
    }
    pids_.push_back(pid);
    return absl::OkStatus();
  }

  // Wait returns when every rank exited 0, or the first rank that failed, or the
  // ranks still running at the deadline (then killed).
  absl::Status Wait(std::chrono::seconds timeout, const std::string& dir) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::vector<bool> done(pids_.size(), false);
    size_t finished = 0;
    // Failed ranks, first seen first. A rank that dies takes the ranks waiting on it in
    // collectives down with it (Gloo sees the connection close): the others that fail
    // within a second are reported too, after it.
    std::vector<std::string> failures;
    std::optional<std::chrono::steady_clock::time_point> first_failure;
    while (finished < pids_.size()) {
      for (size_t r = 0; r < pids_.size(); ++r) {
        if (done[r]) continue;
        int status = 0;
        if (waitpid(pids_[r], &status, WNOHANG) != pids_[r]) continue;
        done[r] = true;
        pids_[r] = 0;
        ++finished;
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
          const std::string how = WIFEXITED(status)
                                      ? absl::StrCat("exited with status ", WEXITSTATUS(status))
                                      : absl::StrCat("was killed by signal ", WTERMSIG(status));
          failures.push_back(
              absl::StrCat("rank ", r, " ", how, ": ", LastLine(RankFile(dir, r, "log"))));
          if (!first_failure) first_failure = std::chrono::steady_clock::now();
        }
      }
      const auto now = std::chrono::steady_clock::now();
      if (first_failure && (finished == pids_.size() || now - *first_failure > kSettle)) {
        return absl::InternalError(absl::StrCat(failures.size(), " of ", pids_.size(),
                                                " ranks failed: ", absl::StrJoin(failures, "; ")));
      }
      if (finished == pids_.size()) break;
      if (now > deadline) {
        // Each unfinished rank with the last thing it said: a rank waiting in a
        // collective for a hung one hangs too, and the logs tell them apart.
        std::vector<std::string> running;
        for (size_t r = 0; r < pids_.size(); ++r) {
          if (!done[r]) {
            running.push_back(absl::StrCat(r, " (\"", LastLine(RankFile(dir, r, "log")), "\")"));
          }
        }
        return absl::DeadlineExceededError(
            absl::StrCat("killed after ", timeout.count(), " s (--rank_timeout_s): rank",
                         running.size() == 1 ? " " : "s ", absl::StrJoin(running, ", "), " of ",
                         pids_.size(), " did not finish"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return absl::OkStatus();
  }

 private:
  void KillAll() {
    for (pid_t pid : pids_) {
      if (pid <= 0) continue;
      kill(pid, SIGKILL);
      int status = 0;
      waitpid(pid, &status, 0);
    }
    pids_.clear();
  }

  std::vector<pid_t> pids_;
};

// TempDir is a private directory, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TEST_TMPDIR");
    if (base == nullptr) base = std::getenv("TMPDIR");
    std::string pattern = absl::StrCat(base != nullptr ? base : "/tmp", "/memledger-ranks-XXXXXX");
    if (mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// RankResult is a rank's result file, parsed.
struct RankResult {
  RankMeasurement measurement;
  std::vector<Piece> grads;  // per variant, `none` first
  Piece params;
  std::vector<std::string> owned;
};

absl::StatusOr<RankResult> ReadRankResult(const std::string& path, size_t variants) {
  std::ifstream in(path);
  if (!in) return absl::InternalError(absl::StrCat("a rank wrote no result: ", path));
  RankResult result;
  RankMeasurement& m = result.measurement;
  std::map<std::string, int64_t*> scalars = {{"n_params", &m.n_params},
                                             {"param_bytes", &m.param_bytes},
                                             {"grad_bytes", &m.grad_bytes},
                                             {"optimizer_state_bytes", &m.optimizer_state_bytes},
                                             {"adamw_state_bytes", &m.adamw_state_bytes}};
  std::string line;
  while (std::getline(in, line)) {
    std::vector<std::string> f = absl::StrSplit(line, ' ');
    bool ok = f.size() >= 2;
    if (ok && f[0] == "variant" && f.size() == 6) {
      RankVariantMeasurement v;
      Piece piece;
      ok = absl::SimpleAtoi(f[2], &v.held_bytes) && absl::SimpleAtoi(f[3], &v.in_flight) &&
           absl::SimpleAtoi(f[4], &piece.offset) && absl::SimpleAtoi(f[5], &piece.length);
      m.variants.push_back(v);
      result.grads.push_back(piece);
    } else if (ok && f[0] == "peak" && f.size() >= 4) {
      // peak V BYTES PHASE OP..., the op's name may have spaces.
      size_t v = 0;
      int64_t bytes = 0;
      ok = absl::SimpleAtoi(f[1], &v) && v < m.variants.size() && absl::SimpleAtoi(f[2], &bytes);
      if (ok) {
        m.variants[v].peak_bytes = bytes;
        m.variants[v].peak_phase = f[3];
        m.variants[v].peak_op = absl::StrJoin(f.begin() + 4, f.end(), " ");
      }
    } else if (ok && f[0] == "unit_grad_diff" && f.size() == 3) {
      size_t v = 0;
      ok = absl::SimpleAtoi(f[1], &v) && v < m.variants.size() &&
           absl::SimpleAtod(f[2], &m.variants[v].unit_grad_diff);
    } else if (ok && f[0] == "params" && f.size() == 3) {
      ok = absl::SimpleAtoi(f[1], &result.params.offset) &&
           absl::SimpleAtoi(f[2], &result.params.length);
    } else if (ok && f[0] == "owned") {
      result.owned.push_back(f[1]);
    } else if (ok && scalars.count(f[0]) == 1) {
      ok = absl::SimpleAtoi(f[1], scalars[f[0]]);
    } else {
      ok = false;
    }
    if (!ok) return absl::InternalError(absl::StrCat("bad line in ", path, ": ", line));
  }
  if (m.variants.size() != variants) {
    return absl::InternalError(
        absl::StrCat(path, " has ", m.variants.size(), " variants, expected ", variants));
  }
  return result;
}

// MaxDiff is max |a - b| (0 where they are equal, infinities too); NaN if either has a
// NaN the other lacks. With `nan_equal`, NaN in both at one position counts as equal (a
// pure fp16 AdamW step makes NaN and inf where g^2 underflows, sharded or not).
double MaxDiff(const at::Tensor& a, const at::Tensor& b, bool nan_equal = false) {
  if (a.numel() == 0) return 0;
  at::Tensor same = a == b;
  if (nan_equal) same = same | (a.isnan() & b.isnan());
  at::Tensor diff = (a - b).abs().masked_fill(same, 0);
  return diff.max().item<double>();
}

absl::StatusOr<DistributedMeasurement> MeasureOrThrow(const ModelConfig& config,
                                                      const ParallelSpec& parallel,
                                                      const DistributedRequest& request,
                                                      const std::vector<std::string>& command) {
  TempDir dir;
  if (dir.path().empty()) return absl::InternalError("cannot create a directory for the ranks");
  const int64_t world = WorldSize(config.tp, parallel);
  {
    RankProcesses processes;
    for (int64_t r = 0; r < world; ++r) {
      std::vector<std::string> argv = command;
      argv.push_back(absl::StrCat(kRankWorkerFlag, dir.path(), ":", r));
      if (absl::Status s = processes.Start(argv, RankFile(dir.path(), r, "log")); !s.ok()) {
        return s;
      }
    }
    if (absl::Status s = processes.Wait(std::chrono::seconds(request.timeout_s), dir.path());
        !s.ok()) {
      return s;
    }
  }

  // The single-process reference: the whole batch's gradients, and the parameters
  // before the step.
  ConfigureThreads();
  UseNativeKernels();
  ModelAndInput built = BuildModel(SingleProcessConfig(config, parallel), request.seed);
  ForwardWithVariant(*built.model, built.input, request.attention, Variant()).loss.backward();
  std::map<std::string, at::Tensor> initial_params, reference_grads;
  for (const auto& item : built.model->named_parameters()) {
    reference_grads[item.key()] = item.value().grad().to(at::kFloat);
    initial_params[item.key()] = item.value().detach();
  }

  const std::vector<Variant> variants = WithReference(request.variants);
  std::vector<RankResult> results;
  for (int64_t r = 0; r < world; ++r) {
    absl::StatusOr<RankResult> result =
        ReadRankResult(RankFile(dir.path(), r, "txt"), variants.size());
    if (!result.ok()) return result.status();
    for (const std::string& name : result->owned) {
      if (reference_grads.count(name) == 0) {
        return absl::InternalError(absl::StrCat("rank ", r, " owns an unknown parameter ", name));
      }
    }
    results.push_back(*std::move(result));
  }

  // Per stage, the unsharded step: the stage's parameters stepped on the gradients its
  // ranks reduced, gathered from their pieces. Each rank's updated parameters must match
  // its piece of it: ZeRO's sharded step and all-gather change nothing. (Against the
  // single process's own step instead, AdamW's first update, about lr x g / |g|, would
  // magnify rounding in the near-zero gradients.)
  // By (stage, tp rank): the ranks that hold the same parameters. The flat updated
  // parameters, fp32.
  std::map<std::pair<int64_t, int64_t>, at::Tensor> stepped;
  auto shard_of = [&](const RankPosition& p) { return std::make_pair(p.stage, p.tp_rank); };
  for (int64_t r = 0; r < world; ++r) {
    const auto stage = shard_of(PositionOf(r, config.tp, parallel));
    const RankResult& result = results[r];
    const int64_t n = result.measurement.n_params;
    if (stepped.count(stage) == 0) stepped[stage] = at::zeros({n}, at::kFloat);
    // Reuse the slot for the gathered gradients until the stage's step below.
    const Piece& piece = result.grads[0];
    stepped[stage]
        .narrow(0, piece.offset, piece.length)
        .copy_(ReadPiece(RankFile(dir.path(), r, "grad0"), piece.length));
  }
  for (auto& [stage, flat] : stepped) {
    // dp rank 0 of them: rank = tp_rank + tp x dp x stage.
    const RankResult& any = results[stage.second + config.tp * parallel.dp * stage.first];
    std::vector<at::Tensor> params;
    int64_t offset = 0;
    for (const std::string& name : any.owned) {
      at::Tensor p = TakeShard(initial_params[name], ShardOf(config, name, stage.second))
                         .clone()
                         .requires_grad_(true);
      p.mutable_grad() = flat.narrow(0, offset, p.numel()).view(p.sizes()).to(p.scalar_type());
      offset += p.numel();
      params.push_back(p);
    }
    OptimizerRunner optimizer(request.optimizer, params);
    optimizer.Step();
    flat = Flat(params, 0).to(at::kFloat);
  }

  DistributedMeasurement measurement;
  measurement.parallel = parallel;
  for (int64_t r = 0; r < world; ++r) {
    RankResult& result = results[r];
    RankMeasurement& m = result.measurement;
    m.position = PositionOf(r, config.tp, parallel);
    std::vector<at::Tensor> grads;
    for (const std::string& name : result.owned) {
      grads.push_back(TakeShard(reference_grads[name], ShardOf(config, name, m.position.tp_rank)));
    }
    const at::Tensor flat_grads = Flat(grads, 0);
    for (size_t v = 0; v < variants.size(); ++v) {
      const Piece& piece = result.grads[v];
      m.variants[v].variant = variants[v];
      m.variants[v].max_grad_diff =
          MaxDiff(ReadPiece(RankFile(dir.path(), r, absl::StrCat("grad", v)), piece.length),
                  flat_grads.narrow(0, piece.offset, piece.length));
    }
    m.max_param_diff =
        MaxDiff(ReadPiece(RankFile(dir.path(), r, "params"), result.params.length),
                stepped[shard_of(m.position)].narrow(0, result.params.offset, result.params.length),
                /*nan_equal=*/true);
    measurement.ranks.push_back(std::move(m));
  }
  return measurement;
}

}  // namespace

RankPosition PositionOf(int64_t rank, int64_t tp, const ParallelSpec& parallel) {
  const int64_t outer = rank / tp;  // dp_rank + dp x stage
  return RankPosition{rank, rank % tp, outer % parallel.dp, outer / parallel.dp};
}

int64_t WorldSize(int64_t tp, const ParallelSpec& parallel) {
  return tp * parallel.dp * parallel.pp;
}

absl::StatusOr<DistributedMeasurement> MeasureDistributed(const ModelConfig& config,
                                                          const ParallelSpec& parallel,
                                                          const DistributedRequest& request,
                                                          const std::vector<std::string>& command) {
  if (absl::Status s = ValidateDistributed(config, parallel, request); !s.ok()) return s;
  try {
    return MeasureOrThrow(config, parallel, request, command);
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("LibTorch: ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("runtime: ", e.what()));
  }
}

int RunRankWorker(const ModelConfig& config, const ParallelSpec& parallel,
                  const DistributedRequest& request, absl::string_view worker) {
  const size_t colon = worker.rfind(':');
  int64_t rank = -1;
  if (colon == absl::string_view::npos || !absl::SimpleAtoi(worker.substr(colon + 1), &rank) ||
      rank < 0 || rank >= WorldSize(config.tp, parallel)) {
    std::cerr << "memledger rank: bad " << kRankWorkerFlag << worker << "\n";
    return 2;
  }
  // A rank dies with the verify that started it (killed, or interrupted by the user)
  // rather than wait in a collective for ranks that are gone.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (absl::Status s = ValidateDistributed(config, parallel, request); !s.ok()) {
    std::cerr << "memledger rank " << rank << ": " << s.message() << "\n";
    return 2;
  }
  try {
    Rank(config, parallel, request, std::string(worker.substr(0, colon)), rank).Run();
  } catch (const c10::Error& e) {
    std::cerr << "memledger rank " << rank << ": LibTorch: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "memledger rank " << rank << ": " << e.what() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace memledger::runtime
