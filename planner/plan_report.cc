#include "planner/plan_report.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "estimator/graph/family.h"
#include "estimator/spec/input_file.h"
#include "estimator/report/report.h"
#include "estimator/report/units.h"
#include "rapidjson/error/en.h"

namespace memledger {
namespace {

using Allocator = rapidjson::Document::AllocatorType;

rapidjson::Value String(const std::string& s, Allocator& allocator) {
  return rapidjson::Value(s, allocator);
}

std::string Flops(int64_t flops) { return absl::StrFormat("%.3g", static_cast<double>(flops)); }

// LayoutText: "; one of 8 data-parallel ranks with ZeRO-1", "; 4 pipeline stages of 8
// micro-batches", "; one of 8 data-parallel ranks, each with 1 / 8 of the experts (every
// expert-parallel rank alike)", or nothing for one process.
std::string LayoutText(const ParallelSpec& p) {
  std::string out;
  if (p.pp > 1 || p.micro_batches > 1) {
    out = p.pp > 1 ? absl::StrCat("; ", p.pp, " pipeline stages of ", p.micro_batches,
                                  " micro-batches")
                   : absl::StrCat("; ", p.micro_batches, " micro-batches accumulated");
  }
  if (p.dp > 1) {
    absl::StrAppend(&out, p.pp > 1 ? ", each stage " : "; ", "one of ", p.dp,
                    " data-parallel ranks",
                    p.zero > 0 ? absl::StrCat(" with ZeRO-", p.zero) : std::string());
  }
  if (p.ep > 1) {
    absl::StrAppend(&out, ", each with 1 / ", p.ep,
                    " of the experts (every expert-parallel rank alike)");
  }
  return out;
}

}  // namespace

std::vector<std::string> PlanRuns(const std::vector<LayerChoice>& layers, int64_t first) {
  std::vector<std::string> runs;
  size_t start = 0;
  for (size_t i = 1; i <= layers.size(); ++i) {
    if (i < layers.size() && layers[i] == layers[start]) continue;
    const int64_t a = first + static_cast<int64_t>(start);
    const int64_t b = first + static_cast<int64_t>(i) - 1;
    const std::string span = a == b ? absl::StrCat(a) : absl::StrCat(a, "-", b);
    runs.push_back(absl::StrCat(span, " ", layers[start].Name()));
    start = i;
  }
  return runs;
}

std::vector<std::string> StageRuns(const StagePlan& stage) {
  std::vector<std::string> runs;
  size_t next = 0;
  for (const StageRange& chunk : stage.chunks) {
    const size_t end = std::min(stage.layers.size(), next + static_cast<size_t>(chunk.layers));
    std::vector<LayerChoice> layers(stage.layers.begin() + static_cast<std::ptrdiff_t>(next),
                                    stage.layers.begin() + static_cast<std::ptrdiff_t>(end));
    for (std::string& run : PlanRuns(layers, chunk.first_layer)) runs.push_back(std::move(run));
    next = end;
  }
  return runs;
}

rapidjson::Document PlanReportJson(const PlanReport& r) {
  const Prediction& p = r.prediction;
  rapidjson::Document doc =
      StudyJsonHead(p.config, p.attention, p.optimizer,
                    {p.n_params, p.param_bytes, p.grad_bytes, p.optimizer_state_bytes,
                     p.adamw_state_bytes});
  Allocator& a = doc.GetAllocator();
  doc.AddMember("budget_bytes", r.budget_bytes, a);
  if (r.parallel.dp > 1) doc.AddMember("parallel", ParallelJson(r.parallel, a), a);
  rapidjson::Value plan(rapidjson::kArrayType);
  for (const LayerChoice& choice : r.plan.layers) plan.PushBack(String(choice.Name(), a), a);
  doc.AddMember("plan", plan, a);
  doc.AddMember("peak_bytes", r.plan.peak_bytes, a);
  if (r.plan_peak.has_value()) doc.AddMember("peak", PeakJson(*r.plan_peak, a), a);
  doc.AddMember("recompute_flops", r.plan.recompute_flops, a);
  doc.AddMember("step_flops", r.plan.step_flops, a);
  doc.AddMember("overhead", RoundTo4(r.plan.overhead), a);
  if (r.flops_per_second > 0) {
    doc.AddMember("flops_per_second", r.flops_per_second, a);
    doc.AddMember("step_seconds",
                  RoundTo4(static_cast<double>(r.plan.step_flops + r.plan.recompute_flops) /
                         r.flops_per_second),
                  a);
  }
  doc.AddMember("smallest_budget_bytes", r.smallest_budget_bytes, a);
  const bool cuda = p.config.device == Device::kCuda;
  if (cuda) {
    // The plan's replay through the caching allocator; what the budget holds.
    doc.AddMember("peak_allocated_bytes", r.plan_peak.has_value() ? r.plan_peak->bytes : 0, a);
    doc.AddMember("peak_reserved_bytes", r.plan_reserved_bytes, a);
    doc.AddMember("device_bytes", r.plan_device_bytes, a);
    doc.AddMember("smallest_device_bytes", r.smallest_device_bytes, a);
    doc.AddMember("composed_bytes",
                  "peak_bytes, smallest_budget_bytes and the frontier's: requests rounded to "
                  "512 B, max_memory_allocated() with expandable segments",
                  a);
  }
  rapidjson::Value variants(rapidjson::kObjectType);
  for (const VariantCost& v : r.variants) {
    rapidjson::Value entry(rapidjson::kObjectType);
    if (v.peak_bytes.has_value()) entry.AddMember("peak_bytes", *v.peak_bytes, a);
    if (cuda && v.peak_bytes.has_value()) {
      entry.AddMember("peak_reserved_bytes", v.peak_reserved_bytes, a);
    }
    entry.AddMember("recompute_flops", v.recompute_flops, a);
    entry.AddMember("overhead", RoundTo4(v.overhead), a);
    variants.AddMember(String(v.name, a), entry, a);
  }
  doc.AddMember("variants", variants, a);
  if (!r.stages.empty()) {
    rapidjson::Value stages(rapidjson::kArrayType);
    for (const StagePlan& stage : r.stages) {
      rapidjson::Value entry(rapidjson::kObjectType);
      entry.AddMember("stage", stage.stage, a);
      rapidjson::Value layers(rapidjson::kArrayType);
      for (const StageRange& chunk : stage.chunks) {
        rapidjson::Value range(rapidjson::kArrayType);
        range.PushBack(chunk.first_layer, a).PushBack(chunk.first_layer + chunk.layers - 1, a);
        layers.PushBack(range, a);
      }
      entry.AddMember("layers", layers, a);  // [first, last] per chunk
      entry.AddMember("in_flight", stage.in_flight, a);
      entry.AddMember("peak_bytes", stage.peak_bytes, a);
      if (cuda) entry.AddMember("peak_reserved_bytes", stage.peak_reserved_bytes, a);
      entry.AddMember("peak_op", String(stage.peak_op, a), a);
      entry.AddMember("recompute_flops", stage.recompute_flops, a);
      entry.AddMember("plans_replayed", stage.attempts, a);
      rapidjson::Value runs(rapidjson::kArrayType);
      for (const std::string& run : StageRuns(stage)) runs.PushBack(String(run, a), a);
      entry.AddMember("plan", runs, a);
      stages.PushBack(entry, a);
    }
    doc.AddMember("stages", stages, a);
  }
  rapidjson::Value frontier(rapidjson::kArrayType);
  for (const FrontierPoint& point : r.frontier) {
    rapidjson::Value entry(rapidjson::kObjectType);
    entry.AddMember("budget_bytes", point.budget_bytes, a);
    entry.AddMember("peak_bytes", point.plan.peak_bytes, a);
    entry.AddMember("recompute_flops", point.plan.recompute_flops, a);
    entry.AddMember("overhead", RoundTo4(point.plan.overhead), a);
    rapidjson::Value runs(rapidjson::kArrayType);
    for (const std::string& run : PlanRuns(point.plan.layers)) runs.PushBack(String(run, a), a);
    entry.AddMember("plan", runs, a);
    frontier.PushBack(entry, a);
  }
  doc.AddMember("frontier", frontier, a);
  return doc;
}

std::string PlanReportTable(const PlanReport& r) {
  const ModelConfig& c = r.prediction.config;
  std::string out = absl::StrFormat(
      "checkpoint plan: %s, %d layers, batch %d, seq %d, %s attention, %s%s, %s%s%s; budget "
      "%s\n",
      FamilyName(c.family), c.layers, c.batch, c.seq, AttentionModeName(r.prediction.attention),
      ModelDTypeName(c.dtype),
      c.amp == DType::kFloat32 ? "" : absl::StrCat(" with ", AmpName(c.amp), " autocast"),
      OptimizerName(r.prediction.optimizer.kind),
      r.prediction.optimizer.master_weights ? " with fp32 master weights" : "",
      LayoutText(r.parallel), HumanBytes(r.budget_bytes));
  const bool staged = !r.stages.empty();
  const bool searched = r.searched;
  if (staged) {
    // Each stage's own plan, and its replayed peak.
    for (const StagePlan& stage : r.stages) {
      // Interleaved, what is in flight is micro-batch chunks.
      const std::string unit = r.parallel.virtual_stages > 1 ? "micro-batch chunk" : "micro-batch";
      absl::StrAppendFormat(&out, "  stage %d (%d %s%s in flight): %s; peak %s\n", stage.stage,
                            stage.in_flight, unit,
                            stage.in_flight == 1 ? "" : (r.parallel.virtual_stages > 1 ? "s" : "es"),
                            absl::StrJoin(StageRuns(stage), ", "), HumanBytes(stage.peak_bytes));
    }
  } else {
    for (const std::string& run : PlanRuns(r.plan.layers)) {
      absl::StrAppend(&out, "  layers ", run, "\n");
    }
  }
  absl::StrAppendFormat(&out,
                        "peak %s (%d B), recompute %s FLOPs, overhead %.4f over no "
                        "checkpointing (step %s FLOPs)",
                        HumanBytes(r.plan.peak_bytes), r.plan.peak_bytes,
                        Flops(r.plan.recompute_flops), r.plan.overhead,
                        Flops(r.plan.step_flops));
  if (r.flops_per_second > 0) {
    absl::StrAppendFormat(
        &out, ", %.4g s at %.4g FLOP/s",
        static_cast<double>(r.plan.step_flops + r.plan.recompute_flops) / r.flops_per_second,
        r.flops_per_second);
  }
  const bool cuda = c.device == Device::kCuda;
  if (r.plan_peak.has_value()) {
    absl::StrAppendFormat(&out, "\npeak in the %s: %s", StepPhaseName(r.plan_peak->phase),
                          r.plan_peak->op);
  }
  if (searched) {
    const std::string device =
        cuda ? absl::StrFormat(": %s reserved + %s outside the allocator = %s on the device",
                               HumanBytes(r.plan_reserved_bytes),
                               HumanBytes(r.outside_allocator_bytes),
                               HumanBytes(r.plan_device_bytes))
             : "";
    absl::StrAppend(&out,
                    staged ? absl::StrCat("\n(each stage's peak is its rank's step replayed",
                                          device, "; the plan is searched for stage by stage, "
                                          "so one of less recompute may exist)")
                           : absl::StrCat("\n(the plan's step is replayed", device,
                                          "; the plan is searched for with the composed "
                                          "planner as a guide, and one of less recompute may "
                                          "exist)"));
    absl::StrAppendFormat(&out, "\nevery layer fully checkpointed, %s %s (%d B)\n\n",
                          staged ? "the most loaded stage needs" : "the step needs",
                          HumanBytes(r.smallest_budget_bytes), r.smallest_budget_bytes);
  } else if (cuda) {
    // The composed peak counts requests; the replay counts the allocator's blocks.
    absl::StrAppendFormat(
        &out,
        "\non cuda, the plan replayed through the caching allocator: allocated %s (%d B), "
        "reserved %s (%d B) + %s outside the allocator = %s on the device, within the "
        "budget\n(the composed peak above counts requests rounded to 512 B: "
        "max_memory_allocated() with --expandable_segments)",
        HumanBytes(r.plan_peak.has_value() ? r.plan_peak->bytes : 0),
        r.plan_peak.has_value() ? r.plan_peak->bytes : 0, HumanBytes(r.plan_reserved_bytes),
        r.plan_reserved_bytes, HumanBytes(r.outside_allocator_bytes),
        HumanBytes(r.plan_device_bytes));
    absl::StrAppendFormat(&out,
                          "\nsmallest budget found to fit on cuda: %s (%d B), the reserved "
                          "peak and the outside of the least composed plan or of all-full, "
                          "whichever needs less\n\n",
                          HumanBytes(r.smallest_device_bytes), r.smallest_device_bytes);
  } else {
    absl::StrAppendFormat(&out, "\nsmallest budget any plan fits: %s (%d B)\n\n",
                          HumanBytes(r.smallest_budget_bytes), r.smallest_budget_bytes);
  }
  absl::StrAppend(&out, cuda ? "variant        allocated     reserved      overhead\n"
                             : "variant        peak          overhead\n");
  for (const VariantCost& v : r.variants) {
    const std::string peak = v.peak_bytes.has_value() ? HumanBytes(*v.peak_bytes) : "-";
    if (cuda) {
      absl::StrAppendFormat(
          &out, "%-14s %-13s %-13s %.4f\n", v.name, peak,
          v.peak_bytes.has_value() ? HumanBytes(v.peak_reserved_bytes) : "-", v.overhead);
    } else {
      absl::StrAppendFormat(&out, "%-14s %-13s %.4f\n", v.name, peak, v.overhead);
    }
  }
  if (!r.frontier.empty()) {
    absl::StrAppend(&out, "\nfrontier (budget -> least recompute",
                    cuda ? "; requests rounded to 512 B" : "", ")\n",
                    "budget        peak          overhead  plan\n");
    for (const FrontierPoint& point : r.frontier) {
      std::vector<std::string> runs = PlanRuns(point.plan.layers);
      absl::StrAppendFormat(&out, "%-13s %-13s %.4f    %s\n", HumanBytes(point.budget_bytes),
                            HumanBytes(point.plan.peak_bytes), point.plan.overhead,
                            absl::StrJoin(runs, ", "));
    }
  }
  return out;
}

}  // namespace memledger
