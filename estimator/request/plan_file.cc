#include "estimator/request/plan_file.h"

#include <sys/stat.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "estimator/spec/input_file.h"
#include "rapidjson/document.h"
#include "rapidjson/error/en.h"

namespace memledger {

absl::StatusOr<Variant> ParsePlanJson(absl::string_view json) {
  if (absl::Status s = CheckJsonNesting(json); !s.ok()) return s;
  rapidjson::Document doc;
  doc.Parse(json.data(), json.size());
  if (doc.HasParseError()) {
    return absl::InvalidArgumentError(absl::StrCat("not JSON at offset ", doc.GetErrorOffset(),
                                                   ": ",
                                                   rapidjson::GetParseError_En(doc.GetParseError())));
  }
  if (!doc.IsObject() || !doc.HasMember("plan") || !doc["plan"].IsArray()) {
    return absl::InvalidArgumentError(
        "expected an object with a \"plan\" array of layer choices (as //planner writes)");
  }
  std::vector<LayerChoice> layers;
  const rapidjson::Value& plan = doc["plan"];
  for (rapidjson::SizeType i = 0; i < plan.Size(); ++i) {
    if (!plan[i].IsString()) {
      return absl::InvalidArgumentError(absl::StrCat("plan[", i, "] is not a string"));
    }
    absl::StatusOr<LayerChoice> choice =
        ParseLayerChoice(absl::string_view(plan[i].GetString(), plan[i].GetStringLength()));
    if (!choice.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("plan[", i, "]: ", choice.status().message()));
    }
    layers.push_back(*choice);
  }
  if (layers.empty()) return absl::InvalidArgumentError("the plan has no layers");
  return PlanVariant(std::move(layers));
}

// kMaxInlinePlanLayers bounds an inline plan's layers (a count could ask for billions).
constexpr int64_t kMaxInlinePlanLayers = 1 << 20;

absl::StatusOr<Variant> ParsePlanRuns(absl::string_view text) {
  std::vector<LayerChoice> layers;
  for (absl::string_view run : absl::StrSplit(text, ';')) {
    const size_t star = run.rfind('*');
    int64_t count = 1;
    absl::string_view name = run;
    if (star != absl::string_view::npos) {
      name = run.substr(0, star);
      if (!absl::SimpleAtoi(run.substr(star + 1), &count) || count < 1 ||
          count > kMaxInlinePlanLayers) {
        return absl::InvalidArgumentError(absl::StrCat(
            "run '", run, "': the count after '*' must be a whole number from 1 to ",
            kMaxInlinePlanLayers));
      }
    }
    absl::StatusOr<LayerChoice> choice = ParseLayerChoice(name);
    if (!choice.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("run '", run, "': ", choice.status().message()));
    }
    if (static_cast<int64_t>(layers.size()) + count > kMaxInlinePlanLayers) {
      return absl::InvalidArgumentError(
          absl::StrCat("more than ", kMaxInlinePlanLayers, " layers"));
    }
    layers.insert(layers.end(), static_cast<size_t>(count), *choice);
  }
  return PlanVariant(std::move(layers));
}

std::string PlanRunsText(const Variant& plan) {
  std::string out;
  const std::vector<LayerChoice>& layers = plan.layers;
  for (size_t start = 0; start < layers.size();) {
    size_t end = start;
    while (end < layers.size() && layers[end] == layers[start]) ++end;
    absl::StrAppend(&out, out.empty() ? "" : ";", layers[start].Name());
    if (end - start > 1) absl::StrAppend(&out, "*", end - start);
    start = end;
  }
  return out;
}

absl::StatusOr<Variant> ReadPlan(const std::string& value) {
  if (!absl::EndsWith(value, ".json")) {
    absl::StatusOr<Variant> plan = ParsePlanRuns(value);
    if (plan.ok()) return plan;
    // Not a plan's runs: the file the planner's --plan_out wrote, whatever its name.
    struct stat info;
    if (stat(value.c_str(), &info) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("--plan: ", plan.status().message()));
    }
  }
  absl::StatusOr<std::string> text = ReadInputFile(value, "--plan", kMaxJsonBytes);
  if (absl::IsNotFound(text.status())) {
    return absl::InvalidArgumentError(absl::StrCat("--plan ", value, ": cannot read the file"));
  }
  if (!text.ok()) return absl::InvalidArgumentError(text.status().message());
  absl::StatusOr<Variant> plan = ParsePlanJson(*text);
  if (!plan.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--plan ", value, ": ", plan.status().message()));
  }
  return plan;
}

}  // namespace memledger
