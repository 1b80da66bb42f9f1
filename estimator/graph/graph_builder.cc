// GraphBuilder's members that peft's LoRA adapts (estimator/graph/graph_builder.h).
#include "estimator/graph/graph_builder.h"

#include <string>

namespace memledger {

// Conv1D is GPT-2's linear: addmm(bias, x.view(-1, in), weight) with weight (in, out),
// or where config.lora targets it peft's lora.Linear around it (Adapted).
// Autocast casts addmm's arguments last to first: weight, input, bias.
int GraphBuilder::Conv1D(const std::string& name, int x, SymDim in, SymDim out) {
  int result;
  {
    Composite call(this);
    int weight = Param(name + ".weight", {in, out});  // the module's order: weight, bias
    int bias = Param(name + ".bias", {out});
    weight = Lower(name + ".weight", weight);
    int flat = Lower(name + ".input",
                     Op1(OpType::kView, name + ".flatten", {x}, {.shape = {kB * kT, in}}));
    bias = Lower(name + ".bias", bias);
    int mm = Op1(OpType::kAddmm, name, {bias, flat, weight}, {}, OpKind::kMatmul);
    result = Op1(OpType::kView, name + ".unflatten", {mm}, {.shape = {kB, kT, out}});
  }
  return config_.lora.Targets(name) ? Adapted(name, x, result, in, out) : result;
}

// Adapted is peft's lora.Linear (peft 0.21.2, tuners/lora/layer.py, Linear.forward)
// around a base layer's `result` of `x`, an nn.Linear or GPT-2's Conv1D (dispatch_default
// wraps both in lora.Linear): base_layer(x) + lora_B(lora_A(dropout(x))) * scaling;
// lora_A (r, in) and lora_B (out, r) registered after the base layer in fp32
// (kLoraAdapterDtype), the dropout (p > 0) its own noise, `* scaling` a Python float; a
// bf16 model's fp32 sum is cast back (result.to()).
int GraphBuilder::Adapted(const std::string& name, int x, int result, SymDim in,
                          SymDim out) {
  const SymDim r = Sym(config_.lora.rank);
  const DType adapter = kLoraAdapterDtype;
  // _cast_input_dtype: x.to() the adapter's dtype (a copy of a bf16 input).
  const int cast = ToDtype(name + ".lora_input", x, adapter);
  const int dropped = Dropout(name + ".lora_dropout", cast, config_.lora.dropout);
  const int a = MatmulFolded(name + ".lora_A", dropped,
                             AddTensor(name + ".lora_A.weight", adapter, true, {r, in}), in, r);
  const int b = MatmulFolded(name + ".lora_B", a,
                             AddTensor(name + ".lora_B.weight", adapter, true, {out, r}), r, out);
  const int scaled = MulWrapped(name + ".lora_scaling", b);
  const int sum = Op1(OpType::kAdd, name + ".lora", {result, scaled});
  const int back = ToDtype(name + ".lora_result", sum, graph_.tensors[result].dtype);
  HeldThroughHere({x, cast});  // the call's argument and forward's local `x`, to its return
  return back;
}

}  // namespace memledger
