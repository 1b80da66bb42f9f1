#include "estimator/predict/sweep.h"

#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "estimator/spec/checked_math.h"
#include "estimator/predict/predict.h"
#include "rapidjson/stringbuffer.h"
#include "rapidjson/writer.h"

namespace memledger {
namespace {

constexpr int64_t kMaxPoints = 100000;

absl::Status SweepError(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("--sweep: ", what));
}

absl::StatusOr<int64_t> ParseValue(absl::string_view text) {
  int64_t value = 0;
  if (!absl::SimpleAtoi(text, &value) || value < 1) {
    return SweepError(absl::StrCat("'", text, "' is not a whole number >= 1"));
  }
  return value;
}

// CsvField quotes a field that holds a comma, quote or newline (RFC 4180).
std::string CsvField(const std::string& field) {
  if (field.find_first_of(",\"\n") == std::string::npos) return field;
  std::string quoted = "\"";
  for (char ch : field) quoted += ch == '"' ? std::string("\"\"") : std::string(1, ch);
  return quoted + "\"";
}

int64_t* Field(RunRequest& request, const std::string& name) {
  if (name == "batch") return &request.batch;
  if (name == "seq") return &request.seq;
  return nullptr;
}

}  // namespace

int64_t SweepGrid::size() const {
  int64_t n = 1;
  for (const SweepAxis& axis : axes) n *= static_cast<int64_t>(axis.values.size());
  return n;
}

absl::StatusOr<SweepGrid> ParseSweep(absl::string_view text) {
  SweepGrid grid;
  CheckedInt64 points = 1;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    std::pair<absl::string_view, absl::string_view> name_values = absl::StrSplit(part, ':');
    SweepAxis axis;
    axis.name = std::string(name_values.first);
    if (axis.name != "batch" && axis.name != "seq" && axis.name != "layers") {
      return SweepError(absl::StrCat("unknown axis '", axis.name, "' (batch, seq, layers)"));
    }
    for (const SweepAxis& seen : grid.axes) {
      if (seen.name == axis.name) return SweepError(absl::StrCat("'", axis.name, "' twice"));
    }
    const absl::string_view values = name_values.second;
    if (values.empty()) return SweepError(absl::StrCat("'", axis.name, "' has no values"));
    if (const size_t dots = values.find(".."); dots != absl::string_view::npos) {
      absl::StatusOr<int64_t> lo = ParseValue(values.substr(0, dots));
      if (!lo.ok()) return lo.status();
      absl::StatusOr<int64_t> hi = ParseValue(values.substr(dots + 2));
      if (!hi.ok()) return hi.status();
      if (*hi < *lo) return SweepError(absl::StrCat("'", part, "' runs backwards"));
      for (int64_t v = *lo; v <= *hi; v *= 2) {  // doubling: 1, 2, 4, ...
        axis.values.push_back(v);
        if (v > *hi / 2) break;
      }
    } else {
      for (absl::string_view value : absl::StrSplit(values, '|')) {
        absl::StatusOr<int64_t> v = ParseValue(value);
        if (!v.ok()) return v.status();
        axis.values.push_back(*v);
      }
    }
    points *= static_cast<int64_t>(axis.values.size());
    if (points.overflowed() || points.value() > kMaxPoints) {
      return SweepError(absl::StrCat("more than ", kMaxPoints, " points"));
    }
    grid.axes.push_back(std::move(axis));
  }
  if (grid.axes.empty()) return SweepError("names no axis (e.g. batch:1..64,seq:1024..32768)");
  return grid;
}

absl::StatusOr<std::string> RunSweep(const RunRequest& request, const SweepGrid& grid,
                                     int64_t budget_bytes, SweepFormat format) {
  std::string out;
  if (format == SweepFormat::kCsv) {
    out = "model,layers,batch,seq,variant,param_bytes,grad_bytes,optimizer_state_bytes,"
          "saved_bytes,sum_bytes,peak_bytes,fits\n";
  }
  std::vector<size_t> index(grid.axes.size(), 0);
  for (int64_t point = 0; point < grid.size(); ++point) {
    RunRequest run = request;
    std::string where;
    for (size_t a = 0; a < grid.axes.size(); ++a) {
      const SweepAxis& axis = grid.axes[a];
      const int64_t value = axis.values[index[a]];
      if (int64_t* field = Field(run, axis.name); field != nullptr) {
        *field = value;
      } else {
        run.layers = value;
      }
      absl::StrAppend(&where, where.empty() ? "" : ", ", axis.name, " ", value);
    }
    absl::StatusOr<RunSpec> spec = RunSpecFromRequest(run);
    absl::StatusOr<Prediction> p = spec.ok() ? Predict(spec->config, [&] {
      PredictOptions options;
      options.attention = spec->attention;
      options.variants = spec->variants;
      options.optimizer = spec->optimizer;
      return options;
    }())
                                             : absl::StatusOr<Prediction>(spec.status());
    if (!p.ok()) {
      return absl::Status(p.status().code(),
                          absl::StrCat("--sweep at ", where, ": ", p.status().message()));
    }
    for (const VariantPrediction& v : p->variants) {
      const CheckedInt64 sum = CheckedInt64(p->param_bytes) + p->grad_bytes +
                               p->optimizer_state_bytes + v.saved_bytes;
      if (sum.overflowed()) return SweepError(absl::StrCat("bytes overflow at ", where));
      // What must fit is the step's peak where it is simulated; otherwise the sum, which
      // bounds it from above for everything but workspaces.
      const int64_t needed = v.peak.has_value() ? v.peak->bytes : sum.value();
      const std::string fits =
          budget_bytes <= 0 ? "" : (needed <= budget_bytes ? "true" : "false");
      const std::string peak = v.peak.has_value() ? absl::StrCat(v.peak->bytes) : "";
      const ModelConfig& c = p->config;
      if (format == SweepFormat::kCsv) {
        absl::StrAppend(&out, CsvField(run.model), ",", c.layers, ",", c.batch, ",", c.seq, ",",
                        v.variant.Name(), ",", p->param_bytes, ",", p->grad_bytes, ",",
                        p->optimizer_state_bytes, ",", v.saved_bytes, ",", sum.value(), ",",
                        peak, ",", fits, "\n");
      } else {
        rapidjson::StringBuffer buffer;
        rapidjson::Writer<rapidjson::StringBuffer> w(buffer);
        w.StartObject();
        w.Key("model");
        w.String(run.model.c_str());
        for (const auto& [key, value] :
             {std::pair<const char*, int64_t>{"layers", c.layers},
              {"batch", c.batch},
              {"seq", c.seq}}) {
          w.Key(key);
          w.Int64(value);
        }
        w.Key("variant");
        w.String(v.variant.Name().c_str());
        for (const auto& [key, value] :
             {std::pair<const char*, int64_t>{"param_bytes", p->param_bytes},
              {"grad_bytes", p->grad_bytes},
              {"optimizer_state_bytes", p->optimizer_state_bytes},
              {"saved_bytes", v.saved_bytes},
              {"sum_bytes", sum.value()}}) {
          w.Key(key);
          w.Int64(value);
        }
        w.Key("peak_bytes");
        if (v.peak.has_value()) {
          w.Int64(v.peak->bytes);
        } else {
          w.Null();
        }
        w.Key("fits");
        if (fits.empty()) {
          w.Null();
        } else {
          w.Bool(fits == "true");
        }
        w.EndObject();
        absl::StrAppend(&out, buffer.GetString(), "\n");
      }
    }
    // Next point: the last axis fastest.
    for (size_t a = grid.axes.size(); a-- > 0;) {
      if (++index[a] < grid.axes[a].values.size()) break;
      index[a] = 0;
    }
  }
  return out;
}

}  // namespace memledger
