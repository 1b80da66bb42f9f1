// PickleWriter writes Python pickle data (protocol 2) of dicts, lists, strings, integers,
// booleans and None, for readers such as torch.cuda._memory_viz that take a pickled
// snapshot. Containers nest; every Begin has its End.
//
// Example:
//   PickleWriter w;
//   w.BeginDict();
//   w.Str("size"); w.Int(512);
//   w.EndDict();
//   std::string bytes = w.Finish();  // pickle.loads(bytes) == {"size": 512}
#ifndef ESTIMATOR_REPORT_PICKLE_H_
#define ESTIMATOR_REPORT_PICKLE_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace memledger {

class PickleWriter {
 public:
  PickleWriter();
  // A dict's items are written as key, value, key, value, ... between these.
  void BeginDict();
  void EndDict();
  void BeginList();
  void EndList();
  void Str(absl::string_view utf8);
  void Int(int64_t value);
  void Bool(bool value);
  void None();
  // Finish returns the pickle (the writer is spent).
  std::string Finish();

 private:
  std::string out_;
};

}  // namespace memledger

#endif  // ESTIMATOR_REPORT_PICKLE_H_
