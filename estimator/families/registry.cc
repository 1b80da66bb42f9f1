// The estimator's family registry: estimator/spec/families.inc, one line a family,
// expanded into FamilyOf's table. graph/family.h declares FamilyOf and Families; they
// are defined here, beside what they register, so that graph/ names no family.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "estimator/graph/family.h"

namespace memledger {

#define MEMLEDGER_FAMILY(name) const FamilyDef& name##Family();
#include "estimator/spec/families.inc"
#undef MEMLEDGER_FAMILY

namespace {

// Registered: every family in Family's order, each checked to be its own entry.
const std::vector<const FamilyDef*>& Registered() {
  static const auto* const kFamilies = [] {
    auto* families = new std::vector<const FamilyDef*>{
#define MEMLEDGER_FAMILY(name) &name##Family(),
#include "estimator/spec/families.inc"
#undef MEMLEDGER_FAMILY
    };
    for (size_t i = 0; i < families->size(); ++i) {
      if (static_cast<size_t>((*families)[i]->id) != i) {  // a bug in its folder
        std::fprintf(stderr, "families.inc: the FamilyDef of line %zu (%s) has another id\n",
                     i + 1, std::string((*families)[i]->name).c_str());
        std::abort();
      }
    }
    return families;
  }();
  return *kFamilies;
}

}  // namespace

const FamilyDef& FamilyOf(Family family) { return *Registered()[static_cast<size_t>(family)]; }

const std::vector<const FamilyDef*>& Families() { return Registered(); }

}  // namespace memledger
