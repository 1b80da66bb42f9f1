// The C ABI as a capacity planner calls it: a request in, predict's JSON out; every kind
// of bad request is an error code and one line; strings are owned by the caller; 16
// threads at once get what one thread gets.
#include "api/memledger.h"
#include "estimator/graph/family.h"
#include "estimator/request/parallel_spec.h"

#include <gtest/gtest.h>

#include <initializer_list>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "rapidjson/document.h"

namespace {

struct Result {
  int code = -1;
  std::string response;
  std::string error;
};

Result Call(const char* request, int (*run)(const char*, char**, char**) = memledger_predict) {
  char* response = nullptr;
  char* error = nullptr;
  Result result;
  result.code = run(request, &response, &error);
  if (response != nullptr) result.response = response;
  if (error != nullptr) result.error = error;
  memledger_free(response);
  memledger_free(error);
  return result;
}

TEST(ApiTest, DefaultRequestIsTheStudysPrediction) {
  Result r = Call("{}");
  ASSERT_EQ(r.code, MEMLEDGER_OK) << r.error;
  EXPECT_TRUE(r.error.empty());
  rapidjson::Document doc;
  doc.Parse(r.response.c_str());
  ASSERT_FALSE(doc.HasParseError());
  EXPECT_EQ(doc["saved_bytes"]["none"].GetInt64(), 51052544);  // see predict_test
  EXPECT_STREQ(doc["torch"].GetString(), "2.15.0");
}

TEST(ApiTest, FieldsAreTheFlags) {
  Result r = Call(R"({"model": "llama-3-8b", "batch": 1, "seq": 8192, "amp": "bf16",
                      "variants": "none,full", "explain": false})");
  ASSERT_EQ(r.code, MEMLEDGER_OK) << r.error;
  rapidjson::Document doc;
  doc.Parse(r.response.c_str());
  EXPECT_EQ(doc["n_params"].GetInt64(), 8030261248);  // model_presets_test
  EXPECT_STREQ(doc["amp"].GetString(), "bf16");
  EXPECT_TRUE(doc["saved_bytes"].HasMember("full"));
  EXPECT_FALSE(doc["saved_bytes"].HasMember("every_2"));
  Result explained = Call(R"({"layers": 1, "explain": true})");
  ASSERT_EQ(explained.code, MEMLEDGER_OK) << explained.error;
  EXPECT_NE(explained.response.find("\"breakdown\""), std::string::npos);
}

// The parallel keys are the flags': the per-rank JSON, whose numbers ranks_test and
// predict_cli_test check by hand.
TEST(ApiTest, ParallelKeysGiveThePerRankJson) {
  Result r = Call(R"({"model": "tiny-llama", "layers": 8, "batch": 2, "seq": 8, "dp": 2,
                      "pp": 2, "zero": 1, "micro_batches": 4, "schedule": "1f1b",
                      "variants": "none"})");
  ASSERT_EQ(r.code, MEMLEDGER_OK) << r.error;
  rapidjson::Document doc;
  doc.Parse(r.response.c_str());
  ASSERT_FALSE(doc.HasParseError());
  EXPECT_EQ(doc["parallel"]["world_size"].GetInt64(), 4);
  ASSERT_EQ(doc["ranks"].Size(), 2u);
  EXPECT_EQ(doc["n_params"].GetInt64(), doc["ranks"][0]["n_params"].GetInt64());
  // "ep": a kind of rank per expert-parallel rank. tiny-qwen3-moe: width 32, 2 layers of
  // 4 experts of width 32, each gate_up (64, 32) + down (32, 32) = 3,072 parameters; a
  // rank holds 2 of each layer's 4, so 2 x 2 x 3,072 = 12,288 fewer than the model.
  Result ep = Call(R"({"model": "tiny-qwen3-moe", "dp": 2, "ep": 2, "variants": "none"})");
  ASSERT_EQ(ep.code, MEMLEDGER_OK) << ep.error;
  Result one = Call(R"({"model": "tiny-qwen3-moe", "variants": "none"})");
  ASSERT_EQ(one.code, MEMLEDGER_OK) << one.error;
  rapidjson::Document ranks, model;
  ranks.Parse(ep.response.c_str());
  model.Parse(one.response.c_str());
  ASSERT_FALSE(ranks.HasParseError() || model.HasParseError());
  EXPECT_EQ(ranks["parallel"]["ep"].GetInt64(), 2);
  ASSERT_EQ(ranks["ranks"].Size(), 2u);
  std::set<int64_t> ep_ranks;
  for (const rapidjson::Value& rank : ranks["ranks"].GetArray()) {
    ep_ranks.insert(rank["ep_rank"].GetInt64());
    EXPECT_EQ(model["n_params"].GetInt64() - rank["n_params"].GetInt64(), 12288);
  }
  EXPECT_EQ(ep_ranks, (std::set<int64_t>{0, 1}));
  // "reshard_after_forward" is fully_shard's bool | int: the int reaches the estimator
  // (ranks_test holds its bytes to the real stack), the message is the flag's.
  Result to_two = Call(R"({"model": "tiny-llama", "dp": 4, "fsdp": true,
                           "reshard_after_forward": 2, "variants": "none"})");
  ASSERT_EQ(to_two.code, MEMLEDGER_OK) << to_two.error;
  rapidjson::Document fsdp;
  fsdp.Parse(to_two.response.c_str());
  ASSERT_FALSE(fsdp.HasParseError());
  EXPECT_EQ(std::string(fsdp["parallel"]["data_parallel"].GetString()), "fsdp2");
  EXPECT_EQ(fsdp["parallel"]["fsdp"]["reshard_after_forward"].GetInt64(), 2);
  Result to_three = Call(R"({"model": "tiny-llama", "dp": 4, "fsdp": true,
                             "reshard_after_forward": 3})");
  EXPECT_EQ(to_three.code, MEMLEDGER_INVALID_ARGUMENT);
  EXPECT_EQ(to_three.error,
            "--reshard_after_forward as a number must divide the --dp 4 ranks (fully_shard's "
            "post-forward mesh), got 3");
  Result bad = Call(R"({"model": "tiny-llama", "layers": 8, "pp": 3})");
  EXPECT_EQ(bad.code, MEMLEDGER_INVALID_ARGUMENT);
  EXPECT_NE(bad.error.find("--layers 8 is not divisible by --pp 3"), std::string::npos)
      << bad.error;
  // The planner plans each stage.
  Result plan = Call(R"({"model": "tiny-llama", "pp": 2, "budget_gib": 1})", memledger_plan);
  EXPECT_EQ(plan.code, MEMLEDGER_OK) << plan.error;
  rapidjson::Document planned;
  planned.Parse(plan.response.c_str());
  ASSERT_FALSE(planned.HasParseError());
  EXPECT_EQ(planned["stages"].Size(), 2u);
}

// A request is validated once, where it enters (ValidRunFromRequest): the prediction
// under it, one process's or each kind of rank's, takes the proof. Before, the C ABI's
// request was validated, then Predict validated it again (2), and a --dp request's ranks
// again per stage and kind.
TEST(ApiTest, ARequestIsValidatedOnce) {
  for (const char* request :
       {R"({"model": "tiny-llama", "variants": "none,full"})",
        R"({"model": "tiny-llama", "layers": 4, "dp": 2, "pp": 2, "micro_batches": 2})",
        R"({"model": "tiny-qwen3-moe", "dp": 2, "ep": 2})",
        R"({"model": "tiny-llama", "dp": 2, "fsdp": true, "mp_param_dtype": "bf16",
            "mp_reduce_dtype": "fp32"})"}) {
    const int64_t configs = memledger::ValidateConfigCalls();
    const int64_t layouts = memledger::ValidateParallelCalls();
    Result r = Call(request);
    ASSERT_EQ(r.code, MEMLEDGER_OK) << request << r.error;
    EXPECT_EQ(memledger::ValidateConfigCalls() - configs, 1) << request;
    EXPECT_EQ(memledger::ValidateParallelCalls() - layouts, 1) << request;
  }
}

// One process's step of 10^12 layers is composed from a few layers' replay (ComposePeak)
// in bounded memory, whatever the layer pattern (a layer_types period of 6 and 4, MoE
// layers): the parameters are exactly linear in the layers, from two small models. The
// peak is at least the small models' line; a later moment can overtake it, by at most
// the DynamicCache's 8-byte scalar per sliding layer, the one tensor per layer held
// past the forward's layers (it passes the line at about 10^5 of tiny-gemma3's layers).
TEST(ApiTest, ATrillionLayersAreComposedFromAFew) {
  constexpr int64_t kSmall = 12, kLarge = 24, kHuge = 1200000000000;  // periods divide 12
  for (const char* model : {"tiny-llama", "tiny-gemma3", "tiny-olmo3", "tiny-qwen3-moe"}) {
    auto predicted = [&](int64_t layers) -> std::pair<int64_t, int64_t> {
      Result r = Call(absl::StrCat(R"({"model": ")", model, R"(", "layers": )", layers,
                                   R"(, "variants": "none"})")
                          .c_str());
      EXPECT_EQ(r.code, MEMLEDGER_OK) << model << " " << layers << ": " << r.error;
      rapidjson::Document doc;
      doc.Parse(r.response.c_str());
      if (doc.HasParseError() || !doc.HasMember("n_params")) return {0, 0};
      return {doc["n_params"].GetInt64(), doc["peak_bytes"]["none"].GetInt64()};
    };
    const auto [params_small, peak_small] = predicted(kSmall);
    const auto [params_large, peak_large] = predicted(kLarge);
    const auto [params_huge, peak_huge] = predicted(kHuge);
    const int64_t periods = (kHuge - kSmall) / (kLarge - kSmall);
    EXPECT_EQ(params_huge, params_small + periods * (params_large - params_small)) << model;
    const int64_t line = peak_small + periods * (peak_large - peak_small);
    EXPECT_GE(peak_huge, line) << model;
    EXPECT_LE(peak_huge, line + 8 * kHuge) << model;
  }
}

TEST(ApiTest, BadRequestsAreOneLineErrors) {
  struct Case {
    const char* request;
    const char* message;
  };
  for (const Case& c : {
           Case{"{", "request: not JSON (Missing a name for object member. at offset 1)"},
           Case{"[]", "request: not a JSON object"},
           Case{R"({"layer": 2})", "request: \"layer\" is not a request key (see api/memledger.h)"},
           Case{R"({"layers": "2"})", "request: \"layers\" must be an integer"},
           Case{R"({"layers": 2.5})", "request: \"layers\" must be an integer"},
           Case{R"({"model": 7})", "request: \"model\" must be a string"},
           Case{R"({"momentum": "high"})", "request: \"momentum\" must be a number"},
           Case{R"({"master_weights": 1})", "request: \"master_weights\" must be true or false"},
           Case{R"({"layers": 0})", "--layers must be >= 1, got 0"},
           Case{R"({"width": 130})", "--width 130 is not divisible by --heads 4"},
           Case{R"({"amp": "bf16", "dtype": "bf16"})",
                "--amp=bf16 needs --dtype=fp32: autocast runs an fp32 model (its master "
                "parameters) in lower precision, not a bf16 one"},
       }) {
    Result r = Call(c.request);
    EXPECT_EQ(r.code, MEMLEDGER_INVALID_ARGUMENT) << c.request;
    EXPECT_EQ(r.error, c.message) << c.request;
    EXPECT_TRUE(r.response.empty()) << c.request;
  }
  // 120,000 '[' overflowed RapidJSON's parser (SIGSEGV); refused before parsing now.
  const std::string deep = R"({"model": )" + std::string(120000, '[');
  Result nested = Call(deep.c_str());
  EXPECT_EQ(nested.code, MEMLEDGER_INVALID_ARGUMENT);
  // The object is level 1, so the 64th '[' (at 10 + 63, after `{"model": `) is the 65th.
  EXPECT_EQ(nested.error,
            "request: nests arrays and objects deeper than 64 levels (at offset 73)");
  // More micro-batches than the step's replay can hold (18.9 GB, then bad_alloc).
  Result micro = Call(R"({"model": "tiny-llama", "pp": 2, "micro_batches": 1000000000})");
  EXPECT_EQ(micro.code, MEMLEDGER_INVALID_ARGUMENT);
  EXPECT_EQ(micro.error, "--micro_batches must be at most 8192, got 1000000000");
  // A rank's step lays out every parameter's gradient bucket: its layers are bounded
  // (kMaxRankLayers; 10^7 layers took 3.5 GB, then bad_alloc).
  Result deep_ranks = Call(R"({"model": "tiny-llama", "dp": 2, "layers": 100000})");
  EXPECT_EQ(deep_ranks.code, MEMLEDGER_INVALID_ARGUMENT);
  EXPECT_EQ(deep_ranks.error,
            "--layers 100000 is more than the 65536 layers a rank's step is simulated with "
            "(--dp, --pp, --micro_batches: every parameter's gradient bucket is laid out)");
  // So does a CUDA step, tensor by tensor (kMaxCudaLayers).
  Result deep_cuda =
      Call(R"({"model": "tiny-llama", "device": "cuda", "dtype": "bf16", "layers": 4097})");
  EXPECT_EQ(deep_cuda.code, MEMLEDGER_INVALID_ARGUMENT);
  EXPECT_EQ(deep_cuda.error,
            "--layers 4097 is more than the 4096 layers a CUDA step is simulated with (tensor "
            "by tensor, through the caching allocator's blocks)");
  // An unknown model's line lists every built-in one, in the registry's order.
  Result unknown = Call(R"({"model": "llama-9"})");
  EXPECT_EQ(unknown.code, MEMLEDGER_INVALID_ARGUMENT);
  const std::string start = "--model: 'llama-9' is neither a built-in model (study, ";
  const std::string end = ") nor a readable config.json";
  EXPECT_EQ(unknown.error.rfind(start, 0), 0u) << unknown.error;
  ASSERT_GE(unknown.error.size(), end.size());
  EXPECT_EQ(unknown.error.substr(unknown.error.size() - end.size()), end) << unknown.error;
  for (const char* preset : {"llama-3-8b", "qwen3-30b-a3b", "tiny-gpt2", "megatron-gpt"}) {
    EXPECT_NE(unknown.error.find(std::string(", ") + preset + ","), std::string::npos)
        << preset << ": " << unknown.error;
  }
  // Overflow is the user's too: 2^40 x 2^30 tokens.
  EXPECT_EQ(Call(R"({"batch": 1099511627776, "seq": 1073741824})").code,
            MEMLEDGER_INVALID_ARGUMENT);
  // NULL request, NULL out-arguments.
  char* error = nullptr;
  EXPECT_EQ(memledger_predict(nullptr, nullptr, &error), MEMLEDGER_INVALID_ARGUMENT);
  EXPECT_STREQ(error, "request: NULL");
  memledger_free(error);
  EXPECT_EQ(memledger_predict("{}", nullptr, nullptr), MEMLEDGER_OK);
}

// memledger_plan: the planner's JSON, the same as `//planner --format=json` makes it
// (planner_cli_test checks that document; here the ABI's codes and keys).
TEST(ApiTest, PlanReturnsThePlannersJson) {
  // The study's default: none peaks at 67,688,232 B and full at 29,551,848 B (measured
  // by the counting allocator in runtime_test and verify, and by the real stack's
  // profiler on the unchanged study; AdamW's 72 step tensors, 4 B each, and full's RNG
  // state included), so 50 MiB needs recompute.
  Result r = Call(R"({"budget_gib": 0.048828125, "frontier_points": 3})", memledger_plan);
  ASSERT_EQ(r.code, MEMLEDGER_OK) << r.error;
  rapidjson::Document doc;
  doc.Parse(r.response.c_str());
  ASSERT_FALSE(doc.HasParseError());
  EXPECT_EQ(doc["budget_bytes"].GetInt64(), 50 << 20);
  EXPECT_EQ(doc["plan"].Size(), 6u);
  EXPECT_LE(doc["peak_bytes"].GetInt64(), 50 << 20);
  EXPECT_GT(doc["recompute_flops"].GetInt64(), 0);
  EXPECT_EQ(doc["variants"]["none"]["peak_bytes"].GetInt64(), 67688232);
  EXPECT_EQ(doc["frontier"].Size(), 3u);

  Result tight = Call(R"({"budget_gib": 0.01})", memledger_plan);
  EXPECT_EQ(tight.code, MEMLEDGER_NO_PLAN);
  EXPECT_NE(tight.error.find("the smallest peak any plan reaches is"), std::string::npos);
  for (const auto& [request, message] : std::initializer_list<std::pair<const char*, const char*>>{
           {"{}", "request: \"budget_gib\" is required"},
           {R"({"budget_gib": -1})",
            "--budget_gib must be a positive number of GiB below 2^33, got -1"},
           {R"({"budget_gib": "80"})", "request: \"budget_gib\" must be a number"},
           {R"({"budget_gib": 1, "explain": true})", "request: \"explain\" is not a plan request key"},
           // One check and one line for a value in and out of int's range (the C ABI
           // read it as "request: \"frontier_points\" ..." past 1000, as the planner's
           // "--frontier_points ..." below): the planner CLI's, planner_cli_test.
           {R"({"budget_gib": 1, "frontier_points": 1})",
            "--frontier_points must be 0 or between 2 and 1000, got 1"},
           {R"({"budget_gib": 1, "frontier_points": 5000})",
            "--frontier_points must be 0 or between 2 and 1000, got 5000"},
           {R"({"budget_gib": 1, "frontier_points": 9223372036854775807})",
            "--frontier_points must be 0 or between 2 and 1000, got 9223372036854775807"},
           {R"({"budget_gib": 1, "cpu_threads": 0})",
            "--cpu_threads must be between 1 and 1024, got 0"},
           {R"({"budget_gib": 1, "model": "tiny-llama", "pp": 2, "dp": 2, "zero": 3})",
            "--zero=3"}}) {
    Result bad = Call(request, memledger_plan);
    EXPECT_EQ(bad.code, MEMLEDGER_INVALID_ARGUMENT) << request << ": " << bad.error;
    EXPECT_NE(bad.error.find(message), std::string::npos) << request << ": " << bad.error;
    EXPECT_TRUE(bad.response.empty());
  }
  // predict does not take the planner's own keys (its budget_gib is a sweep's).
  EXPECT_EQ(Call(R"({"frontier_points": 3})").error,
            "request: \"frontier_points\" is not a request key (see api/memledger.h)");
}

TEST(ApiTest, SearchReturnsTheLayoutsThatFit) {
  // tiny-llama over 4 GPUs of one node, 4 sequences a step, 1 GiB each: every layout
  // fits (layout_search_test checks the set against a brute force).
  const char* request =
      R"({"model": "tiny-llama", "layers": 4, "seq": 8, "gpus": 4, "gpus_per_node": 4,
          "global_batch": 4, "gpu_memory_gib": 1, "gpu": "a100"})";
  Result r = Call(request, memledger_search);
  ASSERT_EQ(r.code, MEMLEDGER_OK) << r.error;
  rapidjson::Document doc;
  doc.Parse(r.response.c_str());
  ASSERT_FALSE(doc.HasParseError());
  EXPECT_EQ(doc["search"]["gpu"].GetString(), std::string("a100"));
  EXPECT_EQ(doc["search"]["budget_bytes"].GetInt64(), int64_t{1} << 30);
  ASSERT_GT(doc["layouts"].Size(), 0u);
  EXPECT_EQ(doc["fitting"].GetInt64(), static_cast<int64_t>(doc["layouts"].Size()));
  const std::string table =
      Call(R"({"model": "tiny-llama", "gpus": 2, "global_batch": 2, "format": "table"})",
           memledger_search)
          .response;
  EXPECT_NE(table.find("memledger layout search"), std::string::npos) << table;
  const std::string svg =
      Call(R"({"model": "tiny-llama", "gpus": 2, "global_batch": 2, "format": "svg"})",
           memledger_search)
          .response;
  EXPECT_NE(svg.find("<svg"), std::string::npos);

  Result tight = Call(R"({"model": "tiny-llama", "gpus": 2, "global_batch": 2,
                          "gpu_memory_gib": 0.000001})",
                      memledger_search);
  EXPECT_EQ(tight.code, MEMLEDGER_NO_LAYOUT);
  EXPECT_NE(tight.error.find("the smallest peak of any layout is"), std::string::npos);
  // "longest_seq": search --longest_seq's answer (search_cli_test), at its bound here.
  Result longest = Call(R"({"model": "tiny-llama", "gpus": 2, "global_batch": 2,
                            "gpu_memory_gib": 1, "longest_seq": 40})",
                        memledger_search);
  ASSERT_EQ(longest.code, MEMLEDGER_OK) << longest.error;
  rapidjson::Document longest_doc;
  longest_doc.Parse(longest.response.c_str());
  ASSERT_FALSE(longest_doc.HasParseError());
  EXPECT_EQ(longest_doc["search"]["seq"].GetInt64(), 40);
  EXPECT_EQ(longest_doc["search"]["longest_seq"]["up_to"].GetInt64(), 40);
  for (const auto& [request, message] : std::initializer_list<std::pair<const char*, const char*>>{
           {R"({"gpus": 2, "global_batch": 2, "seq": 8, "longest_seq": 40})",
            "request: \"longest_seq\" bisects \"seq\": give one of them, not both"},
           {R"({"gpus": 2, "global_batch": 2, "longest_seq": -3})",
            "--longest_seq must be >= 1, got -3"},
           {R"({"global_batch": 2})", "--gpus must be from 1 to 1048576, got 0"},
           {R"({"gpus": 2})", "--global_batch must be >= 1, got 0"},
           {R"({"gpus": 2, "global_batch": 2, "micro_batches": 2})",
            "request: \"micro_batches\" follows from the layout"},
           {R"({"gpus": 2, "global_batch": 2, "tp": 3})", "--tp 3 does not divide a node's 2 GPUs"},
           {R"({"gpus": 2, "global_batch": 2, "gpu": "v100"})", "--gpu must be one of"},
           {R"({"gpus": 2, "global_batch": 2, "mfu": "high"})", "request: \"mfu\" must be a number"},
           // The search CLI's line (search_cli_test), and predict's for --zero.
           {R"({"gpus": 2, "global_batch": 2, "top": -1})", "--top must be >= 0, got -1"},
           {R"({"gpus": 2, "global_batch": 2, "zero": 4})", "--zero must be 0, 1, 2 or 3, got 4"},
           {R"({"gpus": 2, "global_batch": 2, "threads": 5000})", "--threads must be between 0"},
           {R"({"gpus": 2, "global_batch": 2, "format": "csv"})", "\"format\" must be"},
           {R"({"gpus": 2, "global_batch": 2, "budget_gib": 1})",
            "request: \"budget_gib\" is not a search request key"}}) {
    Result bad = Call(request, memledger_search);
    EXPECT_EQ(bad.code, MEMLEDGER_INVALID_ARGUMENT) << request << ": " << bad.error;
    EXPECT_NE(bad.error.find(message), std::string::npos) << request << ": " << bad.error;
    EXPECT_TRUE(bad.response.empty());
  }
}

// predict's --sweep through the C ABI: one row per point and variant, each row's saved
// bytes the single prediction's at that point.
TEST(ApiTest, SweepGivesARowPerPoint) {
  Result r = Call(
      R"({"model": "tiny-llama", "variants": "full", "sweep": "batch:1..4", "format": "csv"})");
  ASSERT_EQ(r.code, MEMLEDGER_OK) << r.error;
  std::vector<std::string> rows;
  for (size_t start = 0, end; (end = r.response.find('\n', start)) != std::string::npos;
       start = end + 1) {
    rows.push_back(r.response.substr(start, end - start));
  }
  ASSERT_EQ(rows.size(), 4u) << r.response;  // the header, then batch 1, 2 and 4
  EXPECT_EQ(rows[0].substr(0, 26), "model,layers,batch,seq,var");
  Result two = Call(R"({"model": "tiny-llama", "variants": "full", "batch": 2})");
  ASSERT_EQ(two.code, MEMLEDGER_OK) << two.error;
  rapidjson::Document doc;
  doc.Parse(two.response.c_str());
  const std::string saved = std::to_string(doc["saved_bytes"]["full"].GetInt64());
  EXPECT_NE(rows[2].find("tiny-llama,2,2,64,full,"), std::string::npos) << rows[2];
  EXPECT_NE(rows[2].find("," + saved + ","), std::string::npos) << rows[2] << " " << saved;
  for (const auto& [request, message] : std::initializer_list<std::pair<const char*, const char*>>{
           {R"({"sweep": "batch:1..4", "format": "table"})",
            "request: \"format\" with \"sweep\" must be \"csv\" or \"jsonl\""},
           {R"({"budget_gib": 80})", "request: \"budget_gib\" goes with \"sweep\""},
           // The CLI's message for the same value (predict_cli_test, python_module_test).
           {R"({"cpu_threads": 0})", "--cpu_threads must be between 1 and 1024, got 0"},
       }) {
    Result bad = Call(request);
    EXPECT_EQ(bad.code, MEMLEDGER_INVALID_ARGUMENT) << request;
    EXPECT_EQ(bad.error, message) << request;
  }
}

// predict's "svg" of a layout: the most loaded rank's step, the chart predict
// --dp --timeline_svg writes (predict_cli_test reads that one).
TEST(ApiTest, SvgOfALayoutIsTheMostLoadedRanksStep) {
  Result r = Call(R"({"model": "tiny-llama", "dp": 2, "zero": 1, "format": "svg"})");
  ASSERT_EQ(r.code, MEMLEDGER_OK) << r.error;
  EXPECT_EQ(r.response.rfind("<svg", 0), 0u);
  EXPECT_NE(r.response.find("the most loaded rank's step, predicted (stage 0"),
            std::string::npos)
      << r.response.substr(0, 400);
}

// The planner's charts through the C ABI: the plan's step ("svg") and the frontier.
TEST(ApiTest, PlanDrawsItsStepAndItsFrontier) {
  Result step = Call(R"({"model": "tiny-llama", "budget_gib": 0.004, "format": "svg"})",
                     memledger_plan);
  ASSERT_EQ(step.code, MEMLEDGER_OK) << step.error;
  EXPECT_EQ(step.response.rfind("<svg", 0), 0u) << step.response.substr(0, 80);
  EXPECT_NE(step.response.find("the plan"), std::string::npos);
  Result frontier = Call(
      R"({"model": "tiny-llama", "budget_gib": 0.004, "format": "frontier_svg"})",
      memledger_plan);
  ASSERT_EQ(frontier.code, MEMLEDGER_OK) << frontier.error;
  EXPECT_EQ(frontier.response.rfind("<svg", 0), 0u);
  Result rank = Call(
      R"({"model": "tiny-llama", "budget_gib": 0.004, "dp": 2, "zero": 1, "format": "svg"})",
      memledger_plan);
  EXPECT_EQ(rank.code, MEMLEDGER_INVALID_ARGUMENT);
  EXPECT_EQ(rank.error, "--timeline_svg draws one process's planned step: not with --dp");
}

TEST(ApiTest, VersionNamesAbiAndTheReferenceStack) {
  EXPECT_EQ(memledger_abi_version(), MEMLEDGER_ABI_VERSION);
  EXPECT_EQ(std::string(memledger_version()),
            "memledger 1 (torch 2.15.0, transformers 5.23.0)");
}

TEST(ApiTest, SixteenThreadsGetTheSerialResults) {
  // Different specs, so threads share the graph cache but not their answers.
  std::vector<std::string> requests;
  const char* models[] = {"study", "gpt2", "tiny-llama", "llama-3-8b"};
  for (int i = 0; i < 16; ++i) {
    requests.push_back(std::string(R"({"model": ")") + models[i % 4] +
                       R"(", "batch": )" + std::to_string(1 + i) +
                       (i % 2 ? R"(, "amp": "bf16")" : R"(, "attention": "math")") + "}");
  }
  std::vector<Result> serial;
  for (const std::string& request : requests) serial.push_back(Call(request.c_str()));
  for (int round = 0; round < 3; ++round) {
    std::vector<Result> parallel(requests.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < requests.size(); ++i) {
      threads.emplace_back([&, i] { parallel[i] = Call(requests[i].c_str()); });
    }
    for (std::thread& t : threads) t.join();
    for (size_t i = 0; i < requests.size(); ++i) {
      ASSERT_EQ(serial[i].code, MEMLEDGER_OK) << requests[i] << ": " << serial[i].error;
      EXPECT_EQ(parallel[i].code, serial[i].code) << requests[i];
      EXPECT_EQ(parallel[i].response, serial[i].response) << requests[i];
    }
  }
}

}  // namespace
