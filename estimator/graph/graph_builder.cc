// GraphBuilder's members that peft's LoRA adapts (estimator/graph/graph_builder.h).
#include "estimator/graph/graph_builder.h"

#include <algorithm>
#include <string>
#include <vector>

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
  return config_.lora.Targets(name) ? Adapted(name, x, result, in, out, true) : result;
}

// Adapted is peft's lora.Linear (peft 0.21.2, tuners/lora/layer.py, Linear.forward)
// around a base layer's `result` of `x`, an nn.Linear or GPT-2's Conv1D (dispatch_default
// wraps both in lora.Linear): base_layer(x) + lora_B(lora_A(dropout(x))) * scaling;
// lora_A (r, in) and lora_B (out, r) registered after the base layer in fp32
// (kLoraAdapterDtype), the dropout (p > 0) its own noise, `* scaling` a Python float; a
// bf16 model's fp32 sum is cast back (result.to()).
int GraphBuilder::Adapted(const std::string& name, int x, int result, SymDim in,
                          SymDim out, bool fan_in_fan_out) {
  const SymDim r = Sym(config_.lora.rank);
  const DType adapter = kLoraAdapterDtype;
  // _cast_input_dtype: x.to() the adapter's dtype (a copy of a bf16 input).
  const int cast = ToDtype(name + ".lora_input", x, adapter);
  const int a_weight = AddTensor(name + ".lora_A.weight", adapter, true, {r, in});
  const int b_weight = AddTensor(name + ".lora_B.weight", adapter, true, {out, r});
  if (config_.lora.dora) {
    const int back = Dora(name, cast, result, a_weight, b_weight, in, out, fan_in_fan_out);
    HeldThroughHere({x, cast});  // the call's argument and forward's local `x`
    return back;
  }
  const int dropped = Dropout(name + ".lora_dropout", cast, config_.lora.dropout);
  const int a = MatmulFolded(name + ".lora_A", dropped, a_weight, in, r);
  const int b = MatmulFolded(name + ".lora_B", a, b_weight, r, out);
  const int scaled = MulWrapped(name + ".lora_scaling", b);
  const int sum = Op1(OpType::kAdd, name + ".lora", {result, scaled});
  const int back = ToDtype(name + ".lora_result", sum, graph_.tensors[result].dtype);
  HeldThroughHere({x, cast});  // the call's argument and forward's local `x`, to its return
  return back;
}

// Dora mirrors peft 0.21.2's DoRA (tuners/lora/variants.py, DoraLinearVariant.forward;
// tuners/lora/dora.py, DoraLinearLayer.forward), the magnitude vector (out, fp32)
// registered after lora_B:
//   x = dropout(x); base_result = result unless the dropout is a module (then None)
//   lora_weight = lora_B(lora_A(eye(in))).T.to(x.dtype)       get_lora_weight
//   weight = base_layer.weight.to(x.dtype)
//   weight_norm = linalg.norm(transpose(weight, fan_in_fan_out)
//                             + scaling * lora_weight.detach(), dim=1).detach()
//   mag_norm_scale = (magnitude / weight_norm).view(1, -1)
//   lora_result = lora_B(lora_A(x))
//   base_result = base_result - bias, or F.linear(x, transpose(weight, fan_in_fan_out))
//   result_dora = (mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result * scaling
//   return result + result_dora, .to(the base result's dtype)
// lora_weight is read only detached, so its branch's nodes never run: what they save
// lives until the forward's locals die (OpDef::no_grad, node_held_until). Autocast
// caches its casts of lora_A and lora_B, which the adapter's own matmuls then reuse.
int GraphBuilder::Dora(const std::string& name, int x, int result, int a_weight,
                       int b_weight, SymDim in, SymDim out, bool fan_in_fan_out) {
  const DType adapter = kLoraAdapterDtype;
  auto parameter = [&](const std::string& tensor) {
    for (size_t t = 0; t < graph_.tensors.size(); ++t) {
      if (graph_.tensors[t].is_parameter && graph_.tensors[t].name == tensor) {
        return static_cast<int>(t);
      }
    }
    return -1;
  };
  const int weight = parameter(name + ".weight");
  const int bias = parameter(name + ".bias");
  const int magnitude = AddTensor(name + ".lora_magnitude_vector.weight", adapter, true, {out});
  const bool dropout = config_.lora.dropout > 0;
  const int dropped = Dropout(name + ".lora_dropout", x, config_.lora.dropout);

  // get_lora_weight: F.linear of a 2-D input is mm(input, weight.t()), autocast casting
  // the weight, then the input. The casts of lora_A and lora_B are autocast's cached
  // ones, which the adapter's own matmuls reach: they alone of the branch have grad.
  const size_t dead_from = graph_.ops.size();
  std::vector<size_t> casts;
  auto cached_cast = [&](const std::string& cast_name, int param) {
    const int cast = Lower(cast_name, param);
    if (cast != param) casts.push_back(graph_.ops.size() - 1);
    return cast;
  };
  const int eye = Op1(OpType::kEye, name + ".dora.eye", {}, {.shape = {in}}, std::nullopt, adapter);
  int a_cast, b_cast, eye_arg, a_arg, b_t, lora_weight;
  {
    Composite call(this);
    a_cast = cached_cast(name + ".lora_A.weight", a_weight);
    eye_arg = Lower(name + ".dora.eye", eye);
    const int a_t = Op1(OpType::kT, name + ".dora.lora_A.weight_t", {a_cast});
    lora_weight = Op1(OpType::kMm, name + ".dora.lora_A", {eye_arg, a_t}, {}, OpKind::kMatmul);
  }
  {
    Composite call(this);
    b_cast = cached_cast(name + ".lora_B.weight", b_weight);
    a_arg = Lower(name + ".dora.lora_A.out", lora_weight);
    b_t = Op1(OpType::kT, name + ".dora.lora_B.weight_t", {b_cast});
    lora_weight = Op1(OpType::kMm, name + ".dora.lora_B", {a_arg, b_t}, {}, OpKind::kMatmul);
  }
  lora_weight = Op1(OpType::kT, name + ".dora.lora_weight", {lora_weight});
  HeldThroughHere({eye});  // get_lora_weight's x_eye, to its return
  lora_weight = ToDtype(name + ".dora.lora_weight.to", lora_weight, adapter);
  for (size_t op = dead_from; op < graph_.ops.size(); ++op) {
    graph_.ops[op].no_grad = std::find(casts.begin(), casts.end(), op) == casts.end();
  }

  const int weight_x = ToDtype(name + ".dora.weight", weight, adapter);
  const int weight_oi =
      fan_in_fan_out ? Op1(OpType::kT, name + ".dora.weight_t", {weight_x}) : weight_x;
  // get_weight_norm: `weight + scaling * lora_weight`, the product dying with the
  // statement, the sum with the call.
  const int scaled = MulWrapped(name + ".dora.scaled_lora_weight", lora_weight);
  const int summed = Op1(OpType::kAdd, name + ".dora.adapted_weight", {weight_oi, scaled});
  const int weight_norm = Op1(OpType::kLinalgVectorNorm, name + ".dora.weight_norm", {summed});
  const int ratio = Op1(OpType::kDivTensor, name + ".dora.mag_norm_scale", {magnitude, weight_norm});
  const int scale = Op1(OpType::kView, name + ".dora.mag_norm_scale.view", {ratio},
                        {.shape = {Sym(1), out}});
  const int a = MatmulFolded(name + ".lora_A", dropped, a_cast, in, Sym(config_.lora.rank));
  const int lora_result = MatmulFolded(name + ".lora_B", a, b_cast, Sym(config_.lora.rank), out);
  int base_result = result;
  if (dropout) {
    // F.linear(x, transpose(weight, fan_in_fan_out)): the dropped input times the weight.
    const int w = fan_in_fan_out ? weight_oi : weight_x;
    base_result = MatmulFolded(name + ".dora.base", dropped, w, in, out);
  } else if (bias >= 0) {
    base_result = Op1(OpType::kSub, name + ".dora.base_result", {result, bias});
  }
  const int minus_one = Op1(OpType::kAddWrappedInt, name + ".dora.mag_norm_scale_minus_1", {scale});
  const int base_part = Op1(OpType::kMulTensor, name + ".dora.base_part", {minus_one, base_result});
  const int lora_part = Op1(OpType::kMulTensor, name + ".dora.lora_part", {scale, lora_result});
  const int lora_scaled = MulWrapped(name + ".dora.lora_scaling", lora_part);
  const int result_dora = Op1(OpType::kAdd, name + ".dora", {base_part, lora_scaled});
  // DoraLinearLayer.forward's locals, to its return; and what the dead branch's nodes
  // save (mm's self_ for the weight's gradient, mat2_ for self's).
  HeldThroughHere({lora_weight, weight_x, weight_norm, scale, lora_result, base_result});
  const int last = static_cast<int>(graph_.ops.size()) - 1;
  for (int t : {eye_arg, a_arg, b_t}) graph_.node_held_until.emplace_back(t, last);
  const int sum = Op1(OpType::kAdd, name + ".lora", {result, result_dora});
  const int back = ToDtype(name + ".lora_result", sum, graph_.tensors[result].dtype);
  HeldThroughHere({dropped});  // DoraLinearVariant.forward's `x`, to its return
  return back;
}

}  // namespace memledger
