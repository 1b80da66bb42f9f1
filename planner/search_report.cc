#include "planner/search_report.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "estimator/graph/family.h"
#include "estimator/request/parallel_spec.h"
#include "estimator/request/plan_file.h"
#include "estimator/report/report.h"
#include "estimator/report/svg.h"
#include "estimator/report/units.h"

namespace memledger {

const char kTimeModelNote[] =
    "memory is exact (each rank's whole step simulated); step time is a model: FLOPs at "
    "the GPU's peak x mfu, the pipeline bubble, and TP, PP, EP and DP/ZeRO communication at "
    "the preset's bandwidths, none of it overlapped (planner/step_time.h)";

namespace {

// ZeroText: the table's "zero" column: ZeRO's stage, or "fsdp" for FSDP2's ranks.
std::string ZeroText(const SearchedLayout& l) {
  return l.fsdp ? "fsdp" : absl::StrCat(l.zero);
}

using Allocator = rapidjson::Document::AllocatorType;

rapidjson::Value String(const std::string& s, Allocator& a) { return rapidjson::Value(s, a); }

std::string ScheduleName(const SearchedLayout& l) {
  return l.virtual_stages > 1 ? "interleaved" : "1f1b";
}

std::string Seconds(double s) {
  if (s >= 1) return absl::StrFormat("%.2f s", s);
  if (s >= 1e-3) return absl::StrFormat("%.1f ms", s * 1e3);
  return absl::StrFormat("%.1f us", s * 1e6);
}

}  // namespace

rapidjson::Document SearchJson(const SearchResult& r, const SearchOptions& o) {
  rapidjson::Document doc =
      StudyJsonHead(r.config, r.attention, r.optimizer,
                    {r.n_params, r.param_bytes, r.grad_bytes, r.optimizer_state_bytes,
                     r.adamw_state_bytes});
  Allocator& a = doc.GetAllocator();
  rapidjson::Value search(rapidjson::kObjectType);
  search.AddMember("model", String(r.model, a), a);
  search.AddMember("gpus", o.gpus, a);
  search.AddMember("gpus_per_node", o.gpus_per_node, a);
  search.AddMember("gpu", String(o.gpu.name, a), a);
  search.AddMember("gpu_source", String(o.gpu.source, a), a);
  search.AddMember("budget_bytes", o.budget_bytes, a);
  search.AddMember("global_batch", o.global_batch, a);
  search.AddMember("seq", r.config.seq, a);
  if (r.longest_seq_up_to > 0) {
    // --longest_seq: seq is the longest that fits, bisected up to up_to.
    rapidjson::Value longest(rapidjson::kObjectType);
    longest.AddMember("up_to", r.longest_seq_up_to, a);
    longest.AddMember("searches", r.longest_seq_searches, a);
    search.AddMember("longest_seq", longest, a);
  }
  if (!o.default_precision.empty()) {
    search.AddMember("default_precision", String(o.default_precision, a), a);
  }
  search.AddMember("mfu", o.mfu, a);
  search.AddMember("max_virtual_stages", o.max_virtual_stages, a);
  search.AddMember("time_model", rapidjson::StringRef(kTimeModelNote), a);
  doc.AddMember("search", search, a);
  doc.AddMember("candidates", r.candidates, a);
  doc.AddMember("invalid", r.invalid, a);
  doc.AddMember("too_big", r.too_big, a);
  doc.AddMember("unmodelled", r.unmodelled, a);
  doc.AddMember("simulated", r.simulated, a);
  doc.AddMember("planned", r.planned, a);
  doc.AddMember("fitting", static_cast<int64_t>(r.layouts.size()), a);
  if (r.cuda) {
    // The first pass counts requests; the best layouts were replayed through the
    // caching allocator (SearchedLayout::checked).
    // (The CUDA context is the head's outside_allocator_bytes.)
    doc.AddMember("checked", r.checked, a);
    doc.AddMember("dropped_when_checked", r.dropped_when_checked, a);
  }
  rapidjson::Value layouts(rapidjson::kArrayType);
  for (size_t i = 0; i < r.layouts.size(); ++i) {
    const SearchedLayout& l = r.layouts[i];
    rapidjson::Value e(rapidjson::kObjectType);
    e.AddMember("rank", static_cast<int64_t>(i + 1), a);  // the table's: 1 is the best
    e.AddMember("tp", l.tp, a);
    e.AddMember("pp", l.pp, a);
    e.AddMember("dp", l.dp, a);
    e.AddMember("zero", l.zero, a);
    // As predict's parallel.data_parallel: how the data-parallel ranks run.
    e.AddMember("data_parallel",
                rapidjson::StringRef(DataParallelName(l.dp, l.zero, l.ep, l.fsdp)), a);
    e.AddMember("ep", l.ep, a);
    e.AddMember("sp", l.sp, a);
    e.AddMember("micro_batch_size", l.micro_batch_size, a);
    e.AddMember("micro_batches", l.micro_batches, a);
    e.AddMember("virtual_stages", l.virtual_stages, a);
    e.AddMember("schedule", String(ScheduleName(l), a), a);
    e.AddMember("checkpoint", String(l.checkpoint.Name(), a), a);
    if (l.checkpoint.kind == VariantKind::kPlan) {
      // The planner's per-stage plan, as predict's and verify's --plan read it inline.
      e.AddMember("plan", String(PlanRunsText(l.checkpoint), a), a);
    }
    e.AddMember("peak_bytes", l.peak_bytes, a);
    e.AddMember("peak_stage", l.stage, a);
    if (r.cuda) {
      e.AddMember("checked", l.checked, a);
      rapidjson::Value reserved, device;  // null until the allocator's replay
      if (l.checked) {
        reserved.SetInt64(l.peak_reserved_bytes);
        device.SetInt64(l.device_bytes);
      }
      e.AddMember("peak_reserved_bytes", reserved, a);
      e.AddMember("device_bytes", device, a);
    }
    e.AddMember("step_time_s", l.time.total_s, a);
    rapidjson::Value time(rapidjson::kObjectType);
    for (const auto& [key, value] :
         {std::pair<const char*, double>{"compute_s", l.time.compute_s},
          {"bubble_s", l.time.bubble_s},
          {"tp_s", l.time.tp_s},
          {"pp_s", l.time.pp_s},
          {"zero3_s", l.time.zero3_s},
          {"ep_s", l.time.ep_s},
          {"dp_s", l.time.dp_s},
          {"optimizer_s", l.time.optimizer_s}}) {
      time.AddMember(rapidjson::StringRef(key), value, a);
    }
    e.AddMember("time", time, a);
    e.AddMember("tflops_per_gpu", l.tflops_per_gpu, a);
    e.AddMember("mfu", l.mfu, a);
    e.AddMember("front", l.front, a);
    e.AddMember("flags", String(l.flags, a), a);
    layouts.PushBack(e, a);
  }
  doc.AddMember("layouts", layouts, a);
  return doc;
}

std::string SearchTable(const SearchResult& r, const SearchOptions& o, size_t top) {
  const ModelConfig& c = r.config;
  std::string out = absl::StrFormat(
      "memledger layout search: %s (%s family, %d layers, width %d), seq %d, global batch "
      "%d, %s%s, %s%s\n"
      "%d x %s (%d per node), %s per GPU, mfu %.2f\n\n",
      r.model, FamilyName(c.family), c.layers, c.width, c.seq, o.global_batch,
      ModelDTypeName(c.dtype),
      c.amp != DType::kFloat32 ? absl::StrCat(" with ", AmpName(c.amp), " autocast")
      : r.fsdp.param_dtype.has_value()
          ? absl::StrCat(" shards, ", ModelDTypeName(*r.fsdp.param_dtype),
                         " compute (FSDP2's MixedPrecisionPolicy)")
          : "",
      OptimizerName(r.optimizer.kind),
      r.optimizer.master_weights ? " with fp32 master weights" : "", o.gpus, o.gpu.name,
      o.gpus_per_node, HumanBytes(o.budget_bytes), o.mfu);
  if (!o.default_precision.empty()) {
    absl::StrAppendFormat(&out,
                          "precision: %s, the search's default (--dtype, --amp, "
                          "--master_weights or --mp_param_dtype choose another)\n",
                          o.default_precision);
  }
  if (r.longest_seq_up_to > 0) {
    // Every length above the one found, up to the next that bisection ruled out, was
    // searched (SearchLongestSequence): the next does not fit.
    const std::string next =
        c.seq < r.longest_seq_up_to ? absl::StrCat("; ", c.seq + 1, " does not fit") : "";
    absl::StrAppendFormat(&out,
                          "the longest sequence that fits: %d (--seq bisected over 1..%d in %d "
                          "search%s%s); the layouts at it:\n",
                          c.seq, r.longest_seq_up_to, r.longest_seq_searches,
                          r.longest_seq_searches == 1 ? "" : "es", next);
  }
  absl::StrAppendFormat(&out,
                        "%d candidates (layouts x checkpointing): %d fit, %d too big, %d "
                        "refused, %d without a simulated peak; %d layouts simulated; %d "
                        "planned per stage\n",
                        r.candidates, r.layouts.size(), r.too_big, r.invalid, r.unmodelled,
                        r.simulated, r.planned);
  if (r.cuda) {
    absl::StrAppendFormat(
        &out,
        "on cuda: found with each storage counted as its request (allocated bytes with "
        "expandable segments), then the best replayed through the caching allocator until "
        "%d fit: %d replayed, %d dropped (reserved + %s of CUDA context above the budget); "
        "'device' is reserved + context, '-' where not replayed\n",
        o.checked_layouts, r.checked, r.dropped_when_checked,
        HumanBytes(r.outside_allocator_bytes));
  }
  out += "\n";
  // A mixture of experts has an expert-parallel column.
  const bool experts = c.moe.Sparse();
  absl::StrAppendFormat(&out, "%4s %3s %3s %4s %4s ", "rank", "tp", "pp", "dp", "zero");
  if (experts) absl::StrAppendFormat(&out, "%3s ", "ep");
  absl::StrAppendFormat(&out, "%3s %4s %5s %3s  %-11s %12s ", "sp", "mbs", "micro", "v",
                        "checkpoint", "peak");
  if (r.cuda) absl::StrAppendFormat(&out, "%12s ", "device");
  absl::StrAppendFormat(&out, "%10s %8s %6s\n", "step", "TFLOP/s", "front");
  for (size_t i = 0; i < r.layouts.size() && i < top; ++i) {
    const SearchedLayout& l = r.layouts[i];
    absl::StrAppendFormat(&out, "%4d %3d %3d %4d %4s ", i + 1, l.tp, l.pp, l.dp, ZeroText(l));
    if (experts) absl::StrAppendFormat(&out, "%3d ", l.ep);
    absl::StrAppendFormat(&out, "%3s %4d %5d %3d  %-11s %12s ", l.sp ? "yes" : "no",
                          l.micro_batch_size, l.micro_batches, l.virtual_stages,
                          l.checkpoint.Name(), HumanBytes(l.peak_bytes));
    if (r.cuda) {
      absl::StrAppendFormat(&out, "%12s ", l.checked ? HumanBytes(l.device_bytes) : "-");
    }
    absl::StrAppendFormat(&out, "%10s %8.1f %6s\n", Seconds(l.time.total_s), l.tflops_per_gpu,
                          l.front ? "*" : "");
  }
  if (r.layouts.size() > top) {
    absl::StrAppendFormat(&out, "... the rest of the %d that fit in the JSON (--format=json)\n",
                          r.layouts.size());
  }
  if (!r.layouts.empty()) {
    const SearchedLayout& best = r.layouts.front();
    absl::StrAppendFormat(
        &out,
        "\nbest: step %s = compute %s + bubble %s + tp %s + pp %s + zero3 %s + %sdp %s + "
        "optimizer %s; peak %s on stage %d\n"
        "  ./bazelw run //:predict -- %s\n",
        Seconds(best.time.total_s), Seconds(best.time.compute_s), Seconds(best.time.bubble_s),
        Seconds(best.time.tp_s), Seconds(best.time.pp_s), Seconds(best.time.zero3_s),
        experts ? absl::StrCat("ep ", Seconds(best.time.ep_s), " + ") : "",
        Seconds(best.time.dp_s), Seconds(best.time.optimizer_s), HumanBytes(best.peak_bytes),
        best.stage, best.flags);
  }
  absl::StrAppend(&out, "\n", kTimeModelNote, "\n");
  return out;
}

namespace {

constexpr int kWidth = 960;
constexpr int kHeight = 520;
constexpr int kLeft = 80;
constexpr int kRight = 170;  // room for the legend
constexpr int kTop = 62;
constexpr int kBottom = 56;
constexpr int kPlotWidth = kWidth - kLeft - kRight;
constexpr int kPlotHeight = kHeight - kTop - kBottom;

const char* const kColours[] = {"#4e79a7", "#f28e2b", "#59a14f", "#b07aa1",
                                "#76b7b2", "#edc948", "#9c755f", "#ff9da7"};

}  // namespace

std::string SearchSvg(const SearchResult& r, const SearchOptions& o) {
  // x: step time from 0; y: bytes from 0 to the budget (every point fits under it).
  double slowest = 0;
  for (const SearchedLayout& l : r.layouts) slowest = std::max(slowest, l.time.total_s);
  const double x1 = slowest > 0 ? slowest * 1.08 : 1;
  const int64_t y_top = NiceBytesCeiling(o.budget_bytes + o.budget_bytes / 20);
  auto X = [&](double s) { return kLeft + s / x1 * kPlotWidth; };
  auto Y = [&](double bytes) {
    return kTop + kPlotHeight - bytes / static_cast<double>(y_top) * kPlotHeight;
  };
  std::string svg = ChartHead(
      kWidth, kHeight, kLeft,
      absl::StrFormat("%s on %d x %s, global batch %d, seq %d", r.model, o.gpus, o.gpu.name,
                      o.global_batch, r.config.seq),
      absl::StrFormat("%d layouts that fit: most loaded rank's exact peak against a modelled "
                      "step time; the line joins the front",
                      r.layouts.size()));
  const double y_step = static_cast<double>(y_top) / 4;
  for (int k = 0; k <= 4; ++k) {
    const double b = y_step * k;
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#eee\"/>\n"
                          "<text x=\"%d\" y=\"%.1f\" class=\"tick\" text-anchor=\"end\">%s</text>\n",
                          kLeft, Y(b), kLeft + kPlotWidth, Y(b), kLeft - 6, Y(b) + 4,
                          HumanBytes(static_cast<int64_t>(b)));
  }
  // Round seconds: about five ticks of 1, 2.5 or 5 x 10^k.
  const double raw = x1 / 5;
  const double decade = std::pow(10.0, std::floor(std::log10(raw)));
  const double x_step = raw / decade <= 1 ? decade : raw / decade <= 2.5 ? 2.5 * decade
                                                   : raw / decade <= 5 ? 5 * decade
                                                                       : 10 * decade;
  for (double s = 0; s <= x1; s += x_step) {
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"#eee\"/>\n"
                          "<text x=\"%.1f\" y=\"%d\" class=\"tick\" text-anchor=\"middle\">%s</text>\n",
                          X(s), kTop, X(s), kTop + kPlotHeight, X(s), kTop + kPlotHeight + 16,
                          s == 0 ? std::string("0") : Seconds(s));
  }
  absl::StrAppendFormat(
      &svg,
      "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" stroke=\"#888\"/>\n"
      "<text x=\"%d\" y=\"%d\" class=\"axis\" text-anchor=\"middle\">predicted step time "
      "(a model)</text>\n"
      "<text x=\"18\" y=\"%d\" class=\"axis\" transform=\"rotate(-90 18 %d)\" "
      "text-anchor=\"middle\">peak per GPU (exact)</text>\n",
      kLeft, kTop, kPlotWidth, kPlotHeight, kLeft + kPlotWidth / 2, kHeight - 14,
      kTop + kPlotHeight / 2, kTop + kPlotHeight / 2);
  const double budget_y = Y(static_cast<double>(o.budget_bytes));
  absl::StrAppendFormat(&svg,
                        "<line class=\"budget\" x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" "
                        "stroke=\"#e15759\" stroke-dasharray=\"5,4\"/>\n"
                        "<text x=\"%d\" y=\"%.1f\" class=\"label\" fill=\"#e15759\" "
                        "text-anchor=\"end\">budget %s</text>\n",
                        kLeft, budget_y, kLeft + kPlotWidth, budget_y, kLeft + kPlotWidth - 4,
                        budget_y - 5, HumanBytes(o.budget_bytes));
  // One colour per checkpointing variant, in the order they first appear.
  std::map<std::string, int> colour;
  std::vector<std::string> legend;
  for (const SearchedLayout& l : r.layouts) {
    const std::string name = l.checkpoint.Name();
    if (colour.emplace(name, static_cast<int>(colour.size()) % 8).second) legend.push_back(name);
  }
  for (const SearchedLayout& l : r.layouts) {
    absl::StrAppendFormat(&svg,
                          "<circle class=\"layout\" cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\" "
                          "fill-opacity=\"0.55\"/>\n",
                          X(l.time.total_s), Y(static_cast<double>(l.peak_bytes)),
                          kColours[colour[l.checkpoint.Name()]]);
  }
  std::string path;
  for (const SearchedLayout& l : r.layouts) {
    if (!l.front) continue;
    absl::StrAppendFormat(&path, "%s%.1f,%.1f", path.empty() ? "M" : " L", X(l.time.total_s),
                          Y(static_cast<double>(l.peak_bytes)));
  }
  if (!path.empty()) {
    absl::StrAppendFormat(&svg,
                          "<path class=\"front\" d=\"%s\" fill=\"none\" stroke=\"#222\" "
                          "stroke-width=\"1.5\"/>\n",
                          path);
  }
  if (!r.layouts.empty()) {
    const SearchedLayout& best = r.layouts.front();
    const double x = X(best.time.total_s), y = Y(static_cast<double>(best.peak_bytes));
    absl::StrAppendFormat(&svg,
                          "<circle class=\"best\" cx=\"%.1f\" cy=\"%.1f\" r=\"6\" fill=\"none\" "
                          "stroke=\"#e15759\" stroke-width=\"2\"/>\n"
                          "<text x=\"%.1f\" y=\"%.1f\" class=\"label\" paint-order=\"stroke\" "
                          "stroke=\"#fff\" stroke-width=\"4\">best: tp %d pp %d dp %d, "
                          "%s, %s, %s</text>\n",
                          x, y, x + 9, y + 16, best.tp, best.pp, best.dp,
                          best.fsdp ? "FSDP2" : absl::StrCat("zero ", best.zero),
                          SvgEscape(best.checkpoint.Name()), Seconds(best.time.total_s));
  }
  for (size_t i = 0; i < legend.size(); ++i) {
    const int y = kTop + 10 + static_cast<int>(i) * 18;
    absl::StrAppendFormat(&svg,
                          "<circle cx=\"%d\" cy=\"%d\" r=\"5\" fill=\"%s\"/>\n"
                          "<text x=\"%d\" y=\"%d\" class=\"label\">%s</text>\n",
                          kLeft + kPlotWidth + 18, y, kColours[colour[legend[i]]],
                          kLeft + kPlotWidth + 28, y + 4, SvgEscape(legend[i]));
  }
  absl::StrAppend(&svg, "</svg>\n");
  return svg;
}

}  // namespace memledger
