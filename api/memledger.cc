#include "api/memledger.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "estimator/memory_snapshot.h"
#include "estimator/predict.h"
#include "estimator/ranks.h"
#include "estimator/report.h"
#include "estimator/rules.h"
#include "estimator/run_request.h"
#include "estimator/timeline_svg.h"
#include "estimator/units.h"
#include "planner/plan_report.h"
#include "planner/plan_run.h"
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

// PlanKeys are memledger_plan's keys beyond the run's.
struct PlanKeys {
  std::optional<double> budget_gib;
  int64_t frontier_points = 9;
  int64_t cpu_threads = 1;
};

absl::StatusOr<RunRequest> RequestFromJson(const rapidjson::Value& doc, bool* explain,
                                           PlanKeys* plan, std::string* format = nullptr);

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
  doc->Parse(json);
  if (doc->HasParseError()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request: not JSON (", rapidjson::GetParseError_En(doc->GetParseError()),
        " at offset ", doc->GetErrorOffset(), ")"));
  }
  return absl::OkStatus();
}

// ParseRequest fills a RunRequest from the JSON object; `explain` from its "explain"
// (predict's only: null for a plan), `plan` from the planner's keys (null for predict),
// `format` from its "format" (null: not a key).
absl::StatusOr<RunRequest> ParseRequest(const char* json, bool* explain, PlanKeys* plan,
                                        std::string* format = nullptr) {
  rapidjson::Document doc;
  if (absl::Status s = ParseJson(json, &doc); !s.ok()) return s;
  return RequestFromJson(doc, explain, plan, format);
}

// RequestFromJson: a RunRequest from one request object.
absl::StatusOr<RunRequest> RequestFromJson(const rapidjson::Value& doc, bool* explain,
                                           PlanKeys* plan, std::string* format) {
  if (!doc.IsObject()) return absl::InvalidArgumentError("request: not a JSON object");
  RunRequest request;
  for (const auto& member : doc.GetObject()) {
    const char* key = member.name.GetString();
    const rapidjson::Value& value = member.value;
    auto integer = [&](int64_t* out) -> absl::Status {
      if (!value.IsInt64()) return KeyError(key, "must be an integer");
      *out = value.GetInt64();
      return absl::OkStatus();
    };
    auto optional_integer = [&](std::optional<int64_t>* out) -> absl::Status {
      if (!value.IsInt64()) return KeyError(key, "must be an integer");
      *out = value.GetInt64();
      return absl::OkStatus();
    };
    auto string = [&](std::string* out) -> absl::Status {
      if (!value.IsString()) return KeyError(key, "must be a string");
      *out = value.GetString();
      return absl::OkStatus();
    };
    auto boolean = [&](bool* out) -> absl::Status {
      if (!value.IsBool()) return KeyError(key, "must be true or false");
      *out = value.GetBool();
      return absl::OkStatus();
    };
    const std::string name = key;
    absl::Status status;
    if (name == "model" && value.IsObject()) {
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
    else if (name == "schedule") status = string(&request.schedule);
    else if (name == "variants") status = string(&request.variants);
    else if (name == "policy") status = string(&request.policy);
    else if (name == "attention") status = string(&request.attention);
    else if (name == "dtype") status = string(&request.dtype);
    else if (name == "amp") status = string(&request.amp);
    else if (name == "optimizer") status = string(&request.optimizer);
    else if (name == "optimizer_impl") status = string(&request.optimizer_impl);
    else if (name == "checkpoint_impl") status = string(&request.checkpoint_impl);
    else if (name == "experts_impl") status = string(&request.experts_impl);
    else if (name == "routing") status = string(&request.routing);
    else if (name == "momentum") {
      if (!value.IsNumber()) return KeyError(key, "must be a number");
      request.momentum = value.GetDouble();
    } else if (name == "master_weights") status = boolean(&request.master_weights);
    else if (name == "sp") status = boolean(&request.sp);
    else if (name == "explain" && explain != nullptr) status = boolean(explain);
    else if (name == "budget_gib" && plan != nullptr) {
      if (!value.IsNumber()) return KeyError(key, "must be a number");
      plan->budget_gib = value.GetDouble();
    } else if (name == "frontier_points" && plan != nullptr) {
      status = integer(&plan->frontier_points);
    } else if (name == "cpu_threads" && plan != nullptr) {
      status = integer(&plan->cpu_threads);
    } else {
      return KeyError(key, plan != nullptr ? "is not a plan request key (see api/memledger.h)"
                                           : "is not a request key (see api/memledger.h)");
    }
    if (!status.ok()) return status;
  }
  return request;
}

absl::StatusOr<std::string> PredictJson(const char* request_json) {
  bool explain = false;
  std::string format = "json";
  absl::StatusOr<RunRequest> request = ParseRequest(request_json, &explain, nullptr, &format);
  if (!request.ok()) return request.status();
  if (format != "json" && format != "table" && format != "svg") {
    return KeyError("format", "must be \"json\", \"table\" or \"svg\"");
  }
  absl::StatusOr<RunSpec> spec = RunSpecFromRequest(*request);
  if (!spec.ok()) return spec.status();
  PredictOptions options = OptionsOf(*spec);
  options.breakdown = explain;
  options.timeline = format == "svg";
  if (format == "svg" && spec->parallel.Distributed()) {
    return KeyError("format", "\"svg\" draws one process's step: not with \"dp\" or \"pp\"");
  }
  if (spec->parallel.Distributed()) {
    absl::StatusOr<DistributedPrediction> p =
        PredictDistributed(spec->config, spec->parallel, options);
    if (!p.ok()) return p.status();
    if (format == "table") return RanksTable(p->whole, p->ranks);
    return JsonString(RanksJson(p->whole, p->ranks));
  }
  absl::StatusOr<Prediction> prediction = Predict(spec->config, options);
  if (!prediction.ok()) return prediction.status();
  if (format == "svg") {
    return PredictedTimelineSvg(
        absl::StrCat("memledger: predicted memory of one training step (torch ", kTorchRelease,
                     ")"),
        prediction->variants);
  }
  if (format == "table") {
    std::string table = PredictionTable(*prediction);
    if (explain) table += "\n" + BreakdownText(*prediction);
    return table;
  }
  return JsonString(PredictionJson(*prediction));
}

// ManyOptions are memledger_predict_many's arguments past the requests.
struct ManyOptions {
  bool peak = true;
  int threads = 0;  // 0: the machine's cores
};

// PredictOne is one request of a batch: its compact result, written by `w`.
absl::Status PredictOne(const rapidjson::Value& item, bool peak,
                        rapidjson::Writer<rapidjson::StringBuffer>& w) {
  absl::StatusOr<RunRequest> request = RequestFromJson(item, nullptr, nullptr);
  if (!request.ok()) return request.status();
  absl::StatusOr<RunSpec> spec = RunSpecFromRequest(*request);
  if (!spec.ok()) return spec.status();
  if (spec->parallel.Distributed()) {
    return absl::InvalidArgumentError("\"dp\" and \"pp\" are memledger_predict's only");
  }
  PredictOptions options = OptionsOf(*spec);
  options.peak = peak;
  absl::StatusOr<Prediction> p = Predict(spec->config, options);
  if (!p.ok()) return p.status();
  w.StartObject();
  w.Key("n_params");
  w.Int64(p->n_params);
  w.Key("param_bytes");
  w.Int64(p->param_bytes);
  w.Key("grad_bytes");
  w.Int64(p->grad_bytes);
  w.Key("optimizer_state_bytes");
  w.Int64(p->optimizer_state_bytes);
  w.Key("saved_bytes");
  w.StartObject();
  for (const VariantPrediction& v : p->variants) {
    w.Key(v.variant.Name().c_str());
    w.Int64(v.saved_bytes);
  }
  w.EndObject();
  if (peak) {
    w.Key("peak_bytes");
    w.StartObject();
    for (const VariantPrediction& v : p->variants) {
      w.Key(v.variant.Name().c_str());
      if (v.peak.has_value()) {
        w.Int64(v.peak->bytes);
      } else {
        w.Null();
      }
    }
    w.EndObject();
  }
  w.EndObject();
  return absl::OkStatus();
}

// PredictMany parses the array once, predicts its requests on `threads` threads (each
// its own share, claimed in order) and joins their results in the requests' order.
absl::StatusOr<std::string> PredictMany(const char* requests_json, const ManyOptions& many) {
  rapidjson::Document doc;
  if (absl::Status s = ParseJson(requests_json, &doc); !s.ok()) return s;
  if (!doc.IsArray()) return absl::InvalidArgumentError("requests: not a JSON array");
  const size_t n = doc.Size();
  std::vector<std::string> results(n);
  std::vector<absl::Status> errors(n);
  std::atomic<size_t> next{0};
  auto work = [&] {
    rapidjson::StringBuffer buffer;
    for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      buffer.Clear();
      rapidjson::Writer<rapidjson::StringBuffer> w(buffer);
      try {
        errors[i] = PredictOne(doc[static_cast<rapidjson::SizeType>(i)], many.peak, w);
      } catch (const std::exception& e) {
        errors[i] = absl::InternalError(e.what());
      }
      if (errors[i].ok()) results[i].assign(buffer.GetString(), buffer.GetSize());
    }
  };
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const size_t threads = std::min<size_t>(many.threads > 0 ? many.threads : cores, std::max<size_t>(n, 1));
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  std::string out = "[";
  for (size_t i = 0; i < n; ++i) {
    if (!errors[i].ok()) {
      return absl::Status(errors[i].code(),
                          absl::StrCat("requests[", i, "]: ", errors[i].message()));
    }
    if (i > 0) out += ",";
    out += results[i];
  }
  out += "]";
  return out;
}

absl::StatusOr<std::string> SnapshotPickle(const char* request_json) {
  absl::StatusOr<RunRequest> request = ParseRequest(request_json, nullptr, nullptr);
  if (!request.ok()) return request.status();
  absl::StatusOr<RunSpec> spec = RunSpecFromRequest(*request);
  if (!spec.ok()) return spec.status();
  if (spec->parallel.Distributed() || spec->variants.size() != 1) {
    return absl::InvalidArgumentError(
        "snapshot: one process's step of one variant: give \"variants\" one name, without "
        "\"dp\" or \"pp\"");
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
  absl::StatusOr<RunRequest> request = ParseRequest(request_json, nullptr, &keys, &format);
  if (!request.ok()) return request.status();
  if (format != "json" && format != "table") {
    return KeyError("format", "must be \"json\" or \"table\"");
  }
  if (!keys.budget_gib.has_value()) {
    return absl::InvalidArgumentError("request: \"budget_gib\" is required");
  }
  const std::optional<int64_t> budget = GibToBytes(*keys.budget_gib);
  if (!budget.has_value()) {
    return KeyError("budget_gib", "must be a positive number of GiB below 2^33");
  }
  // Out of int's range here; the rest of each range is RunPlanner's to check.
  if (keys.frontier_points < 0 || keys.frontier_points > 1000) {
    return KeyError("frontier_points", "must be 0 or between 2 and 1000");
  }
  if (keys.cpu_threads < 1 || keys.cpu_threads > 1024) {
    return KeyError("cpu_threads", "must be between 1 and 1024");
  }
  absl::StatusOr<RunSpec> spec = RunSpecFromRequest(*request);
  if (!spec.ok()) return spec.status();
  PlanRunOptions options;
  options.budget_bytes = *budget;
  options.frontier_points = static_cast<int>(keys.frontier_points);
  options.cpu_threads = static_cast<int>(keys.cpu_threads);
  absl::StatusOr<PlanReport> report = RunPlanner(*spec, options);
  if (!report.ok()) return report.status();
  if (format == "table") return PlanReportTable(*report);
  return JsonString(PlanReportJson(*report));
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
      [&many](const char* json) { return memledger::PredictMany(json, many); }, requests_json,
      response_json, error_message);
}

int memledger_snapshot(const char* request_json, char** snapshot, size_t* snapshot_size,
                       char** error_message) {
  return memledger::Call(memledger::SnapshotPickle, request_json, snapshot, error_message,
                         snapshot_size);
}

void memledger_free(char* string) { std::free(string); }

}  // extern "C"
