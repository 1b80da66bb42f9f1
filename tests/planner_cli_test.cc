// The planner binary as a user runs it: the plan and frontier as JSON and as a table,
// exit 3 when no plan fits, one-line errors (exit 2), and a plan written with
// --plan_out that verify --plan runs in LibTorch.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>

#include "rapidjson/document.h"
#include "tests/json_output.h"
#include "tests/subprocess.h"

namespace {

using memledger::testing::CommandResult;
using memledger::testing::JsonOutput;
using memledger::testing::RunCommand;

CommandResult Planner(const std::string& args, bool merge_stderr = true) {
  return RunCommand("planner/planner " + args, merge_stderr);
}

std::string TempPath(const char* name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/" + name;
}

// The study's default config (6 x 128, 4 heads, B 16, T 64, AdamW) under 50 MiB.
// The planner's files go through predict's writer (estimator/cli/output_files.h): a
// FIFO is refused and stays one, and one bad path leaves every other file unwritten.
TEST(PlannerCliTest, OutputsAreAllOrNoneAndOnlyRegularFilesAreReplaced) {
  const std::string fifo = TempPath("plan_fifo");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0644), 0);
  CommandResult r = Planner("--budget_gib=0.05 --plan_out=" + fifo);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--plan_out=" + fifo + ": is a FIFO, not a regular file"),
            std::string::npos)
      << r.output;
  EXPECT_TRUE(std::filesystem::is_fifo(fifo));
  const std::string json = TempPath("plan_ok.json");
  r = Planner("--budget_gib=0.05 --json_out=" + json + " --plan_out=/nonexistent-dir/p.json");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_FALSE(std::filesystem::exists(json));
  // Standard output on a full disk: exit 2 (it was 0), and no file.
  if (std::filesystem::exists("/dev/full")) {
    r = RunCommand("planner/planner --budget_gib=0.05 --json_out=" + json + " 2>&1 >/dev/full",
                   /*merge_stderr=*/false);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("cannot write to standard output"), std::string::npos) << r.output;
    EXPECT_FALSE(std::filesystem::exists(json));
  }
}

// An output that is another output or the --plan the run reads is refused before the
// planning; a closed pipe is exit 2 with no file (it was SIGPIPE, 141, and *.tmp.* left).
TEST(PlannerCliTest, OutputsAreDistinctFilesAndAClosedPipeWritesNone) {
  namespace fs = std::filesystem;
  const std::string dir = TempPath("planner_same_file");
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string plan = dir + "/plan.json";
  CommandResult r = Planner("--budget_gib=0.05 --plan_out=" + plan, /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream plan_file(plan);
  std::stringstream plan_text;
  plan_text << plan_file.rdbuf();
  for (const auto& [args, message] : std::initializer_list<std::pair<std::string, std::string>>{
           {"--plan_out=" + dir + "/p.json --frontier_svg=" + dir + "/p.json",
            "--frontier_svg=" + dir + "/p.json: is the same file as --plan_out=" + dir +
                "/p.json"},
           {"--json_out=" + dir + "/j.json --plan_out=" + dir + "/./j.json",
            "--plan_out=" + dir + "/./j.json: is the same file as --json_out=" + dir + "/j.json"},
           {"--plan=" + plan + " --json_out=" + plan,
            "--json_out=" + plan + ": is the same file as --plan=" + plan +
                ", which the run reads"}}) {
    r = Planner("--budget_gib=0.05 " + args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << args << ": " << r.output;
    EXPECT_EQ(r.output.find('\n'), r.output.size() - 1) << args << ": " << r.output;
  }
  std::ifstream after(plan);
  std::stringstream after_text;
  after_text << after.rdbuf();
  EXPECT_EQ(after_text.str(), plan_text.str());
  EXPECT_FALSE(fs::exists(dir + "/p.json"));
  EXPECT_FALSE(fs::exists(dir + "/j.json"));
  r = memledger::testing::RunWithClosedStdout(
      "planner/planner --budget_gib=0.05 --plan_out=" + dir + "/out.json --frontier_svg=" + dir +
          "/out.svg",
      dir);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(r.output, "error: cannot write to standard output: Broken pipe\n");
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    EXPECT_TRUE(name == "plan.json" || name == "status" || name == "stderr") << name;
  }
}

TEST(PlannerCliTest, JsonPlanUnderTheBudget) {
  CommandResult r = Planner("--budget_gib=0.048828125", /*merge_stderr=*/false);  // 50 MiB
  rapidjson::Document doc;
  ASSERT_TRUE(JsonOutput(r, &doc));
  EXPECT_EQ(doc["budget_bytes"].GetInt64(), 50 << 20);
  ASSERT_EQ(doc["plan"].Size(), 6u);
  EXPECT_LE(doc["peak_bytes"].GetInt64(), 50 << 20);
  // The plan replayed (estimator/step/liveness) peaks where the planner composed it.
  EXPECT_EQ(doc["peak"]["bytes"].GetInt64(), doc["peak_bytes"].GetInt64());
  EXPECT_TRUE(doc["peak"]["op"].IsString());
  // Measured by the counting allocator (runtime_test, verify) and by the real stack's
  // profiler on the unchanged study (verify/witness.py): the study's `none` peaks at
  // 67,688,232 B and `full` at 29,551,848 B (with AdamW's 6 x 12 step tensors of 4 B:
  // 288 B, and under full the 5,056-byte RNG state of the layer whose backward peaks;
  // the non-reentrant recompute stops before fc2, so no layer output of 16 x 64 x 128
  // x 4 B = 524,288 B is recomputed), so 50 MiB needs some recompute, and an all-full
  // plan fits any budget above 29,551,848.
  EXPECT_EQ(doc["variants"]["none"]["peak_bytes"].GetInt64(), 67688232);
  EXPECT_EQ(doc["variants"]["full"]["peak_bytes"].GetInt64(), 29551848);
  EXPECT_GT(doc["recompute_flops"].GetInt64(), 0);
  EXPECT_LE(doc["smallest_budget_bytes"].GetInt64(), 29551848);
  // full recomputes every layer's forward: 6 x (24 N d^2 + 25 N d + 2 B d T (T + 1)),
  // N = 1024 tokens, d = 128 (planner_test derives it).
  const int64_t n = 1024, d = 128;
  EXPECT_EQ(doc["variants"]["full"]["recompute_flops"].GetInt64(),
            6 * (24 * n * d * d + 25 * n * d + 2 * 16 * d * 64 * 65));
  EXPECT_EQ(doc["variants"]["none"]["overhead"].GetDouble(), 1.0);
  // The plan recomputes less than full does.
  EXPECT_LT(doc["recompute_flops"].GetInt64(),
            doc["variants"]["full"]["recompute_flops"].GetInt64());
  const rapidjson::Value& frontier = doc["frontier"];
  ASSERT_EQ(frontier.Size(), 9u);
  EXPECT_EQ(frontier[0].GetObject()["budget_bytes"].GetInt64(),
            doc["smallest_budget_bytes"].GetInt64());
  EXPECT_EQ(frontier[8].GetObject()["budget_bytes"].GetInt64(), 67688232);
  EXPECT_EQ(frontier[8].GetObject()["overhead"].GetDouble(), 1.0);
}

TEST(PlannerCliTest, TableShowsRunsOfLayersAndTheFrontier) {
  CommandResult r = Planner("--budget_gib=0.04 --format=table --frontier_points=3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("checkpoint plan: study, 6 layers"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("  layers 0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("frontier (budget -> least recompute)"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("every_2"), std::string::npos) << r.output;
}

TEST(PlannerCliTest, NoPlanFitsExitsThreeWithTheSmallestBudget) {
  CommandResult r = Planner("--budget_gib=0.01");  // 10 MiB: below what full needs
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("no checkpoint plan fits 10.24 MiB"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("the smallest peak any plan reaches is"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find('\n'), r.output.size() - 1) << r.output;
}

TEST(PlannerCliTest, BadInputExitsTwoNamingTheFlag) {
  for (const auto& [args, flag] : std::initializer_list<std::pair<const char*, const char*>>{
           {"", "--budget_gib must be a positive number"},
           {"--budget_gib=-1", "--budget_gib"},
           {"--budget_gib=nan", "--budget_gib"},
           // Rounded down to 0 bytes it was "budget_bytes must be positive, got 0".
           {"--budget_gib=1e-12", "--budget_gib 1e-12 is less than one byte"},
           {"--budget_gib=1e30", "--budget_gib"},
           // The C ABI's line for the same value (api_test).
           {"--budget_gib=1 --frontier_points=1",
            "--frontier_points must be 0 or between 2 and 1000, got 1"},
           {"--budget_gib=1 --format=csv", "--format must be json or table"},
           {"--budget_gib=1 --flops_per_second=-2", "--flops_per_second"},
           {"--budget_gib=1 --cpu_threads=0", "--cpu_threads"},
           {"--budget_gib=1 --layers=0", "--layers"},
           {"--budget_gib=1 --width=130", "--width 130 is not divisible by --heads 4"},
           {"--budget_gib=1 --model=tiny-llama --pp=2 --dp=2 --zero=3", "--zero=3"},
           {"--budget_gib=1 --model=tiny-llama --micro_batches=2 --timeline_svg=/tmp/x.svg",
            "not with --pp or --micro_batches"},
           {"--budget_gib=1 --model=tiny-llama --dp=2 --zero=3", "--zero=3"},
           {"--budget_gib=1 --model=tiny-qwen3-moe --dp=2 --ep=2 --routing=worst",
            "--ep: the planner plans expert-parallel ranks under --routing=balanced only"},
           {"--budget_gib=1 stray", "unexpected argument"}}) {
    CommandResult r = Planner(args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.output;
    EXPECT_NE(r.output.find(flag), std::string::npos) << args << ": " << r.output;
    EXPECT_EQ(r.output.find('\n'), r.output.size() - 1) << args << ": " << r.output;
  }
}

// On --device=cuda the budget holds what the device holds under the plan: the caching
// allocator's reserved peak (its replay through the allocator's simulation) and the CUDA
// context outside it. The composed peak counts requests rounded to 512 B, which the
// replay's allocated blocks are at least.
TEST(PlannerCliTest, OnCudaTheDeviceHoldsThePlan) {
  const std::string model = "--model=tiny-llama --layers=6 --batch=8 --seq=1024 --dtype=bf16 "
                            "--device=cuda --frontier_points=3";
  CommandResult r = Planner(model + " --budget_gib=0.38", /*merge_stderr=*/false);
  rapidjson::Document doc;
  ASSERT_TRUE(JsonOutput(r, &doc));
  EXPECT_EQ(doc["device"], "cuda");
  const int64_t budget = doc["budget_bytes"].GetInt64();
  const int64_t context = doc["outside_allocator_bytes"]["cuda_context"].GetInt64();
  EXPECT_EQ(context, 287047680);  // the default, 273.75 MiB
  EXPECT_EQ(doc["device_bytes"].GetInt64(), doc["peak_reserved_bytes"].GetInt64() + context);
  EXPECT_LE(doc["device_bytes"].GetInt64(), budget);
  EXPECT_GE(doc["peak_allocated_bytes"].GetInt64(), doc["peak_bytes"].GetInt64());
  EXPECT_EQ(doc["peak"]["bytes"].GetInt64(), doc["peak_allocated_bytes"].GetInt64());
  EXPECT_GE(doc["peak_reserved_bytes"].GetInt64(), doc["peak_allocated_bytes"].GetInt64());
  // Not every layer is none: without checkpoints the device would need more.
  EXPECT_GT(doc["recompute_flops"].GetInt64(), 0);
  EXPECT_GT(doc["variants"]["none"]["peak_reserved_bytes"].GetInt64() + context, budget);
  EXPECT_LE(doc["smallest_device_bytes"].GetInt64(), budget);
  // Below what the least plan found needs: exit 3, naming it.
  CommandResult small = Planner(model + " --budget_gib=0.3");
  EXPECT_EQ(small.exit_code, 3) << small.output;
  EXPECT_NE(small.output.find("on cuda; the least found needs"), std::string::npos)
      << small.output;
  EXPECT_EQ(small.output.find('\n'), small.output.size() - 1) << small.output;
  // The table says what each number counts.
  CommandResult table = Planner(model + " --budget_gib=0.38 --format=table");
  ASSERT_EQ(table.exit_code, 0) << table.output;
  for (const char* text : {"on cuda, the plan replayed through the caching allocator",
                           "outside the allocator", "within the budget",
                           "variant        allocated     reserved",
                           "requests rounded to 512 B"}) {
    EXPECT_NE(table.output.find(text), std::string::npos) << text << "\n" << table.output;
  }
}

// --frontier_svg draws the frontier; librsvg (which ./bazelw installs) renders it.
TEST(PlannerCliTest, FrontierSvgRenders) {
  const std::string svg = TempPath("frontier.svg"), png = TempPath("frontier.png");
  CommandResult r = Planner("--budget_gib=0.04 --frontier_points=5 --frontier_svg=" + svg,
                            /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream file(svg);
  std::stringstream text;
  text << file.rdbuf();
  EXPECT_EQ(text.str().rfind("<svg ", 0), 0u);
  EXPECT_NE(text.str().find("class=\"frontier\""), std::string::npos);
  EXPECT_NE(text.str().find("class=\"plan\""), std::string::npos);
  EXPECT_NE(text.str().find(">every_2 1.166x</text>"), std::string::npos) << text.str();
  EXPECT_EQ(RunCommand("rsvg-convert --format=png -o '" + png + "' '" + svg + "'").exit_code, 0);
  std::ifstream image(png, std::ios::binary);
  char magic[4] = {};
  image.read(magic, 4);
  EXPECT_EQ(std::string(magic + 1, 3), "PNG");

  CommandResult bad = Planner("--budget_gib=0.04 --frontier_points=0 --frontier_svg=" + svg);
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--frontier_svg needs --frontier_points >= 2"), std::string::npos);
}

// --timeline_svg draws the plan's step (it was listed in --help and ignored): one panel
// whose peak label is the plan's peak_bytes of the JSON.
TEST(PlannerCliTest, TimelineSvgDrawsThePlansStep) {
  const std::string svg = TempPath("plan_timeline.svg");
  CommandResult r = Planner("--budget_gib=0.04 --timeline_svg=" + svg, /*merge_stderr=*/false);
  rapidjson::Document doc;
  ASSERT_TRUE(JsonOutput(r, &doc));
  std::ifstream file(svg);
  std::stringstream text;
  text << file.rdbuf();
  EXPECT_EQ(text.str().rfind("<svg ", 0), 0u);
  EXPECT_NE(text.str().find(": the plan"), std::string::npos);
  EXPECT_NE(text.str().find("(" + std::to_string(doc["peak_bytes"].GetInt64()) + " B)"),
            std::string::npos)
      << text.str().substr(0, 2000);
  CommandResult rank = Planner("--budget_gib=0.04 --dp=2 --zero=1 --timeline_svg=" + svg);
  EXPECT_EQ(rank.exit_code, 2) << rank.output;
  EXPECT_NE(rank.output.find("not with --dp"), std::string::npos) << rank.output;
}

// The plan the planner writes is the plan verify runs: measured == predicted.
// VerifiedPlan runs `plan` with verify in LibTorch (stdout only: verify reports progress
// on stderr once a run takes a second) and returns its JSON, after checking that the
// plan's counted peak is the predicted one.
rapidjson::Document VerifiedPlan(const std::string& model, const std::string& plan) {
  CommandResult v = RunCommand("verify/verify " + model + " --skip_timing --plan=" + plan,
                               /*merge_stderr=*/false);
  EXPECT_EQ(v.exit_code, 0) << v.output;
  rapidjson::Document doc;
  doc.Parse(v.output.c_str());
  EXPECT_FALSE(doc.HasParseError()) << v.output;
  if (doc.HasParseError()) return doc;
  EXPECT_EQ(doc["ratio"]["peak_bytes"]["plan"].GetDouble(), 1.0) << v.output;
  return doc;
}

TEST(PlannerCliTest, PlanOutVerifiesInLibTorch) {
  const std::string plan = TempPath("plan.json");
  const std::string model = "--layers=3 --width=32 --heads=2 --batch=2 --seq=16";
  CommandResult r = Planner(model + " --budget_gib=0.0008 --frontier_points=0 --plan_out=" +
                                plan,
                            /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream file(plan);
  std::stringstream written;
  written << file.rdbuf();
  EXPECT_EQ(written.str(), r.output);  // the same JSON document
  VerifiedPlan(model, plan);
  // --plan_out's file is read back whatever its name (plan.txt was taken for inline runs).
  const std::string txt = TempPath("plan.txt");
  std::ofstream(txt) << written.str();
  CommandResult from_json = RunCommand("estimator/predict " + model + " --plan=" + plan,
                                       /*merge_stderr=*/false);
  CommandResult from_txt = RunCommand("estimator/predict " + model + " --plan=" + txt,
                                      /*merge_stderr=*/false);
  ASSERT_EQ(from_txt.exit_code, 0) << from_txt.output;
  EXPECT_EQ(from_txt.output, from_json.output);

  // A file that is not a plan: exit 2, naming the file.
  std::ofstream(TempPath("bad.json")) << "{\"plan\": [\"none\", \"half\", \"full\"]}";
  CommandResult bad =
      RunCommand("verify/verify " + model + " --skip_timing --plan=" + TempPath("bad.json"));
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("plan[1]: unknown layer choice 'half'"), std::string::npos)
      << bad.output;
  CommandResult missing = RunCommand("verify/verify " + model + " --plan=/nonexistent.json");
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_NE(missing.output.find("--plan /nonexistent.json: cannot read"), std::string::npos)
      << missing.output;
}

// One of 4 data-parallel ranks under ZeRO-1, bf16 with fp32 master weights: the rank's
// resident bytes are the flat parameters and a quarter of the optimizer's state, and its
// step ends in the gradients' reduction; the planner checks its composed peak against
// the rank's replayed step (PredictRanks) before it answers; verify runs the plan on
// the 4 Gloo ranks.
TEST(PlannerCliTest, PlansOneDataParallelRank) {
  const std::string model =
      "--model=tiny-llama --layers=4 --batch=8 --seq=128 --dtype=bf16 --master_weights";
  const std::string plan = TempPath("plan_dp.json");
  CommandResult r = Planner(model + " --dp=4 --zero=1 --budget_gib=0.004 --frontier_points=3" +
                                " --plan_out=" + plan,
                            /*merge_stderr=*/false);
  rapidjson::Document doc;
  ASSERT_TRUE(JsonOutput(r, &doc));
  EXPECT_EQ(doc["parallel"]["dp"].GetInt64(), 4);
  EXPECT_EQ(doc["parallel"]["zero"].GetInt64(), 1);
  EXPECT_LE(doc["peak_bytes"].GetInt64(), 4294967);
  EXPECT_EQ(doc["peak"]["bytes"].GetInt64(), doc["peak_bytes"].GetInt64());
  // The rank's none, as predict says it for the layout.
  CommandResult p = RunCommand(
      "estimator/predict " + model + " --dp=4 --zero=1 --variants=none", /*merge_stderr=*/false);
  rapidjson::Document predicted;
  ASSERT_TRUE(JsonOutput(p, &predicted));
  EXPECT_EQ(doc["variants"]["none"]["peak_bytes"].GetInt64(),
            predicted["peak_bytes"]["none"].GetInt64());
  EXPECT_EQ(doc["optimizer_state_bytes"].GetInt64(),
            predicted["optimizer_state_bytes"].GetInt64());
  // The plan on 4 Gloo ranks in LibTorch: each counts the planned peak.
  CommandResult v = RunCommand("verify/verify " + model +
                                   " --dp=4 --zero=1 --skip_timing --plan=" + plan,
                               /*merge_stderr=*/false);
  EXPECT_EQ(v.exit_code, 0) << v.output;
  rapidjson::Document verified;
  verified.Parse(v.output.c_str());
  ASSERT_FALSE(verified.HasParseError()) << v.output;
  ASSERT_EQ(verified["ranks"].Size(), 4u);
  for (const rapidjson::Value& rank : verified["ranks"].GetArray()) {
    EXPECT_EQ(rank["ratio"]["peak_bytes.plan"].GetDouble(), 1.0);
    EXPECT_EQ(rank["measured"]["peak_bytes.plan"].GetInt64(), doc["peak_bytes"].GetInt64());
  }
}

// A plan per pipeline stage (2 stages of 4 micro-batches, bf16 autocast), under
// 2.5 MiB on each: each stage's plan is replayed by the planner, and verify runs the
// plan on 2 Gloo ranks in LibTorch, where each stage's rank counts the planned peak.
// Without checkpoints stage 0 (2 micro-batches in flight) peaks at 3,840,108 B, more
// than the budget, so its plan recomputes.
TEST(PlannerCliTest, PlansEachPipelineStageAndVerifiesOnGlooRanks) {
  const std::string model =
      "--model=tiny-llama --layers=4 --batch=4 --seq=128 --amp=bf16 --pp=2 --micro_batches=4";
  const std::string plan = TempPath("plan_pp.json");
  CommandResult r = Planner(model + " --budget_gib=0.0025 --plan_out=" + plan,
                            /*merge_stderr=*/false);
  rapidjson::Document doc;
  ASSERT_TRUE(JsonOutput(r, &doc));
  const int64_t budget = doc["budget_bytes"].GetInt64();
  ASSERT_EQ(doc["stages"].Size(), 2u);
  EXPECT_EQ(doc["variants"]["none"]["peak_bytes"].GetInt64(), 3840108);
  EXPECT_GT(doc["recompute_flops"].GetInt64(), 0);
  int64_t most = 0;
  for (const rapidjson::Value& stage : doc["stages"].GetArray()) {
    EXPECT_LE(stage["peak_bytes"].GetInt64(), budget);
    most = std::max(most, stage["peak_bytes"].GetInt64());
  }
  EXPECT_EQ(doc["peak_bytes"].GetInt64(), most);
  EXPECT_EQ(doc["stages"][0]["in_flight"].GetInt64(), 2);
  EXPECT_EQ(doc["stages"][1]["in_flight"].GetInt64(), 1);
  CommandResult v = RunCommand("verify/verify " + model + " --skip_timing --plan=" + plan,
                               /*merge_stderr=*/false);
  EXPECT_EQ(v.exit_code, 0) << v.output;
  rapidjson::Document verified;
  verified.Parse(v.output.c_str());
  ASSERT_FALSE(verified.HasParseError()) << v.output;
  ASSERT_EQ(verified["ranks"].Size(), 2u);
  for (const rapidjson::Value& rank : verified["ranks"].GetArray()) {
    const int64_t stage = rank["stage"].GetInt64();
    EXPECT_EQ(rank["ratio"]["peak_bytes.plan"].GetDouble(), 1.0);
    EXPECT_EQ(rank["measured"]["peak_bytes.plan"].GetInt64(),
              doc["stages"][static_cast<rapidjson::SizeType>(stage)]["peak_bytes"].GetInt64());
  }
  // The table shows each stage's plan.
  CommandResult table = Planner(model + " --budget_gib=0.0025 --format=table");
  ASSERT_EQ(table.exit_code, 0) << table.output;
  EXPECT_NE(table.output.find("  stage 0 (2 micro-batches in flight): "), std::string::npos)
      << table.output;
  EXPECT_NE(table.output.find("  stage 1 (1 micro-batch in flight): "), std::string::npos)
      << table.output;
  // Under what all-full needs on its most loaded stage: exit 3, naming the stage.
  CommandResult small = Planner(model + " --budget_gib=0.001");
  EXPECT_EQ(small.exit_code, 3) << small.output;
  EXPECT_NE(small.output.find("on pipeline stage"), std::string::npos) << small.output;
}

// Pipeline stages on --device=cuda: the plan is searched with each storage counted as its
// request, then replayed through the caching allocator; every stage's reserved peak and
// the CUDA context fit the budget, and predict replays the plan file to the same
// per-stage blocks. Without checkpoints the device would need more: 396,099,584 B (none's
// 104 MiB reserved + 273.75 MiB), above the 0.36 GiB budget (386,547,056 B).
TEST(PlannerCliTest, OnCudaEveryStageFitsByTheAllocatorsReplay) {
  const std::string model =
      "--model=tiny-llama --layers=6 --batch=8 --seq=1024 --dtype=bf16 --device=cuda --pp=2 "
      "--micro_batches=4";
  const std::string plan = TempPath("plan_pp_cuda.json");
  CommandResult r = Planner(model + " --budget_gib=0.36 --plan_out=" + plan,
                            /*merge_stderr=*/false);
  rapidjson::Document doc;
  ASSERT_TRUE(JsonOutput(r, &doc));
  const int64_t budget = doc["budget_bytes"].GetInt64();
  const int64_t context = doc["outside_allocator_bytes"]["cuda_context"].GetInt64();
  EXPECT_EQ(budget, 386547056);
  EXPECT_GT(doc["variants"]["none"]["peak_reserved_bytes"].GetInt64() + context, budget);
  EXPECT_GT(doc["recompute_flops"].GetInt64(), 0);
  ASSERT_EQ(doc["stages"].Size(), 2u);
  CommandResult p = RunCommand("estimator/predict " + model + " --plan=" + plan, false);
  rapidjson::Document predicted;
  ASSERT_TRUE(JsonOutput(p, &predicted));
  int64_t most = 0;
  for (const rapidjson::Value& stage : doc["stages"].GetArray()) {
    const int64_t reserved = stage["peak_reserved_bytes"].GetInt64();
    EXPECT_LE(reserved + context, budget);
    most = std::max(most, reserved + context);
    for (const rapidjson::Value& rank : predicted["ranks"].GetArray()) {
      if (rank["stage"].GetInt64() != stage["stage"].GetInt64()) continue;
      EXPECT_EQ(rank["peak_bytes"]["plan"].GetInt64(), stage["peak_bytes"].GetInt64());
      EXPECT_EQ(rank["peak_reserved_bytes"]["plan"].GetInt64(), reserved);
    }
  }
  EXPECT_EQ(doc["device_bytes"].GetInt64(), most);
}

// Models whose layers differ: tiny-gemma3 (5 sliding-window layers, 1 global) and a
// Qwen3-MoE whose layer 0 is dense (mlp_only_layers) and the rest sparse. Each plan is
// composed kind by kind like any other (with its frontier, whose last point is `none`'s
// own peak, as predict replays it); verify runs it in LibTorch, which counts the planned
// peak. Without checkpoints tiny-gemma3 at B 4, T 128 peaks at
// 13.10 MiB and the MoE at 2,081,444 B, both above their budgets.
TEST(PlannerCliTest, PlansLayersThatDifferAndVerifiesInLibTorch) {
  for (const auto& [model, budget_gib] : std::initializer_list<std::pair<const char*, const char*>>{
           {"--model=tiny-gemma3 --batch=4 --seq=128", "0.004"},
           {"--model=tests/testdata/small-qwen3-moe-dense-first.config.json --batch=2 --seq=64",
            "0.0016"}}) {
    SCOPED_TRACE(model);
    const std::string plan = TempPath("plan_kinds.json");
    CommandResult r = Planner(std::string(model) + " --budget_gib=" + budget_gib +
                                  " --plan_out=" + plan,
                              /*merge_stderr=*/false);
    rapidjson::Document doc;
    ASSERT_TRUE(JsonOutput(r, &doc));
    EXPECT_LE(doc["peak_bytes"].GetInt64(), doc["budget_bytes"].GetInt64());
    EXPECT_GT(doc["variants"]["none"]["peak_bytes"].GetInt64(), doc["budget_bytes"].GetInt64());
    EXPECT_GT(doc["recompute_flops"].GetInt64(), 0);
    EXPECT_LT(doc["recompute_flops"].GetInt64(),
              doc["variants"]["full"]["recompute_flops"].GetInt64());
    const rapidjson::Value& frontier = doc["frontier"];
    ASSERT_EQ(frontier.Size(), 9u);
    EXPECT_EQ(frontier[0].GetObject()["budget_bytes"].GetInt64(),
              doc["smallest_budget_bytes"].GetInt64());
    EXPECT_EQ(frontier[8].GetObject()["budget_bytes"].GetInt64(),
              doc["variants"]["none"]["peak_bytes"].GetInt64());
    EXPECT_EQ(frontier[8].GetObject()["overhead"].GetDouble(), 1.0);
    CommandResult v = RunCommand(std::string("verify/verify ") + model +
                                     " --skip_timing --plan=" + plan,
                                 /*merge_stderr=*/false);
    EXPECT_EQ(v.exit_code, 0) << v.output;
    rapidjson::Document verified;
    verified.Parse(v.output.c_str());
    ASSERT_FALSE(verified.HasParseError()) << v.output;
    EXPECT_TRUE(verified["passed"].GetBool()) << v.output;
    EXPECT_EQ(verified["peak_bytes"]["plan"].GetInt64(), doc["peak_bytes"].GetInt64());
  }
}

// Pipeline stages of layers that differ: tiny-gemma3 (layers 0-2 sliding on stage 0;
// 3-4 sliding and 5 global on stage 1) in 2 stages of 2 micro-batches. Each stage's
// guide is its own layers' model (ModelConfig::LayersAlone); verify runs the plan on 2
// Gloo ranks in LibTorch, each measuring its stage's peak at the planned one, within the
// budget.
TEST(PlannerCliTest, StagesOfLayersThatDifferVerifyOnGlooRanks) {
  const std::string model = "--model=tiny-gemma3 --batch=2 --seq=128 --pp=2 --micro_batches=2";
  const std::string plan = TempPath("plan_gemma_stages.json");
  CommandResult r = Planner(model + " --budget_gib=0.004 --plan_out=" + plan, false);
  rapidjson::Document doc;
  ASSERT_TRUE(JsonOutput(r, &doc));
  ASSERT_EQ(doc["stages"].Size(), 2u);
  CommandResult v =
      RunCommand("verify/verify " + model + " --skip_timing --plan=" + plan, false);
  EXPECT_EQ(v.exit_code, 0) << v.output;
  rapidjson::Document verified;
  verified.Parse(v.output.c_str());
  ASSERT_FALSE(verified.HasParseError()) << v.output;
  EXPECT_TRUE(verified["passed"].GetBool()) << v.output;
  int measured = 0;
  for (const rapidjson::Value& stage : doc["stages"].GetArray()) {
    EXPECT_LE(stage["peak_bytes"].GetInt64(), doc["budget_bytes"].GetInt64());
    for (const rapidjson::Value& rank : verified["ranks"].GetArray()) {
      if (rank["stage"].GetInt64() != stage["stage"].GetInt64()) continue;
      EXPECT_EQ(rank["measured"]["peak_bytes.plan"].GetInt64(), stage["peak_bytes"].GetInt64());
      ++measured;
    }
  }
  EXPECT_EQ(measured, 2);  // each stage's rank
}

// Expert parallelism under balanced routing (tiny-qwen3-moe, 2 data-parallel ranks
// each with 2 of the 4 experts): every rank receives alike, so one plan fits both (and
// over pipeline stages, each stage's plan its ranks), and
// predict replays it on each rank to the planned peak (memledger's LibTorch runtime has
// no expert parallelism; tests/expert_parallel_test.py proves these ranks' steps against
// transformers). Without checkpoints each rank peaks above the budget.
TEST(PlannerCliTest, ExpertParallelRanksShareOnePlan) {
  const std::string model = "--model=tiny-qwen3-moe --batch=4 --seq=128 --dp=2 --ep=2";
  const std::string plan = TempPath("plan_ep.json");
  CommandResult r = Planner(model + " --budget_gib=0.004 --plan_out=" + plan, false);
  rapidjson::Document doc;
  ASSERT_TRUE(JsonOutput(r, &doc));
  EXPECT_LE(doc["peak_bytes"].GetInt64(), doc["budget_bytes"].GetInt64());
  EXPECT_GT(doc["recompute_flops"].GetInt64(), 0);
  CommandResult p = RunCommand("estimator/predict " + model + " --plan=" + plan, false);
  rapidjson::Document predicted;
  ASSERT_TRUE(JsonOutput(p, &predicted));
  ASSERT_EQ(predicted["ranks"].Size(), 2u);
  for (const rapidjson::Value& rank : predicted["ranks"].GetArray()) {
    EXPECT_GT(rank["peak_bytes"]["none"].GetInt64(), doc["budget_bytes"].GetInt64());
    EXPECT_EQ(rank["peak_bytes"]["plan"].GetInt64(), doc["peak_bytes"].GetInt64());
  }
  // Over 2 pipeline stages each stage's 2 expert-parallel ranks share its plan: one entry
  // per stage, whose peak every rank of the stage replays to.
  const std::string staged = "--model=tiny-qwen3-moe --layers=4 --batch=2 --seq=128 --pp=2 "
                             "--dp=2 --ep=2 --micro_batches=2";
  const std::string stage_plan = TempPath("plan_ep_stages.json");
  CommandResult sr = Planner(staged + " --budget_gib=0.004 --plan_out=" + stage_plan, false);
  rapidjson::Document stages;
  ASSERT_TRUE(JsonOutput(sr, &stages));
  ASSERT_EQ(stages["stages"].Size(), 2u);
  CommandResult sp = RunCommand("estimator/predict " + staged + " --plan=" + stage_plan, false);
  rapidjson::Document ranks;
  ASSERT_TRUE(JsonOutput(sp, &ranks));
  ASSERT_EQ(ranks["ranks"].Size(), 4u);  // 2 stages x 2 expert-parallel ranks
  for (const rapidjson::Value& rank : ranks["ranks"].GetArray()) {
    const rapidjson::Value& stage = stages["stages"][rank["stage"].GetUint()];
    EXPECT_EQ(rank["peak_bytes"]["plan"].GetInt64(), stage["peak_bytes"].GetInt64());
    EXPECT_LE(rank["peak_bytes"]["plan"].GetInt64(), stages["budget_bytes"].GetInt64());
  }
}

// The planner's low-precision recipes, each plan run in LibTorch to the same peak:
//   - bf16 with fp32 master weights: the optimizer's step holds every layer's fp32
//     .grad copy (the planner adds them per layer to its probes' step); under 4.1 MiB
//     (all full peaks at 2,509,764 B, none at 7,143,556 B);
//   - bf16 autocast: a checkpointed layer's weight casts live in autocast's cache until
//     the forward ends, and the plan that checkpoints nothing keeps transformers'
//     DynamicCache (none peaks at 8,992,388 B, full at 2,976,196 B); under 5.1 MiB.
TEST(PlannerCliTest, LowPrecisionPlansVerifyInLibTorch) {
  struct Case {
    const char* model;
    const char* budget_gib;
    int64_t budget;
  };
  for (const Case& c :
       {Case{"--model=tiny-llama --layers=4 --batch=8 --seq=128 --dtype=bf16 --master_weights",
             "0.004", 4294967},
        Case{"--model=tiny-llama --layers=4 --batch=8 --seq=128 --amp=bf16", "0.005",
             5368709}}) {
    SCOPED_TRACE(c.model);
    const std::string plan = TempPath("plan_low_precision.json");
    const std::string model = c.model;
    CommandResult r = Planner(model + " --budget_gib=" + c.budget_gib +
                                  " --frontier_points=0 --plan_out=" + plan,
                              /*merge_stderr=*/false);
    rapidjson::Document planned;
    ASSERT_TRUE(JsonOutput(r, &planned));
    EXPECT_LE(planned["peak_bytes"].GetInt64(), c.budget);
    EXPECT_GT(planned["recompute_flops"].GetInt64(), 0);
    rapidjson::Document doc = VerifiedPlan(model, plan);
    if (HasFailure()) continue;
    EXPECT_EQ(doc["peak_bytes"]["plan"].GetInt64(), planned["peak_bytes"].GetInt64());  // measured
  }
}

// The planner validates a request once where it reads it (ValidRunFromFlags): the plan,
// the fixed variants' predictions, FLOPs and the probes' simulations take the proof.
// The stage planner guides each stage with the planner on the stage's layers alone
// (ModelConfig::LayersAlone), a model of its own, validated once per distinct stage:
// tiny-llama's 2 layers over 2 stages are 2 one-layer models, 1 + 2; one stage with 2
// micro-batches in flight, 1 + 1. Counted by the binary at exit
// (MEMLEDGER_COUNT_VALIDATIONS).
TEST(PlannerCliTest, ARequestIsValidatedOnce) {
  const std::pair<const char*, const char*> cases[] = {
      {"--model=tiny-llama --budget_gib=0.01", "validations: config 1, layout 1\n"},
      {"--model=tiny-llama --budget_gib=0.01 --dp=2", "validations: config 1, layout 1\n"},
      {"--model=tiny-llama --budget_gib=0.01 --dp=2 --zero=2",
       "validations: config 1, layout 1\n"},
      {"--model=tiny-llama --budget_gib=0.01 --pp=2 --micro_batches=2",
       "validations: config 3, layout 3\n"},
      {"--model=tiny-llama --budget_gib=0.01 --micro_batches=2",
       "validations: config 2, layout 2\n"},
  };
  for (const auto& [flags, expected] : cases) {
    const CommandResult r = RunCommand(
        std::string("MEMLEDGER_COUNT_VALIDATIONS=1 planner/planner ") + flags + " 2>&1 >/dev/null",
        /*merge_stderr=*/false);
    EXPECT_EQ(r.exit_code, 0) << flags << ": " << r.output;
    EXPECT_EQ(r.output, expected) << flags;
  }
}

}  // namespace
