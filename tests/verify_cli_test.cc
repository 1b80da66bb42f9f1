// The verify binary as a user runs it: a passing run on a small config, JSON keys,
// atomic --json_out, bad input and the memory guard (exit 2).
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>

#include "rapidjson/document.h"
#include "tests/subprocess.h"

namespace {

using memledger::testing::CommandResult;

// Small enough to run in well under a second after LibTorch has loaded.
constexpr char kSmall[] = "--layers=2 --width=32 --heads=2 --batch=2 --seq=8 --skip_timing";

CommandResult Verify(const std::string& args, bool merge_stderr = true) {
  return memledger::testing::RunCommand("verify/verify " + args, merge_stderr);
}

TEST(VerifyCliTest, ModelFlagVerifiesADecoderFamily) {
  CommandResult r = Verify("--model=tiny-gpt2 --batch=2 --seq=8 --skip_timing --format=table");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("OK: every bucket measured == predicted"), std::string::npos)
      << r.output;
  CommandResult typo = Verify("--skip_timng");
  EXPECT_EQ(typo.exit_code, 2) << typo.output;
  EXPECT_NE(typo.output.find("unknown flag --skip_timng"), std::string::npos) << typo.output;
  CommandResult bad = Verify("--model=tiny-gpt2 --seq=500 --skip_timing");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--seq 500 exceeds the model's 128 learned positions"),
            std::string::npos)
      << bad.output;
}

// StudyMissing: `r` is the witness's refusal of a study it cannot find
// (verify/witness.py, STUDY_MISSING) and the run does not require the study
// (MEMLEDGER_REQUIRE_STUDY=1, as .ci/run sets it).
bool StudyMissing(const CommandResult& r) {
  const char* require = std::getenv("MEMLEDGER_REQUIRE_STUDY");
  return r.output.find("the reference study 22_memory_accounting.py is not here") !=
             std::string::npos &&
         !(require != nullptr && std::string(require) == "1");
}

// --witness=transformers adds the real stack's step as a third column, through the
// pinned reference stack's Python (here its @reference_stack wrapper). Transformers'
// GPT-2 agrees without checkpointing, with use_cache's copies of k and v, and so does
// the study in every bucket, under full checkpointing too (torch.utils.checkpoint's
// non-reentrant lazy recompute with early stop, whose peak is in the backward at seq 16).
TEST(VerifyCliTest, WitnessAddsTheRealStacksColumn) {
  const std::string witness =
      " --witness=transformers --witness_python=external/reference_stack/python";
  CommandResult gpt2 = Verify(
      "--model=tiny-gpt2 --batch=2 --seq=16 --skip_timing --variants=none" + witness);
  EXPECT_EQ(gpt2.exit_code, 0) << gpt2.output;
  EXPECT_NE(gpt2.output.find("\"passed\": true"), std::string::npos) << gpt2.output;
  CommandResult bad = Verify(std::string(kSmall) + " --witness=pytorch");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--witness must be none or transformers, got 'pytorch'"),
            std::string::npos)
      << bad.output;
  CommandResult none = Verify(std::string(kSmall) + " --variants=none --format=table" + witness);
  if (StudyMissing(none)) GTEST_SKIP() << none.output;
  ASSERT_EQ(none.exit_code, 0) << none.output;
  EXPECT_NE(none.output.find("transformers"), std::string::npos) << none.output;
  EXPECT_NE(none.output.find("== the real stack's"), std::string::npos) << none.output;
  CommandResult full = Verify(
      "--layers=2 --width=32 --heads=2 --batch=2 --seq=16 --skip_timing --variants=full" +
      witness);
  EXPECT_EQ(full.exit_code, 0) << full.output;
}

// On --dp ranks --witness=transformers runs the real stack on as many Gloo ranks
// (verify/witness_ranks.py: torch's DDP, or FSDP2's fully_shard) and shows a column per
// rank. The Llama (tests/issue_llama.py, as tests/testdata/issue_llama.config.json):
// FSDP2 against the real stack and memledger's LibTorch ranks (runtime/fsdp2_units.h),
// 2,419,740 B a rank as tests/fsdp2_witness_test.py measures it; DDP against both,
// 3,503,004 B (tests/ddp_witness_test.py); FSDP2's MixedPrecisionPolicy, which the
// LibTorch ranks do not run, against the real stack alone, 1,904,796 B.
TEST(VerifyCliTest, WitnessOnRanksIsAColumnPerRank) {
  const std::string run =
      "--model=tests/testdata/issue_llama.config.json --batch=2 --seq=32 --dp=2 "
      "--variants=none --optimizer_impl=for_loop --skip_timing --witness=transformers "
      "--witness_python=external/reference_stack/python";
  for (const auto& [flags, peak, measured] :
       {std::tuple{" --fsdp", int64_t{2419740}, true}, std::tuple{"", int64_t{3503004}, true},
        std::tuple{" --fsdp --mp_param_dtype=bf16 --mp_reduce_dtype=fp32", int64_t{1904796},
                   false}}) {
    CommandResult r = Verify(run + flags, /*merge_stderr=*/false);
    ASSERT_EQ(r.exit_code, 0) << flags << r.output;
    rapidjson::Document doc;
    doc.Parse(r.output.c_str());
    ASSERT_FALSE(doc.HasParseError()) << r.output;
    EXPECT_TRUE(doc["passed"].GetBool()) << r.output;
    EXPECT_EQ(doc["ranks_measured"].GetBool(), measured) << flags;
    bool found = false;
    for (const rapidjson::Value& row : doc["witness"]["buckets"].GetArray()) {
      if (std::string(row["bucket"].GetString()) != "peak_bytes.none") continue;
      found = true;
      EXPECT_EQ(row["predicted"].GetInt64(), peak) << flags;
      ASSERT_EQ(row["ranks"].Size(), 2u);
      for (const rapidjson::Value& rank : row["ranks"].GetArray()) {
        EXPECT_EQ(rank.GetInt64(), peak) << flags;
      }
    }
    EXPECT_TRUE(found) << r.output;
  }
  CommandResult zero = Verify(run + " --zero=1");
  EXPECT_EQ(zero.exit_code, 2) << zero.output;
  EXPECT_NE(zero.output.find("--witness=transformers on ranks runs torch's DDP and FSDP2"),
            std::string::npos)
      << zero.output;
}

// OLMo 3 in the runtime (runtime/families/olmo3/): its norms after attention and the
// MLP, q/k norms over the projections, fp32 RoPE tables cast back, and past its window of
// 8 the sliding layers' mask; in bf16 with SGD the layers' forward and backward peak.
TEST(VerifyCliTest, Olmo3IsMeasuredAsPredicted) {
  for (const char* flags :
       {"--model=tiny-olmo3 --batch=2 --seq=8", "--model=tiny-olmo3 --batch=2 --seq=8 --amp=bf16",
        "--model=tests/testdata/olmo3-window8.config.json --batch=2 --seq=16 --dtype=bf16 "
        "--optimizer=sgd"}) {
    CommandResult r = Verify(std::string(flags) + " --skip_timing --format=table");
    EXPECT_EQ(r.exit_code, 0) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find("OK: every bucket measured == predicted"), std::string::npos)
        << flags << "\n" << r.output;
  }
}

// --freeze: the runtime freezes the parameters the estimator's graphs do and runs
// enable_input_require_grads' hook under checkpointing, so each variant measures what
// it predicts (against the real stack: real_stack_test's freeze cases).
TEST(VerifyCliTest, FrozenEmbeddingsAndHeadAreMeasuredAsPredicted) {
  for (const char* flags :
       {"--model=tiny-llama --freeze=embeddings,lm_head", "--model=tiny-gpt2 --freeze=embeddings",
        "--model=tiny-gemma3 --freeze=lm_head --dtype=bf16"}) {
    CommandResult r = Verify(std::string(flags) +
                             " --batch=2 --seq=8 --variants=none,full,selective --skip_timing "
                             "--format=table");
    EXPECT_EQ(r.exit_code, 0) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find("OK: every bucket measured == predicted"), std::string::npos)
        << flags << "\n" << r.output;
  }
}

TEST(VerifyCliTest, MegatronGptRunsWithItsDropoutAndFusedSoftmax) {
  // megatron-gpt's dropouts (each keeps a bool mask) and fused causal softmax (keeps its
  // output, no mask tensor), measured in one process against the Korthikanti-style walk.
  CommandResult r = Verify(
      "--model=megatron-gpt --layers=2 --width=64 --heads=4 --batch=1 --seq=16 --vocab=128 "
      "--attention=math --skip_timing",
      /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  rapidjson::Document doc;
  doc.Parse(r.output.c_str());
  ASSERT_FALSE(doc.HasParseError()) << r.output;
  EXPECT_TRUE(doc["passed"].GetBool());
  for (const char* variant : {"none", "full", "every_2", "selective"}) {
    EXPECT_EQ(doc["ratio"]["saved_bytes"][variant].GetDouble(), 1.0) << variant;
  }
  // Batch 4 x seq 64: the step peaks in the backward, after the dropouts' and the fused
  // softmax's backwards (one new gradient each; the softmax's in place), counted as
  // predicted.
  r = Verify(
      "--model=megatron-gpt --layers=2 --width=64 --heads=4 --batch=4 --seq=64 --vocab=128 "
      "--attention=math --skip_timing",
      /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  doc.Parse(r.output.c_str());
  ASSERT_FALSE(doc.HasParseError()) << r.output;
  for (const char* variant : {"none", "full", "every_2", "selective"}) {
    EXPECT_EQ(doc["ratio"]["peak_bytes"][variant].GetDouble(), 1.0) << variant;
    EXPECT_STREQ(doc["peak"][variant]["phase"].GetString(), "backward") << variant;
  }
}

TEST(VerifyCliTest, PassingRunPrintsStudySchema) {
  CommandResult r = Verify(kSmall, /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  rapidjson::Document doc;
  doc.Parse(r.output.c_str());
  ASSERT_FALSE(doc.HasParseError()) << r.output;
  for (const char* key : {"config", "n_params", "param_bytes", "grad_bytes",
                          "adamw_state_bytes", "saved_bytes", "saved_ratio_vs_none", "time_s",
                          "max_grad_diff", "predicted_saved_bytes_none",
                          "measured_over_predicted", "predicted", "ratio"}) {
    EXPECT_TRUE(doc.HasMember(key)) << key;
  }
  EXPECT_TRUE(doc["time_s"]["none"].IsNull());  // --skip_timing
  EXPECT_TRUE(doc["passed"].GetBool());
  // Measured none for L=2, d=32, H=2, 16 tokens: 4 x 16 x (2 x (16*32 + 4 + 2) + 32)
  // = 64 x 1068 = 68352, and the ratio to the prediction is exactly 1.
  EXPECT_EQ(doc["saved_bytes"]["none"].GetInt64(), 68352);
  EXPECT_EQ(doc["predicted"]["saved_bytes"]["none"].GetInt64(), 68352);
  EXPECT_EQ(doc["ratio"]["saved_bytes"]["selective"].GetDouble(), 1.0);
  EXPECT_EQ(doc["ratio"]["adamw_state_bytes"].GetDouble(), 1.0);
}

TEST(VerifyCliTest, TableShowsRatiosAndVerdict) {
  CommandResult r = Verify(std::string(kSmall) + " --format=table --attention=math");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("saved_bytes.every_2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("1.0000"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("OK: every bucket"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("MISMATCH"), std::string::npos) << r.output;
}

TEST(VerifyCliTest, JsonOutIsWrittenWhole) {
  const std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/verify.json";
  CommandResult r = Verify(std::string(kSmall) + " --json_out=" + path, /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream file(path);
  std::stringstream contents;
  contents << file.rdbuf();
  EXPECT_EQ(contents.str(), r.output);
}

// An output that is another output or the config.json --model reads is refused before
// the measurement (the config was replaced by the report).
TEST(VerifyCliTest, OutputsAreDistinctFromEachOtherAndFromTheInputs) {
  const std::string dir = std::getenv("TEST_TMPDIR");
  const std::string config = dir + "/verify_config.json";
  {
    std::ifstream source("tests/testdata/olmo3-window8.config.json");
    std::ofstream copy(config);
    copy << source.rdbuf();
  }
  std::stringstream before;
  before << std::ifstream(config).rdbuf();
  for (const auto& [args, message] : std::initializer_list<std::pair<std::string, std::string>>{
           {"--model=" + config + " --json_out=" + dir + "/./verify_config.json",
            "--json_out=" + dir + "/./verify_config.json: is the same file as --model=" + config +
                ", which the run reads"},
           {std::string(kSmall) + " --json_out=" + dir + "/v.json --timeline_svg=" + dir +
                "/v.json",
            "--timeline_svg=" + dir + "/v.json: is the same file as --json_out=" + dir +
                "/v.json"}}) {
    CommandResult r = Verify(args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << args << ": " << r.output;
    EXPECT_EQ(r.output.find('\n'), r.output.size() - 1) << args << ": " << r.output;
  }
  std::stringstream after;
  after << std::ifstream(config).rdbuf();
  EXPECT_EQ(after.str(), before.str());
  EXPECT_FALSE(std::ifstream(dir + "/v.json").good());
}

TEST(VerifyCliTest, BadInputExitsTwo) {
  for (const auto& [args, message] : std::initializer_list<std::pair<const char*, const char*>>{
           {"--width=30 --heads=4", "--width 30 is not divisible by --heads 4"},
           {"--layers=0", "--layers"},
           {"--every=0", "--every"},
           {"--variants=sometimes", "--variants"},
           {"--max_memory_gib=-1", "--max_memory_gib"},
           // A NaN compared false with every bound and turned the guard off.
           {"--max_memory_gib=nan",
            "--max_memory_gib must be 0 (half the available memory) or a positive number of "
            "GiB below 2^33, got nan"},
           {"--micro_batches=4", "--micro_batches 4 without --dp or --pp"},
           {"--grad_tolerance=-1", "--grad_tolerance"},
           // An infinite tolerance passed every gradient, a NaN one too.
           {"--grad_tolerance=inf", "--grad_tolerance must be a finite number >= 0, got inf"},
           {"--model=tiny-llama --dp=2 --grad_tolerance=inf",
            "--grad_tolerance must be a finite number >= 0, got inf"},
           {"--grad_tolerance=-inf", "--grad_tolerance must be a finite number >= 0, got -inf"},
           // The runtime measures the CPU: a CUDA step was measured there and reported
           // as a MISMATCH (exit 1). Refused on every machine, with or without a GPU.
           {"--model=tiny-llama --dtype=bf16 --device=cuda",
            "--device=cuda: verify measures the step on the CPU only"},
           {"--model=tiny-llama --dtype=bf16 --device=cuda --dp=2",
            "--device=cuda: verify measures the step on the CPU only"},
           // The default config needs about 0.3 GiB: 1 MiB is refused before any
           // allocation, naming the predicted size.
           {"--max_memory_gib=0.001", "predicted to need"}}) {
    CommandResult r = Verify(args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << args << ": " << r.output;
    EXPECT_EQ(r.output.find("MISMATCH"), std::string::npos) << args << ": " << r.output;
  }
  // What the runtime cannot run exits 3 with the reason.
  CommandResult core = Verify(
      "--model=megatron-gpt --layers=2 --width=64 --heads=4 --batch=1 --seq=16 "
      "--attention=math --variants=none,core_attention");
  EXPECT_EQ(core.exit_code, 3) << core.output;
  EXPECT_NE(core.output.find("no core_attention recompute yet"), std::string::npos)
      << core.output;
  // On ranks, the memory guard counts every rank process: refused before any starts.
  CommandResult ranks = Verify("--model=tiny-llama --dp=2 --max_memory_gib=0.001");
  EXPECT_EQ(ranks.exit_code, 2) << ranks.output;
  EXPECT_NE(ranks.output.find("predicted to need"), std::string::npos) << ranks.output;
}

}  // namespace
