// The predict binary as a user runs it: exit codes, one-line errors naming the flag,
// JSON on stdout (its output files are predict_output_files_test's).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "rapidjson/document.h"
#include "tests/subprocess.h"

namespace {

using memledger::testing::CommandResult;

CommandResult Predict(const std::string& args) {
  return memledger::testing::RunCommand("estimator/predict " + args);
}

TEST(PredictCliTest, DefaultJson) {
  CommandResult r = Predict("");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  rapidjson::Document doc;
  doc.Parse(r.output.c_str());
  ASSERT_FALSE(doc.HasParseError()) << r.output;
  EXPECT_EQ(doc["saved_bytes"]["none"].GetInt64(), 51052544);  // see predict_test
  EXPECT_STREQ(doc["torch"].GetString(), "2.15.0");
  EXPECT_STREQ(doc["transformers"].GetString(), "5.23.0");
}

TEST(PredictCliTest, BadInputExitsTwoNamingTheFlag) {
  for (const auto& [args, flag] : std::initializer_list<std::pair<const char*, const char*>>{
           {"--layers=0", "--layers"},
           {"--width=-8", "--width"},
           {"--width=130", "--width 130 is not divisible by --heads 4"},
           {"--batch=0", "--batch"},
           {"--seq=-1", "--seq"},
           {"--heads=0", "--heads"},
           {"--variants=none,fast", "--variants"},
           {"--policy=softmax", "--policy"},
           {"--every=0", "--every"},
           {"--attention=sparse", "--attention"},
           {"--format=xml", "--format"},
           {"--dtype=fp8", "--dtype must be fp32, bf16 or fp16"},
           {"--optimizer=lion", "--optimizer must be adamw, adam or sgd"},
           {"--master_weights", "--master_weights needs --dtype=bf16 or fp16"},
           {"--amp=fp16 --dtype=bf16", "--amp=fp16 needs --dtype=fp32"},
           {"--amp=int8", "--amp must be none, bf16 or fp16"},
           {"--momentum=0.9", "--momentum applies to --optimizer=sgd"},
           {"--tp=0", "--tp must be >= 1, got 0"},
           {"--tp=2", "not the study family"},
           {"--model=tiny-gpt2 --tp=3", "--heads 4 is not divisible by --tp 3"},
           // The families it lists are the registry's decoders (FamilyNames).
           {"--sp", "--sp (sequence parallelism) needs --tp >= 2 and a llama, gpt2, "},
           {"--model=tiny-llama --tp=2 --sp --amp=bf16", "--sp with --amp is not modelled"},
           {"--model=megatron-gpt", "megatron-gpt needs --attention=math"},
           {"--variants=core_attention", "core_attention recomputes math attention's core"},
           {"--device=tpu", "--device must be cpu or cuda"},
           {"--expandable_segments", "--expandable_segments is a CUDA caching allocator setting"},
           {"--cuda_context_mib=-1", "--cuda_context_mib must be a number of MiB from 0"},
           // Given without --device=cuda it was silently ignored.
           {"--cuda_context_mib=100",
            "--cuda_context_mib is the CUDA context's device memory: it needs --device=cuda"},
           {"--sdpa_backend=fast", "--sdpa_backend must be auto, flash, efficient, cudnn or math"},
           {"--sdpa_backend=cudnn", "--sdpa_backend=cudnn: a CUDA kernel: needs --device=cuda"},
           {"--device=cuda --attention=math", "--device=cuda: --attention=math"},
           {"--device=cuda --model=tiny-qwen3-moe --experts_impl=eager",
            "--device=cuda: --experts_impl=eager (the experts' loop over the routing) is not "
            "modelled yet"},
           {"--device=cuda --model=tiny-qwen3-moe --ep=2 --dp=2",
            "--device=cuda: expert parallelism (--ep) is not modelled yet"},
           {"--ep=2 --dp=2", "--ep (expert parallelism) needs a mixture-of-experts model"},
           {"--ep=0", "--ep must be >= 1, got 0"},
           // The search's and the C ABI's line for the same value (search_cli_test,
           // api_test): the search said "--zero 4 must be 0, 1, 2 or 3".
           {"--dp=2 --zero=4", "--zero must be 0, 1, 2 or 3, got 4"},
           // DDP's options would be ignored without DDP.
           {"--gradient_as_bucket_view",
            "--gradient_as_bucket_view is an option of torch's DistributedDataParallel: it "
            "needs --dp > 1 without --zero"},
           {"--dp=2 --zero=1 --ddp_bucket_mb=25", "--ddp_bucket_mb is an option of torch's"},
           {"--dp=2 --ddp_bucket_mb=0", "--ddp_bucket_mb must be a number of MiB above 0"},
           {"--dp=2 --ddp_bucket_mb=nan", "--ddp_bucket_mb must be a number of MiB above 0"},
           {"--dp=2 --ddp_bucket_mb=x", "--ddp_bucket_mb: Illegal value 'x'"},
           {"--model=tiny-llama --fsdp", "--fsdp shards over --dp ranks: it needs --dp > 1"},
           {"--model=tiny-llama --dp=2 --fsdp --zero=3",
            "--fsdp is torch's FSDP2, --zero DeepSpeed's and Megatron's sharding: give one"},
           {"--model=tiny-llama --dp=2 --fsdp --pp=2", "--fsdp with --pp is not modelled yet"},
           {"--dp=2 --fsdp", "--fsdp: fully_shard's units are modelled for the decoder"},
           {"--model=tiny-llama --dp=2 --reshard_after_forward=false",
            "--reshard_after_forward is FSDP2's: it needs --fsdp"},
           {"--model=tiny-llama --dp=2 --fsdp --reshard_after_forward=yes",
            "--reshard_after_forward must be true, false, auto or a number of ranks, got 'yes'"},
           {"--model=tiny-llama --dp=2 --fsdp --reshard_after_forward=0",
            "--reshard_after_forward must be true, false, auto or a number of ranks, got '0'"},
           {"--model=tiny-llama --dp=4 --fsdp --reshard_after_forward=3",
            "--reshard_after_forward as a number must divide the --dp 4 ranks (fully_shard's "
            "post-forward mesh), got 3"},
           {"--model=tiny-llama --dp=4 --reshard_after_forward=2",
            "--reshard_after_forward is FSDP2's: it needs --fsdp"},
           {"--model=tiny-llama --dp=2 --offload=cpu --device=cuda",
            "--offload is FSDP2's CPUOffloadPolicy: it needs --fsdp"},
           {"--model=tiny-llama --dp=2 --fsdp --offload=cpu",
            "--offload=cpu moves FSDP2's shards from a GPU to host memory: it needs "
            "--device=cuda"},
           {"--model=tiny-llama --dp=2 --fsdp --offload=disk --device=cuda",
            "--offload must be none or cpu, got 'disk'"},
           {"--model=tiny-llama --dp=2 --mp_param_dtype=bf16",
            "--mp_param_dtype and --mp_reduce_dtype are FSDP2's MixedPrecisionPolicy: they need "
            "--fsdp"},
           {"--model=tiny-llama --dp=2 --fsdp --mp_param_dtype=int8",
            "--mp_param_dtype must be fp32, bf16 or fp16, got 'int8'"},
           {"--model=tiny-llama --dp=2 --fsdp --mp_param_dtype=bf16",
            "--mp_reduce_dtype: FSDP2 reducing in bf16 or fp16 is not modelled yet"},
           {"--model=tiny-llama --dp=2 --fsdp --mp_param_dtype=bf16 --mp_reduce_dtype=fp32 "
            "--dtype=bf16",
            "FSDP2's mixed precision is modelled over fp32 parameters"},
           {"--model=tiny-llama --dp=2 --fsdp --gradient_as_bucket_view",
            "it needs --dp > 1 without --zero or --fsdp"},
           {"--model=tiny-qwen3-moe --ep=3 --dp=3", "--ep 3 does not divide the 4 experts"},
           {"--model=tiny-qwen3-moe --ep=2 --dp=3", "--ep 2 must divide --dp 3"},
           {"--model=tiny-qwen3-moe --ep=2 --dp=2 --zero=1",
            "--ep with --zero is not modelled yet"},
           {"--batch=1099511627776 --seq=1073741824", "overflow"},
           {"stray", "unexpected argument"},
           // Abseil's parse errors exit 2 like the rest.
           {"--layers=abc", "--layers: Illegal value 'abc' specified for flag 'layers'"},
           {"--nosuchflag=1", "unknown flag --nosuchflag"},
           {"--layers", "--layers needs a value"},
           {"--explain=maybe", "--explain"}}) {
    CommandResult r = Predict(args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.output;
    EXPECT_NE(r.output.find(flag), std::string::npos) << args << ": " << r.output;
    // One line.
    EXPECT_EQ(r.output.find('\n'), r.output.size() - 1) << args << ": " << r.output;
  }
}

// One tensor-parallel rank of Korthikanti et al.'s 22B model (korthikanti_test checks
// the numbers): the table says whose buckets these are, the JSON config carries tp.
TEST(PredictCliTest, TensorParallelRank) {
  const std::string model =
      "--model=megatron-gpt --layers=48 --width=6144 --heads=64 --batch=4 --seq=2048 "
      "--dtype=fp16 --attention=math --tp=8 --sp --variants=none,core_attention";
  CommandResult table = Predict(model + " --format=table");
  ASSERT_EQ(table.exit_code, 0) << table.output;
  EXPECT_NE(table.output.find("one of 8 tensor-parallel ranks with sequence parallelism"),
            std::string::npos)
      << table.output;
  CommandResult json = Predict(model);
  ASSERT_EQ(json.exit_code, 0) << json.output;
  rapidjson::Document doc;
  doc.Parse(json.output.c_str());
  ASSERT_FALSE(doc.HasParseError()) << json.output;
  EXPECT_EQ(doc["config"]["tp"].GetInt64(), 8);
  EXPECT_TRUE(doc["config"]["sp"].GetBool());
  EXPECT_TRUE(doc["config"]["megatron"].GetBool());
  EXPECT_TRUE(doc["saved_bytes"].HasMember("core_attention"));
}

// --dp/--pp: the top-level buckets are the most loaded rank's, `ranks` lists every kind
// of rank. tiny-llama, 8 layers over 2 stages (4 each), dp 2 with ZeRO-1: stage 0 holds
// 4 x 9,280 + 3,072 (embedding) = 40,192 parameters and, in fp32 AdamW, ceil(40,192 /
// 2) x 8 B = 160,768 B of optimizer state; with 4 micro-batches it holds 2 of them.
TEST(PredictCliTest, DistributedRunReportsEveryKindOfRank) {
  const std::string model =
      "--model=tiny-llama --layers=8 --batch=2 --seq=8 --variants=none,full --dp=2 --pp=2 "
      "--zero=1 --micro_batches=4";
  CommandResult json = Predict(model);
  ASSERT_EQ(json.exit_code, 0) << json.output;
  rapidjson::Document doc;
  doc.Parse(json.output.c_str());
  ASSERT_FALSE(doc.HasParseError()) << json.output;
  EXPECT_EQ(doc["parallel"]["world_size"].GetInt64(), 4);
  const auto& ranks = doc["ranks"];
  ASSERT_EQ(ranks.Size(), 2u);
  for (const auto& rank : ranks.GetArray()) {
    EXPECT_EQ(rank["ranks"].GetInt64(), 2);
    EXPECT_EQ(rank["micro_batches_in_flight"]["none"].GetInt64(),
              2 - rank["stage"].GetInt64());
    if (rank["stage"].GetInt64() == 0) {
      EXPECT_EQ(rank["n_params"].GetInt64(), 40192);
      // ZeRO-1 over 2: 2 moments x ceil(40192 / 2) x 4 B, and the shard's one step, 4 B.
      EXPECT_EQ(rank["optimizer_state_bytes"].GetInt64(), 160768 + 4);
      EXPECT_TRUE(rank["embedding"].GetBool());
    }
  }
  // The top level is ranks[0]'s, the most loaded.
  EXPECT_EQ(doc["n_params"].GetInt64(), ranks[0]["n_params"].GetInt64());
  EXPECT_EQ(doc["saved_bytes"]["none"].GetInt64(), ranks[0]["saved_bytes"]["none"].GetInt64());
  EXPECT_GE(ranks[0]["total_bytes"]["none"].GetInt64(),
            ranks[1]["total_bytes"]["none"].GetInt64());
  // The whole step's peak is simulated per stage (1F1B, ZeRO-1): the top level's is the
  // most loaded stage's.
  ASSERT_TRUE(doc.HasMember("peak_bytes")) << json.output;
  EXPECT_EQ(doc["peak_bytes"]["none"].GetInt64(), ranks[0]["peak_bytes"]["none"].GetInt64());
  // Every rank kind says where its peak is and what it holds then, its categories
  // summing to its bytes.
  for (const auto& rank : ranks.GetArray()) {
    const auto& peak = rank["peak"]["none"];
    EXPECT_EQ(peak["bytes"].GetInt64(), rank["peak_bytes"]["none"].GetInt64());
    EXPECT_TRUE(peak.HasMember("phase") && peak.HasMember("op")) << json.output;
    int64_t categories = 0;
    for (const auto& c : peak["by_category"].GetObject()) categories += c.value.GetInt64();
    EXPECT_EQ(categories, peak["bytes"].GetInt64());
  }
  EXPECT_STREQ(doc["peak"]["none"]["op"].GetString(), ranks[0]["peak"]["none"]["op"].GetString());
  CommandResult table = Predict(model + " --format=table");
  ASSERT_EQ(table.exit_code, 0) << table.output;
  EXPECT_NE(table.output.find("4 ranks (dp 2 x tp 1 x pp 2, 1f1b, 4 micro-batches, ZeRO-1)"),
            std::string::npos)
      << table.output;
  EXPECT_NE(table.output.find("per kind of rank"), std::string::npos) << table.output;
  for (const char* bad : {"--pp=3", "--zero=1", "--pp=2 --schedule=zigzag",
                          "--pp=2 --explain", "--dp=2 --sweep=batch:1..2"}) {
    CommandResult r = Predict(std::string("--model=tiny-llama --layers=8 ") + bad);
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.output;
  }
}

TEST(PredictCliTest, TableAndExplain) {
  CommandResult r = Predict("--format=table --explain --layers=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("MiB"), std::string::npos);
  EXPECT_NE(r.output.find("kept by"), std::string::npos);
  // The release whose rules the numbers follow, in the table and in the breakdown.
  EXPECT_NE(r.output.find("torch 2.15.0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("follows PyTorch 2.15.0"), std::string::npos) << r.output;
}

TEST(PredictCliTest, ModelPresetAnswersWithThePublishedParameterCount) {
  CommandResult r = Predict("--model=llama-3-8b --batch=1 --seq=8192 --format=table");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("8030261248"), std::string::npos) << r.output;  // model_presets_test
  EXPECT_NE(r.output.find("saved by segment"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("head share"), std::string::npos) << r.output;
}

TEST(PredictCliTest, SizeFlagsOverrideThePreset) {
  // tiny-llama with 3 layers instead of 2: 24,736 + 9,280 (one layer, see
  // model_presets_test) = 34,016.
  CommandResult r = Predict("--model=tiny-llama --layers=3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  rapidjson::Document doc;
  doc.Parse(r.output.c_str());
  ASSERT_FALSE(doc.HasParseError()) << r.output;
  EXPECT_EQ(doc["n_params"].GetInt64(), 34016);
  EXPECT_STREQ(doc["config"]["family"].GetString(), "llama");
  EXPECT_TRUE(doc["saved_bytes_by_segment"]["none"].HasMember("head_loss"));
}

TEST(PredictCliTest, ConfigJsonErrorsExitTwoNamingFileAndKey) {
  const std::string path = std::string(getenv("TEST_TMPDIR")) + "/config.json";
  std::ofstream(path) << R"({"model_type": "llama", "hidden_size": 64})";
  CommandResult r = Predict("--model=" + path);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(r.output, "error: " + path + ": \"intermediate_size\" is missing\n");
  CommandResult good = Predict("--model=tests/testdata/gpt2.config.json --seq=1024 --batch=1");
  EXPECT_EQ(good.exit_code, 0) << good.output;
  for (const char* args : {"--model=no-such-model", "--model=tiny-llama --kv_heads=3",
                           "--model=tiny-llama --policy=gelu --variants=selective",
                           "--model=tiny-gpt2 --seq=129", "--model=tiny-llama --vocab=0"}) {
    CommandResult bad = Predict(args);
    EXPECT_EQ(bad.exit_code, 2) << args << ": " << bad.output;
    EXPECT_EQ(bad.output.find('\n'), bad.output.size() - 1) << args << ": " << bad.output;
  }
  // Only a regular file of at most 16 MiB is read: a device would be read forever.
  const std::string big = std::string(getenv("TEST_TMPDIR")) + "/big.json";
  std::ofstream(big).close();
  std::filesystem::resize_file(big, (std::uintmax_t{16} << 20) + 1);  // sparse
  for (const auto& [args, message] : std::vector<std::pair<std::string, std::string>>{
           {"--model=/dev/zero", "error: --model: '/dev/zero' is not a regular file"},
           {"--model=tests/testdata", "error: --model: 'tests/testdata' is a directory"},
           {"--model=" + big, "error: --model: '" + big + "' has 16777217 bytes, more than "
                              "the 16777216 a JSON input may have\n"}}) {
    CommandResult bad = Predict(args);
    EXPECT_EQ(bad.exit_code, 2) << args << ": " << bad.output;
    EXPECT_EQ(bad.output.rfind(message, 0), 0u) << args << ": " << bad.output;
    EXPECT_EQ(bad.output.find('\n'), bad.output.size() - 1) << args << ": " << bad.output;
  }
}

// Config keys that change memory were silently ignored; each is modelled or refused now.
TEST(PredictCliTest, ConfigKeysThatChangeMemoryAreModelledOrRefused) {
  const std::string dir = std::string(getenv("TEST_TMPDIR"));
  const std::string llama =
      R"("hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, )"
      R"("num_attention_heads": 4, "vocab_size": 100)";
  const std::string gpt2 =
      R"("model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128, )"
      R"("vocab_size": 100)";
  int n = 0;
  for (const auto& [json, args, message] :
       std::initializer_list<std::tuple<std::string, std::string, std::string>>{
           {R"({"model_type": "mistral", )" + llama + R"(, "sliding_window": -5})", "",
            R"("sliding_window" must be >= 1, got -5)"},
           // A window the sequence reaches masks every layer: refused, not ignored.
           {R"({"model_type": "mistral", )" + llama + R"(, "sliding_window": 16})",
            "--seq=8192", "a sliding window (the config's sliding_window 16) masks every layer"},
           {R"({"model_type": "qwen2", )" + llama + R"(, "use_sliding_window": true})", "",
            R"("use_sliding_window" true is not modelled yet)"},
           {"{" + gpt2 + R"(, "activation_function": "relu"})", "",
            R"("activation_function" must be gelu_new, got relu)"},
           {"{" + gpt2 + R"(, "add_cross_attention": true})", "",
            R"("add_cross_attention" true is not modelled yet (use false))"},
           {"{" + gpt2 + R"(, "reorder_and_upcast_attn": true})", "",
            R"("reorder_and_upcast_attn" true is not modelled yet)"},
           {R"({"model_type": "llama", "hidden_size": 32, )" + llama + "}", "",
            R"("hidden_size" is given more than once)"},
           // It said "parameter bytes overflow int64 at layers=2 width=64", naming no file.
           {R"({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, )"
            R"("n_positions": 128, "vocab_size": 900000000000000000})",
            "", R"("vocab_size" 900000000000000000 x hidden size 64: the embedding's bytes overflow int64)"},
       }) {
    const std::string path = dir + "/keys" + std::to_string(n++) + ".json";
    std::ofstream(path) << json;
    CommandResult r = Predict("--model=" + path + " " + args);
    EXPECT_EQ(r.exit_code, 2) << json << "\n" << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << json << "\n" << r.output;
    EXPECT_EQ(r.output.find('\n'), r.output.size() - 1) << r.output;
  }
  // Mistral's window below the sequence attends as without one.
  const std::string short_window = dir + "/mistral.json";
  std::ofstream(short_window) << R"({"model_type": "mistral", )" + llama +
                                     R"(, "sliding_window": 4096})";
  EXPECT_EQ(Predict("--model=" + short_window + " --seq=64").exit_code, 0);
  // mlp_only_layers names layers: --layers=8 derives the same model as a config of 8
  // layers (it repeated [sparse, sparse, dense], making layer 5 dense too).
  const std::string moe =
      R"({"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, )"
      R"("num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, )"
      R"("num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, )"
      R"("mlp_only_layers": [2], "num_hidden_layers": )";
  std::ofstream(dir + "/moe3.json") << moe << "3}";
  std::ofstream(dir + "/moe8.json") << moe << "8}";
  CommandResult overridden = Predict("--model=" + dir + "/moe3.json --layers=8");
  CommandResult written = Predict("--model=" + dir + "/moe8.json");
  ASSERT_EQ(overridden.exit_code, 0) << overridden.output;
  rapidjson::Document a, b;
  a.Parse(overridden.output.c_str());
  b.Parse(written.output.c_str());
  ASSERT_FALSE(a.HasParseError() || b.HasParseError());
  // 7 sparse layers and 1 dense, as written. (A sparse layer has 256 parameters more than
  // a dense one: its router, 4 x 64; its experts, 4 x 3 x 64 x 32, equal the dense MLP's
  // 3 x 64 x 128. The repeated period gave 6 and 2, 256 fewer.)
  EXPECT_EQ(a["n_params"].GetInt64(), b["n_params"].GetInt64());
  EXPECT_EQ(a["peak_bytes"]["none"].GetInt64(), b["peak_bytes"]["none"].GetInt64());
  // layer_types that name each of 3 layers without repeating have no period for 8: the
  // override is refused (it repeated them); a list that repeats extends.
  CommandResult unrepeated =
      Predict("--model=tests/testdata/gemma3-window8.config.json --layers=8");
  EXPECT_EQ(unrepeated.exit_code, 2) << unrepeated.output;
  EXPECT_NE(unrepeated.output.find("--layers 8: the config's layer_types name each of its 3 "
                                   "layers and do not repeat"),
            std::string::npos)
      << unrepeated.output;
  EXPECT_EQ(Predict("--model=tests/testdata/gemma3-window8.config.json --layers=3").exit_code, 0);
  EXPECT_EQ(Predict("--model=tests/testdata/olmo-3-7b.config.json --layers=8").exit_code, 0);
}

TEST(PredictCliTest, SweepPrintsCsvRows) {
  CommandResult r = Predict("--sweep=batch:1..4 --variants=none,full --budget_gib=1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // A header and 3 batches x 2 variants.
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 7) << r.output;
  EXPECT_EQ(r.output.rfind("model,layers,batch,seq,variant,", 0), 0u) << r.output;
  for (const char* args : {"--sweep=batch:1..4 --format=table", "--format=csv",
                           "--budget_gib=8", "--sweep=batch:1 --budget_gib=-1",
                           "--sweep=batch:1 --budget_gib=1e300"}) {
    CommandResult bad = Predict(args);
    EXPECT_EQ(bad.exit_code, 2) << args << ": " << bad.output;
  }
}

TEST(PredictCliTest, HelpNamesTheReferenceStack) {
  CommandResult r = Predict("--help");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("as torch 2.15.0 and transformers 5.23.0 keep them"),
            std::string::npos)
      << r.output;
}

// --help lists every flag of predict's own sources, grouped; --helpfull (Abseil's
// listing, by file) is the independent list of what exists.
TEST(PredictCliTest, HelpListsEveryFlagByGroup) {
  CommandResult help = Predict("--help");
  ASSERT_EQ(help.exit_code, 0) << help.output;
  for (const char* group : {"\nmodel:\n", "\ninput:\n", "\nprecision:\n", "\noptimizer:\n",
                            "\ncheckpointing:\n", "\nparallelism:\n", "\ndevice:\n",
                            "\noutput:\n"}) {
    EXPECT_NE(help.output.find(group), std::string::npos) << group << help.output;
  }
  EXPECT_LT(help.output.find("\nmodel:\n"), help.output.find("\noutput:\n"));
  // Every flag has its group: none is left under "other".
  EXPECT_EQ(help.output.find("\nother:\n"), std::string::npos) << help.output;
  CommandResult full = Predict("--helpfull");
  std::istringstream lines(full.output);
  std::string line;
  bool ours = false;
  int flags = 0;
  while (std::getline(lines, line)) {
    if (line.find("Flags from ") != std::string::npos) {
      ours = line.find("estimator/") != std::string::npos;
      continue;
    }
    const size_t dashes = line.find("    --");
    if (!ours || dashes != 0) continue;
    const std::string name = line.substr(4, line.find(' ', 6) - 4);  // "--layers"
    const bool listed = help.output.find("\n  " + name + "\n") != std::string::npos ||
                        help.output.find("\n  " + name + " (default") != std::string::npos;
    EXPECT_TRUE(listed) << name << help.output;
    ++flags;
  }
  EXPECT_GE(flags, 30) << full.output;
}

TEST(PredictCliTest, InputsAndCountsAreBoundedBeforeTheWork) {
  const std::string dir = std::string(getenv("TEST_TMPDIR"));
  // 120,000 '[' overflowed the parser's stack (SIGSEGV, nothing on stderr).
  const std::string deep = dir + "/deep.json";
  std::ofstream(deep) << std::string(120000, '[');
  // A routing row near INT64_MAX overflowed its sum (UBSan named llama.cc): tiny-qwen3-moe's
  // 4 experts, 2 a token, see at most batch 1 x seq 4 = 4 tokens each, 8 pairs a row.
  const std::string huge_routing = dir + "/huge_routing.json";
  std::ofstream(huge_routing)
      << R"({"layers": [[9223372036854775807, 9223372036854775807, 0, 0], [4, 4, 0, 0]]})";
  for (const auto& [args, message] :
       std::initializer_list<std::pair<std::string, std::string>>{
           {"--model=" + deep,
            deep + ": nests arrays and objects deeper than 64 levels (at offset 64)"},
           {"--routing=" + deep + " --model=tiny-qwen3-moe --experts_impl=eager",
            "nests arrays and objects deeper than 64 levels"},
           {"--plan=" + deep, "nests arrays and objects deeper than 64 levels"},
           {"--model=tiny-qwen3-moe --experts_impl=eager --batch=1 --seq=4 --routing=" +
                huge_routing,
            "--routing row 0 must give each of the 4 experts 0 to 4 tokens, 8 in all "
            "(batch x seq x 2)"},
           // 9223372036854775807 micro-batches grew to 18.9 GB, then bad_alloc.
           {"--model=tiny-llama --pp=2 --micro_batches=9223372036854775807",
            "--micro_batches must be at most 8192, got 9223372036854775807"},
           {"--model=tiny-llama --layers=16 --pp=16 --micro_batches=8192",
            "--pp 16 x --virtual_stages 1 x --micro_batches 8192 must be at most 65536"},
           {"--model=tiny-llama --layers=5000 --timeline_svg=" + dir + "/t.svg",
            "records every allocation: at most 4096 layers, got --layers 5000"},
           // Steps laid out layer by layer: 10^7 layers on ranks grew to 3.5 GB, then
           // bad_alloc; 10^12 on CUDA, 2.9 GB.
           {"--model=tiny-llama --pp=2 --micro_batches=2 --layers=10000000",
            "--layers 10000000 is more than the 65536 layers a rank's step is simulated with"},
           {"--model=tiny-llama --dtype=bf16 --device=cuda --layers=1000000000000",
            "--layers 1000000000000 is more than the 4096 layers a CUDA step is simulated "
            "with"},
           {"--model=tiny-llama --dtype=bf16 --device=cuda --layers=4096 --pp=2 "
            "--micro_batches=32",
            "--layers 4096 x --micro_batches 32 must be at most 65536 on --device=cuda"},

           // A flagfile could name /dev/zero, a FIFO or itself.
           {"--flagfile=/dev/zero", "--flagfile is not supported"},
           {"--fromenv=layers", "--fromenv is not supported"},
           // A size given as 0 was the model's own (kv heads 32, 4 x width).
           {"--model=llama-3-8b --kv_heads=0", "--kv_heads must be >= 1, got 0"},
           {"--model=llama-3-8b --intermediate=0", "--intermediate must be >= 1, got 0"},
           {"--model=llama-3-8b --head_dim=0", "--head_dim must be >= 1, got 0"},
       }) {
    CommandResult r = Predict(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << args << "\n" << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << args << r.output;
  }
  EXPECT_FALSE(std::ifstream(dir + "/t.svg").good());
}

// The bounds keep a prediction within memory: at each bound the run fits in a 2 GiB
// address space (RLIMIT_AS, ulimit -v), and past it the refusal costs nothing.
TEST(PredictCliTest, AtItsBoundsAPredictionFitsInTwoGibOfAddressSpace) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a sanitizer's shadow memory does not fit under ulimit -v";
#endif
  const std::string dir = std::string(getenv("TEST_TMPDIR"));
  for (const std::string& args :
       {std::string("--model=tiny-llama --layers=8 --pp=8 --micro_batches=8192"),
        "--model=tiny-llama --layers=4096 --variants=none --timeline_svg=" + dir + "/b.svg",
        "--model=tiny-llama --layers=4096 --variants=none --device=cuda --snapshot_out=" +
            dir + "/b.pickle",
        std::string("--model=tiny-llama --pp=2 --micro_batches=9223372036854775807"),
        // Composed from a few layers: a layer_types period, a sliding DynamicCache (one
        // 8-byte scalar per sliding layer, 3 GB at 10^9 one by one), MoE layers.
        std::string("--model=tiny-olmo3 --layers=1000000000000"),
        std::string("--model=tiny-gemma3 --layers=1000000000000"),
        std::string("--model=tiny-qwen3-moe --layers=1000000000000"),
        // At the bounds of the steps laid out layer by layer.
        std::string("--model=tiny-llama --layers=65536 --pp=2 --micro_batches=2"),
        std::string("--model=tiny-llama --layers=4096 --dtype=bf16 --device=cuda")}) {
    CommandResult r = memledger::testing::RunCommand(
        "(ulimit -v 2097152 && estimator/predict " + args + " > /dev/null)");
    const bool past_the_bound = args.find("9223372036854775807") != std::string::npos;
    EXPECT_EQ(r.exit_code, past_the_bound ? 2 : 0) << args << "\n" << r.output;
  }
}

TEST(PredictCliTest, MicroBatchesWithoutRanksAccumulateGradients) {
  // --micro_batches=4 on one process was ignored; it is the rank's step of 4 micro-batches
  // (gradient accumulation), as the planner has it: the same buckets, and a report of the
  // one rank.
  CommandResult one = Predict("--model=tiny-llama --variants=none");
  CommandResult four = Predict("--model=tiny-llama --variants=none --micro_batches=4");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  ASSERT_EQ(four.exit_code, 0) << four.output;
  EXPECT_NE(four.output, one.output);
  EXPECT_NE(four.output.find("\"micro_batches\": 4"), std::string::npos) << four.output;
}

// A newline, a carriage return or an escape sequence in what the user typed split the
// one-line error or reached the terminal; invalid UTF-8 went out raw. Each is written
// out; valid UTF-8 is kept.
TEST(PredictCliTest, ControlCharactersInInputAreEscapedInTheError) {
  const std::string dir = std::string(getenv("TEST_TMPDIR"));
  for (const auto& [args, shown] : std::initializer_list<std::pair<std::string, std::string>>{
           {"--model='bad\nname\x1b[31m\xff caf\xc3\xa9'",
            "--model: 'bad\\nname\\x1b[31m\\xff caf\xc3\xa9' is neither a built-in model"},
           {"--model=tiny-llama --json_out='" + dir + "/x\ry' --timeline_svg='" + dir + "/x\ry'",
            "--timeline_svg=" + dir + "/x\\ry: is the same file as --json_out=" + dir + "/x\\ry"},
           {"--model=tiny-llama --json_out='/nonexistent-dir/\x1b]0;title\x07.json'",
            "--json_out=/nonexistent-dir/\\x1b]0;title\\x07.json: cannot create"},
           {"--variants='none\tfull'", "none\\tfull"},
           {"--layers='1\n2'", "--layers: Illegal value '1\\n2'"},
           {"'stray\nargument'", "unexpected argument(s): stray\\nargument"},
       }) {
    CommandResult r = Predict(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(shown), std::string::npos) << args << "\n" << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << args << r.output;
    EXPECT_EQ(r.output.find('\x1b'), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find('\r'), std::string::npos) << r.output;
  }
}

// The CUDA context's size is taken with --device=cuda: its own bucket,
// 100 MiB = 104,857,600 B.
TEST(PredictCliTest, CudaContextMibSetsTheContextOnCuda) {
  CommandResult r = memledger::testing::RunCommand(
      "estimator/predict --model=tiny-llama --device=cuda --dtype=bf16 --variants=full "
      "--cuda_context_mib=100",
      /*merge_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  rapidjson::Document doc;
  doc.Parse(r.output.c_str());
  ASSERT_FALSE(doc.HasParseError()) << r.output;
  EXPECT_EQ(doc["outside_allocator_bytes"]["cuda_context"].GetInt64(), 104857600);
}

// A request is validated once where predict reads it (ValidRunFromFlags): what predicts
// from it, one process's step or each kind of rank's, takes the proof. Counted by the
// binary itself at exit (MEMLEDGER_COUNT_VALIDATIONS).
TEST(PredictCliTest, ARequestIsValidatedOnce) {
  for (const char* flags :
       {"--model=tiny-llama --variants=none,full", "--model=tiny-llama --dp=2",
        "--model=tiny-llama --layers=4 --pp=2 --micro_batches=2 --dp=2 --zero=1",
        "--model=tiny-qwen3-moe --dp=2 --ep=2",
        "--model=tiny-llama --dp=4 --fsdp --reshard_after_forward=2 --device=cuda"}) {
    const memledger::testing::CommandResult r = memledger::testing::RunCommand(
        std::string("MEMLEDGER_COUNT_VALIDATIONS=1 estimator/predict ") + flags +
            " 2>&1 >/dev/null",
        /*merge_stderr=*/false);
    EXPECT_EQ(r.exit_code, 0) << flags << ": " << r.output;
    EXPECT_EQ(r.output, "validations: config 1, layout 1\n") << flags;
  }
}

}  // namespace
