#include "verify/verify_ranks.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "estimator/spec/checked_math.h"
#include "estimator/graph/family.h"
#include "estimator/step/liveness.h"
#include "estimator/report/report.h"
#include "estimator/graph/rules.h"
#include "estimator/report/units.h"
#include "verify/verify_report.h"

namespace memledger {
namespace {

using Allocator = rapidjson::Document::AllocatorType;

rapidjson::Value Key(const std::string& s, Allocator& a) { return rapidjson::Value(s, a); }

const RankKind* KindOfStage(const RanksPrediction& prediction, int64_t stage) {
  for (const RankKind& kind : prediction.kinds) {
    if (kind.stage == stage) return &kind;
  }
  return nullptr;
}

// PredictedVariant: the kind's prediction of `variant`; null when not predicted.
const RankVariant* PredictedVariant(const RankKind* kind, const Variant& variant) {
  if (kind == nullptr) return nullptr;
  for (const RankVariant& v : kind->variants) {
    if (v.held.variant.Name() == variant.Name()) return &v;
  }
  return nullptr;
}

std::string RankName(const runtime::RankPosition& p) {
  return absl::StrCat("rank ", p.rank, " (tp ", p.tp_rank, ", dp ", p.dp_rank, ", stage ", p.stage,
                      ")");
}

}  // namespace

double RankGradTolerance(const ModelConfig& config, const ParallelSpec& parallel) {
  const DType compute = config.amp != DType::kFloat32 ? config.amp : config.dtype;
  double eps = 0x1p-23;  // fp32 (and wider: none is computed in)
  if (compute == DType::kBFloat16) eps = 0x1p-7;
  if (compute == DType::kFloat16) eps = 0x1p-10;
  const int64_t n = std::max({config.width, config.Intermediate(), config.moe.intermediate,
                              config.heads * config.HeadDim(), config.vocab,
                              config.batch * config.seq * parallel.micro_batches * parallel.dp});
  return 2 * std::sqrt(static_cast<double>(n)) * eps;
}

absl::StatusOr<RanksVerifyReport> VerifyRanks(const ModelConfig& config,
                                              const ParallelSpec& parallel,
                                              const runtime::DistributedRequest& request,
                                              double grad_tolerance, int64_t max_memory_bytes,
                                              const std::vector<std::string>& command) {
  PredictOptions options;
  options.attention = request.attention;
  options.variants = request.variants;
  options.optimizer = request.optimizer;
  // The ranks run one intra-op thread each (the machine's cores are shared), and
  // selective checkpoints without a Python dispatch mode.
  options.cpu_threads = 1;
  options.python_dispatch_mode = false;
  absl::StatusOr<RanksPrediction> prediction = PredictRanks(config, parallel, options);
  if (!prediction.ok()) return prediction.status();
  options.peak = false;
  // Every rank process, and the reference, holds the whole model and batch.
  ModelConfig whole_batch = config;
  whole_batch.batch = config.batch * parallel.dp * parallel.micro_batches;
  whole_batch.shard.tp = 1;
  whole_batch.shard.sp = false;
  absl::StatusOr<Prediction> whole = Predict(whole_batch, options);
  if (!whole.ok()) return whole.status();
  const CheckedInt64 footprint =
      CheckedInt64(PredictedFootprintBytes(*whole)) *
      (parallel.tp * parallel.dp * parallel.pp + 1);
  if (absl::Status s =
          CheckFootprint(footprint.overflowed() ? INT64_MAX : footprint.value(), max_memory_bytes);
      !s.ok()) {
    return s;
  }
  absl::StatusOr<runtime::DistributedMeasurement> measurement =
      runtime::MeasureDistributed(config, parallel, request, command);
  if (!measurement.ok()) return measurement.status();

  RanksVerifyReport report;
  report.config = config;
  report.parallel = parallel;
  report.request = request;
  report.grad_tolerance = grad_tolerance;
  const bool fullest_only = DataParallelOf(parallel) == DataParallel::kFsdp2;
  for (runtime::RankMeasurement& m : measurement->ranks) {
    const RankKind* kind = KindOfStage(*prediction, m.position.stage);
    if (kind == nullptr) {
      return absl::InternalError(
          absl::StrCat("no predicted rank kind for stage ", m.position.stage));
    }
    RankCheck check;
    check.buckets.push_back(CheckBucket("n_params", kind->n_params, m.n_params));
    check.buckets.push_back(CheckBucket("param_bytes", kind->param_bytes, m.param_bytes));
    check.buckets.push_back(CheckBucket("grad_bytes", kind->grad_bytes, m.grad_bytes));
    check.buckets.push_back(
        CheckBucket("optimizer_state_bytes", kind->optimizer_state_bytes, m.optimizer_state_bytes));
    if (request.optimizer.kind == OptimizerKind::kAdamW) {
      check.buckets.push_back(
          CheckBucket("adamw_state_bytes", kind->adamw_state_bytes, m.adamw_state_bytes));
    }
    // Per requested variant: what the schedule held at once, and how many micro-batches.
    for (const RankVariant& predicted : kind->variants) {
      const std::string name = predicted.held.variant.Name();
      for (const runtime::RankVariantMeasurement& v : m.variants) {
        if (v.variant.Name() != name) continue;
        check.buckets.push_back(CheckBucket(absl::StrCat("saved_bytes.", name),
                                            predicted.held.saved_bytes, v.held_bytes));
        check.buckets.push_back(CheckBucket(absl::StrCat("micro_batches_in_flight.", name),
                                            predicted.in_flight, v.in_flight));
        // The whole step's peak, where both sides model it (RankStepModelled; a
        // peak measured where the simulation lacks an op is reported, not compared).
        if (predicted.held.peak.has_value() && v.peak_bytes >= 0) {
          check.buckets.push_back(CheckBucket(absl::StrCat("peak_bytes.", name),
                                              predicted.held.peak->bytes, v.peak_bytes));
        } else if (predicted.held.peak.has_value()) {
          report.failures.push_back(absl::StrCat(RankName(m.position), ": the peak of ", name,
                                                 " is predicted but was not measured"));
        }
      }
    }
    // FSDP2's prediction is rank 0's, the fullest: a later rank whose last rows are
    // padding steps fewer elements (torch.optim's state is zeros_like the local shard,
    // not the padded one), so it holds at most that.
    const bool at_most = fullest_only && m.position.dp_rank > 0;
    for (const BucketCheck& bucket : check.buckets) {
      if (!bucket.exact() && !(at_most && bucket.measured <= bucket.predicted)) {
        report.failures.push_back(absl::StrCat(RankName(m.position), " ", MismatchLine(bucket)));
      }
    }
    for (const runtime::RankVariantMeasurement& v : m.variants) {
      if (!(v.max_grad_diff <= grad_tolerance)) {  // also catches NaN
        report.failures.push_back(absl::StrFormat(
            "%s: gradients of %s differ from the single process's by %g > tolerance %g",
            RankName(m.position), v.variant.Name(), v.max_grad_diff, grad_tolerance));
      }
      if (v.unit_grad_diff != -1 && !(v.unit_grad_diff <= grad_tolerance)) {
        report.failures.push_back(absl::StrFormat(
            "%s: %s's unit-by-unit gradients of %s differ from the step's without "
            "gathering by %g > tolerance %g",
            RankName(m.position), parallel.fsdp.enabled ? "FSDP2" : "ZeRO-3",
            v.variant.Name(), v.unit_grad_diff, grad_tolerance));
      }
    }
    if (!(m.max_param_diff <= grad_tolerance)) {
      report.failures.push_back(
          absl::StrFormat("%s: parameters after the step differ from the unsharded step's by %g > "
                          "tolerance %g",
                          RankName(m.position), m.max_param_diff, grad_tolerance));
    }
    check.measured = std::move(m);
    report.ranks.push_back(std::move(check));
  }
  report.prediction = *std::move(prediction);
  return report;
}

namespace {

// WitnessSource names the real stack's run: "the real stack (transformers 5.23.0, torch
// 2.15.0): torch's FSDP2 (fully_shard) on 2 Gloo ranks; ...".
std::string WitnessSource(const RanksVerifyReport& r) {
  return absl::StrCat("the real stack (transformers ", kTransformersRelease, ", torch ",
                      kTorchRelease, "): torch's ",
                      r.parallel.fsdp.enabled ? "FSDP2 (fully_shard)" : "DistributedDataParallel",
                      " on ", r.parallel.dp, " Gloo ranks",
                      r.parallel.fsdp.enabled ? "; predicted: rank 0's, the fullest" : "");
}

}  // namespace

absl::StatusOr<RanksVerifyReport> PredictedRanksReport(
    const ModelConfig& config, const ParallelSpec& parallel,
    const runtime::DistributedRequest& request) {
  RanksVerifyReport report;
  report.config = config;
  report.parallel = parallel;
  report.request = request;
  report.measured = false;
  return report;
}

absl::Status AddRanksWitness(const std::vector<std::map<std::string, int64_t>>& witness,
                             RanksVerifyReport* report) {
  PredictOptions options;
  options.attention = report->request.attention;
  options.variants = report->request.variants;
  options.optimizer = report->request.optimizer;
  options.peak = true;
  absl::StatusOr<RanksPrediction> prediction =
      PredictRanks(report->config, report->parallel, options);
  if (!prediction.ok()) return prediction.status();
  if (!report->measured) report->prediction = *prediction;
  const RankKind& kind = prediction->kinds.front();  // data-parallel ranks: one kind
  std::vector<std::pair<std::string, int64_t>> predicted = {
      {"param_bytes", kind.param_bytes},
      {"grad_bytes", kind.grad_bytes},
      {"optimizer_state_bytes", kind.optimizer_state_bytes},
      {"communication_bytes", kind.communication_bytes}};
  for (const RankVariant& v : kind.variants) {
    if (!v.held.peak.has_value()) {
      report->witness_failures.push_back(absl::StrCat(
          "the peak of ", v.held.variant.Name(), " is measured but not predicted: ",
          v.held.peak_unavailable));
      continue;
    }
    predicted.emplace_back(absl::StrCat("peak_bytes.", v.held.variant.Name()),
                           v.held.peak->bytes);
  }
  const bool fullest_only = report->parallel.fsdp.enabled;
  for (const auto& [bucket, bytes] : predicted) {
    RanksVerifyReport::WitnessRow row{bucket, bytes, {}};
    for (size_t r = 0; r < witness.size(); ++r) {
      auto it = witness[r].find(bucket);
      if (it == witness[r].end()) {
        return absl::InternalError(absl::StrCat("witness: rank ", r, " has no ", bucket));
      }
      row.ranks.push_back(it->second);
      const bool ok = r == 0 || !fullest_only ? it->second == bytes : it->second <= bytes;
      if (!ok) {
        report->witness_failures.push_back(absl::StrCat(
            "rank ", r, " ", bucket, ": predicted ", bytes, ", the real stack measured ",
            it->second));
      }
    }
    report->witness.push_back(std::move(row));
  }
  return absl::OkStatus();
}

rapidjson::Document RanksVerifyJson(const RanksVerifyReport& r) {
  // The study's head with the most loaded rank's measured buckets, as predict's JSON
  // has its most loaded rank's predicted ones at the top (RankKind::Load: the peak of
  // `none`, which runs first, where counted; else the sum of the buckets).
  const runtime::RankMeasurement* most = nullptr;
  auto total = [](const runtime::RankMeasurement& m) {
    if (!m.variants.empty() && m.variants.front().peak_bytes >= 0) {
      return m.variants.front().peak_bytes;
    }
    return m.param_bytes + m.grad_bytes + m.optimizer_state_bytes +
           (m.variants.empty() ? 0 : m.variants.front().held_bytes);
  };
  for (const RankCheck& check : r.ranks) {
    if (most == nullptr || total(check.measured) > total(*most)) most = &check.measured;
  }
  ParameterBuckets buckets;
  if (most != nullptr) {
    buckets = {most->n_params, most->param_bytes, most->grad_bytes, most->optimizer_state_bytes,
               most->adamw_state_bytes};
  }
  rapidjson::Document doc =
      StudyJsonHead(r.config, r.request.attention, r.request.optimizer, buckets);
  Allocator& a = doc.GetAllocator();
  doc.AddMember("parallel", ParallelJson(r.parallel, a), a);
  doc.AddMember("backend", "gloo", a);
  if (most != nullptr) {
    doc.AddMember("most_loaded_rank", most->position.rank, a);
    // Its counted whole-step peaks, as predict's JSON has the most loaded rank's
    // predicted ones at the top.
    rapidjson::Value peaks(rapidjson::kObjectType);
    for (const runtime::RankVariantMeasurement& v : most->variants) {
      if (v.peak_bytes >= 0) {
        peaks.AddMember(Key(v.variant.Name(), a), rapidjson::Value(v.peak_bytes), a);
      }
    }
    if (peaks.MemberCount() > 0) doc.AddMember("peak_bytes", peaks, a);
  }

  rapidjson::Value ranks(rapidjson::kArrayType);
  for (const RankCheck& check : r.ranks) {
    const runtime::RankMeasurement& m = check.measured;
    rapidjson::Value rank(rapidjson::kObjectType);
    rank.AddMember("rank", m.position.rank, a);
    rank.AddMember("tp_rank", m.position.tp_rank, a);
    rank.AddMember("dp_rank", m.position.dp_rank, a);
    rank.AddMember("stage", m.position.stage, a);
    rapidjson::Value predicted(rapidjson::kObjectType), measured(rapidjson::kObjectType),
        ratio(rapidjson::kObjectType);
    for (const BucketCheck& b : check.buckets) {
      predicted.AddMember(Key(b.name, a), rapidjson::Value(b.predicted), a);
      measured.AddMember(Key(b.name, a), rapidjson::Value(b.measured), a);
      ratio.AddMember(Key(b.name, a), rapidjson::Value(b.ratio), a);
    }
    rank.AddMember("measured", measured, a);
    rank.AddMember("predicted", predicted, a);
    rank.AddMember("ratio", ratio, a);
    rapidjson::Value grad_diff(rapidjson::kObjectType);
    for (const runtime::RankVariantMeasurement& v : m.variants) {
      grad_diff.AddMember(Key(v.variant.Name(), a), rapidjson::Value(v.max_grad_diff), a);
    }
    rank.AddMember("max_grad_diff", grad_diff, a);
    rapidjson::Value unit_grad_diff(rapidjson::kObjectType);
    for (const runtime::RankVariantMeasurement& v : m.variants) {
      if (v.unit_grad_diff == -1) continue;
      unit_grad_diff.AddMember(Key(v.variant.Name(), a), rapidjson::Value(v.unit_grad_diff), a);
    }
    if (unit_grad_diff.MemberCount() > 0) rank.AddMember("unit_grad_diff", unit_grad_diff, a);
    // peak_where: per variant, where the step's peak happened (measured) and was
    // predicted to; without a prediction, the measured bytes and why.
    rapidjson::Value peak_where(rapidjson::kObjectType);
    const RankKind* kind = KindOfStage(r.prediction, m.position.stage);
    for (const runtime::RankVariantMeasurement& v : m.variants) {
      const RankVariant* predicted = PredictedVariant(kind, v.variant);
      if (v.peak_bytes < 0 || predicted == nullptr) continue;
      rapidjson::Value where(rapidjson::kObjectType);
      where.AddMember("measured_phase", Key(v.peak_phase, a), a);
      where.AddMember("measured_op", Key(v.peak_op, a), a);
      if (predicted->held.peak.has_value()) {
        where.AddMember("predicted_phase", Key(StepPhaseName(predicted->held.peak->phase), a), a);
        where.AddMember("predicted_op", Key(predicted->held.peak->op, a), a);
      } else {
        where.AddMember("measured_bytes", v.peak_bytes, a);
        where.AddMember("not_predicted", Key(predicted->held.peak_unavailable, a), a);
      }
      peak_where.AddMember(Key(v.variant.Name(), a), where, a);
    }
    if (peak_where.MemberCount() > 0) rank.AddMember("peak_where", peak_where, a);
    rank.AddMember("max_param_diff", m.max_param_diff, a);
    ranks.PushBack(rank, a);
  }
  doc.AddMember("ranks", ranks, a);
  if (!r.witness.empty()) {
    // The real stack's ranks beside the prediction, bucket by bucket.
    rapidjson::Value witness(rapidjson::kObjectType);
    witness.AddMember("source", Key(WitnessSource(r), a), a);
    rapidjson::Value rows(rapidjson::kArrayType);
    for (const RanksVerifyReport::WitnessRow& row : r.witness) {
      rapidjson::Value entry(rapidjson::kObjectType);
      entry.AddMember("bucket", Key(row.bucket, a), a);
      entry.AddMember("predicted", row.predicted, a);
      rapidjson::Value measured(rapidjson::kArrayType);
      for (int64_t bytes : row.ranks) measured.PushBack(bytes, a);
      entry.AddMember("ranks", measured, a);
      rows.PushBack(entry, a);
    }
    witness.AddMember("buckets", rows, a);
    doc.AddMember("witness", witness, a);
  }
  doc.AddMember("ranks_measured", r.measured, a);
  std::vector<std::string> failures = r.failures;
  failures.insert(failures.end(), r.witness_failures.begin(), r.witness_failures.end());
  AddVerdictJson(r.grad_tolerance, failures, doc);
  return doc;
}

std::string RanksVerifyTable(const RanksVerifyReport& r) {
  const ModelConfig& c = r.config;
  const ParallelSpec& p = r.parallel;
  const std::string pipeline =
      p.schedule == PipelineSchedule::kInterleaved
          ? absl::StrFormat("%d virtual stages, interleaved", p.virtual_stages)
          : std::string("1f1b");
  std::string out = absl::StrFormat(
      "memledger verify on %d Gloo ranks: %s%d layers, width %d, batch %d, seq %d; tp %d, dp "
      "%d (%s), pp %d with %d micro-batches (%s); %s, torch %s\n",
      p.tp * p.dp * p.pp,
      !FamilyOf(c.family).decoder ? "" : absl::StrCat(FamilyName(c.family), " family, "), c.layers,
      c.width, c.batch, c.seq, p.tp, p.dp,
      p.zero > 0 ? absl::StrCat("ZeRO-", p.zero)
                 : std::string(DataParallelName(DataParallelOf(p))),
      p.pp, p.micro_batches, pipeline,
      OptimizerName(r.request.optimizer.kind), kTorchRelease);
  for (const RankCheck& check : r.ranks) {
    const runtime::RankMeasurement& m = check.measured;
    absl::StrAppendFormat(&out, "\n%s\n%-36s %16s %16s %10s %12s\n", RankName(m.position), "bucket",
                          "predicted", "measured", "ratio", "");
    for (const BucketCheck& b : check.buckets) {
      const bool bytes = absl::StrContains(b.name, "bytes");
      absl::StrAppendFormat(&out, "%-36s %16d %16d %10.4f %12s%s\n", b.name, b.predicted,
                            b.measured, b.ratio, bytes ? HumanBytes(b.measured) : "",
                            b.exact() ? "" : "  MISMATCH");
    }
    double worst = 0;
    for (const runtime::RankVariantMeasurement& v : m.variants) {
      worst = std::max(worst, v.max_grad_diff);
    }
    absl::StrAppendFormat(&out, "%-36s %16.3g\n%-36s %16.3g\n", "max_grad_diff (all variants)",
                          worst, "max_param_diff (after the step)", m.max_param_diff);
    const RankKind* kind = KindOfStage(r.prediction, m.position.stage);
    for (const runtime::RankVariantMeasurement& v : m.variants) {
      const RankVariant* predicted = PredictedVariant(kind, v.variant);
      if (v.peak_bytes < 0 || predicted == nullptr) continue;
      const std::string measured = absl::StrCat("measured in the ", v.peak_phase, " at ",
                                                v.peak_op.empty() ? "(no op)" : v.peak_op);
      if (predicted->held.peak.has_value()) {
        absl::StrAppendFormat(&out, "peak of %s: predicted in the %s at %s; %s\n",
                              v.variant.Name(), StepPhaseName(predicted->held.peak->phase),
                              predicted->held.peak->op, measured);
      } else {
        absl::StrAppendFormat(&out, "peak of %s: %d B (%s), %s; not predicted: %s\n",
                              v.variant.Name(), v.peak_bytes, HumanBytes(v.peak_bytes), measured,
                              predicted->held.peak_unavailable);
      }
    }
  }
  if (!r.measured) {
    absl::StrAppend(&out,
                    "\nthe LibTorch ranks do not run this layout (FSDP2's "
                    "MixedPrecisionPolicy): the prediction is checked against the real stack "
                    "only\n");
  }
  if (!r.witness.empty()) {
    absl::StrAppendFormat(&out, "\n%s\n%-28s %16s", WitnessSource(r), "bucket", "predicted");
    for (size_t rank = 0; rank < r.witness.front().ranks.size(); ++rank) {
      absl::StrAppendFormat(&out, " %14s", absl::StrCat("rank ", rank));
    }
    out += "\n";
    for (const RanksVerifyReport::WitnessRow& row : r.witness) {
      absl::StrAppendFormat(&out, "%-28s %16d", row.bucket, row.predicted);
      for (int64_t bytes : row.ranks) absl::StrAppendFormat(&out, " %14d", bytes);
      out += "\n";
    }
  }
  std::vector<std::string> failures = r.failures;
  failures.insert(failures.end(), r.witness_failures.begin(), r.witness_failures.end());
  return out + Verdict(r.measured
                           ? absl::StrFormat("%s; "
                                             "gradients within %g of one process on the "
                                             "whole batch; the sharded step equals the "
                                             "unsharded one%s.",
                                             r.parallel.fsdp.enabled
                                                 ? "rank 0's buckets measured == predicted, "
                                                   "the other ranks' at most that"
                                                 : "every rank's buckets measured == predicted",
                                             r.grad_tolerance,
                                             r.witness.empty() ? "" : "; the real stack's too")
                           : std::string("every rank of the real stack measured what is "
                                         "predicted."),
                       failures);
}

}  // namespace memledger
