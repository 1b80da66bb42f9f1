// predict with frozen parameters, peft's LoRA and activation offloading as a user runs
// it: the refusals, one line each naming the flag, and what the table and the JSON say
// of what trains (the numbers themselves are checked against the real stack by
// real_stack_test and fake_cuda_step_test, and by hand in predict_test).
#include <gtest/gtest.h>

#include <initializer_list>
#include <string>
#include <utility>

#include "rapidjson/document.h"
#include "tests/json_output.h"
#include "tests/subprocess.h"

namespace {

using memledger::testing::CommandResult;
using memledger::testing::JsonOutput;

CommandResult Predict(const std::string& args) {
  return memledger::testing::RunCommand("estimator/predict " + args);
}

TEST(FineTuningCliTest, BadInputExitsTwoNamingTheFlag) {
  for (const auto& [args, flag] : std::initializer_list<std::pair<const char*, const char*>>{
           {"--model=tiny-llama --freeze=layers:0-1",
            "--freeze lists embeddings and lm_head (comma-separated) or none, got "
            "'layers:0-1': frozen decoder layers are not modelled yet"},
           {"--freeze=embeddings", "--freeze embeddings needs a transformers model"},
           {"--model=tiny-llama --freeze=lm_head --dp=2 --zero=1",
            "--freeze is modelled on one process, or on --dp ranks under DDP: not with --pp, "
            "--micro_batches above 1, --zero or --fsdp yet"},
           {"--model=tiny-llama --lora_rank=8 --dp=2 --fsdp", "--lora_rank is modelled on one "
            "process, or on --dp ranks under DDP"},
           {"--model=tiny-llama --lora_rank=-1", "--lora_rank must be from 0 to 65536, got -1"},
           {"--model=tiny-llama --lora_dropout=0.1",
            "--lora_alpha, --lora_dropout, --lora_targets and --use_dora describe LoRA "
            "adapters: they need --lora_rank >= 1"},
           {"--model=tiny-llama --lora_rank=8 --lora_dropout=1",
            "--lora_dropout must be in [0, 1), got 1"},
           {"--model=tiny-llama --lora_rank=8 --lora_targets=qkv",
            "--lora_targets qkv: no linear layer of the model has that name (peft: target "
            "modules not found in the base model); the layers' are q_proj, k_proj, v_proj, "
            "o_proj, gate_proj, up_proj and down_proj, or all-linear"},
           {"--model=tiny-gpt2 --lora_rank=8 --lora_targets=q_proj",
            "the layers' are c_attn, c_proj (attn.c_proj and mlp.c_proj) and c_fc, or "
            "all-linear"},
           {"--model=megatron-gpt --lora_rank=8", "not the gpt2 family's Megatron model"},
           {"--model=tiny-olmo3 --lora_rank=8",
            "--lora_targets: peft 0.21.2 has no default target modules for the olmo3 family: "
            "name them, or all-linear"},
           {"--model=tiny-qwen3-moe --lora_rank=8 --lora_targets=all-linear",
            "--lora_targets all-linear on a mixture of experts"},
           {"--model=tiny-llama --lora_rank=8 --micro_batches=2",
            "--lora_rank is modelled on one process, or on --dp ranks under DDP"},
           {"--model=tiny-llama --offload_activations=gpu --device=cuda",
            "--offload_activations must be none or cpu, got 'gpu'"},
           {"--model=tiny-llama --offload_activations=cpu",
            "--offload_activations=cpu copies what autograd saves from a GPU to host memory: "
            "it needs --device=cuda"},
           {"--model=tiny-llama --offload_activations=cpu --device=cuda --dp=2",
            "--offload_activations is modelled on one process and one micro-batch"},
           {"--model=tiny-llama --offload_activations=cpu --device=cuda --tp=2",
            "--offload_activations is modelled on one process: not with --tp"},
           {"--model=tiny-llama --lora_rank=8 --dtype=bf16 --master_weights",
            "--master_weights with --lora_rank: peft's adapters, all that trains, are fp32"},
           {"--model=tiny-llama --use_dora",
            "--lora_alpha, --lora_dropout, --lora_targets and --use_dora describe LoRA "
            "adapters: they need --lora_rank >= 1"},
           {"--model=tiny-gpt2 --lora_rank=8 --use_dora --lora_dropout=0.1",
            "--use_dora with --lora_dropout on the gpt2 family's Conv1D layers is not "
            "modelled yet"},
       }) {
    CommandResult r = Predict(args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.output;
    EXPECT_NE(r.output.find(flag), std::string::npos) << args << ": " << r.output;
    EXPECT_EQ(r.output.find('\n'), r.output.size() - 1) << args << ": " << r.output;
  }
}

// tiny-llama with peft's default LoRA, r 8 on q_proj (32 -> 32) and v_proj (32 -> 16):
// (8 x 32 + 32 x 8) + (8 x 32 + 16 x 8) = 896 parameters a layer, 1,792 in its 2 layers.
TEST(FineTuningCliTest, JsonAndTableSayWhatTrains) {
  rapidjson::Document doc;
  ASSERT_TRUE(JsonOutput(Predict("--model=tiny-llama --variants=none --lora_rank=8"), &doc));
  EXPECT_EQ(doc["n_trainable_params"].GetInt64(), 1792);
  EXPECT_EQ(doc["grad_bytes"].GetInt64(), 1792 * 4);
  EXPECT_EQ(doc["lora"]["rank"].GetInt64(), 8);
  EXPECT_STREQ(doc["lora"]["targets"].GetString(), "q_proj,v_proj");
  EXPECT_EQ(doc["frozen_param_bytes"].GetInt64(),
            doc["param_bytes"].GetInt64() - 1792 * 4);
  // GPT-2's default target is its Conv1D c_attn (32 -> 96): 8 x 32 + 96 x 8 = 1,024 a
  // layer, 2,048 in tiny-gpt2's 2 layers.
  rapidjson::Document gpt2_doc;
  ASSERT_TRUE(JsonOutput(Predict("--model=tiny-gpt2 --variants=none --lora_rank=8"), &gpt2_doc));
  EXPECT_EQ(gpt2_doc["n_trainable_params"].GetInt64(), 2048);
  EXPECT_STREQ(gpt2_doc["lora"]["targets"].GetString(), "c_attn");
  CommandResult table =
      Predict("--model=tiny-llama --variants=none --freeze=embeddings,lm_head --format=table");
  ASSERT_EQ(table.exit_code, 0) << table.output;
  EXPECT_NE(table.output.find("frozen: embeddings,lm_head"), std::string::npos) << table.output;
  // Embedding and head: 2 x 96 x 32 fp32 = 24,576 B.
  EXPECT_NE(table.output.find("frozen_param_bytes"), std::string::npos) << table.output;
  EXPECT_NE(table.output.find("24576"), std::string::npos) << table.output;
  // DoRA adds a magnitude vector per target, one element per output: 32 (q_proj) + 16
  // (v_proj) a layer, 1,792 + 2 x 48 = 1,888 in all, each fp32.
  rapidjson::Document dora_doc;
  ASSERT_TRUE(JsonOutput(Predict("--model=tiny-llama --variants=none --lora_rank=8 --use_dora"),
                         &dora_doc));
  EXPECT_EQ(dora_doc["n_trainable_params"].GetInt64(), 1888);
  EXPECT_EQ(dora_doc["grad_bytes"].GetInt64(), 1888 * 4);
  EXPECT_TRUE(dora_doc["lora"]["use_dora"].GetBool());
  EXPECT_FALSE(doc["lora"]["use_dora"].GetBool());
  CommandResult dora_table =
      Predict("--model=tiny-llama --variants=none --lora_rank=8 --use_dora --format=table");
  ASSERT_EQ(dora_table.exit_code, 0) << dora_table.output;
  EXPECT_NE(dora_table.output.find("DoRA r=8 on q_proj,v_proj"), std::string::npos)
      << dora_table.output;
  CommandResult help = Predict("--help");
  ASSERT_EQ(help.exit_code, 0) << help.output;
  EXPECT_NE(help.output.find("\nfine-tuning:\n  --freeze"), std::string::npos) << help.output;
  EXPECT_NE(help.output.find("  --use_dora"), std::string::npos) << help.output;
}

}  // namespace
