// The Python module `memledger`, over the C ABI (api/memledger.h):
//
//   import memledger
//   p = memledger.predict(model="llama-3-8b", batch=1, seq=8192, amp="bf16")
//   p["saved_bytes"]["full"]
//
// predict(**fields) takes the request fields of api/memledger.h as keyword arguments and
// returns predict's JSON as a dict; bad input raises ValueError with the CLI's message.
#include <pybind11/pybind11.h>

#include <string>

#include "api/memledger.h"

namespace py = pybind11;

namespace {

py::object Predict(const py::kwargs& fields) {
  py::module_ json = py::module_::import("json");
  const std::string request = py::str(json.attr("dumps")(fields));
  char* response = nullptr;
  char* error = nullptr;
  int code = 0;
  {
    py::gil_scoped_release release;  // predictions run in parallel from Python threads
    code = memledger_predict(request.c_str(), &response, &error);
  }
  const std::string response_text = response != nullptr ? response : "";
  const std::string error_text = error != nullptr ? error : "";
  memledger_free(response);
  memledger_free(error);
  if (code == MEMLEDGER_INVALID_ARGUMENT) throw py::value_error(error_text);
  if (code != MEMLEDGER_OK) throw std::runtime_error(error_text);
  return json.attr("loads")(response_text);
}

}  // namespace

PYBIND11_MODULE(memledger, m) {
  m.doc() = "memledger: training memory of Transformers, predicted byte for byte.";
  m.def("predict", &Predict,
        "predict(**fields) -> dict: the prediction for the request fields of "
        "api/memledger.h (model, layers, width, heads, kv_heads, head_dim, intermediate, "
        "vocab, batch, seq, variants, every, policy, attention, dtype, amp, optimizer, "
        "momentum, master_weights, explain). Raises ValueError for bad input.");
  m.attr("__version__") = memledger_version();
}
