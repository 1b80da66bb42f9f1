#include "runtime/megatron_functions.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <memory>
#include <utility>
#include <vector>

namespace memledger::runtime::distributed_internal {
namespace {

namespace ag = torch::autograd;

c10d::ProcessGroupGloo* GroupOf(ag::AutogradContext* ctx) {
  return reinterpret_cast<c10d::ProcessGroupGloo*>(ctx->saved_data["group"].toInt());
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

}  // namespace

std::unique_ptr<TensorParallel> MakeGlooTensorParallel(GroupPtr group, int64_t rank,
                                                       int64_t size, bool sequence_parallel) {
  return std::make_unique<GlooTensorParallel>(std::move(group), rank, size, sequence_parallel);
}

}  // namespace memledger::runtime::distributed_internal
