#include "verify/verify_report.h"

#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "estimator/graph/family.h"
#include "estimator/report/report.h"
#include "estimator/graph/rules.h"
#include "estimator/report/timeline_svg.h"
#include "estimator/report/units.h"

namespace memledger {
namespace {

using Allocator = rapidjson::Document::AllocatorType;

rapidjson::Value Key(const std::string& s, Allocator& a) { return rapidjson::Value(s, a); }

// NoneTime is `none`'s measured forward+backward time, if measured and positive.
std::optional<double> NoneTime(const runtime::Measurement& m) {
  for (const runtime::VariantMeasurement& v : m.variants) {
    if (v.variant.kind == VariantKind::kNone && v.time_s.has_value() && *v.time_s > 0) {
      return v.time_s;
    }
  }
  return std::nullopt;
}

}  // namespace

void AddVerdictJson(double grad_tolerance, const std::vector<std::string>& failures,
                    rapidjson::Document& doc) {
  Allocator& a = doc.GetAllocator();
  doc.AddMember("grad_tolerance", grad_tolerance, a);
  doc.AddMember("passed", failures.empty(), a);
  rapidjson::Value list(rapidjson::kArrayType);
  for (const std::string& f : failures) list.PushBack(Key(f, a), a);
  doc.AddMember("failures", list, a);
}

absl::StatusOr<std::string> VerifyTimelineSvg(const VerifyReport& r) {
  if (!r.peak_unavailable.empty()) {
    return absl::UnimplementedError(absl::StrCat("--timeline_svg: ", r.peak_unavailable));
  }
  std::vector<TimelinePanel> panels;
  for (const VariantPrediction& v : r.prediction.variants) {
    if (v.timeline == nullptr) {
      return absl::FailedPreconditionError("the report has no predicted timeline");
    }
    const runtime::VariantMeasurement* measured = nullptr;
    for (const runtime::VariantMeasurement& m : r.measurement.variants) {
      if (m.variant.Name() == v.variant.Name()) measured = &m;
    }
    if (measured == nullptr || measured->step.events.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("variant ", v.variant.Name(), " has no measured step"));
    }
    const runtime::StepMemory& step = measured->step;
    MeasuredLine line;
    line.peak_bytes = step.peak_bytes;
    // Zero-byte allocations (empty workspaces) move nothing: left out, like the
    // prediction's, so that the two steps line up event for event.
    line.live.reserve(step.events.size());
    size_t mark = 0;
    for (size_t i = 0; i < step.events.size(); ++i) {
      for (; mark < step.phases.size() && step.phases[mark].first_event <= static_cast<int64_t>(i);
           ++mark) {
        for (int p = 0; p < kNumStepPhases; ++p) {
          if (step.phases[mark].name == StepPhaseName(static_cast<StepPhase>(p))) {
            line.phase_start[p] = static_cast<int64_t>(line.live.size());
          }
        }
      }
      if (step.events[i].bytes != 0) {
        line.live.push_back(step.resident_bytes + step.events[i].live);
      }
    }
    panels.push_back({v.variant.Name(), v.timeline.get(), std::move(line)});
  }
  return TimelineSvg(
      absl::StrCat("memledger verify: one training step, predicted (areas) and measured "
                   "(line), torch ",
                   kTorchRelease),
      panels);
}

rapidjson::Document VerifyJson(const VerifyReport& r) {
  const runtime::Measurement& m = r.measurement;
  const Prediction& p = r.prediction;
  rapidjson::Document doc = StudyJsonHead(
      m.config, m.attention, m.optimizer,
      {m.n_params, m.param_bytes, m.grad_bytes, m.optimizer_state_bytes, m.adamw_state_bytes});
  Allocator& a = doc.GetAllocator();

  const double none_bytes = static_cast<double>(m.reference_saved_bytes);
  rapidjson::Value saved(rapidjson::kObjectType), ratio_vs_none(rapidjson::kObjectType),
      time_s(rapidjson::kObjectType), grad_diff(rapidjson::kObjectType);
  for (const runtime::VariantMeasurement& v : m.variants) {
    const std::string name = v.variant.Name();
    saved.AddMember(Key(name, a), rapidjson::Value(v.saved_bytes), a);
    ratio_vs_none.AddMember(Key(name, a), rapidjson::Value(RoundTo4(v.saved_bytes / none_bytes)),
                            a);
    rapidjson::Value t;  // null with --skip_timing
    if (v.time_s.has_value()) t.SetDouble(std::round(*v.time_s * 1e5) / 1e5);
    time_s.AddMember(Key(name, a), t, a);
    grad_diff.AddMember(Key(name, a), rapidjson::Value(v.max_grad_diff), a);
  }
  doc.AddMember("saved_bytes", saved, a);
  rapidjson::Value held(rapidjson::kObjectType);
  for (const runtime::VariantMeasurement& v : m.variants) {
    held.AddMember(Key(v.variant.Name(), a), rapidjson::Value(v.held_after_forward_bytes), a);
  }
  doc.AddMember("held_after_forward_bytes", held, a);
  // The whole step's measured peak (resident bytes included) and where the counting
  // allocator saw it; the prediction's own account of its peak beside it.
  rapidjson::Value peak_bytes(rapidjson::kObjectType), peaks(rapidjson::kObjectType);
  for (const runtime::VariantMeasurement& v : m.variants) {
    if (v.step.peak_bytes == 0) continue;  // steps not measured
    peak_bytes.AddMember(Key(v.variant.Name(), a), rapidjson::Value(v.step.peak_bytes), a);
    rapidjson::Value where(rapidjson::kObjectType);
    where.AddMember("bytes", v.step.peak_bytes, a);
    where.AddMember("phase", Key(v.step.peak.phase, a), a);
    where.AddMember("op", Key(v.step.peak.op, a), a);
    where.AddMember("kernel", Key(v.step.peak.inner_op, a), a);
    peaks.AddMember(Key(v.variant.Name(), a), where, a);
  }
  if (!peak_bytes.ObjectEmpty()) {
    doc.AddMember("peak_bytes", peak_bytes, a);
    doc.AddMember("peak", peaks, a);
  }
  rapidjson::Value predicted_peaks(rapidjson::kObjectType);
  for (const VariantPrediction& v : p.variants) {
    if (v.peak.has_value()) {
      predicted_peaks.AddMember(Key(v.variant.Name(), a), PeakJson(*v.peak, a), a);
    }
  }
  if (!predicted_peaks.ObjectEmpty()) doc.AddMember("predicted_peak", predicted_peaks, a);
  if (!r.peak_unavailable.empty()) {
    doc.AddMember("peak_unavailable", Key(r.peak_unavailable, a), a);
  }
  doc.AddMember("saved_ratio_vs_none", ratio_vs_none, a);
  doc.AddMember("time_s", time_s, a);
  // Recompute overhead: the FLOP model's prediction beside the measured time ratio to
  // none (null without timing or without none).
  const std::optional<double> none_time = NoneTime(m);
  rapidjson::Value overhead(rapidjson::kObjectType);
  for (size_t i = 0; i < m.variants.size() && i < r.predicted_overhead.size(); ++i) {
    const runtime::VariantMeasurement& v = m.variants[i];
    rapidjson::Value entry(rapidjson::kObjectType), predicted, measured;
    if (r.predicted_overhead[i].has_value())
      predicted.SetDouble(RoundTo4(*r.predicted_overhead[i]));
    if (v.time_s.has_value() && none_time.has_value()) {
      measured.SetDouble(RoundTo4(*v.time_s / *none_time));
    }
    entry.AddMember("predicted", predicted, a);
    entry.AddMember("measured", measured, a);
    overhead.AddMember(Key(v.variant.Name(), a), entry, a);
  }
  doc.AddMember("recompute_overhead", overhead, a);
  doc.AddMember("max_grad_diff", m.max_grad_diff, a);
  doc.AddMember("predicted_saved_bytes_none", p.korthikanti_saved_bytes_none, a);
  doc.AddMember("measured_over_predicted", RoundTo4(r.measured_over_korthikanti), a);

  // Buckets named "<bucket>.<variant>" nest by bucket: predicted.saved_bytes.none.
  rapidjson::Value predicted(rapidjson::kObjectType), ratio(rapidjson::kObjectType);
  for (const BucketCheck& b : r.buckets) {
    const size_t dot = b.name.find('.');
    if (dot == std::string::npos) {
      predicted.AddMember(Key(b.name, a), rapidjson::Value(b.predicted), a);
      ratio.AddMember(Key(b.name, a), rapidjson::Value(b.ratio), a);
      continue;
    }
    const std::string bucket = b.name.substr(0, dot), variant = b.name.substr(dot + 1);
    for (rapidjson::Value* object : {&predicted, &ratio}) {
      if (!object->HasMember(bucket.c_str())) {
        object->AddMember(Key(bucket, a), rapidjson::Value(rapidjson::kObjectType), a);
      }
    }
    predicted[bucket.c_str()].AddMember(Key(variant, a), rapidjson::Value(b.predicted), a);
    ratio[bucket.c_str()].AddMember(Key(variant, a), rapidjson::Value(b.ratio), a);
  }
  doc.AddMember("predicted", predicted, a);
  doc.AddMember("ratio", ratio, a);
  doc.AddMember("max_grad_diff_per_variant", grad_diff, a);
  if (!m.routing.empty()) {
    // The eager experts' routing the prediction took from the runtime: the forwards'
    // (saved and held bytes) and each variant's whole step's (its peak).
    auto rows_json = [&](const std::vector<std::vector<int64_t>>& rows) {
      rapidjson::Value layers(rapidjson::kArrayType);
      for (const std::vector<int64_t>& row : rows) {
        rapidjson::Value counts(rapidjson::kArrayType);
        for (int64_t n : row) counts.PushBack(rapidjson::Value(n), a);
        layers.PushBack(counts, a);
      }
      return layers;
    };
    rapidjson::Value routing(rapidjson::kObjectType), steps(rapidjson::kObjectType);
    routing.AddMember("forward", rows_json(m.routing), a);
    for (const runtime::VariantMeasurement& v : m.variants) {
      if (v.step.routing.empty()) continue;
      steps.AddMember(Key(v.variant.Name(), a), rows_json(v.step.routing), a);
    }
    routing.AddMember("steps", steps, a);
    doc.AddMember("measured_routing", routing, a);
  }
  if (!r.witness.empty()) {
    // The real stack's step (verify/witness.py), by bucket, and the releases it ran.
    rapidjson::Value witness(rapidjson::kObjectType), buckets(rapidjson::kObjectType);
    witness.AddMember("stack", Key(absl::StrCat("torch ", kTorchRelease, ", transformers ",
                                                 kTransformersRelease), a),
                      a);
    for (const auto& [name, bytes] : r.witness) {
      buckets.AddMember(Key(name, a), rapidjson::Value(bytes), a);
    }
    witness.AddMember("measured", buckets, a);
    doc.AddMember("witness", witness, a);
  }
  std::vector<std::string> failures = r.failures;
  failures.insert(failures.end(), r.witness_failures.begin(), r.witness_failures.end());
  AddVerdictJson(r.grad_tolerance, failures, doc);
  return doc;
}

std::string VerifyTable(const VerifyReport& r) {
  const ModelConfig& c = r.measurement.config;
  std::string out = absl::StrFormat(
      "memledger verify: %s%d layers, width %d, %d heads, batch %d, seq %d, %s attention, "
      "%s%s, %s%s, torch %s\n\n",
      !FamilyOf(c.family).decoder ? "" : absl::StrCat(FamilyName(c.family), " family, "), c.layers,
      c.width, c.heads, c.batch, c.seq, AttentionModeName(r.measurement.attention),
      ModelDTypeName(c.dtype),
      c.amp == DType::kFloat32 ? "" : absl::StrCat(" with ", AmpName(c.amp), " autocast"),
      OptimizerName(r.measurement.optimizer.kind),
      r.measurement.optimizer.master_weights ? " with fp32 master weights" : "",
      r.measurement.torch_version);
  if (!r.measurement.routing.empty()) {
    // The eager experts' sizes are the routing: say it was the runtime's own.
    auto rows_text = [](const std::vector<std::vector<int64_t>>& rows) {
      std::vector<std::string> layers;
      for (const std::vector<int64_t>& row : rows) layers.push_back(absl::StrJoin(row, ","));
      return absl::StrJoin(layers, " | ");
    };
    absl::StrAppend(&out,
                    "eager experts, predicted with the runtime's own routing (tokens per "
                    "expert, layer by layer; each step routes on the parameters the steps "
                    "before it moved):\n",
                    absl::StrFormat("  %-17s %s\n", "forwards", rows_text(r.measurement.routing)));
    for (const runtime::VariantMeasurement& v : r.measurement.variants) {
      if (v.step.routing.empty()) continue;
      absl::StrAppendFormat(&out, "  %-17s %s\n", absl::StrCat(v.variant.Name(), "'s step"),
                            rows_text(v.step.routing));
    }
    out += "\n";
  }
  // With --witness=transformers a third column: the real stack's step (verify/witness.py).
  const bool witness = !r.witness.empty();
  absl::StrAppendFormat(&out, "%-34s %16s %16s %s%10s %12s\n", "bucket", "predicted", "measured",
                        witness ? absl::StrFormat("%16s ", "transformers") : "", "ratio", "");
  for (const BucketCheck& b : r.buckets) {
    std::string real;
    bool real_differs = false;
    if (witness) {
      auto it = r.witness.find(b.name);
      real = absl::StrFormat("%16s ", it == r.witness.end() ? "-" : absl::StrCat(it->second));
      real_differs = it != r.witness.end() && it->second != b.predicted;
    }
    absl::StrAppendFormat(&out, "%-34s %16d %16d %s%10.4f %12s%s%s\n", b.name, b.predicted,
                          b.measured, real, b.ratio,
                          b.name == "n_params" ? "" : HumanBytes(b.measured),
                          b.exact() ? "" : "  MISMATCH", real_differs ? "  REAL STACK DIFFERS" : "");
  }
  absl::StrAppendFormat(&out, "\n%-24s %16d %16s %10.4f   (measured none / Korthikanti)\n",
                        "Korthikanti (none)", r.prediction.korthikanti_saved_bytes_none, "",
                        r.measured_over_korthikanti);
  absl::StrAppendFormat(&out, "\n%-24s %16s %16s %12s %12s\n", "variant", "max_grad_diff", "time_s",
                        "time/none", "FLOPs model");
  const std::optional<double> none_time = NoneTime(r.measurement);
  for (size_t i = 0; i < r.measurement.variants.size(); ++i) {
    const runtime::VariantMeasurement& v = r.measurement.variants[i];
    const bool ratio = v.time_s.has_value() && none_time.has_value();
    const bool model = i < r.predicted_overhead.size() && r.predicted_overhead[i].has_value();
    absl::StrAppendFormat(&out, "%-24s %16.3g %16s %12s %12s\n", v.variant.Name(), v.max_grad_diff,
                          v.time_s.has_value() ? absl::StrFormat("%.5f", *v.time_s) : "-",
                          ratio ? absl::StrFormat("%.3f", *v.time_s / *none_time) : "-",
                          model ? absl::StrFormat("%.3f", *r.predicted_overhead[i]) : "-");
  }
  std::vector<std::string> failures = r.failures;
  failures.insert(failures.end(), r.witness_failures.begin(), r.witness_failures.end());
  return out + Verdict(absl::StrFormat("every bucket measured == predicted%s; gradients "
                                       "within %g of none.",
                                       witness ? " == the real stack's" : "", r.grad_tolerance),
                       failures);
}

}  // namespace memledger
