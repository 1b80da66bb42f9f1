// The decoder model around the families' layers, written with GraphBuilder: the
// model-level tensors its forward makes for the layers (DecoderModelTensors) and a model
// whose layers differ by attention span (GraphsByLayerAttention). Used by
// estimator/families/ only.
#ifndef ESTIMATOR_GRAPH_DECODER_MODEL_H_
#define ESTIMATOR_GRAPH_DECODER_MODEL_H_

#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "estimator/graph/block_graph.h"
#include "estimator/graph/graph_builder.h"
#include "estimator/spec/config.h"

namespace memledger {

// DecoderModelTensors is the graph of the model-level tensors that `readers` read, as the
// decoder model's forward makes them without grad (LlamaModel.forward,
// modeling_llama.py:375-388, and its look-alikes, after the embeddings; GPT2Model's
// position ids before them): position_ids, the sliding-window layers' mask
// (causal_mask_mapping), then each rotary embedding's tables, the global one's and the
// sliding layers' own (one call per layer type; equal in size, so their order, a Python
// set's, moves no peak).
inline BlockGraph DecoderModelTensors(const ModelConfig& config,
                                      const std::vector<const BlockGraph*>& readers) {
  // read: the dtype in which a reader reads `id`, if one does.
  auto read = [&](ModelTensor id) -> std::optional<DType> {
    for (const BlockGraph* reader : readers) {
      for (const TensorDef& tensor : reader->tensors) {
        if (tensor.global == id) return tensor.dtype;
      }
    }
    return std::nullopt;
  };
  GraphBuilder g(config);
  int last = -1;
  auto returns = [&](int tensor, ModelTensor id) {
    g.Returns(tensor, id);
    last = tensor;
  };
  if (read(ModelTensor::kPositionIds)) returns(g.PositionIds(), ModelTensor::kPositionIds);
  if (read(ModelTensor::kSlidingMask)) {
    returns(g.SlidingWindowMaskTensor(), ModelTensor::kSlidingMask);
  }
  for (const auto& [cos, sin, name] :
       {std::tuple{ModelTensor::kRopeCos, ModelTensor::kRopeSin, "rotary_emb"},
        std::tuple{ModelTensor::kRopeLocalCos, ModelTensor::kRopeLocalSin, "rotary_emb_local"}}) {
    const std::optional<DType> dtype = read(cos);
    if (!dtype.has_value()) continue;
    const auto [cos_table, sin_table] = g.RopeTables(name, *dtype);
    returns(cos_table, cos);
    returns(sin_table, sin);
  }
  return g.Finish(last);
}
// The layers' tensors, made after the embeddings.
inline BlockGraph DecoderModelTensors(const ModelConfig& config,
                                      const std::vector<BlockGraph>& layer_kinds) {
  std::vector<const BlockGraph*> readers;
  for (const BlockGraph& kind : layer_kinds) readers.push_back(&kind);
  return DecoderModelTensors(config, readers);
}

// GraphsByLayerAttention: a model of sliding-window and full layers, one layer kind per
// attention span its pattern has, in the pattern's order of first appearance; `layer`
// builds a kind.
template <typename BuildLayer>
ModelGraphs GraphsByLayerAttention(const ModelConfig& config, BlockGraph prologue,
                                   BlockGraph epilogue, BuildLayer layer) {
  ModelGraphs graphs;
  graphs.prologue = std::move(prologue);
  graphs.epilogue = std::move(epilogue);
  std::vector<LayerAttention> period = {LayerAttention::kFull};
  if (!config.layer_attention.empty()) period = config.LayerAttentionPeriod();
  graphs.pattern.clear();
  std::vector<LayerAttention> kinds;
  for (LayerAttention type : period) {
    size_t kind = 0;
    while (kind < kinds.size() && kinds[kind] != type) ++kind;
    if (kind == kinds.size()) {
      kinds.push_back(type);
      graphs.layer_kinds.push_back(layer(type));
    }
    graphs.pattern.push_back(static_cast<int>(kind));
  }
  graphs.tensors_after_prologue = DecoderModelTensors(config, graphs.layer_kinds);
  return graphs;
}

}  // namespace memledger

#endif  // ESTIMATOR_GRAPH_DECODER_MODEL_H_
