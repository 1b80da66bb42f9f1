// Links and exercises each system library once: LibTorch, Abseil, RapidJSON,
// Google Benchmark, GoogleTest.
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <gtest/gtest.h>
#include <rapidjson/document.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include <string>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(int, dependencies_test_flag, 7, "A flag, to link absl flags.");

namespace {

TEST(DependenciesTest, LibTorchMatmul) {
  // [[1, 2], [3, 4]] @ [[1, 0], [0, 1]] = the same matrix; its sum is 10.
  at::Tensor a = at::arange(1, 5, at::kFloat).view({2, 2});
  at::Tensor b = at::eye(2, at::kFloat);
  EXPECT_FLOAT_EQ(at::mm(a, b).sum().item<float>(), 10.0f);
}

// The wheel's LibTorch and Debian's Abseil/GoogleTest/Benchmark must agree on the C++11
// string ABI: toString() returns a std::string across the library boundary, so this
// links only if LibTorch was built with the same _GLIBCXX_USE_CXX11_ABI as this code.
static_assert(_GLIBCXX_USE_CXX11_ABI == 1, "Debian's libraries use the C++11 ABI");

TEST(DependenciesTest, LibTorchSharesTheCxx11StringAbi) {
  EXPECT_EQ(at::ones({1}).toString(), "CPUFloatType");
}

TEST(DependenciesTest, AbseilStatusAndFlags) {
  absl::StatusOr<int> bad = absl::InvalidArgumentError(absl::StrCat("bad ", 42));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "bad 42");
  EXPECT_EQ(absl::GetFlag(FLAGS_dependencies_test_flag), 7);
}

TEST(DependenciesTest, RapidJsonRoundTrip) {
  rapidjson::Document doc;
  doc.Parse(R"({"saved_bytes": 51052544, "variant": "none"})");
  ASSERT_FALSE(doc.HasParseError());
  EXPECT_EQ(doc["saved_bytes"].GetInt64(), 51052544);
  rapidjson::StringBuffer out;
  rapidjson::Writer<rapidjson::StringBuffer> writer(out);
  doc.Accept(writer);
  EXPECT_EQ(std::string(out.GetString()), R"({"saved_bytes":51052544,"variant":"none"})");
}

void BM_Nothing(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(state.iterations());
}
BENCHMARK(BM_Nothing);

TEST(DependenciesTest, BenchmarkRegistrationCompiles) {
  // Registration above compiled and linked; the library reports a CPU count.
  EXPECT_GT(benchmark::CPUInfo::Get().num_cpus, 0);
}

}  // namespace
