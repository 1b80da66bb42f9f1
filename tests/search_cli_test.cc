// //planner:search as a user runs it: JSON whose layouts' flags make predict say the
// same peak, the table and the chart, --help listing every flag, exit 3 when no layout
// fits and one-line errors (exit 2).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <set>
#include <string>

#include "rapidjson/document.h"
#include "tests/json_output.h"
#include "tests/subprocess.h"

namespace {

using memledger::testing::CommandResult;
using memledger::testing::JsonOutput;
using memledger::testing::RunCommand;

// tiny-llama at 4 layers, seq 8, over 4 GPUs of one node, 4 sequences a step.
constexpr char kTiny[] =
    "--model=tiny-llama --layers=4 --seq=8 --gpus=4 --gpus_per_node=4 --global_batch=4 ";

CommandResult Search(const std::string& args, bool merge_stderr = true) {
  return RunCommand("planner/search " + args, merge_stderr);
}

// PredictedPeak runs predict with a layout's flags: the most loaded of its ranks' peaks
// under `checkpoint` (its first rank's: predict orders them by a plan's peak, or the
// only variant's), -1 on failure.
int64_t PredictedPeak(const std::string& flags, const std::string& checkpoint) {
  CommandResult p = RunCommand("estimator/predict " + flags, false);
  EXPECT_EQ(p.exit_code, 0) << flags << ": " << p.output;
  rapidjson::Document predicted;
  predicted.Parse(p.output.c_str());
  if (p.exit_code != 0 || predicted.HasParseError()) return -1;
  int64_t most = 0;
  for (const rapidjson::Value& rank : predicted["ranks"].GetArray()) {
    most = std::max(most, rank["peak_bytes"][checkpoint.c_str()].GetInt64());
  }
  EXPECT_EQ(predicted["ranks"][0]["peak_bytes"][checkpoint.c_str()].GetInt64(), most) << flags;
  EXPECT_EQ(predicted["peak_bytes"][checkpoint.c_str()].GetInt64(), most) << flags;
  return most;
}

// PlannedLayouts checks a search's plan layouts: each within the budget and reproduced
// by predict; how many there are.
// SearchJson runs search with `args` (stdout alone) and parses its JSON into `doc` (the
// text into `output`, if given); a fatal failure unless it exits 0 with JSON (callers wrap
// it in ASSERT_NO_FATAL_FAILURE).
void SearchJson(const std::string& args, rapidjson::Document* doc,
                std::string* output = nullptr) {
  CommandResult r = Search(args, false);
  ASSERT_TRUE(JsonOutput(r, doc));
  if (output != nullptr) *output = r.output;
}

// ExpectCheckedLayoutReproduces runs predict with a CUDA layout the allocator checked:
// its allocated and reserved peaks are the layout's; predict's JSON into `predicted` (a
// fatal failure unless it exits 0 with JSON: callers wrap it in ASSERT_NO_FATAL_FAILURE).
void ExpectCheckedLayoutReproduces(const rapidjson::Value& layout,
                                   rapidjson::Document* predicted) {
  const std::string flags = layout["flags"].GetString();
  CommandResult p = RunCommand("estimator/predict " + flags, false);
  ASSERT_EQ(p.exit_code, 0) << flags << ": " << p.output;
  predicted->Parse(p.output.c_str());
  ASSERT_FALSE(predicted->HasParseError()) << p.output;
  const char* variant = layout["checkpoint"].GetString();
  EXPECT_EQ((*predicted)["peak_bytes"][variant].GetInt64(), layout["peak_bytes"].GetInt64())
      << flags;
  EXPECT_EQ((*predicted)["peak_reserved_bytes"][variant].GetInt64(),
            layout["peak_reserved_bytes"].GetInt64())
      << flags;
}

int PlannedLayouts(const rapidjson::Document& doc) {
  int plans = 0;
  for (const rapidjson::Value& l : doc["layouts"].GetArray()) {
    if (std::string(l["checkpoint"].GetString()) != "plan") continue;
    ++plans;
    EXPECT_LE(l["peak_bytes"].GetInt64(), doc["search"]["budget_bytes"].GetInt64());
    EXPECT_EQ(PredictedPeak(l["flags"].GetString(), "plan"), l["peak_bytes"].GetInt64())
        << l["flags"].GetString();
  }
  return plans;
}

std::string TempPath(const char* name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/" + name;
}

TEST(SearchCliTest, LayoutsReproduceWithPredict) {
  // 600,000 B as GiB.
  rapidjson::Document doc;
  ASSERT_NO_FATAL_FAILURE(
      SearchJson(std::string(kTiny) + "--gpu_memory_gib=0.000558793544769", &doc));
  EXPECT_EQ(doc["search"]["gpus"].GetInt64(), 4);
  EXPECT_EQ(doc["search"]["gpu"].GetString(), std::string("h100"));
  EXPECT_NE(std::string(doc["search"]["time_model"].GetString()).find("a model"),
            std::string::npos);
  const rapidjson::Value& layouts = doc["layouts"];
  ASSERT_GT(layouts.Size(), 3u);
  EXPECT_EQ(doc["fitting"].GetInt64(), static_cast<int64_t>(layouts.Size()));
  const int64_t budget = doc["search"]["budget_bytes"].GetInt64();
  // The first three layouts, each through predict's own command line.
  for (rapidjson::SizeType i = 0; i < 3; ++i) {
    const rapidjson::Value& l = layouts[i];
    EXPECT_LE(l["peak_bytes"].GetInt64(), budget);
    EXPECT_EQ(l["tp"].GetInt64() * l["pp"].GetInt64() * l["dp"].GetInt64(), 4);
    for (const char* key : {"zero", "sp", "micro_batch_size", "micro_batches", "virtual_stages",
                            "schedule", "checkpoint", "peak_stage", "step_time_s", "time",
                            "tflops_per_gpu", "mfu", "front"}) {
      EXPECT_TRUE(l.HasMember(key)) << key;
    }
    CommandResult p = RunCommand(std::string("estimator/predict ") + l["flags"].GetString(), false);
    ASSERT_EQ(p.exit_code, 0) << l["flags"].GetString() << ": " << p.output;
    rapidjson::Document predicted;
    predicted.Parse(p.output.c_str());
    ASSERT_FALSE(predicted.HasParseError()) << p.output;
    EXPECT_EQ(predicted["peak_bytes"][l["checkpoint"].GetString()].GetInt64(),
              l["peak_bytes"].GetInt64())
        << l["flags"].GetString();
  }
}

// On --device=cuda the best layouts are replayed through the caching allocator: each
// checked one's flags (--device=cuda among them) make predict say its allocated peak,
// and its device bytes are predict's reserved peak plus the CUDA context outside the
// allocator; the others say null.
TEST(SearchCliTest, OnCudaTheCheckedLayoutsReproduceWithPredict) {
  rapidjson::Document doc;
  ASSERT_NO_FATAL_FAILURE(
      SearchJson(std::string(kTiny) + "--device=cuda --checked_layouts=3", &doc));
  EXPECT_EQ(doc["checked"].GetInt64(), 3);
  EXPECT_EQ(doc["dropped_when_checked"].GetInt64(), 0);
  const int64_t outside = doc["outside_allocator_bytes"]["cuda_context"].GetInt64();
  EXPECT_GT(outside, 0);
  const rapidjson::Value& layouts = doc["layouts"];
  ASSERT_GT(layouts.Size(), 3u);
  for (rapidjson::SizeType i = 0; i < 4; ++i) {
    const rapidjson::Value& l = layouts[i];
    const std::string flags = l["flags"].GetString();
    if (i == 3) {
      EXPECT_FALSE(l["checked"].GetBool()) << flags;
      EXPECT_TRUE(l["device_bytes"].IsNull()) << flags;
      continue;
    }
    ASSERT_TRUE(l["checked"].GetBool()) << flags;
    EXPECT_NE(flags.find("--device=cuda"), std::string::npos) << flags;
    rapidjson::Document predicted;
    ASSERT_NO_FATAL_FAILURE(ExpectCheckedLayoutReproduces(l, &predicted));
    EXPECT_EQ(predicted["outside_allocator_bytes"]["cuda_context"].GetInt64(), outside);
    EXPECT_EQ(l["device_bytes"].GetInt64(), l["peak_reserved_bytes"].GetInt64() + outside);
  }
}

// LoRA is one process's: on one GPU the search lists its step, and on CUDA every
// layout reproduces with predict (whose LoRA step the real stack measures). The ranks
// once counted every base weight as training; every layout was then refused with no
// reason said ("0 refused, 0 without a simulated peak").
TEST(SearchCliTest, LoraOnOneGpuReproducesWithPredict) {
  rapidjson::Document doc;
  ASSERT_NO_FATAL_FAILURE(SearchJson(
      "--model=tiny-llama --layers=4 --seq=8 --gpus=1 --global_batch=4 --batch=4 "
      "--dtype=bf16 --lora_rank=8 --lora_targets=all-linear --device=cuda "
      "--checked_layouts=8",
      &doc));
  const rapidjson::Value& layouts = doc["layouts"];
  ASSERT_EQ(layouts.Size(), 4u);  // none, selective, every_2, full
  for (const rapidjson::Value& l : layouts.GetArray()) {
    const std::string flags = l["flags"].GetString();
    EXPECT_NE(flags.find("--lora_rank=8"), std::string::npos) << flags;
    rapidjson::Document predicted;
    ASSERT_NO_FATAL_FAILURE(ExpectCheckedLayoutReproduces(l, &predicted));
  }
}

// Where no layout fits without checkpoints, the fastest are also planned per stage: a
// plan (layers that differ in checkpointing) joins the ranking with its choices inline in
// the flags. Each plan reproduces with predict, and the best on 4 Gloo ranks in
// LibTorch, where the most loaded rank counts the planned peak.
TEST(SearchCliTest, PlansJoinTheRankingAndReproduce) {
  // fp32, the precision the budget below was chosen for.
  const std::string tiny =
      "--model=tiny-llama --layers=4 --seq=128 --gpus=4 --gpus_per_node=4 --global_batch=16 "
      "--dtype=fp32 ";
  // 1.54 MiB; two layouts planned, each checked below.
  rapidjson::Document doc;
  std::string output;
  ASSERT_NO_FATAL_FAILURE(
      SearchJson(tiny + "--gpu_memory_gib=0.0015 --planned_layouts=2", &doc, &output));
  EXPECT_EQ(doc["planned"].GetInt64(), 2);
  const int64_t budget = doc["search"]["budget_bytes"].GetInt64();
  const rapidjson::Value* best_plan = nullptr;
  int plans = 0;
  for (const rapidjson::Value& l : doc["layouts"].GetArray()) {
    if (std::string(l["checkpoint"].GetString()) != "plan") continue;
    ++plans;
    if (best_plan == nullptr) best_plan = &l;
    EXPECT_LE(l["peak_bytes"].GetInt64(), budget);
    const std::string flags = l["flags"].GetString();
    EXPECT_NE(flags.find(std::string("--plan='") + l["plan"].GetString() + "'"),
              std::string::npos)
        << flags;
    EXPECT_EQ(PredictedPeak(flags, "plan"), l["peak_bytes"].GetInt64()) << flags;
  }
  ASSERT_GT(plans, 0) << output;
  CommandResult v = RunCommand(
      std::string("verify/verify ") + (*best_plan)["flags"].GetString() + " --skip_timing", false);
  EXPECT_EQ(v.exit_code, 0) << v.output;
  rapidjson::Document verified;
  verified.Parse(v.output.c_str());
  ASSERT_FALSE(verified.HasParseError()) << v.output;
  int64_t most = 0;
  for (const rapidjson::Value& rank : verified["ranks"].GetArray()) {
    EXPECT_EQ(rank["ratio"]["peak_bytes.plan"].GetDouble(), 1.0);
    most = std::max(most, rank["measured"]["peak_bytes.plan"].GetInt64());
  }
  EXPECT_EQ(most, (*best_plan)["peak_bytes"].GetInt64());
}

// Layers that differ (tiny-gemma3: 5 sliding-window layers, 1 global), 2 MiB per GPU:
// the fastest layouts that must recompute include ZeRO-3 ones, which the stage planner
// does not plan; they keep their standard variants, and the search goes on (it stopped
// with the planner's error). Each plan reproduces with predict (under an interleaved
// layout's plan another stage than none's most loaded peaks highest: predict puts it
// first).
TEST(SearchCliTest, LayersThatDifferArePlannedButNotUnderZero3) {
  rapidjson::Document doc;
  std::string output;
  ASSERT_NO_FATAL_FAILURE(SearchJson(
      "--model=tiny-gemma3 --seq=128 --gpus=4 --gpus_per_node=4 --global_batch=8 "
      "--gpu_memory_gib=0.002",
      &doc, &output));
  EXPECT_GT(doc["planned"].GetInt64(), 0);
  for (const rapidjson::Value& l : doc["layouts"].GetArray()) {
    if (std::string(l["checkpoint"].GetString()) == "plan") {
      EXPECT_LT(l["zero"].GetInt64(), 3);
    }
  }
  EXPECT_GT(PlannedLayouts(doc), 0) << output;
}

// A mixture of experts (tiny-qwen3-moe: 4 experts, 2 per token) on 4 GPUs: the search
// also splits the experts over ep of the data-parallel ranks (without tp and ZeRO, as
// --ep is modelled). Each such layout reproduces with predict (its most loaded rank,
// every expert-parallel rank predicted), its flags carry --ep, and its time has the
// all-to-alls; --ep fixes it.
TEST(SearchCliTest, ExpertParallelLayoutsOfAMixtureOfExperts) {
  const std::string moe =
      "--model=tiny-qwen3-moe --seq=64 --gpus=4 --gpus_per_node=4 --global_batch=8 "
      "--gpu_memory_gib=1 ";
  rapidjson::Document doc;
  std::string output;
  ASSERT_NO_FATAL_FAILURE(SearchJson(moe, &doc, &output));
  std::set<int64_t> eps;
  for (const rapidjson::Value& l : doc["layouts"].GetArray()) {
    const int64_t ep = l["ep"].GetInt64();
    eps.insert(ep);
    if (ep == 1) {
      EXPECT_EQ(l["time"]["ep_s"].GetDouble(), 0.0);
      continue;
    }
    EXPECT_EQ(l["tp"].GetInt64(), 1);
    EXPECT_EQ(l["zero"].GetInt64(), 0);
    EXPECT_EQ(l["dp"].GetInt64() % ep, 0);
    EXPECT_GT(l["time"]["ep_s"].GetDouble(), 0.0);
    const std::string flags = l["flags"].GetString();
    EXPECT_NE(flags.find("--ep=" + std::to_string(ep)), std::string::npos) << flags;
    EXPECT_EQ(PredictedPeak(flags, l["checkpoint"].GetString()), l["peak_bytes"].GetInt64())
        << flags;
  }
  // ep 1, 2 and 4 of the 4 data-parallel ranks (4 experts).
  EXPECT_EQ(eps, (std::set<int64_t>{1, 2, 4})) << output;
  CommandResult fixed = Search(moe + "--ep=2 --format=table", false);
  ASSERT_EQ(fixed.exit_code, 0) << fixed.output;
  EXPECT_NE(fixed.output.find(" ep "), std::string::npos) << fixed.output;
  EXPECT_NE(fixed.output.find("+ ep "), std::string::npos) << fixed.output;
  rapidjson::Document only;
  ASSERT_NO_FATAL_FAILURE(SearchJson(moe + "--ep=2", &only));
  for (const rapidjson::Value& l : only["layouts"].GetArray()) EXPECT_EQ(l["ep"].GetInt64(), 2);
  // At 2 MiB with ep 2 (4 layers, seq 128, fp32) some layouts must recompute: their
  // per-stage plans (balanced routing: every expert-parallel rank alike) fit every rank.
  rapidjson::Document plans;
  std::string planned;
  ASSERT_NO_FATAL_FAILURE(SearchJson(
      "--model=tiny-qwen3-moe --layers=4 --seq=128 --gpus=4 --gpus_per_node=4 "
      "--global_batch=8 --gpu_memory_gib=0.002 --ep=2 --dtype=fp32",
      &plans, &planned));
  for (const rapidjson::Value& l : plans["layouts"].GetArray()) EXPECT_EQ(l["ep"].GetInt64(), 2);
  EXPECT_GT(PlannedLayouts(plans), 0) << planned;
}

// Without a precision flag the search plans what large models train with, and says so:
// bf16 parameters with fp32 master weights; with --fsdp FSDP2's MixedPrecisionPolicy;
// with LoRA bf16 weights. Each layout's flags carry it, so predict reproduces it.
TEST(SearchCliTest, DefaultPrecisionIsSaidAndCarriedByTheFlags) {
  struct Case {
    const char* args;
    const char* precision;  // the table's and the JSON's words
    const char* flags;      // what each layout's flags carry
  };
  for (const Case& c : {
           Case{"", "bf16 parameters, fp32 master weights", "--dtype=bf16 --master_weights"},
           Case{"--fsdp --dp=4 ",
                "fp32 parameters, FSDP2's MixedPrecisionPolicy(param_dtype=bf16, "
                "reduce_dtype=fp32)",
                "--mp_param_dtype=bf16 --mp_reduce_dtype=fp32"},
           Case{"--gpus=1 --lora_rank=8 ", "bf16 weights, LoRA's adapters fp32", "--dtype=bf16"},
       }) {
    const std::string args = std::string(kTiny) + c.args;
    rapidjson::Document doc;
    std::string output;
    ASSERT_NO_FATAL_FAILURE(SearchJson(args, &doc, &output));
    EXPECT_STREQ(doc["search"]["default_precision"].GetString(), c.precision) << args;
    ASSERT_GT(doc["layouts"].Size(), 0u) << output;
    const rapidjson::Value& best = doc["layouts"][0];
    const std::string flags = best["flags"].GetString();
    EXPECT_NE(flags.find(c.flags), std::string::npos) << flags;
    // One GPU's prediction has no ranks; its peak_bytes are the most loaded rank's anyway.
    rapidjson::Document predicted;
    ASSERT_TRUE(JsonOutput(RunCommand("estimator/predict " + flags, false), &predicted));
    EXPECT_EQ(predicted["peak_bytes"][best["checkpoint"].GetString()].GetInt64(),
              best["peak_bytes"].GetInt64())
        << flags;
    CommandResult table = Search(args + "--format=table", false);
    ASSERT_EQ(table.exit_code, 0) << table.output;
    EXPECT_NE(table.output.find(std::string("precision: ") + c.precision +
                                ", the search's default"),
              std::string::npos)
        << table.output;
  }
  // A precision flag is the run's own: no default, no line.
  for (const char* named : {"--dtype=fp32", "--amp=bf16", "--dtype=bf16 --master_weights"}) {
    rapidjson::Document doc;
    ASSERT_NO_FATAL_FAILURE(SearchJson(std::string(kTiny) + named, &doc));
    EXPECT_FALSE(doc["search"].HasMember("default_precision")) << named;
  }
}

TEST(SearchCliTest, TableAndChart) {
  const std::string svg = TempPath("search.svg");
  CommandResult r = Search(std::string(kTiny) +
                           "--gpu_memory_gib=1 --format=table --top=5 --chart_svg=" + svg);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("memledger layout search: tiny-llama"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("checkpoint"), std::string::npos);
  EXPECT_NE(r.output.find("that fit in the JSON"), std::string::npos);
  EXPECT_NE(r.output.find("./bazelw run //:predict -- --model=tiny-llama"), std::string::npos);
  EXPECT_NE(r.output.find("step time is a model"), std::string::npos);
  std::ifstream in(svg);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_NE(text.str().find("<svg"), std::string::npos);
  EXPECT_NE(text.str().find("class=\"front\""), std::string::npos);
  EXPECT_NE(text.str().find("class=\"budget\""), std::string::npos);
  EXPECT_NE(text.str().find("class=\"best\""), std::string::npos);
}

TEST(SearchCliTest, HelpListsEveryFlagByGroup) {
  CommandResult r = Search("--help");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* flag : {"--gpus ", "--gpus_per_node", "--gpu_memory_gib", "--global_batch",
                           "--gpu ", "--mfu", "--max_virtual_stages", "--top", "--chart_svg",
                           "--longest_seq",
                           "--model", "--dtype", "--amp", "--master_weights", "--variants"}) {
    EXPECT_NE(r.output.find(flag), std::string::npos) << flag;
  }
  for (const char* group : {"\nmodel:", "\ninput:", "\nprecision:", "\ncheckpointing:",
                            "\nparallelism:", "\ndevice:", "\noutput:"}) {
    EXPECT_NE(r.output.find(group), std::string::npos) << group;
  }
  EXPECT_EQ(r.output.find("\nother:"), std::string::npos) << r.output;
}

TEST(SearchCliTest, LayoutFlagsFixThatPart) {
  rapidjson::Document doc;
  ASSERT_NO_FATAL_FAILURE(
      SearchJson(std::string(kTiny) + "--gpu_memory_gib=1 --tp=2 --sp --batch=1", &doc));
  ASSERT_GT(doc["layouts"].Size(), 0u);
  for (const rapidjson::Value& l : doc["layouts"].GetArray()) {
    EXPECT_EQ(l["tp"].GetInt64(), 2);
    EXPECT_TRUE(l["sp"].GetBool());
    EXPECT_EQ(l["micro_batch_size"].GetInt64(), 1);
  }
}

TEST(SearchCliTest, NoLayoutFitsExitsThree) {
  CommandResult r = Search(std::string(kTiny) + "--gpu_memory_gib=0.000001");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("no layout of 4 GPUs fits"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("the smallest peak of any layout is"), std::string::npos);
}

// --longest_seq answers with the longest sequence and the layouts at it (the bisection
// against a brute force: longest_seq_test): at the bound when that fits, in one search;
// exit 3 when not even one token fits.
TEST(SearchCliTest, LongestSeqSaysTheLengthAndItsLayouts) {
  const std::string tiny =
      "--model=tiny-llama --layers=4 --gpus=2 --gpus_per_node=2 --global_batch=4 ";
  rapidjson::Document doc;
  ASSERT_NO_FATAL_FAILURE(SearchJson(tiny + "--gpu_memory_gib=1 --longest_seq=48", &doc));
  EXPECT_EQ(doc["search"]["seq"].GetInt64(), 48);
  EXPECT_EQ(doc["search"]["longest_seq"]["up_to"].GetInt64(), 48);
  EXPECT_EQ(doc["search"]["longest_seq"]["searches"].GetInt64(), 1);
  ASSERT_GT(doc["layouts"].Size(), 0u);
  EXPECT_NE(std::string(doc["layouts"][0]["flags"].GetString()).find("--seq=48"),
            std::string::npos);
  CommandResult table = Search(tiny + "--gpu_memory_gib=1 --longest_seq=48 --format=table");
  ASSERT_EQ(table.exit_code, 0) << table.output;
  EXPECT_NE(table.output.find("the longest sequence that fits: 48 (--seq bisected over 1..48 "
                              "in 1 search); the layouts at it:"),
            std::string::npos)
      << table.output;
  CommandResult none = Search(tiny + "--gpu_memory_gib=0.000001 --longest_seq=48");
  EXPECT_EQ(none.exit_code, 3) << none.output;
  EXPECT_NE(none.output.find("--longest_seq: not even a sequence of 1 fits: no layout of 2 GPUs "
                             "fits"),
            std::string::npos)
      << none.output;
}

TEST(SearchCliTest, AFullStandardOutputIsAnError) {
  // > /dev/full exited 0; the search's output is checked as predict's is.
  if (!std::ifstream("/dev/full").good()) GTEST_SKIP() << "no /dev/full";
  CommandResult r = memledger::testing::RunCommand(
      "planner/search --model=tiny-llama --gpus=2 --global_batch=2 2>&1 >/dev/full",
      /*merge_stderr=*/false);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("cannot write to standard output: No space left on device"),
            std::string::npos)
      << r.output;
}

// --json_out and --chart_svg naming one file were both written, the last rename winning;
// a closed pipe killed the search (SIGPIPE, 141) and left *.tmp.* beside the files.
TEST(SearchCliTest, OutputsAreDistinctFilesAndAClosedPipeWritesNone) {
  namespace fs = std::filesystem;
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/search_outputs";
  fs::remove_all(dir);
  fs::create_directories(dir);
  CommandResult r = Search("--model=tiny-llama --gpus=2 --global_batch=2 --json_out=" + dir +
                           "/s.json --chart_svg=" + dir + "/./s.json");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--chart_svg=" + dir + "/./s.json: is the same file as --json_out=" +
                          dir + "/s.json"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find('\n'), r.output.size() - 1) << r.output;
  EXPECT_FALSE(fs::exists(dir + "/s.json"));
  r = memledger::testing::RunWithClosedStdout(
      "planner/search --model=tiny-llama --gpus=2 --global_batch=2 --json_out=" + dir +
          "/s.json --chart_svg=" + dir + "/s.svg",
      dir);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(r.output, "error: cannot write to standard output: Broken pipe\n");
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    EXPECT_TRUE(name == "status" || name == "stderr") << name;
  }
}

// A global batch's micro-batch sizes came from its divisors, listed one by one: 2^63 - 1
// never returned. Only the counts a rank's step lays out (at most 8,192 micro-batches)
// are enumerated now.
TEST(SearchCliTest, AHugeGlobalBatchIsSplitIntoAtMost8192MicroBatches) {
  rapidjson::Document doc;
  // 2^40 sequences over 2 data-parallel ranks: at least 2^39 / 8,192 = 2^26 a micro-batch.
  ASSERT_NO_FATAL_FAILURE(SearchJson(
      "--model=tiny-llama --seq=8 --gpus=2 --gpus_per_node=2 --global_batch=1099511627776 "
      "--gpu_memory_gib=1000000000 --format=json",
      &doc));
  ASSERT_FALSE(doc["layouts"].GetArray().Empty());
  for (const rapidjson::Value& layout : doc["layouts"].GetArray()) {
    const int64_t micro_batches = layout["micro_batches"].GetInt64();
    EXPECT_LE(micro_batches, 8192) << layout["flags"].GetString();
    EXPECT_EQ(layout["micro_batch_size"].GetInt64() * micro_batches * layout["dp"].GetInt64(),
              int64_t{1} << 40)
        << layout["flags"].GetString();
  }
  // 2^63 - 1 = 7^2 x 73 x 127 x 337 x 92,737 x 649,657: every micro-batch of it overflows
  // the step's byte counts, so no layout is modelled (exit 2), at once.
  CommandResult r = Search(
      "--model=tiny-llama --seq=8 --gpus=1 --global_batch=9223372036854775807");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("no layout of 1 GPUs is modelled for this model"), std::string::npos)
      << r.output;
}

TEST(SearchCliTest, BadInputExitsTwoNamingTheFlag) {
  struct Case {
    const char* args;
    const char* message;
  };
  for (const Case& c :
       {Case{"--model=tiny-llama --gpus=12 --global_batch=4", "--gpus 12 is not a multiple"},
        Case{"--model=tiny-llama --gpus=4 --global_batch=0", "--global_batch must be >= 1"},
        // Every layout of 4 GPUs is a rank's step (it ran past 20 s, each refused).
        Case{"--model=tiny-llama --gpus=4 --global_batch=4 --layers=100000",
             "--layers 100000 is more than the 65536 layers a rank's step is simulated with "
             "(every layout of 4 GPUs is one)"},
        Case{"--model=tiny-llama --global_batch=4", "--gpus must be from 1 to 1048576, got 0"},
        // 2^62 GPUs in one node: each divisor pair a tensor x pipeline size, the search
        // ran past 100 s.
        Case{"--model=tiny-llama --gpus=4611686018427387904 "
             "--gpus_per_node=4611686018427387904 --global_batch=4",
             "--gpus must be from 1 to 1048576, got 4611686018427387904"},
        Case{"--model=tiny-llama --gpus=4 --global_batch=4 --micro_batches=2",
             "--micro_batches follows from the layout"},
        // Each layout flag's own error (all of them were "fits no layout ... with the
        // layout flags given").
        Case{"--model=tiny-llama --gpus=4 --global_batch=4 --tp=3",
             "--tp 3 does not divide a node's 4 GPUs (tensor-parallel ranks share a node)"},
        Case{"--model=tiny-llama --gpus=4 --global_batch=4 --zero=4",
             "--zero must be 0, 1, 2 or 3, got 4"},
        Case{"--model=tiny-llama --gpus=1 --global_batch=4 --fsdp",
             "--fsdp shards over the data-parallel ranks: it needs --gpus > 1"},
        Case{"--model=tiny-llama --gpus=4 --global_batch=4 --reshard_after_forward=2",
             "--reshard_after_forward is FSDP2's: it needs --fsdp"},
        Case{"--model=tiny-llama --gpus=4 --global_batch=4 --fsdp --offload=cpu --device=cuda",
             "--offload: the search's step time does not model the host's optimizer step"},
        Case{"--model=tiny-llama --gpus=1 --global_batch=4 --offload_activations=cpu "
             "--device=cuda",
             "--offload_activations: the search's step time does not model the copies to and "
             "from host memory yet"},
        // A flag modelled on one process or DDP's ranks refuses every ZeRO layout: the
        // search says the first refusal's reason.
        Case{"--model=tiny-llama --gpus=2 --global_batch=4 --lora_rank=8 --zero=1",
             "without a simulated peak); the first refused: --lora_rank is modelled on one "
             "process, or on --dp ranks under DDP"},
        // The C ABI's lines for the same values (api_test), and predict's for --zero.
        Case{"--model=tiny-llama --gpus=4 --global_batch=4 --top=-1",
             "--top must be >= 0, got -1"},
        Case{"--model=tiny-llama --gpus=4 --global_batch=4 --pp=5",
             "--pp 5 does not divide the 4 GPUs"},
        Case{"--model=tiny-llama --gpus=4 --global_batch=4 --pp=4",
             "--pp 4 does not divide the 2 layers"},
        Case{"--model=tiny-llama --gpus=4 --global_batch=4 --virtual_stages=0",
             "--virtual_stages 0 must be >= 1"},
        Case{"--model=tiny-llama --gpus=4 --global_batch=4 --batch=3",
             "--batch 3 (sequences per micro-batch) does not divide --global_batch 4"},
        Case{"--model=tiny-llama --gpus=4 --global_batch=4 --ep=2",
             "--ep (expert parallelism) needs a mixture-of-experts model"},
        Case{"--model=tiny-qwen3-moe --gpus=4 --global_batch=4 --ep=3",
             "--ep 3 does not divide the 4 experts"},
        Case{"--model=tiny-qwen3-moe --gpus=4 --global_batch=4 --ep=0",
             "--ep must be >= 1, got 0"},
        Case{"--model=tiny-llama --gpus=4 --global_batch=4 --gpu=v100", "--gpu must be one of"},
        Case{"--model=tiny-llama --gpus=4 --global_batch=4 --device=cuda --checked_layouts=-1",
             "--checked_layouts must be between 0 and 4096"},
        Case{"--model=tiny-llama --gpus=4 --global_batch=4 --mfu=2", "--mfu must be in"},
        Case{"--model=tiny-llama --gpus=4 --global_batch=4 --gpu_memory_gib=-1",
             "--gpu_memory_gib must be"},
        Case{"--model=tiny-llama --gpus=4 --global_batch=4 --format=csv", "--format must be"},
        Case{"--model=tiny-llama --gpus=4 --global_batch=4 --planned_layouts=-1",
             "--planned_layouts must be between 0 and 64"},
        Case{"--model=tiny-llama --gpus=4 --global_batch=4 --plan='full*2'",
             "--plan: the search chooses the checkpointing"},
        // Every count up to it was tried: 2^63 - 1 never returned.
        Case{"--model=tiny-llama --gpus=4 --global_batch=4 --max_virtual_stages="
             "9223372036854775807",
             "--max_virtual_stages must be between 1 and 1024, got 9223372036854775807"},
        Case{"--model=tiny-llama --gpus=4 --global_batch=4 --longest_seq=-1",
             "--longest_seq must be >= 1, got -1"},
        Case{"--model=tiny-llama --gpus=4 --global_batch=4 --seq=8 --longest_seq=64",
             "--longest_seq bisects --seq: give one of them, not both"},
        Case{"--model=nope --gpus=4 --global_batch=4", "--model"}}) {
    CommandResult r = Search(c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args << ": " << r.output;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << c.args << ": " << r.output;
    EXPECT_EQ(r.output.find('\n'), r.output.size() - 1) << "one line: " << r.output;
  }
}

}  // namespace
