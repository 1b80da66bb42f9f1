// The Python module `memledger`, over the C ABI (api/memledger.h):
//
//   import memledger
//   p = memledger.predict(model="llama-3-8b", batch=1, seq=8192, amp="bf16")
//   p["saved_bytes"]["full"]
//
// predict(**fields) takes the request fields of api/memledger.h as keyword arguments (model
// also as a config.json dict or a transformers PretrainedConfig, read through to_dict()) and
// returns predict's JSON as a memledger.Prediction, a dict whose repr() is a summary and
// which Jupyter shows as the table and the timeline chart; bad input raises ValueError
// with the CLI's message.
// plan(budget_gib=..., **fields) returns the checkpoint planner's JSON; when no plan
// fits it raises memledger.NoPlanFits (a ValueError) naming the smallest budget.
// search(gpus=..., global_batch=..., **fields) returns the layout search's JSON; when
// no layout fits it raises memledger.NoLayoutFits (a ValueError).
// snapshot(variant=..., path=..., **fields) returns a variant's predicted step as a
// PyTorch memory snapshot pickle (bytes), also written to path. predict_many(requests,
// peak=True, threads=0) predicts a list of request dicts in one call.
#include <pybind11/eval.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "api/memledger.h"
#include "api/predict_many.h"
#include "estimator/cli/output_files.h"
#include "rapidjson/document.h"

namespace py = pybind11;

namespace {

// NoPlanFits is memledger_plan's MEMLEDGER_NO_PLAN, raised as memledger.NoPlanFits;
// NoLayoutFits memledger_search's MEMLEDGER_NO_LAYOUT, as memledger.NoLayoutFits.
struct NoPlanFits : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct NoLayoutFits : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Fields makes `model` JSON-ready: a str or dict as it is, a path-like as its path, and
// anything with to_dict() (a transformers PretrainedConfig; memledger does not import
// transformers) as its dict.
py::dict Fields(const py::dict& given) {
  if (!given.contains("model")) return given;
  py::object model = given["model"];
  if (py::isinstance<py::str>(model) || py::isinstance<py::dict>(model)) return given;
  py::dict fields(given);  // a copy: the caller's dict keeps its model
  if (py::hasattr(model, "to_dict")) {
    fields["model"] = model.attr("to_dict")();
  } else if (py::hasattr(model, "__fspath__")) {
    fields["model"] = py::module_::import("os").attr("fspath")(model);
  }
  return fields;
}

// NonFinite: the path of the first float in `value` that is not finite ("model.
// rope_theta", "batch"), which JSON cannot say; nullopt if there is none.
std::optional<std::string> NonFinite(const py::handle& value, const std::string& path,
                                     int depth = 0) {
  if (depth > 64) return std::nullopt;  // ToJson's and the C ABI's limit says it
  if (py::isinstance<py::float_>(value)) {
    if (std::isfinite(value.cast<double>())) return std::nullopt;
    return path + ": " + std::string(py::str(value)) + " is not a number JSON can say";
  }
  if (py::isinstance<py::dict>(value)) {
    for (const auto& [key, item] : py::reinterpret_borrow<py::dict>(value)) {
      const std::string name = py::str(key);
      if (auto found = NonFinite(item, path.empty() ? name : path + "." + name, depth + 1)) {
        return found;
      }
    }
  } else if (py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value)) {
    size_t i = 0;
    for (const py::handle& item : value) {
      if (auto found = NonFinite(item, path + "[" + std::to_string(i++) + "]", depth + 1)) {
        return found;
      }
    }
  }
  return std::nullopt;
}

// Dumps is json.dumps(value, default=str): what JSON cannot say (a dtype in a config's
// dict) as its str(); a NaN or an infinity is a ValueError naming its key (json.dumps
// would write NaN, which no JSON parser reads).
std::string Dumps(const py::object& value) {
  if (std::optional<std::string> bad = NonFinite(value, "")) throw py::value_error(*bad);
  py::object json = py::module_::import("json");
  return py::str(json.attr("dumps")(value, py::arg("default") =
                                               py::module_::import("builtins").attr("str")));
}

// Call sends the keyword arguments as a JSON request to `run` (memledger_predict or
// memledger_plan) and returns its JSON as Python objects.
py::object Call(int (*run)(const char*, char**, char**), const py::kwargs& given) {
  py::module_ json = py::module_::import("json");
  // The answer is the JSON, as Python objects: a table or chart is the command line's
  // (or a Prediction's display), a sweep's rows predict_many's.
  if (given.contains("format") && py::str(given["format"]).cast<std::string>() != "json") {
    throw py::value_error(
        "format: these calls return the JSON as Python objects (a Prediction shows its "
        "table and chart in Jupyter; `memledger predict --format=table` prints it)");
  }
  if (given.contains("sweep")) {
    throw py::value_error(
        "sweep: predict() makes one prediction; predict_many() takes the grid's points "
        "(`memledger predict --sweep` prints its rows)");
  }
  const py::dict fields = Fields(given);
  const std::string request = Dumps(fields);
  char* response = nullptr;
  char* error = nullptr;
  int code = 0;
  {
    py::gil_scoped_release release;  // calls run in parallel from Python threads
    code = run(request.c_str(), &response, &error);
  }
  const std::string response_text = response != nullptr ? response : "";
  const std::string error_text = error != nullptr ? error : "";
  memledger_free(response);
  memledger_free(error);
  if (code == MEMLEDGER_INVALID_ARGUMENT) throw py::value_error(error_text);
  if (code == MEMLEDGER_NO_LAYOUT && run == memledger_search) throw NoLayoutFits(error_text);
  if (code == MEMLEDGER_NO_PLAN) throw NoPlanFits(error_text);
  if (code != MEMLEDGER_OK) throw std::runtime_error(error_text);
  return json.attr("loads")(response_text);
}

// kResultClasses defines predict()'s result: its JSON as a dict that prints a summary and,
// in Jupyter, shows the CLI's table and the timeline chart (rendered on demand through
// the same request with "format" table or svg).
constexpr char kResultClasses[] = R"py(
import html, json

class Prediction(dict):
    "predict()'s JSON as a dict; repr() a summary, in Jupyter the table and the chart."

    def __init__(self, data, request):
        super().__init__(data)
        self._request = dict(request)

    def _render(self, kind):
        request = dict(self._request, format=kind)
        code, text = _call("predict", json.dumps(request, default=str))
        return text if code == 0 else None

    def __repr__(self):
        model = self._request.get("model", "study")
        if not isinstance(model, str):
            model = "a config.json"
        peaks = self.get("peak_bytes") or {}
        saved = self.get("saved_bytes") or {}
        return (f"memledger.Prediction({model}: n_params={self.get('n_params')}, "
                f"saved_bytes={saved}, peak_bytes={peaks})")

    def _repr_html_(self):
        table = self._render("table") or ""
        svg = self._render("svg") or ""
        return "<pre>" + html.escape(table) + "</pre>" + svg
)py";

py::object& PredictionClass() {
  static py::object* const cls = new py::object();
  return *cls;
}

py::object Predict(const py::kwargs& given) {
  py::object result = Call(memledger_predict, given);
  return PredictionClass()(result, Fields(given));
}

// Snapshot: memledger_snapshot's pickle as bytes, also written to `path` when given;
// `variant` is the one variant ("variants" with one name).
py::bytes Snapshot(const py::object& variant, const py::object& path, py::kwargs fields) {
  if (!variant.is_none()) fields["variants"] = variant;
  const std::string request = Dumps(Fields(fields));
  char* snapshot = nullptr;
  size_t size = 0;
  char* error = nullptr;
  int code = 0;
  {
    py::gil_scoped_release release;
    code = memledger_snapshot(request.c_str(), &snapshot, &size, &error);
  }
  const std::string bytes = snapshot != nullptr ? std::string(snapshot, size) : "";
  const std::string error_text = error != nullptr ? error : "";
  memledger_free(snapshot);
  memledger_free(error);
  if (code == MEMLEDGER_INVALID_ARGUMENT) throw py::value_error(error_text);
  if (code != MEMLEDGER_OK) throw std::runtime_error(error_text);
  py::bytes result(bytes);
  if (!path.is_none()) {
    // A file's path, not a file descriptor (open(1, "wb") wrote to stdout and closed it);
    // written as the command line writes its files (estimator/cli/output_files.h).
    if (!py::isinstance<py::str>(path) && !py::hasattr(path, "__fspath__")) {
      throw py::type_error("snapshot: path must be a str or an os.PathLike, not " +
                           std::string(py::str(path.get_type().attr("__name__"))));
    }
    const std::string file = py::str(py::module_::import("os").attr("fspath")(path));
    if (absl::Status s = memledger::WriteOutputFile("path", file, bytes); !s.ok()) {
      throw py::value_error("snapshot: " + std::string(s.message()));
    }
  }
  return result;
}
py::object Plan(const py::kwargs& fields) { return Call(memledger_plan, fields); }
py::object Search(const py::kwargs& fields) { return Call(memledger_search, fields); }

// GcPause disables Python's cyclic garbage collector for its lifetime, if it was
// enabled (gc.disable / gc.enable), also when an exception unwinds.
class GcPause {
 public:
  GcPause() : gc_(py::module_::import("gc")), was_enabled_(gc_.attr("isenabled")().cast<bool>()) {
    if (was_enabled_) gc_.attr("disable")();
  }
  ~GcPause() {
    if (was_enabled_) gc_.attr("enable")();
  }
  GcPause(const GcPause&) = delete;
  GcPause& operator=(const GcPause&) = delete;

 private:
  py::module_ gc_;
  bool was_enabled_;
};

// ToJson writes a Python value as json.dumps(value, default=str) would read back into
// `out`: dicts (their keys as str), lists and tuples, str, bool, int, float and None;
// anything else as its str(). A float that is not finite is bad input, as JSON has none,
// and so is nesting past 64 levels (json.dumps' "circular reference", or nearly).
void ToJson(const py::handle& value, rapidjson::Value& out,
            rapidjson::Document::AllocatorType& a, int depth = 0) {
  if (depth > 64) {
    throw py::value_error("requests: nested more than 64 deep (a circular reference?)");
  }
  if (value.is_none()) {
    out.SetNull();
  } else if (py::isinstance<py::bool_>(value)) {
    out.SetBool(value.cast<bool>());
  } else if (py::isinstance<py::int_>(value)) {
    int overflow = 0;
    const long long n = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
    if (overflow == 0) {
      out.SetInt64(n);
    } else {
      out.SetDouble(PyLong_AsDouble(value.ptr()));  // as a JSON parser reads a huge integer
    }
  } else if (py::isinstance<py::float_>(value)) {
    const double x = value.cast<double>();
    if (!std::isfinite(x)) throw py::value_error("requests: " + std::string(py::str(value)) +
                                                 " is not a number JSON can say");
    out.SetDouble(x);
  } else if (py::isinstance<py::dict>(value)) {
    out.SetObject();
    for (const auto& [key, item] : py::reinterpret_borrow<py::dict>(value)) {
      const std::string name = py::str(key);
      rapidjson::Value converted;
      ToJson(item, converted, a, depth + 1);
      out.AddMember(rapidjson::Value(name.c_str(), static_cast<rapidjson::SizeType>(name.size()), a),
                    converted, a);
    }
  } else if (py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value)) {
    out.SetArray();
    for (const py::handle& item : value) {
      rapidjson::Value converted;
      ToJson(item, converted, a, depth + 1);
      out.PushBack(converted, a);
    }
  } else {
    const std::string text = py::str(value);
    out.SetString(text.c_str(), static_cast<rapidjson::SizeType>(text.size()), a);
  }
}

// PredictMany: every request (a dict of predict's fields) in one call, the GIL
// released while its threads predict. The requests become one JSON document in C++ (no
// text either way); the results come back as structs (api/predict_many.h) and become
// dicts here.
py::object PredictMany(const py::list& requests, bool peak, int threads) {
  if (threads < 0 || threads > 1024) {
    throw py::value_error("threads must be between 0 (the cores) and 1024, got " +
                          std::to_string(threads));
  }
  rapidjson::Document doc(rapidjson::kArrayType);
  doc.Reserve(static_cast<rapidjson::SizeType>(requests.size()), doc.GetAllocator());
  for (const py::handle& item : requests) {
    rapidjson::Value request;
    ToJson(py::isinstance<py::dict>(item) ? Fields(py::reinterpret_borrow<py::dict>(item))
                                          : py::reinterpret_borrow<py::object>(item),
           request, doc.GetAllocator());
    doc.PushBack(request, doc.GetAllocator());
  }
  absl::StatusOr<std::vector<memledger::ManyResult>> results;
  {
    py::gil_scoped_release release;
    try {
      results = memledger::PredictMany(doc, {peak, threads});
    } catch (const std::exception& e) {  // as the C ABI's calls: an internal error
      results = absl::InternalError(e.what());
    }
  }
  if (!results.ok()) {
    const std::string message(results.status().message());
    if (absl::IsInvalidArgument(results.status()) || absl::IsOutOfRange(results.status()) ||
        absl::IsNotFound(results.status())) {
      throw py::value_error(message);
    }
    throw std::runtime_error(message);
  }
  // Python's cyclic GC would scan the growing list at every few hundred dicts made; these
  // dicts hold only ints and strs, so it has nothing to find until they are all made.
  GcPause pause;
  // The keys once, as Python strings; each variant name once per distinct name.
  const py::str n_params("n_params"), param_bytes("param_bytes"), grad_bytes("grad_bytes"),
      optimizer_state_bytes("optimizer_state_bytes"), saved_bytes("saved_bytes"),
      peak_bytes("peak_bytes");
  std::vector<std::pair<std::string, py::str>> names;
  auto name_of = [&names](const std::string& name) -> py::str {
    for (const auto& [known, str] : names) {
      if (known == name) return str;
    }
    names.emplace_back(name, py::str(name));
    return names.back().second;
  };
  py::list out(results->size());
  for (size_t i = 0; i < results->size(); ++i) {
    const memledger::ManyResult& r = (*results)[i];
    py::dict d;
    d[n_params] = py::int_(r.n_params);
    d[param_bytes] = py::int_(r.param_bytes);
    d[grad_bytes] = py::int_(r.grad_bytes);
    d[optimizer_state_bytes] = py::int_(r.optimizer_state_bytes);
    py::dict saved, peaks;
    for (const memledger::ManyVariant& v : r.variants) {
      const py::str name = name_of(v.name);
      saved[name] = py::int_(v.saved_bytes);
      if (peak) {
        peaks[name] = v.peak_bytes.has_value() ? py::object(py::int_(*v.peak_bytes)) : py::none();
      }
    }
    d[saved_bytes] = std::move(saved);
    if (peak) d[peak_bytes] = std::move(peaks);
    out[i] = std::move(d);
  }
  return out;
}

}  // namespace

// RawCall is the `memledger` command's way in: (code, text) of memledger_predict or
// memledger_plan for a JSON request, the text the Bazel CLIs print (or the error line).
py::tuple RawCall(const std::string& kind, const std::string& request) {
  int (*run)(const char*, char**, char**) = nullptr;
  if (kind == "predict") run = memledger_predict;
  if (kind == "plan") run = memledger_plan;
  if (kind == "search") run = memledger_search;
  if (run == nullptr) throw py::value_error("_call: kind must be predict, plan or search");
  char* response = nullptr;
  char* error = nullptr;
  int code = 0;
  {
    py::gil_scoped_release release;
    code = run(request.c_str(), &response, &error);
  }
  const std::string text = response != nullptr ? response : (error != nullptr ? error : "");
  memledger_free(response);
  memledger_free(error);
  return py::make_tuple(code, text);
}

PYBIND11_MODULE(memledger, m) {
  m.doc() = "memledger: training memory of Transformers, predicted byte for byte.";
  m.def("predict", &Predict,
        "predict(**fields) -> dict: the prediction for the request fields of "
        "api/memledger.h (model, layers, width, heads, kv_heads, head_dim, intermediate, "
        "vocab, batch, seq, variants, every, policy, attention, dtype, amp, optimizer, "
        "optimizer_impl, checkpoint_impl, freeze, lora_rank, lora_alpha, lora_dropout, lora_targets, use_dora, momentum, master_weights, tp, sp, dp, pp, virtual_stages, "
        "micro_batches, zero, ddp_bucket_mb, gradient_as_bucket_view, fsdp, "
        "reshard_after_forward, mp_param_dtype, mp_reduce_dtype, offload, schedule, experts_impl, "
        "routing, device, sdpa_backend, cublas_workspace_config, offload_activations, "
        "explain); with dp or pp above 1, per rank ('ranks'). "
        "Raises ValueError "
        "for bad input.");
  m.def("plan", &Plan,
        "plan(budget_gib=..., **fields) -> dict: the checkpoint plan with the least "
        "recompute whose predicted step peak fits budget_gib (plan, peak_bytes, overhead, "
        "variants, frontier); fields as predict's, plus frontier_points and cpu_threads. "
        "Raises ValueError for bad input and NoPlanFits (a ValueError) when no plan fits.");
  m.def("search", &Search,
        "search(gpus=..., global_batch=..., **fields) -> dict: every parallel layout of the "
        "model over `gpus` GPUs whose most loaded rank's exact step peak fits "
        "gpu_memory_gib (default: the gpu preset's), fastest first by a modelled step time "
        "(layouts: tp, pp, dp, zero, sp, micro_batch_size, micro_batches, virtual_stages, "
        "checkpoint, peak_bytes, step_time_s, flags); fields as predict's but the layout's, "
        "plus gpus_per_node, gpu (h100, h200, a100), mfu, max_virtual_stages, threads. "
        "Raises ValueError for bad input and NoLayoutFits (a ValueError) when no layout "
        "fits.");
  m.def("predict_many", &PredictMany, py::arg("requests"), py::arg("peak") = true,
        py::arg("threads") = 0,
        "predict_many(requests, peak=True, threads=0) -> list of dict: each request (a "
        "dict of predict's fields, not dp or pp) predicted in one call over `threads` "
        "threads (0: the cores), the GIL released: n_params, param_bytes, grad_bytes, "
        "optimizer_state_bytes, saved_bytes and (with peak) peak_bytes by variant. "
        "peak=False skips the step simulation. Raises ValueError naming the first bad "
        "request.");
  m.def("snapshot", &Snapshot, py::arg("variant") = py::none(), py::arg("path") = py::none(),
        "snapshot(variant=..., path=None, **fields) -> bytes: the variant's predicted step "
        "as a PyTorch memory snapshot, the pickle torch.cuda.memory._snapshot() writes "
        "(pickle.loads it, or open it with torch.cuda._memory_viz or "
        "https://pytorch.org/memory_viz), also written to path when given; fields as "
        "predict's (not dp or pp). Raises ValueError for bad input.");
  m.def("_call", &RawCall, "_call(kind, request_json) -> (code, text): the C ABI's raw answer");
  py::dict scope;
  scope["_call"] = m.attr("_call");
  scope["__builtins__"] = py::module_::import("builtins");
  py::exec(kResultClasses, scope);
  PredictionClass() = scope["Prediction"];
  m.attr("Prediction") = scope["Prediction"];
  PredictionClass().attr("__module__") = "memledger";
  py::register_exception<NoPlanFits>(m, "NoPlanFits", PyExc_ValueError);
  py::register_exception<NoLayoutFits>(m, "NoLayoutFits", PyExc_ValueError);
  m.attr("__version__") = memledger_version();
}
