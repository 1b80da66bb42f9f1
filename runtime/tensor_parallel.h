// TensorParallel: the collectives a tensor-parallel rank's model calls at Megatron's
// communication points. The model code (runtime/families/, selective_ops.cc) calls this
// interface; runtime/megatron_functions.cc implements it over a c10d Gloo group.
#ifndef RUNTIME_TENSOR_PARALLEL_H_
#define RUNTIME_TENSOR_PARALLEL_H_

#include <ATen/core/Tensor.h>

namespace memledger::runtime {

// TensorParallel is what a tensor-parallel rank's model calls at Megatron's
// communication points (runtime/megatron_functions.cc implements it over a c10d
// group). None of them keeps a tensor for backward beyond what is said.
class TensorParallel {
 public:
  virtual ~TensorParallel() = default;
  // CopyIn is Megatron's f before column-parallel linears: the identity forward, an
  // all-reduce of the gradient backward.
  virtual at::Tensor CopyIn(const at::Tensor& x) = 0;
  // ReduceOut is g after row-parallel linears: the partial sums all-reduced in place
  // and returned (Megatron's _ReduceFromModelParallelRegion), the identity backward.
  // With `reduced`, x already holds the sum (a selective cache's replay returns the
  // output the recording forward reduced in place): the identity both ways.
  virtual at::Tensor ReduceOut(const at::Tensor& x, bool reduced) = 0;
  // VocabEmbedding looks `ids` up in this rank's rows of the vocabulary (zeros for the
  // others' tokens) and all-reduces in place; it keeps Megatron's masked ids (int64)
  // and mask (bool), each of ids' shape.
  virtual at::Tensor VocabEmbedding(const at::Tensor& ids, const at::Tensor& weight) = 0;
  // VocabCrossEntropy is cross_entropy(ignore_index=-100, mean) over logits whose
  // vocabulary columns are split over the ranks ((N, V / tp) fp32 here; labels (N)).
  // As Megatron's, it turns the logits into their softmax in place and keeps them, with
  // the masked targets (int64, N) and the target mask (bool, N); backward turns the
  // softmax into the gradient in place.
  virtual at::Tensor VocabCrossEntropy(const at::Tensor& logits, const at::Tensor& labels) = 0;

  // SequenceParallel: Megatron's sequence parallelism is on: outside the column- and
  // row-parallel regions, hidden states hold this rank's seq / tp tokens.
  virtual bool SequenceParallel() const = 0;
  // Scatter: this rank's tokens of x (B, T, D), a new (B, T / tp, D) tensor; backward
  // all-gathers. Keeps nothing.
  virtual at::Tensor Scatter(const at::Tensor& x) = 0;
  // ReduceScatter: this rank's tokens of the sum of the ranks' partial (B, T, D), a new
  // tensor, the partial summed in place (`reduced`: x already holds the sum, as in
  // ReduceOut); backward all-gathers. Keeps nothing.
  virtual at::Tensor ReduceScatter(const at::Tensor& x, bool reduced) = 0;
  // GatherLinear: x (B, T / tp, in) all-gathered along the sequence, times the weight,
  // plus bias where defined: (B, T, out). The weight is (out, in) as nn.Linear's, or
  // with `conv1d` (in, out) as GPT-2's Conv1D; its gradient comes in its own layout.
  // Keeps x and the weight (backward gathers x again and reduce-scatters x's gradient).
  // With `cached`, returns *cached instead of computing it (selective recompute).
  virtual at::Tensor GatherLinear(const at::Tensor& x, const at::Tensor& weight,
                                  const at::Tensor& bias, bool conv1d,
                                  const at::Tensor* cached) = 0;
};

}  // namespace memledger::runtime

#endif  // RUNTIME_TENSOR_PARALLEL_H_
