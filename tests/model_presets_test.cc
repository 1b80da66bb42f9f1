// Built-in models and the config.json reader: parameter counts equal the published
// checkpoints' (hand arithmetic in the comments), and every kind of bad config.json is
// one InvalidArgument line naming the file and the key.
#include "estimator/request/model_presets.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "estimator/graph/family.h"
#include "estimator/predict/predict.h"
#include "tests/status_matchers.h"

namespace memledger {
namespace {

int64_t ParamsOf(const ModelConfig& config) {
  absl::StatusOr<Prediction> p = Predict(config, {});
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? p->n_params : -1;
}

int64_t PresetParams(const char* name) {
  absl::StatusOr<ModelConfig> config = ModelFromPreset(name);
  EXPECT_TRUE(config.ok()) << config.status();
  return config.ok() ? ParamsOf(*config) : -1;
}

TEST(ModelPresetsTest, ParameterCountsEqualThePublishedCheckpoints) {
  // gpt2: wte 50257 x 768 = 38,597,376; wpe 1024 x 768 = 786,432; per layer ln_1 1,536
  // + c_attn 768 x 2304 + 2304 = 1,771,776 + c_proj 768 x 768 + 768 = 590,592 + ln_2
  // 1,536 + c_fc 768 x 3072 + 3072 = 2,362,368 + c_proj 3072 x 768 + 768 = 2,360,064
  // = 7,087,872, x 12 = 85,054,464; ln_f 1,536; the head is tied: 124,439,808.
  EXPECT_EQ(PresetParams("gpt2"), 124439808);
  // llama-2-7b: embed and head 2 x 32000 x 4096 = 262,144,000; per layer q, k, v, o
  // 4 x 4096^2 = 67,108,864 + MLP 3 x 4096 x 11008 = 135,266,304 + norms 8,192 =
  // 202,383,360, x 32 = 6,476,267,520; final norm 4,096: 6,738,415,616.
  EXPECT_EQ(PresetParams("llama-2-7b"), 6738415616);
  // llama-3-8b: embed and head 2 x 128256 x 4096 = 1,050,673,152; per layer q and o
  // 2 x 4096^2 = 33,554,432 + k and v 2 x 4096 x 1024 = 8,388,608 + MLP 3 x 4096 x
  // 14336 = 176,160,768 + norms 8,192 = 218,112,000, x 32 = 6,979,584,000; final norm
  // 4,096: 8,030,261,248.
  EXPECT_EQ(PresetParams("llama-3-8b"), 8030261248);
  // mistral-7b: the same layers with vocab 32000: 2 x 131,072,000 + 6,979,584,000 +
  // 4,096 = 7,241,732,096.
  EXPECT_EQ(PresetParams("mistral-7b"), 7241732096);
  // qwen2.5-7b: embed and head 2 x 152064 x 3584 = 1,089,994,752; per layer q 3584^2 +
  // 3584 = 12,848,640 + k and v 2 x (3584 x 512 + 512) = 3,671,040 + o 12,845,056 + MLP
  // 3 x 3584 x 18944 = 203,685,888 + norms 7,168 = 233,057,792, x 28 = 6,525,618,176;
  // final norm 3,584: 7,615,616,512.
  EXPECT_EQ(PresetParams("qwen2.5-7b"), 7615616512);
  // qwen3-8b: embed and head 2 x 151936 x 4096 = 1,244,659,712; per layer q and o
  // 2 x 4096 x (32 x 128) = 33,554,432 + k and v 2 x 4096 x (8 x 128) = 8,388,608 +
  // q_norm and k_norm 2 x 128 = 256 + MLP 3 x 4096 x 12288 = 150,994,944 + norms 8,192 =
  // 192,946,432, x 36 = 6,946,071,552; final norm 4,096: 8,190,735,360 (Qwen3-8B's
  // model card: 8.2B).
  EXPECT_EQ(PresetParams("qwen3-8b"), 8190735360);
  // gemma-3-27b (its text model, tied head): embed 262,208 x 5,376 = 1,409,630,208; per
  // layer q and o 2 x 5,376 x (32 x 128) = 44,040,192 + k and v 2 x 5,376 x (16 x 128) =
  // 22,020,096 + q_norm and k_norm 2 x 128 = 256 + MLP 3 x 5,376 x 21,504 = 346,816,512
  // + four norms 4 x 5,376 = 21,504: 412,898,560, x 62 = 25,599,710,720; final norm
  // 5,376: 27,009,346,304 (Gemma 3 27B: 27B with its 0.4B vision tower aside).
  EXPECT_EQ(PresetParams("gemma-3-27b"), 27009346304);
  // tiny-gemma3: embed 96 x 32 = 3,072; per layer q, o 2 x 32 x 64 + k, v 2 x 32 x 32 +
  // norms 2 x 16 + MLP 3 x 32 x 64 + 4 x 32 = 12,448, x 6 = 74,688; final norm 32: 77,792.
  EXPECT_EQ(PresetParams("tiny-gemma3"), 77792);
  // olmo-3-7b: embed and head 2 x 100278 x 4096 = 821,477,376; per layer q, k, v, o
  // 4 x 4096^2 = 67,108,864 + q_norm and k_norm over the whole projections 2 x 4096 =
  // 8,192 + MLP 3 x 4096 x 11008 = 135,266,304 + two norms 8,192 = 202,391,552, x 32 =
  // 6,476,529,664; final norm 4,096: 7,298,011,136.
  EXPECT_EQ(PresetParams("olmo-3-7b"), 7298011136);
  // olmo-3-32b: embed and head 2 x 100278 x 5120 = 1,026,846,720; per layer q and o 2 x
  // 5120^2 = 52,428,800 + k and v 2 x 5120 x (8 x 128) = 10,485,760 + q_norm 5,120 and
  // k_norm 1,024 + MLP 3 x 5120 x 27648 = 424,673,280 + two norms 10,240 = 487,604,224,
  // x 64 = 31,206,670,336; final norm 5,120: 32,233,522,176.
  EXPECT_EQ(PresetParams("olmo-3-32b"), 32233522176);
  // tiny-olmo3: embed and head 2 x 128 x 64 = 16,384; per layer q, o 2 x 64 x 64 + k, v
  // 2 x 64 x 32 + q_norm 64 + k_norm 32 + MLP 3 x 64 x 128 + two norms 128 = 37,088, x 4 =
  // 148,352; final norm 64: 164,800.
  EXPECT_EQ(PresetParams("tiny-olmo3"), 164800);
  // llama-3-70b: embed and head 2 x 128256 x 8192 = 2,101,346,304; per layer q and o
  // 2 x 8192^2 = 134,217,728 + k and v 2 x 8192 x 1024 = 16,777,216 + MLP 3 x 8192 x
  // 28672 = 704,643,072 + norms 16,384 = 855,654,400, x 80 = 68,452,352,000; final
  // norm 8,192: 70,553,706,496.
  EXPECT_EQ(PresetParams("llama-3-70b"), 70553706496);
  // tiny-llama (d 32, 4 heads, 2 kv heads of 8, F 64, V 96, 2 layers): embed and head
  // 2 x 3,072; per layer q and o 2 x 1,024 + k and v 2 x 512 + MLP 3 x 2,048 + norms 64
  // = 9,280, x 2; final norm 32: 24,736.
  EXPECT_EQ(PresetParams("tiny-llama"), 24736);
  // tiny-gpt2 (d 32, F 128, V 96, 128 positions, 2 layers): wte 3,072 + wpe 4,096; per
  // layer 64 + 3,168 + 1,056 + 64 + 4,224 + 4,128 = 12,704, x 2; ln_f 64: 32,640.
  EXPECT_EQ(PresetParams("tiny-gpt2"), 32640);
  // tiny-qwen3 (d 32, 4 heads and 2 kv heads of 16, F 64, V 96, 2 layers, untied):
  // embed and head 2 x 3,072; per layer q 32 x 64 + k and v 2 x 32 x 32 + o 64 x 32 =
  // 6,144 + q_norm and k_norm 2 x 16 + MLP 3 x 2,048 + norms 64 = 12,384, x 2; final
  // norm 32: 30,944.
  EXPECT_EQ(PresetParams("tiny-qwen3"), 30944);
  // qwen3-30b-a3b: embed and head 2 x 151,936 x 2,048 = 622,329,856; per layer q and o
  // 2 x 2,048 x (32 x 128) = 16,777,216 + k and v 2 x 2,048 x (4 x 128) = 2,097,152 +
  // q_norm and k_norm 256 + experts' gate_up 128 x 1,536 x 2,048 = 402,653,184 and
  // down 128 x 2,048 x 768 = 201,326,592 + router 128 x 2,048 = 262,144 + norms 4,096 =
  // 623,120,640, x 48 = 29,909,790,720; final norm 2,048: 30,532,122,624 (Qwen3-30B-A3B's
  // model card: 30.5B).
  EXPECT_EQ(PresetParams("qwen3-30b-a3b"), 30532122624);
  // mixtral-8x7b: embed and head 2 x 32,000 x 4,096 = 262,144,000; per layer q and o
  // 2 x 4,096^2 = 33,554,432 + k and v 2 x 4,096 x 1,024 = 8,388,608 + experts' gate_up
  // 8 x 28,672 x 4,096 = 939,524,096 and down 8 x 4,096 x 14,336 = 469,762,048 + router
  // 8 x 4,096 = 32,768 + norms 8,192 = 1,451,270,144, x 32 = 46,440,644,608; final norm
  // 4,096: 46,702,792,704 (Mixtral 8x7B: 46.7B).
  EXPECT_EQ(PresetParams("mixtral-8x7b"), 46702792704);
  // tiny-qwen3-moe: tiny-qwen3's attention (6,176 per layer with its q/k norms), 4
  // experts of width 32: gate_up 4 x 64 x 32 = 8,192, down 4 x 32 x 32 = 4,096, router
  // 4 x 32 = 128, norms 64: 18,656 per layer, x 2; embed, head and final norm 6,176:
  // 43,488.
  EXPECT_EQ(PresetParams("tiny-qwen3-moe"), 43488);
}

// An unknown model_type's message names every model_type a registered family reads, so
// a new family's cannot go unlisted.
TEST(ModelPresetsTest, UnknownModelTypeNamesEveryRegisteredOne) {
  const absl::Status bad = ModelFromHfConfigJson(R"({"model_type": "bert"})", "bad.json").status();
  ASSERT_FALSE(bad.ok());
  const std::string message(bad.message());
  EXPECT_EQ(message.rfind("bad.json: \"model_type\" 'bert' is not supported (", 0), 0u)
      << message;
  EXPECT_EQ(message.back(), ')') << message;
  auto names = [&message](const std::string& type) {  // as a word of the list
    for (const char* before : {" ", "("}) {
      for (const char* after : {",", ")"}) {
        if (message.find(before + type + after) != std::string::npos) return true;
      }
    }
    return false;
  };
  for (const FamilyDef* family : Families()) {
    for (const std::string& type : family->model_types) EXPECT_TRUE(names(type)) << type;
  }
}

TEST(ModelPresetsTest, StudyPresetIsTheDefaultConfig) {
  ASSERT_OK_AND_ASSIGN(ModelConfig study, ModelFromPreset("study"));
  EXPECT_EQ(study, ModelConfig());
  EXPECT_EQ(ModelFromPreset("llama-4").status().code(), absl::StatusCode::kNotFound);
}

std::string ReadTestdata(const std::string& name) {
  std::ifstream in("tests/testdata/" + name);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(HfConfigTest, ReadsTheUsualKeysOfEachModelType) {
  // The published config.json files give the presets' models back.
  ASSERT_OK_AND_ASSIGN(ModelConfig llama, ModelFromHfConfigJson(
                                              ReadTestdata("llama-3-8b.config.json"), "l"));
  EXPECT_EQ(llama.family, Family::kLlama);
  EXPECT_EQ(llama.KvHeads(), 8);
  EXPECT_EQ(llama.HeadDim(), 128);
  EXPECT_EQ(ParamsOf(llama), 8030261248);
  ASSERT_OK_AND_ASSIGN(ModelConfig qwen, ModelFromHfConfigJson(
                                             ReadTestdata("qwen2.5-7b.config.json"), "q"));
  EXPECT_TRUE(qwen.qkv_bias);
  EXPECT_EQ(ParamsOf(qwen), 7615616512);
  ASSERT_OK_AND_ASSIGN(ModelConfig qwen3, ModelFromHfConfigJson(
                                              ReadTestdata("qwen3-8b.config.json"), "q3"));
  EXPECT_TRUE(qwen3.qk_norm);
  EXPECT_FALSE(qwen3.qkv_bias);
  EXPECT_EQ(qwen3.HeadDim(), 128);
  EXPECT_EQ(ParamsOf(qwen3), 8190735360);
  ASSERT_OK_AND_ASSIGN(ModelConfig gpt2,
                       ModelFromHfConfigJson(ReadTestdata("gpt2.config.json"), "g"));
  EXPECT_EQ(gpt2.family, Family::kGpt2);
  EXPECT_TRUE(gpt2.tie_embeddings);
  EXPECT_EQ(gpt2.Intermediate(), 3072);  // n_inner absent: 4 x n_embd
  EXPECT_EQ(ParamsOf(gpt2), 124439808);
  // The sparse models' files (transcribed from the Hugging Face model pages).
  ASSERT_OK_AND_ASSIGN(ModelConfig qwen3_moe,
                       ModelFromHfConfigJson(ReadTestdata("qwen3-30b-a3b.config.json"), "m"));
  EXPECT_EQ(qwen3_moe.moe.experts, 128);
  EXPECT_EQ(qwen3_moe.moe.top_k, 8);
  EXPECT_TRUE(qwen3_moe.moe.norm_topk_prob);
  EXPECT_TRUE(qwen3_moe.moe.sparse_layers.empty());  // every layer sparse
  EXPECT_EQ(ParamsOf(qwen3_moe), 30532122624);
  ASSERT_OK_AND_ASSIGN(ModelConfig mixtral,
                       ModelFromHfConfigJson(ReadTestdata("mixtral-8x7b.config.json"), "x"));
  EXPECT_EQ(mixtral.moe.block, MoeBlock::kMixtral);
  EXPECT_EQ(mixtral.moe.intermediate, 14336);
  EXPECT_FALSE(mixtral.qk_norm);
  EXPECT_EQ(ParamsOf(mixtral), 46702792704);
  // A published Gemma 3 config.json is the multimodal Gemma3Config: its text_config
  // (defaults from Gemma3TextConfig: vocabulary 262208, tied embeddings, the 6-layer
  // pattern) is gemma-3-27b's text model, 27,009,346,304 parameters (by hand in
  // ModelPresetsTest; the published 27B adds a 0.4B vision tower, not modelled).
  ASSERT_OK_AND_ASSIGN(ModelConfig gemma,
                       ModelFromHfConfigJson(ReadTestdata("gemma-3-27b.config.json"), "g3"));
  EXPECT_EQ(gemma.family, Family::kGemma3);
  EXPECT_EQ(gemma.layers, 62);
  EXPECT_EQ(gemma.sliding_window, 1024);
  EXPECT_EQ(gemma.LayerAttentionPeriod().size(), 6u);
  EXPECT_EQ(ParamsOf(gemma), 27009346304);
  // OLMo 3 7B's config.json (tests/testdata, as reported for allenai/Olmo-3-1025-7B):
  // the olmo-3-7b preset's 7,298,011,136 parameters (by hand in ModelPresetsTest), its
  // 32 layers 3 sliding : 1 full, window 4096; yarn rope_scaling changes no tensor.
  ASSERT_OK_AND_ASSIGN(ModelConfig olmo,
                       ModelFromHfConfigJson(ReadTestdata("olmo-3-7b.config.json"), "o3"));
  EXPECT_EQ(olmo.family, Family::kOlmo3);
  EXPECT_EQ(olmo.layers, 32);
  EXPECT_EQ(olmo.sliding_window, 4096);
  EXPECT_EQ(olmo.LayerAttentionPeriod().size(), 4u);
  EXPECT_EQ(ParamsOf(olmo), 7298011136);
  // dynamic_rope_update's types recompute inv_freq in the forward: refused.
  EXPECT_STATUS(ModelFromHfConfigJson(
                    R"({"model_type": "olmo3", "rope_scaling": {"rope_type": "dynamic"}})",
                    "o3.json"),
                absl::StatusCode::kInvalidArgument,
                "o3.json: \"rope_scaling.rope_type\" 'dynamic' is not modelled yet");
}

// Qwen3MoeDecoderLayer is sparse iff its index is not in mlp_only_layers and
// (index + 1) % decoder_sparse_step == 0; Qwen3MoeConfig's head_dim defaults to
// hidden_size / heads (not Qwen3's 128), and num_local_experts is num_experts' alias.
TEST(HfConfigTest, Qwen3MoeSparseLayers) {
  const std::string sizes =
      R"("model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 6, "num_attention_heads": 4, "vocab_size": 100,
         "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16)";
  ASSERT_OK_AND_ASSIGN(ModelConfig every, ModelFromHfConfigJson("{" + sizes + "}", "a.json"));
  EXPECT_EQ(every.HeadDim(), 16);
  EXPECT_TRUE(every.moe.sparse_layers.empty());
  EXPECT_FALSE(every.moe.norm_topk_prob);  // Qwen3MoeConfig's default
  ASSERT_OK_AND_ASSIGN(ModelConfig step, ModelFromHfConfigJson(
                                             "{" + sizes + R"(, "decoder_sparse_step": 2})", "a"));
  // Layers 1, 3, 5 sparse: the period (dense, sparse).
  EXPECT_EQ(step.moe.sparse_layers, (std::vector<bool>{false, true}));
  ASSERT_OK_AND_ASSIGN(ModelConfig first, ModelFromHfConfigJson(
                                              "{" + sizes + R"(, "mlp_only_layers": [0]})", "a"));
  EXPECT_EQ(first.moe.sparse_layers,
            (std::vector<bool>{false, true, true, true, true, true}));
  ASSERT_OK_AND_ASSIGN(
      ModelConfig alias,
      ModelFromHfConfigJson(R"({"model_type": "qwen3_moe", "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "vocab_size": 100, "num_local_experts": 6, "num_experts_per_tok": 2})", "a"));
  EXPECT_EQ(alias.moe.experts, 6);
  EXPECT_EQ(ModelFromHfConfigJson("{" + sizes + R"(, "mlp_only_layers": [6]})", "a.json")
                .status()
                .message(),
            "a.json: \"mlp_only_layers\" must list layer indices in [0, 6)");
  EXPECT_EQ(ModelFromHfConfigJson(R"({"model_type": "qwen3_moe", "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "vocab_size": 100, "num_experts": 4, "num_experts_per_tok": 5})", "a.json")
                .status()
                .message(),
            "a.json: \"num_experts_per_tok\" 5 exceeds the 4 experts");
  EXPECT_EQ(ModelFromHfConfigJson("{" + sizes + R"(, "output_router_logits": true})", "a.json")
                .status()
                .message(),
            "a.json: \"output_router_logits\" true (the load-balancing loss) is not "
            "modelled yet");
}

// Qwen3Config's head_dim is 128 when missing, whatever hidden_size / heads is
// (configuration_qwen3.py); its layer types may only be full attention here.
TEST(HfConfigTest, Qwen3HeadDimDefaultAndLayerTypes) {
  const std::string sizes =
      R"("model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100)";
  ASSERT_OK_AND_ASSIGN(ModelConfig c, ModelFromHfConfigJson("{" + sizes + "}", "a.json"));
  EXPECT_EQ(c.HeadDim(), 128);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_TRUE(ModelFromHfConfigJson(
                  "{" + sizes + R"(, "layer_types": ["full_attention", "full_attention"],
                                    "use_sliding_window": false})",
                  "b.json")
                  .ok());
  for (const auto& [extra, message] : std::vector<std::pair<std::string, std::string>>{
           {R"("use_sliding_window": true)",
            "c.json: \"use_sliding_window\" true is not modelled yet (use false)"},
           {R"("layer_types": ["full_attention", "chunked"])",
            "c.json: \"layer_types\" 'chunked' is not a layer type (full_attention, "
            "sliding_attention)"},
           {R"("layer_types": ["full_attention"])",
            "c.json: \"layer_types\" has 1 entries for 2 layers"},
           {R"("layer_types": ["sliding_attention", "full_attention"])",
            "c.json: \"layer_types\" 'sliding_attention' is not modelled yet for this "
            "model_type"},
           {R"("layer_types": "full_attention")",
            "c.json: \"layer_types\" must be a list of strings"},
       }) {
    absl::StatusOr<ModelConfig> bad =
        ModelFromHfConfigJson("{" + sizes + ", " + extra + "}", "c.json");
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << extra;
    EXPECT_EQ(bad.status().message(), message) << extra;
  }
}

TEST(HfConfigTest, MistralAndDefaults) {
  // num_key_value_heads and head_dim absent: heads and hidden / heads.
  ASSERT_OK_AND_ASSIGN(
      ModelConfig c,
      ModelFromHfConfigJson(R"({"model_type": "mistral", "hidden_size": 64,
                                "intermediate_size": 128, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "vocab_size": 100})",
                            "m.json"));
  EXPECT_EQ(c.KvHeads(), 4);
  EXPECT_EQ(c.HeadDim(), 16);
  EXPECT_FALSE(c.tie_embeddings);
  EXPECT_TRUE(c.use_cache);  // LlamaConfig's (MistralConfig's) default
}

// LlamaJson is a valid small llama config.json with `key` set to `value` (raw JSON).
std::string LlamaJson(const std::string& key = "", const std::string& value = "") {
  std::map<std::string, std::string> fields = {
      {"model_type", "\"llama\""},     {"hidden_size", "64"},
      {"intermediate_size", "128"},    {"num_hidden_layers", "2"},
      {"num_attention_heads", "4"},    {"vocab_size", "100"}};
  if (!key.empty()) fields[key] = value;
  std::string json = "{";
  for (const auto& [k, v] : fields) {
    json += (json.size() > 1 ? ", \"" : "\"") + k + "\": " + v;
  }
  return json + "}";
}

TEST(HfConfigTest, EveryBadInputIsOneLineNamingFileAndKey) {
  ASSERT_TRUE(ModelFromHfConfigJson(LlamaJson(), "good.json").ok());  // the base is valid
  struct Case {
    std::string json;
    std::string message;
  };
  for (const Case& c : std::vector<Case>{
           {"{not json", "bad.json: not JSON (Missing a name for object member. at offset 1)"},
           {"[1, 2]", "bad.json: not a JSON object"},
           {"{}", "bad.json: \"model_type\" is missing"},
           {R"({"model_type": 7})", "bad.json: \"model_type\" must be a string"},
           {R"({"model_type": "gemma3"})", "bad.json: \"text_config\" is missing"},
           {R"({"model_type": "gemma3", "text_config": 3})",
            "bad.json: \"text_config\" must be an object"},
           {R"({"model_type": "gemma3", "text_config": {"hidden_size": -1}})",
            "bad.json: \"text_config.hidden_size\" must be >= 1, got -1"},
           {R"({"model_type": "gemma3", "text_config": {"model_type": "llama"}})",
            "bad.json: \"text_config.model_type\" must be gemma3_text, got llama"},
           {R"({"model_type": "llama"})", "bad.json: \"hidden_size\" is missing"},
           {LlamaJson("num_hidden_layers", "\"two\""),
            "bad.json: \"num_hidden_layers\" must be an integer"},
           {LlamaJson("hidden_size", "64.5"), "bad.json: \"hidden_size\" must be an integer"},
           {LlamaJson("vocab_size", "0"), "bad.json: \"vocab_size\" must be >= 1, got 0"},
           {LlamaJson("num_key_value_heads", "3"),
            "bad.json: \"num_attention_heads\" 4 is not divisible by num_key_value_heads 3"},
           {LlamaJson("hidden_size", "66"),
            "bad.json: \"hidden_size\" 66 is not divisible by num_attention_heads 4 and there "
            "is no head_dim"},
           {LlamaJson("head_dim", "15"), "bad.json: \"head_dim\" 15 must be even for RoPE"},
           {LlamaJson("tie_word_embeddings", "\"yes\""),
            "bad.json: \"tie_word_embeddings\" must be true or false"},
           {LlamaJson("hidden_act", "\"gelu\""),
            "bad.json: \"hidden_act\" must be silu, got gelu"},
           {LlamaJson("rms_norm_eps", "-1"), "bad.json: \"rms_norm_eps\" must be a number > 0"},
           // A layer pattern that does not repeat is as long as the model: bounded before
           // it is sized (kMaxLayerPeriod). 10^8 layers alone are composed, not refused.
           {R"({"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 48,
                "num_hidden_layers": 100000000, "num_attention_heads": 4,
                "vocab_size": 128, "num_experts": 4, "num_experts_per_tok": 2,
                "mlp_only_layers": [0]})",
            "bad.json: \"num_hidden_layers\" 100000000: mlp_only_layers makes a layer "
            "pattern of 100000000 layers (it repeats no sooner), more than the 65536 a "
            "step's replay holds"},
           {R"({"model_type": "gemma3_text", "hidden_size": 32, "intermediate_size": 48,
                "num_hidden_layers": 100000000, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 128,
                "sliding_window_pattern": 100000000})",
            "bad.json: \"sliding_window_pattern\" 100000000 makes a layer pattern of "
            "100000000 layers (it repeats no sooner), more than the 65536 a step's replay "
            "holds"},
           {LlamaJson("attention_dropout", "0.1"),
            "bad.json: \"attention_dropout\" > 0 is not modelled yet (use 0.0)"},
           {R"({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 5,
                "n_positions": 32, "vocab_size": 10})",
            "bad.json: \"n_embd\" 64 is not divisible by n_head 5"},
       }) {
    absl::StatusOr<ModelConfig> config = ModelFromHfConfigJson(c.json, "bad.json");
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument) << c.json;
    EXPECT_EQ(config.status().message(), c.message) << c.json;
  }
}

// GPT-2's dropouts: each key its own site's, GPT2Config's 0.1 when missing.
TEST(HfConfigTest, Gpt2DropoutsPerSite) {
  const std::string sizes =
      R"("model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 32,
         "vocab_size": 10)";
  ASSERT_OK_AND_ASSIGN(ModelConfig defaults, ModelFromHfConfigJson("{" + sizes + "}", "a.json"));
  EXPECT_EQ(defaults.dropout, (ModelConfig::Dropouts{.resid = 0.1, .embd = 0.1, .attn = 0.1}));
  ASSERT_OK_AND_ASSIGN(
      ModelConfig none,
      ModelFromHfConfigJson(
          "{" + sizes + R"(, "resid_pdrop": 0, "embd_pdrop": 0.0, "attn_pdrop": 0})", "b.json"));
  EXPECT_FALSE(none.dropout.Any());
  ASSERT_OK_AND_ASSIGN(
      ModelConfig attn,
      ModelFromHfConfigJson(
          "{" + sizes + R"(, "resid_pdrop": 0, "embd_pdrop": 0.2, "attn_pdrop": 0.25})", "c.json"));
  EXPECT_EQ(attn.dropout, (ModelConfig::Dropouts{.resid = 0, .embd = 0.2, .attn = 0.25}));
  absl::StatusOr<ModelConfig> bad =
      ModelFromHfConfigJson("{" + sizes + R"(, "resid_pdrop": 1.5})", "d.json");
  EXPECT_EQ(bad.status().message(), "d.json: \"resid_pdrop\" must be a number in [0, 1)");
}

// Llama's attention_bias and mlp_bias are nn.Linear(bias=True) (modeling_llama.py:158-160,
// 219-229); Qwen3's attention_bias the same on q, k, v and o; Mistral's projections
// have none whatever the key says.
TEST(HfConfigTest, LlamaBiasesAreParameters) {
  // LlamaJson's model: d 64, 4 heads of 16 (kv heads 4), F 128, V 100, 2 layers, untied.
  // Per layer q, k, v, o 4 x 64^2 = 16,384 + MLP 3 x 64 x 128 = 24,576 + norms 128 =
  // 41,088, x 2 = 82,176; embed and head 2 x 100 x 64 = 12,800; final norm 64: 95,040.
  ASSERT_OK_AND_ASSIGN(ModelConfig plain, ModelFromHfConfigJson(LlamaJson(), "plain.json"));
  EXPECT_EQ(ParamsOf(plain), 95040);
  // attention_bias: q, k, v and o 4 x 64 = 256 more per layer, 512 in all: 95,552.
  ASSERT_OK_AND_ASSIGN(ModelConfig attention,
                       ModelFromHfConfigJson(LlamaJson("attention_bias", "true"), "a.json"));
  EXPECT_TRUE(attention.qkv_bias && attention.o_bias && !attention.mlp_bias);
  EXPECT_EQ(ParamsOf(attention), 95552);
  // mlp_bias: gate and up 2 x 128 + down 64 = 320 more per layer, 640 in all: 95,680.
  ASSERT_OK_AND_ASSIGN(ModelConfig mlp,
                       ModelFromHfConfigJson(LlamaJson("mlp_bias", "true"), "m.json"));
  EXPECT_TRUE(mlp.mlp_bias && !mlp.qkv_bias && !mlp.o_bias);
  EXPECT_EQ(ParamsOf(mlp), 95680);
  // Mistral reads neither key (its projections are bias=False): the plain count.
  std::string mistral = LlamaJson("mlp_bias", "true");
  mistral.replace(mistral.find("\"llama\""), 7, "\"mistral\"");
  mistral.insert(mistral.size() - 1, ", \"attention_bias\": true");
  ASSERT_OK_AND_ASSIGN(ModelConfig unbiased, ModelFromHfConfigJson(mistral, "mistral.json"));
  EXPECT_EQ(ParamsOf(unbiased), 95040);
}

// transformers' attribute_map aliases (PreTrainedConfig.__setattr__): an alias sets its
// key, and beside it wins, the class's dataclass field being set first
// (configuration_utils.py:157-165, 500-507); Qwen3MoeConfig's field is the alias itself.
TEST(HfConfigTest, AttributeMapAliasesSetTheirKeys) {
  // GPT-2, d 128 (hidden_size beside n_embd 64), 2 layers, V 128, 32 positions, tied,
  // n_inner 4d = 512: wte 128 x 128 = 16,384 + wpe 32 x 128 = 4,096; per layer ln_1 256
  // + c_attn 128 x 384 + 384 = 49,536 + c_proj 128 x 128 + 128 = 16,512 + ln_2 256 +
  // c_fc 128 x 512 + 512 = 66,048 + c_proj 512 x 128 + 128 = 65,664 = 198,272, x 2 =
  // 396,544; ln_f 256: 417,280 (transformers' GPT2LMHeadModel counts the same).
  for (const char* json :
       {R"({"model_type": "gpt2", "n_embd": 64, "hidden_size": 128, "n_layer": 2,
            "n_head": 4, "n_positions": 32, "vocab_size": 128})",
        R"({"model_type": "gpt2", "hidden_size": 128, "n_embd": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 32, "vocab_size": 128})"}) {
    ASSERT_OK_AND_ASSIGN(ModelConfig gpt2, ModelFromHfConfigJson(json, "gpt2.json"));
    gpt2.seq = 16;  // within the 32 positions
    EXPECT_EQ(gpt2.width, 128) << json;
    EXPECT_EQ(gpt2.max_positions, 32) << json;
    EXPECT_EQ(ParamsOf(gpt2), 417280) << json;
  }
  // Mixtral, num_experts 16 (MixtralConfig's alias of num_local_experts), d 32, 4 heads
  // and 2 kv heads of 8, F 48, V 128, 2 layers, untied: embed and head 2 x 128 x 32 =
  // 8,192; per layer q and o 2 x 1,024 + k and v 2 x 32 x 16 = 3,072 + router 16 x 32 =
  // 512 + experts' gate_up 16 x 96 x 32 = 49,152 and down 16 x 32 x 48 = 24,576 + norms
  // 64 = 77,376, x 2 = 154,752; final norm 32: 162,976.
  const std::string mixtral =
      R"("model_type": "mixtral", "hidden_size": 32, "intermediate_size": 48,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 128, "num_experts_per_tok": 2, "num_experts": 16)";
  for (const std::string& json : {"{" + mixtral + "}",
                                  "{" + mixtral + R"(, "num_local_experts": 8})"}) {
    ASSERT_OK_AND_ASSIGN(ModelConfig sixteen, ModelFromHfConfigJson(json, "mixtral.json"));
    EXPECT_EQ(sixteen.moe.experts, 16) << json;
    EXPECT_EQ(ParamsOf(sixteen), 162976) << json;
  }
  // Qwen3-MoE: num_local_experts, set after the num_experts field, wins.
  ASSERT_OK_AND_ASSIGN(
      ModelConfig qwen3_moe,
      ModelFromHfConfigJson(R"({"model_type": "qwen3_moe", "hidden_size": 32,
          "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
          "vocab_size": 128, "num_experts": 16, "num_local_experts": 8,
          "num_experts_per_tok": 2})", "q.json"));
  EXPECT_EQ(qwen3_moe.moe.experts, 8);
  // An error about the key names the alias the file holds.
  EXPECT_EQ(ModelFromHfConfigJson(R"({"model_type": "gpt2", "n_embd": 64, "hidden_size": "64",
                "n_layer": 2, "n_head": 4, "vocab_size": 128})", "g.json").status().message(),
            "g.json: \"hidden_size\" (an alias of n_embd) must be an integer");
}

// A layer count is not bounded by itself: the layers are held as one period of their
// pattern, so 10^12 layers of a pattern derived from numbers cost what a period does.
TEST(HfConfigTest, DeepModelsKeepTheirPeriod) {
  ASSERT_OK_AND_ASSIGN(ModelConfig llama, ModelFromHfConfigJson(
                                              LlamaJson("num_hidden_layers", "1000000000000"),
                                              "deep.json"));
  EXPECT_EQ(llama.layers, 1000000000000);
  // decoder_sparse_step 3: layers 2, 5, 8, ... are sparse (configuration_qwen3_moe.py).
  ASSERT_OK_AND_ASSIGN(ModelConfig moe, ModelFromHfConfigJson(
      R"({"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 1000000000000, "num_attention_heads": 4, "vocab_size": 128,
          "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 3})",
      "deep.json"));
  EXPECT_EQ(moe.moe.sparse_layers, (std::vector<bool>{false, false, true}));
  // A pattern longer than the model: every layer slides (sliding_window_pattern 10^9
  // over 10^6 layers).
  ASSERT_OK_AND_ASSIGN(ModelConfig gemma, ModelFromHfConfigJson(
      R"({"model_type": "gemma3_text", "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 1000000, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 8, "vocab_size": 128, "sliding_window_pattern": 1000000000})",
      "deep.json"));
  EXPECT_EQ(gemma.layer_attention, std::vector<LayerAttention>{LayerAttention::kSliding});
}

// What transformers cannot build is refused, naming the key: a RoPE type that its
// ROPE_INIT_FUNCTIONS lacks (case-sensitive), a factor that is no number, a partial
// rotation a non-default type cannot apply; strings are whole (a NUL inside is part of
// them) and UTF-8.
TEST(HfConfigTest, NonsenseIsRefusedNamingTheKey) {
  for (const auto& [key, value, message] :
       std::initializer_list<std::tuple<std::string, std::string, std::string>>{
           {"rope_scaling", R"({"rope_type": "su", "factor": 2.0})",
            "bad.json: \"rope_scaling.rope_type\" 'su' is not a RoPE type transformers builds "
            "(default, linear, dynamic, yarn, longrope, llama3, proportional; "
            "modeling_rope_utils.py)"},
           {"rope_parameters", R"({"rope_type": "Dynamic", "factor": 2.0})",
            "bad.json: \"rope_parameters.rope_type\" 'Dynamic' is not a RoPE type "
            "transformers builds (default, linear, dynamic, yarn, longrope, llama3, "
            "proportional; modeling_rope_utils.py)"},
           {"rope_scaling", R"({"type": "banana"})",
            "bad.json: \"rope_scaling.type\" 'banana' is not a RoPE type transformers "
            "builds (default, linear, dynamic, yarn, longrope, llama3, proportional; "
            "modeling_rope_utils.py)"},
           {"rope_parameters", R"({"rope_type": "yarn", "factor": "x"})",
            "bad.json: \"rope_parameters.factor\" must be a number"},
           {"rope_parameters", R"({"rope_type": "linear"})",
            "bad.json: \"rope_parameters.factor\" is missing (rope_type 'linear' needs it)"},
           {"rope_parameters", R"({"rope_type": "yarn", "factor": 4.0,
                                   "partial_rotary_factor": 0.5})",
            "bad.json: \"rope_parameters.partial_rotary_factor\" < 1 with rope_type 'yarn' "
            "shortens inv_freq, which the model's RoPE then cannot apply to its heads (use "
            "1.0)"},
           {"rope_parameters", R"({"rope_type": "default", "partial_rotary_factor": 0})",
            "bad.json: \"rope_parameters.partial_rotary_factor\" must be a number in (0, 1]"},
           {"hidden_act", R"("silu\u0000gelu")",
            std::string("bad.json: \"hidden_act\" must be silu, got silu\0gelu", 50)},
           {"model_type", R"("llama\u0000evil")",
            std::string("bad.json: \"model_type\" 'llama\0evil' is not supported", 52)},
       }) {
    absl::StatusOr<ModelConfig> config = ModelFromHfConfigJson(LlamaJson(key, value), "bad.json");
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument) << key << value;
    EXPECT_EQ(config.status().message().substr(0, message.size()), message) << key << value;
  }
  // The default type never reads partial_rotary_factor (the tables stay (T, d_head)).
  EXPECT_TRUE(ModelFromHfConfigJson(
                  LlamaJson("rope_parameters",
                            R"({"rope_type": "default", "partial_rotary_factor": 0.5})"),
                  "ok.json")
                  .ok());
  EXPECT_TRUE(ModelFromHfConfigJson(LlamaJson("partial_rotary_factor", "0.5"), "ok.json").ok());
  // The older top-level partial_rotary_factor is each rope object's where it has none
  // (modeling_rope_utils.py:786): with yarn, transformers 5.23's forward on this config
  // fails ("The size of tensor a (16) must match the size of tensor b (8)").
  const std::string top_level_partial = LlamaJson(
      "partial_rotary_factor", R"(0.5, "rope_parameters": {"rope_type": "yarn", "factor": 2.0})");
  EXPECT_EQ(ModelFromHfConfigJson(top_level_partial, "bad.json").status().message(),
            "bad.json: \"partial_rotary_factor\" < 1 with rope_type 'yarn' shortens inv_freq, "
            "which the model's RoPE then cannot apply to its heads (use 1.0)");
  EXPECT_EQ(ModelFromHfConfigJson(LlamaJson("partial_rotary_factor", "\"half\""), "bad.json")
                .status()
                .message(),
            "bad.json: \"partial_rotary_factor\" must be a number in (0, 1]");
  // Invalid UTF-8 (a lone continuation byte) in a value and in a key.
  for (const std::string& json : {LlamaJson("hidden_act", "\"si\x80lu\""),
                                  LlamaJson("\xff", "1")}) {
    absl::StatusOr<ModelConfig> config = ModelFromHfConfigJson(json, "bad.json");
    EXPECT_EQ(config.status().message().substr(0, 40),
              "bad.json: not JSON (Invalid encoding in ")
        << config.status();
  }
}

// HfConfigJson writes what ModelFromHfConfigJson reads back: the same model.
TEST(HfConfigTest, WrittenConfigsReadBackAsTheSameModel) {
  ASSERT_OK_AND_ASSIGN(ModelConfig llama, ModelFromPreset("tiny-llama"));
  llama.max_positions = 2048;  // a Llama config.json always names max_position_embeddings
  ModelConfig qwen2 = llama;
  qwen2.qkv_bias = true;
  qwen2.tie_embeddings = true;
  qwen2.kv_heads = 1;
  ASSERT_OK_AND_ASSIGN(ModelConfig qwen3, ModelFromPreset("tiny-qwen3"));
  qwen3.max_positions = 2048;
  ASSERT_OK_AND_ASSIGN(ModelConfig gpt2, ModelFromPreset("tiny-gpt2"));
  ModelConfig biased = llama;  // attention_bias and mlp_bias
  biased.qkv_bias = biased.o_bias = biased.mlp_bias = true;
  ModelConfig qwen3_biased = qwen3;  // Qwen3's attention_bias
  qwen3_biased.qkv_bias = qwen3_biased.o_bias = true;
  for (const ModelConfig& model : {llama, qwen2, qwen3, gpt2, biased, qwen3_biased}) {
    ASSERT_OK_AND_ASSIGN(std::string json, HfConfigJson(model));
    ASSERT_OK_AND_ASSIGN(ModelConfig read, ModelFromHfConfigJson(json, "written.json"));
    read.batch = model.batch;
    read.seq = model.seq;
    EXPECT_EQ(read, model) << json;
  }
  EXPECT_NE(HfConfigJson(gpt2)->find("\"resid_pdrop\": 0.0"), std::string::npos);
  // use_cache round-trips, and is true when a config.json leaves it out (GPT2Config's
  // and LlamaConfig's default).
  ModelConfig no_cache = llama;
  no_cache.use_cache = false;
  ASSERT_OK_AND_ASSIGN(ModelConfig read, ModelFromHfConfigJson(*HfConfigJson(no_cache), "n"));
  EXPECT_FALSE(read.use_cache);
  EXPECT_EQ(HfConfigJson(ModelConfig()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(HfConfigTest, ModelFlagReadsAFileOrNamesBothChoices) {
  ASSERT_OK_AND_ASSIGN(ModelConfig gpt2, ModelFromFlag("tests/testdata/gpt2.config.json"));
  EXPECT_EQ(gpt2.layers, 12);
  absl::StatusOr<ModelConfig> missing = ModelFromFlag("no-such-model");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("neither a built-in model"), std::string::npos)
      << missing.status();
}

}  // namespace
}  // namespace memledger
