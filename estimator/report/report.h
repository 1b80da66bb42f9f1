// Renders a Prediction for people and programs: the study's JSON schema (via
// RapidJSON), a table with human units, and the per-op breakdown (--explain).
#ifndef ESTIMATOR_REPORT_REPORT_H_
#define ESTIMATOR_REPORT_REPORT_H_

#include <cstdint>
#include <string>

#include "estimator/spec/config.h"
#include "estimator/step/liveness.h"
#include "estimator/predict/predict.h"
#include "estimator/predict/ranks.h"
#include "rapidjson/document.h"

namespace memledger {

// ParameterBuckets are the parameter-side keys, predicted or measured.
struct ParameterBuckets {
  int64_t n_params = 0;
  int64_t param_bytes = 0;
  int64_t grad_bytes = 0;
  int64_t optimizer_state_bytes = 0;
  int64_t adamw_state_bytes = 0;  // reported for AdamW only
};

// StudyJsonHead starts a report object the way the study's does: config, attention,
// torch (kTorchRelease), dtype, optimizer, n_params, param_bytes, grad_bytes,
// optimizer_state_bytes and, for AdamW, adamw_state_bytes.
rapidjson::Document StudyJsonHead(const ModelConfig& config, AttentionMode attention,
                                  const OptimizerSpec& optimizer,
                                  const ParameterBuckets& buckets);

// PredictionJson holds the study's keys (config, n_params, param_bytes, grad_bytes,
// adamw_state_bytes, saved_bytes, saved_ratio_vs_none, predicted_saved_bytes_none,
// measured_over_predicted: here the exact prediction over Korthikanti's) plus
// attention, policy, cache_bytes and, if the prediction has one, the breakdown.
rapidjson::Document PredictionJson(const Prediction& prediction);

// PeakJson is a step peak as {"bytes", "phase", "op", "by_category": {category: bytes}}.
rapidjson::Value PeakJson(const StepPeak& peak, rapidjson::Document::AllocatorType& allocator);

// JsonString serializes with two-space indentation and a final newline.
std::string JsonString(const rapidjson::Value& value);

// PredictionTable is a table with exact bytes and human units. `scope`, if given, says
// whose numbers they are (in place of the tensor-parallel line).
std::string PredictionTable(const Prediction& prediction, const std::string& scope = "");

// RankView is `whole` (the model's prediction) seen from one kind of rank: its
// parameters, gradients, optimizer state and held activations in place of the whole
// model's, Korthikanti's per-GPU formula for it, and no peaks.
Prediction RankView(const Prediction& whole, const RankKind& kind);

// ParallelJson is the layout: dp, tp, sp, pp, virtual_stages, micro_batches, schedule,
// zero, world_size and how the data-parallel ranks run.
rapidjson::Value ParallelJson(const ParallelSpec& parallel,
                              rapidjson::Document::AllocatorType& allocator);

// RanksJson is PredictionJson of the most loaded rank (RankView of ranks.kinds[0]) plus
// "parallel" (the layout) and "ranks": every kind of rank, the most loaded first, with
// its position (stage, layers, embedding, head), how many ranks share it, its buckets
// and, per variant, its saved bytes, micro-batches in flight and total.
rapidjson::Document RanksJson(const Prediction& whole, const RanksPrediction& ranks);

// RanksTable is PredictionTable of the most loaded rank, then a row per kind of rank.
std::string RanksTable(const Prediction& whole, const RanksPrediction& ranks);

// BreakdownText lists every kept storage of each kind of block, op by op, with the
// arithmetic's factors (shape, dtype) and bytes. REQUIRES: predicted with breakdown.
std::string BreakdownText(const Prediction& prediction);

}  // namespace memledger

#endif  // ESTIMATOR_REPORT_REPORT_H_
