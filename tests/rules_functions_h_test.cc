// Checks the estimator's keep rules (estimator/graph/rules.h) against the pinned wheel's own
// torch/csrc/autograd/generated/Functions.h: for every op, the SavedVariable members of
// its backward nodes are exactly the tensors the rules say are kept (plus the optional
// inputs the graphs never pass). A torch upgrade that changes what a node saves, or
// renames it, fails here before any measurement runs.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "estimator/graph/rules.h"

namespace memledger {
namespace {

std::string ReadFunctionsH() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const std::string base = srcdir != nullptr ? srcdir : ".";
  for (const std::string& path :
       {base + "/libtorch/include/torch/csrc/autograd/generated/Functions.h",
        base + "/memledger/external/libtorch/include/torch/csrc/autograd/generated/"
               "Functions.h"}) {
    std::ifstream in(path);
    if (!in) continue;
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }
  return "";
}

// SavedMembers returns the SavedVariable members of backward node `node`; `found` says
// whether the header defines the node at all.
std::set<std::string> SavedMembers(const std::string& header, const std::string& node,
                                   bool* found) {
  const std::string opening = "struct TORCH_API " + node + " : public ";
  const size_t begin = header.find(opening);
  *found = begin != std::string::npos;
  if (!*found) return {};
  const size_t end = header.find("\n};", begin);
  const std::string body = header.substr(begin, end - begin);
  std::set<std::string> members;
  static const std::regex kSaved(R"((?:std::vector<SavedVariable>|SavedVariable) (\w+);)");
  for (auto it = std::sregex_iterator(body.begin(), body.end(), kSaved);
       it != std::sregex_iterator(); ++it) {
    members.insert((*it)[1]);
  }
  return members;
}

TEST(RulesFunctionsHTest, TheHeaderIsThePinnedReleases) {
  const std::string header = ReadFunctionsH();
  ASSERT_FALSE(header.empty()) << "Functions.h not found under TEST_SRCDIR";
  // Functions.h does not name its release; a node that exists only in 2.x (the CPU
  // flash SDPA backward) tells it is not an old header.
  EXPECT_NE(header.find("ScaledDotProductFlashAttentionForCpuBackward0"), std::string::npos);
}

TEST(RulesFunctionsHTest, EveryKeepRuleNamesExactlyTheNodesSavedTensors) {
  const std::string header = ReadFunctionsH();
  ASSERT_FALSE(header.empty());
  for (int i = 0; i < kNumOpTypes; ++i) {
    const OpType type = static_cast<OpType>(i);
    const OpSemantics& rule = RuleTable::Pinned().Of(type);
    std::set<std::string> expected;
    for (const KeepRule& keep : rule.keeps) expected.insert(std::string(keep.saved_name));
    for (std::string_view absent : rule.absent_saved) expected.insert(std::string(absent));
    if (rule.backward_nodes.empty()) {
      EXPECT_TRUE(expected.empty()) << OpTypeName(type) << " keeps tensors but has no node";
      continue;
    }
    if (rule.custom_function) continue;  // Megatron's autograd Functions: not in the header
    std::set<std::string> saved;
    for (std::string_view node : rule.backward_nodes) {
      bool found = false;
      std::set<std::string> members = SavedMembers(header, std::string(node), &found);
      EXPECT_TRUE(found) << OpTypeName(type) << ": no " << node << " in Functions.h";
      saved.insert(members.begin(), members.end());
    }
    EXPECT_EQ(saved, expected) << OpTypeName(type);
  }
}

TEST(RulesFunctionsHTest, TheParserSeesSavedMembers) {
  // A guard for the test itself: AddmmBackward0 saves mat1_ and mat2_ (and sizes and
  // strides, which are not SavedVariables).
  bool found = false;
  EXPECT_EQ(SavedMembers(ReadFunctionsH(), "AddmmBackward0", &found),
            (std::set<std::string>{"mat1_", "mat2_"}));
  EXPECT_TRUE(found);
}

}  // namespace
}  // namespace memledger
