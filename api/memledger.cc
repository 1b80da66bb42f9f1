#include "api/memledger.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "api/predict_many.h"
#include "estimator/spec/option_checks.h"
#include "estimator/report/memory_snapshot.h"
#include "estimator/predict/predict.h"
#include "estimator/predict/ranks.h"
#include "estimator/report/report.h"
#include "estimator/graph/rules.h"
#include "estimator/request/run_request.h"
#include "estimator/predict/sweep.h"
#include "estimator/report/timeline_svg.h"
#include "estimator/report/units.h"
#include "estimator/spec/input_file.h"
#include "planner/frontier_svg.h"
#include "planner/layout_search.h"
#include "planner/longest_seq.h"
#include "planner/plan_report.h"
#include "planner/plan_run.h"
#include "planner/search_report.h"
#include "rapidjson/document.h"
#include "rapidjson/error/en.h"
#include "rapidjson/stringbuffer.h"
#include "rapidjson/writer.h"

namespace memledger {
namespace {

// CopyString: a malloc'ed copy of `s`'s bytes (NULs included) and a terminating NUL.
char* CopyString(const std::string& s) {
  char* copy = static_cast<char*>(std::malloc(s.size() + 1));
  if (copy != nullptr) std::memcpy(copy, s.c_str(), s.size() + 1);
  return copy;
}

absl::Status KeyError(const char* key, const char* what) {
  return absl::InvalidArgumentError(absl::StrCat("request: \"", key, "\" ", what));
}

// CallKeys reads a call's keys beyond the run's (predict's "explain", the planner's
// budget, the search's GPUs): `read(key, value)` returns nullopt for a key that is not
// the call's, else how reading it went. `call` names the call in the unknown-key error
// ("plan", "search"; empty for predict's).
struct CallKeys {
  std::string call;
  std::function<std::optional<absl::Status>(const std::string& key, const rapidjson::Value& value)>
      read;
};

absl::Status IntegerKey(const std::string& key, const rapidjson::Value& value, int64_t* out) {
  if (!value.IsInt64()) return KeyError(key.c_str(), "must be an integer");
  *out = value.GetInt64();
  return absl::OkStatus();
}

absl::Status NumberKey(const std::string& key, const rapidjson::Value& value, double* out) {
  if (!value.IsNumber()) return KeyError(key.c_str(), "must be a number");
  *out = value.GetDouble();
  return absl::OkStatus();
}

absl::Status BooleanKey(const std::string& key, const rapidjson::Value& value, bool* out) {
  if (!value.IsBool()) return KeyError(key.c_str(), "must be true or false");
  *out = value.GetBool();
  return absl::OkStatus();
}

absl::Status StringKey(const std::string& key, const rapidjson::Value& value, std::string* out) {
  if (!value.IsString()) return KeyError(key.c_str(), "must be a string");
  *out = value.GetString();
  return absl::OkStatus();
}

// PlanKeys are memledger_plan's keys beyond the run's.
struct PlanKeys {
  std::optional<double> budget_gib;
  int64_t frontier_points = 9;
  int64_t cpu_threads = 1;
  double flops_per_second = 0;  // > 0: the plan's step time too

  CallKeys Reader() {
    return {"plan", [this](const std::string& key,
                           const rapidjson::Value& value) -> std::optional<absl::Status> {
              if (key == "budget_gib") {
                double gib = 0;
                absl::Status s = NumberKey(key, value, &gib);
                budget_gib = gib;
                return s;
              }
              if (key == "frontier_points") return IntegerKey(key, value, &frontier_points);
              if (key == "cpu_threads") return IntegerKey(key, value, &cpu_threads);
              if (key == "flops_per_second") return NumberKey(key, value, &flops_per_second);
              return std::nullopt;
            }};
  }
};

absl::StatusOr<RunRequest> RequestFromJson(const rapidjson::Value& doc, const CallKeys* keys,
                                           std::string* format = nullptr);

// OptionsOf: the PredictOptions a request's spec asks for.
PredictOptions OptionsOf(const RunSpec& spec) {
  PredictOptions options;
  options.attention = spec.attention;
  options.variants = spec.variants;
  options.optimizer = spec.optimizer;
  return options;
}

// ParseJson parses one JSON text, naming what it is in errors.
absl::Status ParseJson(const char* json, rapidjson::Document* doc) {
  if (json == nullptr) return absl::InvalidArgumentError("request: NULL");
  if (absl::Status s = CheckJsonNesting(json); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("request: ", s.message()));
  }
  doc->Parse(json);
  if (doc->HasParseError()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request: not JSON (", rapidjson::GetParseError_En(doc->GetParseError()),
        " at offset ", doc->GetErrorOffset(), ")"));
  }
  return absl::OkStatus();
}

// ParseRequest fills a RunRequest from the JSON object; `keys` reads the call's own
// (null: the run's only), `format` its "format" (null: not a key).
absl::StatusOr<RunRequest> ParseRequest(const char* json, const CallKeys* keys,
                                        std::string* format = nullptr) {
  rapidjson::Document doc;
  if (absl::Status s = ParseJson(json, &doc); !s.ok()) return s;
  return RequestFromJson(doc, keys, format);
}

// RequestFromJson: a RunRequest from one request object.
absl::StatusOr<RunRequest> RequestFromJson(const rapidjson::Value& doc, const CallKeys* keys,
                                           std::string* format) {
  if (!doc.IsObject()) return absl::InvalidArgumentError("request: not a JSON object");
  RunRequest request;
  for (const auto& member : doc.GetObject()) {
    const char* key = member.name.GetString();
    const rapidjson::Value& value = member.value;
    const std::string name = key;
    auto integer = [&](int64_t* out) { return IntegerKey(name, value, out); };
    auto optional_integer = [&](std::optional<int64_t>* out) {
      int64_t n = 0;
      absl::Status s = IntegerKey(name, value, &n);
      if (s.ok()) *out = n;
      return s;
    };
    auto string = [&](std::string* out) { return StringKey(name, value, out); };
    auto boolean = [&](bool* out) { return BooleanKey(name, value, out); };
    absl::Status status;
    // The call's own keys first: a call may refuse one of the run's ("batch" for the
    // search, which chooses it).
    if (std::optional<absl::Status> own = keys != nullptr ? keys->read(name, value) : std::nullopt;
        own.has_value()) {
      status = *own;
    } else if (name == "model" && value.IsObject()) {
      // A config.json inline (a dict, or a transformers PretrainedConfig's to_dict()).
      rapidjson::StringBuffer text;
      rapidjson::Writer<rapidjson::StringBuffer> writer(text);
      value.Accept(writer);
      request.model_config_json.assign(text.GetString(), text.GetSize());
      request.model = "request: \"model\"";
    } else if (name == "model") {
      status = string(&request.model);
    } else if (name == "format" && format != nullptr) {
      status = string(format);  // each call checks the formats it renders
    }
    else if (name == "layers") status = optional_integer(&request.layers);
    else if (name == "width") status = optional_integer(&request.width);
    else if (name == "heads") status = optional_integer(&request.heads);
    else if (name == "kv_heads") status = optional_integer(&request.kv_heads);
    else if (name == "head_dim") status = optional_integer(&request.head_dim);
    else if (name == "intermediate") status = optional_integer(&request.intermediate);
    else if (name == "vocab") status = optional_integer(&request.vocab);
    else if (name == "batch") status = integer(&request.batch);
    else if (name == "seq") status = integer(&request.seq);
    else if (name == "every") status = integer(&request.every);
    else if (name == "tp") status = integer(&request.tp);
    else if (name == "dp") status = integer(&request.dp);
    else if (name == "pp") status = integer(&request.pp);
    else if (name == "virtual_stages") status = integer(&request.virtual_stages);
    else if (name == "micro_batches") status = integer(&request.micro_batches);
    else if (name == "zero") status = integer(&request.zero);
    else if (name == "ep") status = integer(&request.ep);
    else if (name == "schedule") status = string(&request.schedule);
    else if (name == "variants") status = string(&request.variants);
    else if (name == "plan") status = string(&request.plan);
    else if (name == "policy") status = string(&request.policy);
    else if (name == "attention") status = string(&request.attention);
    else if (name == "device") status = string(&request.device);
    else if (name == "sdpa_backend") status = string(&request.sdpa_backend);
    else if (name == "expandable_segments") status = boolean(&request.expandable_segments);
    else if (name == "cublas_workspace_config") {
      status = string(&request.cublas_workspace_config);
    }
    else if (name == "offload_activations") status = string(&request.offload_activations);
    else if (name == "dtype") status = string(&request.dtype);
    else if (name == "amp") status = string(&request.amp);
    else if (name == "optimizer") status = string(&request.optimizer);
    else if (name == "optimizer_impl") status = string(&request.optimizer_impl);
    else if (name == "checkpoint_impl") status = string(&request.checkpoint_impl);
    else if (name == "freeze") status = string(&request.freeze);
    else if (name == "lora_targets") status = string(&request.lora_targets);
    else if (name == "lora_rank") status = integer(&request.lora_rank);
    else if (name == "lora_alpha") status = NumberKey(name, value, &request.lora_alpha);
    else if (name == "lora_dropout") status = NumberKey(name, value, &request.lora_dropout);
    else if (name == "experts_impl") status = string(&request.experts_impl);
    else if (name == "routing") status = string(&request.routing);
    else if (name == "momentum") status = NumberKey(name, value, &request.momentum);
    else if (name == "cuda_context_mib") {
      status = NumberKey(name, value, &request.cuda_context_mib);
    }
    else if (name == "master_weights") status = boolean(&request.master_weights);
    else if (name == "use_dora") status = boolean(&request.use_dora);
    else if (name == "gradient_as_bucket_view") status = boolean(&request.gradient_as_bucket_view);
    else if (name == "fsdp") status = boolean(&request.fsdp);
    else if (name == "mp_param_dtype") status = string(&request.mp_param_dtype);
    else if (name == "mp_reduce_dtype") status = string(&request.mp_reduce_dtype);
    else if (name == "offload") status = string(&request.offload);
    else if (name == "reshard_after_forward") {
      // fully_shard's bool | int, or "auto" (its default, None).
      if (value.IsBool()) {
        request.reshard_after_forward = value.GetBool() ? "true" : "false";
      } else if (value.IsString()) {
        status = string(&request.reshard_after_forward);
      } else {
        int64_t ranks = 0;
        status = IntegerKey(name, value, &ranks);
        request.reshard_after_forward = absl::StrCat(ranks);
      }
    }
    else if (name == "ddp_bucket_mb") {
      double mib = 0;
      status = NumberKey(name, value, &mib);
      request.ddp_bucket_mb = mib;
    }
    else if (name == "sp") status = boolean(&request.sp);
    else {
      const std::string call = keys != nullptr && !keys->call.empty() ? keys->call + " " : "";
      return KeyError(key, absl::StrCat("is not a ", call, "request key (see api/memledger.h)")
                               .c_str());
    }
    if (!status.ok()) return status;
  }
  return request;
}

// PredictKeys are memledger_predict's keys beyond the run's: predict's own flags.
struct PredictKeys {
  bool explain = false;
  std::optional<std::string> sweep;
  double budget_gib = 0;  // with sweep: each row's fit
  int64_t cpu_threads = 1;

  CallKeys Reader() {
    return {"", [this](const std::string& key,
                       const rapidjson::Value& value) -> std::optional<absl::Status> {
              if (key == "explain") return BooleanKey(key, value, &explain);
              if (key == "sweep") {
                std::string text;
                absl::Status s = StringKey(key, value, &text);
                sweep = text;
                return s;
              }
              if (key == "budget_gib") return NumberKey(key, value, &budget_gib);
              if (key == "cpu_threads") return IntegerKey(key, value, &cpu_threads);
              return std::nullopt;
            }};
  }
};

// SweepRows: predict's --sweep, its rows as CSV (format "json" or "csv") or JSON lines.
absl::StatusOr<std::string> SweepRows(const RunRequest& request, const PredictKeys& keys,
                                      const std::string& format) {
  if (format != "json" && format != "csv" && format != "jsonl") {
    return KeyError("format", "with \"sweep\" must be \"csv\" or \"jsonl\"");
  }
  if (request.dp > 1 || request.pp > 1) {
    return KeyError("sweep", "does not take \"dp\" or \"pp\" yet");
  }
  // 0: no budget column; otherwise whole bytes that fit int64.
  const absl::StatusOr<int64_t> budget = BudgetBytes(keys.budget_gib, /*zero_is_none=*/true);
  if (!budget.ok()) return budget.status();
  absl::StatusOr<SweepGrid> grid = ParseSweep(*keys.sweep);
  if (!grid.ok()) return grid.status();
  return RunSweep(request, *grid, *budget,
                  format == "jsonl" ? SweepFormat::kJsonLines : SweepFormat::kCsv);
}

absl::StatusOr<std::string> PredictJson(const char* request_json) {
  PredictKeys keys;
  std::string format = "json";
  const CallKeys reader = keys.Reader();
  absl::StatusOr<RunRequest> request = ParseRequest(request_json, &reader, &format);
  if (!request.ok()) return request.status();
  if (keys.sweep.has_value()) {
    // As the CLI checks them: the run's keys first, then the sweep's.
    if (absl::StatusOr<RunSpec> spec = RunSpecFromRequest(*request); !spec.ok()) {
      return spec.status();
    }
    return SweepRows(*request, keys, format);
  }
  if (keys.budget_gib != 0) return KeyError("budget_gib", "goes with \"sweep\"");
  if (format != "json" && format != "table" && format != "svg") {
    return KeyError("format", "must be \"json\", \"table\" or \"svg\" (\"csv\" and "
                              "\"jsonl\" go with \"sweep\")");
  }
  if (absl::Status s = CheckCpuThreads(keys.cpu_threads); !s.ok()) return s;
  // The request is validated here, once; what predicts from it takes the proof.
  absl::StatusOr<ValidRun> run = ValidRunFromRequest(*request);
  if (!run.ok()) return run.status();
  const RunSpec* spec = &run->spec();
  PredictOptions options = OptionsOf(*spec);
  options.cpu_threads = static_cast<int>(keys.cpu_threads);
  const bool explain = keys.explain;
  options.breakdown = explain;
  options.timeline = format == "svg";
  if (spec->parallel.Accumulates()) {
    absl::StatusOr<DistributedPrediction> p =
        PredictValidDistributed(run->config(), spec->parallel, options);
    if (!p.ok()) return p.status();
    if (format == "svg") return RankTimelineSvg(p->ranks.kinds.front());
    if (format == "table") return RanksTable(p->whole, p->ranks);
    return JsonString(RanksJson(p->whole, p->ranks));
  }
  absl::StatusOr<Prediction> prediction = PredictValid(run->config(), options);
  if (!prediction.ok()) return prediction.status();
  if (format == "svg") {
    return PredictedTimelineSvg(PredictedStepTitle(spec->config.device), prediction->variants);
  }
  if (format == "table") {
    std::string table = PredictionTable(*prediction);
    if (explain) table += "\n" + BreakdownText(*prediction);
    return table;
  }
  return JsonString(PredictionJson(*prediction));
}

// PredictOne is one request of a batch, predicted into `result`.
absl::Status PredictOne(const rapidjson::Value& item, bool peak, ManyResult& result) {
  absl::StatusOr<RunRequest> request = RequestFromJson(item, nullptr);
  if (!request.ok()) return request.status();
  absl::StatusOr<ValidRun> run = ValidRunFromRequest(*request);
  if (!run.ok()) return run.status();
  if (run->spec().parallel.Accumulates()) {
    return absl::InvalidArgumentError(
        "\"dp\", \"pp\" and \"micro_batches\" are memledger_predict's only");
  }
  PredictOptions options = OptionsOf(run->spec());
  options.peak = peak;
  absl::StatusOr<Prediction> p = PredictValid(run->config(), options);
  if (!p.ok()) return p.status();
  result.n_params = p->n_params;
  result.param_bytes = p->param_bytes;
  result.grad_bytes = p->grad_bytes;
  result.optimizer_state_bytes = p->optimizer_state_bytes;
  result.variants.reserve(p->variants.size());
  for (const VariantPrediction& v : p->variants) {
    result.variants.push_back(
        {v.variant.Name(), v.saved_bytes,
         v.peak.has_value() ? std::optional<int64_t>(v.peak->bytes) : std::nullopt});
  }
  return absl::OkStatus();
}

// ManyJson writes a batch's results as memledger_predict_many's JSON array.
std::string ManyJson(const std::vector<ManyResult>& results, bool peak) {
  rapidjson::StringBuffer buffer;
  rapidjson::Writer<rapidjson::StringBuffer> w(buffer);
  w.StartArray();
  for (const ManyResult& r : results) {
    w.StartObject();
    w.Key("n_params");
    w.Int64(r.n_params);
    w.Key("param_bytes");
    w.Int64(r.param_bytes);
    w.Key("grad_bytes");
    w.Int64(r.grad_bytes);
    w.Key("optimizer_state_bytes");
    w.Int64(r.optimizer_state_bytes);
    w.Key("saved_bytes");
    w.StartObject();
    for (const ManyVariant& v : r.variants) {
      w.Key(v.name.c_str());
      w.Int64(v.saved_bytes);
    }
    w.EndObject();
    if (peak) {
      w.Key("peak_bytes");
      w.StartObject();
      for (const ManyVariant& v : r.variants) {
        w.Key(v.name.c_str());
        if (v.peak_bytes.has_value()) {
          w.Int64(*v.peak_bytes);
        } else {
          w.Null();
        }
      }
      w.EndObject();
    }
    w.EndObject();
  }
  w.EndArray();
  return std::string(buffer.GetString(), buffer.GetSize());
}

absl::StatusOr<std::string> SnapshotPickle(const char* request_json) {
  absl::StatusOr<RunRequest> request = ParseRequest(request_json, nullptr);
  if (!request.ok()) return request.status();
  absl::StatusOr<RunSpec> spec = RunSpecFromRequest(*request);
  if (!spec.ok()) return spec.status();
  if (spec->parallel.Accumulates() || spec->variants.size() != 1) {
    return absl::InvalidArgumentError(
        "snapshot: one process's step of one variant: give \"variants\" one name, without "
        "\"dp\", \"pp\" or \"micro_batches\"");
  }
  PredictOptions options = OptionsOf(*spec);
  options.timeline = true;
  absl::StatusOr<Prediction> prediction = Predict(spec->config, options);
  if (!prediction.ok()) return prediction.status();
  const VariantPrediction& v = prediction->variants.front();
  if (v.timeline == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("snapshot: no step simulation: ", v.peak_unavailable));
  }
  return MemorySnapshotPickle(*v.timeline);
}

absl::StatusOr<std::string> PlanJson(const char* request_json) {
  PlanKeys keys;
  std::string format = "json";
  const CallKeys reader = keys.Reader();
  absl::StatusOr<RunRequest> request = ParseRequest(request_json, &reader, &format);
  if (!request.ok()) return request.status();
  if (format != "json" && format != "table" && format != "svg" && format != "frontier_svg") {
    return KeyError("format", "must be \"json\", \"table\", \"svg\" or \"frontier_svg\"");
  }
  if (!keys.budget_gib.has_value()) {
    return absl::InvalidArgumentError("request: \"budget_gib\" is required");
  }
  const absl::StatusOr<int64_t> budget = BudgetBytes(*keys.budget_gib);
  if (!budget.ok()) return budget.status();
  if (absl::Status s = CheckCpuThreads(keys.cpu_threads); !s.ok()) return s;
  absl::StatusOr<ValidRun> run = ValidRunFromRequest(*request);
  if (!run.ok()) return run.status();
  const RunSpec* spec = &run->spec();
  PlanRunOptions options;
  options.budget_bytes = *budget;
  options.frontier_points = keys.frontier_points;  // RunPlanner checks it
  options.cpu_threads = static_cast<int>(keys.cpu_threads);
  options.flops_per_second = keys.flops_per_second;
  options.timeline = format == "svg";
  absl::StatusOr<PlanReport> report = RunPlanner(*run, options);
  if (!report.ok()) return report.status();
  if (format == "table") return PlanReportTable(*report);
  if (format == "svg") return PlanTimelineSvg(*spec, *report);
  if (format == "frontier_svg") {
    if (report->frontier.size() < 2) {
      return KeyError("format", "\"frontier_svg\" needs \"frontier_points\" >= 2");
    }
    return FrontierSvg(FrontierTitle(*spec), *report);
  }
  return JsonString(PlanReportJson(*report));
}

// SearchKeys are memledger_search's keys beyond the run's: //planner:search's flags.
struct SearchKeys {
  SearchRequest search;
  int64_t top = 20;  // the table's rows
  int64_t longest_seq = 0;  // > 0: the longest sequence up to it (planner/longest_seq.h)
  bool seq_given = false;
  bool precision_given = false;  // a precision key (DefaultSearchPrecision)

  CallKeys Reader() {
    return {"search", [this](const std::string& key,
                             const rapidjson::Value& value) -> std::optional<absl::Status> {
              if (key == "gpus") return IntegerKey(key, value, &search.gpus);
              if (key == "gpus_per_node") return IntegerKey(key, value, &search.gpus_per_node);
              if (key == "global_batch") return IntegerKey(key, value, &search.global_batch);
              if (key == "max_virtual_stages") {
                return IntegerKey(key, value, &search.max_virtual_stages);
              }
              if (key == "threads") return IntegerKey(key, value, &search.threads);
              if (key == "planned_layouts") {
                return IntegerKey(key, value, &search.planned_layouts);
              }
              if (key == "checked_layouts") {
                return IntegerKey(key, value, &search.checked_layouts);
              }
              if (key == "top") return IntegerKey(key, value, &top);
              if (key == "longest_seq") return IntegerKey(key, value, &longest_seq);
              if (key == "seq") seq_given = true;  // and read as the run's
              if (key == "dtype" || key == "amp" || key == "master_weights" ||
                  key == "mp_param_dtype" || key == "mp_reduce_dtype") {
                precision_given = true;  // and read as the run's
              }
              if (key == "mfu") return NumberKey(key, value, &search.mfu);
              if (key == "gpu") return StringKey(key, value, &search.gpu);
              if (key == "gpu_memory_gib") {
                double gib = 0;
                absl::Status s = NumberKey(key, value, &gib);
                search.gpu_memory_gib = gib;
                return s;
              }
              // The layout's keys fix that part of it ("batch": the micro-batch size).
              LayoutConstraints& fixed = search.fixed;
              for (const auto& [name, field] :
                   {std::pair<const char*, std::optional<int64_t>*>{"tp", &fixed.tp},
                    {"pp", &fixed.pp},
                    {"dp", &fixed.dp},
                    {"zero", &fixed.zero},
                    {"virtual_stages", &fixed.virtual_stages},
                    {"ep", &fixed.ep},
                    {"batch", &fixed.micro_batch_size}}) {
                if (key != name) continue;
                int64_t n = 0;
                absl::Status s = IntegerKey(key, value, &n);
                *field = n;
                return s;
              }
              if (key == "sp") {
                bool sp = false;
                absl::Status s = BooleanKey(key, value, &sp);
                fixed.sp = sp;
                return s;
              }
              if (key == "micro_batches" || key == "schedule") {
                return KeyError(key.c_str(),
                                "follows from the layout: give \"global_batch\" and "
                                "\"virtual_stages\"");
              }
              return std::nullopt;
            }};
  }
};

absl::StatusOr<std::string> SearchCall(const char* request_json) {
  SearchKeys keys;
  std::string format = "json";
  const CallKeys reader = keys.Reader();
  absl::StatusOr<RunRequest> request = ParseRequest(request_json, &reader, &format);
  if (!request.ok()) return request.status();
  if (format != "json" && format != "table" && format != "svg") {
    return KeyError("format", "must be \"json\", \"table\" or \"svg\"");
  }
  if (absl::Status s = CheckTop(keys.top); !s.ok()) return s;
  absl::StatusOr<SearchOptions> options = SearchOptionsFrom(keys.search);
  if (!options.ok()) return options.status();
  DefaultSearchPrecision(keys.precision_given, *request, *options);
  if (keys.longest_seq != 0 && keys.seq_given) {
    return KeyError("longest_seq", "bisects \"seq\": give one of them, not both");
  }
  absl::StatusOr<SearchResult> result =
      keys.longest_seq != 0 ? SearchLongestSequence(*request, *options, keys.longest_seq)
                            : SearchLayouts(*request, *options);
  if (!result.ok()) return result.status();
  if (format == "table") return SearchTable(*result, *options, static_cast<size_t>(keys.top));
  if (format == "svg") return SearchSvg(*result, *options);
  return JsonString(SearchJson(*result, *options));
}

int CodeOf(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kResourceExhausted:
      return MEMLEDGER_NO_PLAN;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kNotFound:
      return MEMLEDGER_INVALID_ARGUMENT;
    default:
      return MEMLEDGER_INTERNAL;
  }
}

// Call runs one request through `run` and hands the result over the C boundary: the
// JSON, or the error code and one line; nothing may unwind into C.
// `response_size`, when not null, gets the response's length (0 on error).
// `run` is called as absl::StatusOr<std::string>(const char*).
template <typename Run>
int Call(Run run, const char* request_json, char** response_json, char** error_message,
         size_t* response_size = nullptr) {
  if (response_json != nullptr) *response_json = nullptr;
  if (error_message != nullptr) *error_message = nullptr;
  if (response_size != nullptr) *response_size = 0;
  int code = MEMLEDGER_INTERNAL;
  std::string error;
  try {
    absl::StatusOr<std::string> json = run(request_json);
    if (json.ok()) {
      if (response_json != nullptr) *response_json = memledger::CopyString(*json);
      if (response_size != nullptr) *response_size = json->size();
      return MEMLEDGER_OK;
    }
    code = memledger::CodeOf(json.status());
    error = std::string(json.status().message());
  } catch (const std::exception& e) {  // nothing may unwind into C
    error = absl::StrCat("internal error: ", e.what());
  } catch (...) {
    error = "internal error";
  }
  if (error_message != nullptr) *error_message = memledger::CopyString(error);
  return code;
}

}  // namespace

absl::StatusOr<std::vector<ManyResult>> PredictMany(const char* requests_json,
                                                    const ManyOptions& many) {
  rapidjson::Document doc;
  if (absl::Status s = ParseJson(requests_json, &doc); !s.ok()) return s;
  return PredictMany(doc, many);
}

absl::StatusOr<std::vector<ManyResult>> PredictMany(const rapidjson::Value& doc,
                                                    const ManyOptions& many) {
  if (!doc.IsArray()) return absl::InvalidArgumentError("requests: not a JSON array");
  const size_t n = doc.Size();
  std::vector<ManyResult> results(n);
  std::vector<absl::Status> errors(n);
  // Each thread claims the next request in order; results land in their own slots.
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      try {
        errors[i] = PredictOne(doc[static_cast<rapidjson::SizeType>(i)], many.peak, results[i]);
      } catch (const std::exception& e) {
        errors[i] = absl::InternalError(e.what());
      }
    }
  };
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const size_t threads =
      std::min<size_t>(many.threads > 0 ? many.threads : cores, std::max<size_t>(n, 1));
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  for (size_t i = 0; i < n; ++i) {
    if (!errors[i].ok()) {
      return absl::Status(errors[i].code(),
                          absl::StrCat("requests[", i, "]: ", errors[i].message()));
    }
  }
  return results;
}

}  // namespace memledger

extern "C" {

const char* memledger_version(void) {
  static const std::string* const kVersion = new std::string(absl::StrCat(
      "memledger ", MEMLEDGER_ABI_VERSION, " (torch ", memledger::kTorchRelease,
      ", transformers ", memledger::kTransformersRelease, ")"));
  return kVersion->c_str();
}

int memledger_abi_version(void) { return MEMLEDGER_ABI_VERSION; }

int memledger_predict(const char* request_json, char** response_json, char** error_message) {
  return memledger::Call(memledger::PredictJson, request_json, response_json, error_message);
}

int memledger_plan(const char* request_json, char** response_json, char** error_message) {
  return memledger::Call(memledger::PlanJson, request_json, response_json, error_message);
}

int memledger_search(const char* request_json, char** response_json, char** error_message) {
  return memledger::Call(memledger::SearchCall, request_json, response_json, error_message);
}

int memledger_predict_many(const char* requests_json, int peak, int threads,
                           char** response_json, char** error_message) {
  if (response_json != nullptr) *response_json = nullptr;
  if (error_message != nullptr) *error_message = nullptr;
  if (threads < 0 || threads > 1024) {
    if (error_message != nullptr) {
      *error_message = memledger::CopyString(
          absl::StrCat("threads must be between 0 (the cores) and 1024, got ", threads));
    }
    return MEMLEDGER_INVALID_ARGUMENT;
  }
  const memledger::ManyOptions many{peak != 0, threads};
  return memledger::Call(
      [&many](const char* json) -> absl::StatusOr<std::string> {
        absl::StatusOr<std::vector<memledger::ManyResult>> results =
            memledger::PredictMany(json, many);
        if (!results.ok()) return results.status();
        return memledger::ManyJson(*results, many.peak);
      },
      requests_json, response_json, error_message);
}

int memledger_snapshot(const char* request_json, char** snapshot, size_t* snapshot_size,
                       char** error_message) {
  return memledger::Call(memledger::SnapshotPickle, request_json, snapshot, error_message,
                         snapshot_size);
}

void memledger_free(char* string) { std::free(string); }

}  // extern "C"
