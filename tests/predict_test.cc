// Predict against hand arithmetic. Per block and per token, flash attention keeps
// (in fp32 elements): x d, ln1 mean+rstd 2, ln1 out d, qkv 3d, attention out d,
// logsumexp H, x after the first residual d, ln2 mean+rstd 2, ln2 out d, fc1 out 4d,
// gelu out 4d = 16d + 4 + H; the loss keeps the last output (d per token).
// Math attention keeps 16d + 4 per token (q, k, v copies replace the qkv storage, the
// merged heads replace out; no logsumexp) plus, per block, the softmax (B*H*T*T fp32)
// and the causal mask (T*T bool).
// A checkpointed block keeps its input (d per token); selective(matmul) adds the four
// Linear outputs: 3d + d + 4d + d = 9d per token.
#include <algorithm>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "estimator/spec/config.h"
#include "estimator/graph/family.h"
#include "estimator/request/model_presets.h"
#include "estimator/request/parallel_spec.h"
#include "estimator/predict/predict.h"
#include "estimator/predict/ranks.h"
#include "tests/status_matchers.h"

namespace memledger {
namespace {

ModelConfig Config(int64_t layers, int64_t width, int64_t heads, int64_t batch, int64_t seq) {
  ModelConfig config =
      StudyModel(/*layers=*/layers, /*width=*/width, /*heads=*/heads,
                 /*batch=*/batch, /*seq=*/seq);
  return config;
}

std::vector<Variant> Variants(const char* names, const char* policy = "matmul") {
  absl::StatusOr<std::vector<Variant>> variants = ParseVariants(names, /*every=*/2, policy);
  EXPECT_TRUE(variants.ok()) << variants.status();
  return *variants;
}

struct Expected {
  int64_t none, full, every_2, every_3, every_1, selective;
};

void ExpectSaved(const ModelConfig& config, AttentionMode attention, const Expected& e) {
  PredictOptions options;
  options.attention = attention;
  options.variants = Variants("none,full,every_2,every_3,every_1,selective");
  ASSERT_OK_AND_ASSIGN(Prediction p, Predict(config, options));
  ASSERT_EQ(p.variants.size(), 6u);
  EXPECT_EQ(p.variants[0].saved_bytes, e.none);
  EXPECT_EQ(p.variants[1].saved_bytes, e.full);
  EXPECT_EQ(p.variants[2].saved_bytes, e.every_2);
  EXPECT_EQ(p.variants[3].saved_bytes, e.every_3);
  EXPECT_EQ(p.variants[4].saved_bytes, e.every_1);
  EXPECT_EQ(p.variants[5].saved_bytes, e.selective);
}

TEST(PredictTest, StudyDefaultConfig) {
  // L=6, d=128, H=4, B=16, T=64: 1024 tokens.
  ModelConfig config;
  ASSERT_OK_AND_ASSIGN(Prediction p, Predict(config, {}));
  // n_params = 6 * (12*128^2 + 13*128) = 6 * (196608 + 1664) = 1189632.
  EXPECT_EQ(p.n_params, 1189632);
  EXPECT_EQ(p.param_bytes, 4758528);        // x 4 B
  EXPECT_EQ(p.grad_bytes, 4758528);
  EXPECT_EQ(p.adamw_state_bytes, 9517056);  // exp_avg + exp_avg_sq
  ASSERT_EQ(p.variants.size(), 4u);
  // none: 4 B x 1024 x (6 x (16*128 + 4 + 4) + 128) = 4096 x 12464 = 51052544.
  EXPECT_EQ(p.variants[0].saved_bytes, 51052544);
  // full: 4 x 1024 x 128 x (6 inputs + 1 loss input) = 3670016.
  EXPECT_EQ(p.variants[1].saved_bytes, 3670016);
  // every_2: blocks 0, 2, 4 keep 128 each, 1, 3, 5 keep 2056 each, loss 128:
  // 4096 x (3 x 128 + 3 x 2056 + 128) = 4096 x 6680 = 27361280.
  EXPECT_EQ(p.variants[2].saved_bytes, 27361280);
  // selective: 4096 x 128 x (6 x 10 + 1) = 31981568, of which the cache is
  // 4096 x 6 x 9 x 128 = 28311552.
  EXPECT_EQ(p.variants[3].saved_bytes, 31981568);
  EXPECT_EQ(p.variants[3].cache_bytes, 28311552);
  // Korthikanti: 6 x 4 x 16 x 1024 x 128 = 50331648; 51052544 / 50331648 = 1.01432...
  EXPECT_EQ(p.korthikanti_saved_bytes_none, 50331648);
  EXPECT_NEAR(p.saved_none_over_korthikanti, 1.014323, 1e-6);
  // 3670016 / 51052544 = 0.071887...
  EXPECT_NEAR(p.variants[1].saved_ratio_vs_none, 0.071887, 1e-6);
}

// A prediction validates its config once, at its entry (ValidateRun); the walks, plans
// and step simulations under it take the validated config and never check it again.
// Counted for the study, a decoder with the KV cache's two graph sets (tiny-llama's
// every_k checkpoints without it), and a sliding-window model.
TEST(PredictTest, ValidatesItsConfigOnce) {
  for (const char* preset : {"study", "tiny-llama", "tiny-gemma3"}) {
    ASSERT_OK_AND_ASSIGN(ModelConfig config, ModelFromPreset(preset));
    const int64_t before = ValidateConfigCalls();
    ASSERT_OK_AND_ASSIGN(Prediction p, Predict(config, {}));
    EXPECT_EQ(ValidateConfigCalls() - before, 1) << preset;
    EXPECT_EQ(p.variants.size(), 4u);
  }
}

// The models a capability needs are listed from the registry, not by hand: the llama
// family's presets with experts (estimator/families/llama/llama.cc, LlamaPresets, in its
// order) and the gpt2 family's Megatron preset.
TEST(PredictTest, ARefusalListsTheRegistrysModels) {
  ASSERT_OK_AND_ASSIGN(ModelConfig dense, ModelFromPreset("tiny-llama"));
  dense.shard.ep = 2;
  EXPECT_STATUS(ValidateConfig(dense), absl::StatusCode::kInvalidArgument,
                "--ep (expert parallelism) needs a mixture-of-experts model (qwen3-30b-a3b, "
                "mixtral-8x7b, tiny-qwen3-moe or a config.json with experts)");
  dense.shard.ep = 1;
  dense.megatron = true;
  EXPECT_STATUS(ValidateConfig(dense), absl::StatusCode::kInvalidArgument,
                "Megatron's ops (dropout, fused softmax) are modelled for the gpt2 family "
                "only (--model=megatron-gpt)");
}

// Korthikanti et al.'s Table 2 per tensor-parallel GPU, without the dropout masks, for
// 2 layers of s x b x h = 16 x 2 x 64 = 2,048 (fp32, 4 heads): no parallelism 16
// elements per sbh, 2 x 4 x 16 x 2,048 = 262,144; t = 2: 4 + 12/2 = 10, 163,840; with
// sequence parallelism 16/2 = 8, 131,072; math attention adds 2 a s^2 b / t elements,
// 2 x 4 x 2 x (4 x 256 x 2) / 2 = 16,384.
TEST(PredictTest, KorthikantiPerTensorParallelRank) {
  ModelConfig config = StudyModel(/*layers=*/2, /*width=*/64, /*heads=*/4,
                                  /*batch=*/2, /*seq=*/16);
  EXPECT_EQ(KorthikantiSavedBytes(config, AttentionMode::kFlash), 262144);
  config.shard.tp = 2;
  EXPECT_EQ(KorthikantiSavedBytes(config, AttentionMode::kFlash), 163840);
  EXPECT_EQ(KorthikantiSavedBytes(config, AttentionMode::kMath), 163840 + 16384);
  config.shard.sp = true;
  EXPECT_EQ(KorthikantiSavedBytes(config, AttentionMode::kFlash), 131072);
}

TEST(PredictTest, OneLayerOneTokenBothModes) {
  // L=1, d=8, H=2, B=1, T=1: one token.
  // flash none: 4 x (16*8 + 4 + 2 + 8 loss) = 4 x 142 = 568.
  // full = every_k (block 0 is always checkpointed) = 4 x (8 + 8) = 64.
  // selective: 4 x (8 + 9*8 + 8) = 352.
  ExpectSaved(Config(1, 8, 2, 1, 1), AttentionMode::kFlash,
              {/*none=*/568, /*full=*/64, /*every_2=*/64, /*every_3=*/64, /*every_1=*/64,
               /*selective=*/352});
  // math none: 4 x (16*8 + 4 + 8) + softmax 4 x 1*2*1*1 + mask 1 = 560 + 8 + 1 = 569.
  // (B = 1 and T = 1 make every matmul reshape a view; the bytes are the same.)
  ExpectSaved(Config(1, 8, 2, 1, 1), AttentionMode::kMath,
              {569, 64, 64, 64, 64, 352});
}

TEST(PredictTest, TwoLayersSmallBatch) {
  // L=2, d=16, H=4, B=2, T=3: 6 tokens, per block 16*16 + 4 + 4 = 264.
  // none: 4 x 6 x (2 x 264 + 16) = 24 x 544 = 13056.
  // full = every_1: 24 x 16 x 3 = 1152.
  // every_2 = every_3 (only block 0 checkpointed): 24 x (16 + 264 + 16) = 7104.
  // selective: 24 x 16 x 21 = 8064.
  ExpectSaved(Config(2, 16, 4, 2, 3), AttentionMode::kFlash,
              {13056, 1152, 7104, 7104, 1152, 8064});
  // math: per block 16*16 + 4 = 260; none: 24 x (2 x 260 + 16) = 12864, plus per block
  // softmax 4 x 2*4*3*3 = 288 and mask 9: 12864 + 2 x 297 = 13458.
  // every_2: 24 x (16 + 260 + 16) + 297 = 7008 + 297 = 7305.
  ExpectSaved(Config(2, 16, 4, 2, 3), AttentionMode::kMath,
              {13458, 1152, 7305, 7305, 1152, 8064});
}

TEST(PredictTest, ThreeLayersOneHead) {
  // L=3, d=32, H=1, B=4, T=8: 32 tokens, per block 16*32 + 4 + 1 = 517.
  // none: 128 x (3 x 517 + 32) = 128 x 1583 = 202624.
  // full: 128 x 32 x 4 = 16384.
  // every_2 (blocks 0, 2): 128 x (2 x 32 + 517 + 32) = 128 x 613 = 78464.
  // every_3 (block 0): 128 x (32 + 2 x 517 + 32) = 128 x 1098 = 140544.
  // selective: 128 x 32 x 31 = 126976.
  ExpectSaved(Config(3, 32, 1, 4, 8), AttentionMode::kFlash,
              {202624, 16384, 78464, 140544, 16384, 126976});
  // math: 128 x (3 x 516 + 32) = 202240, plus 3 x (softmax 4 x 4*1*8*8 = 1024 +
  // mask 64) = 3264: 205504. every_2: 128 x (64 + 516 + 32) + 1088 = 78336 + 1088 = 79424.
  // every_3: 128 x (32 + 2 x 516 + 32) + 2 x 1088 = 140288 + 2176 = 142464.
  ExpectSaved(Config(3, 32, 1, 4, 8), AttentionMode::kMath,
              {205504, 16384, 79424, 142464, 16384, 126976});
}

TEST(PredictTest, SelectivePolicies) {
  // L=2, d=16, H=4, B=2, T=3 (6 tokens); full checkpointing keeps 1152 bytes.
  const ModelConfig config = Config(2, 16, 4, 2, 3);
  auto saved = [&](const char* policy, AttentionMode attention = AttentionMode::kFlash) {
    PredictOptions options;
    options.attention = attention;
    options.variants = Variants("selective", policy);
    absl::StatusOr<Prediction> p = Predict(config, options);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? p->variants[0].saved_bytes : -1;
  };
  // gelu: + 2 blocks x 6 x 64 x 4 = 3072 -> 4224.
  EXPECT_EQ(saved("gelu"), 4224);
  // layer_norm: out + mean + rstd, 2 per block: + 2 x 2 x 6 x (16 + 2) x 4 = 1728 -> 2880.
  EXPECT_EQ(saved("layer_norm"), 2880);
  // attention: out 6 x 16 x 4 = 384 + logsumexp 2*4*3 x 4 = 96, 2 blocks: + 960 -> 2112.
  EXPECT_EQ(saved("attention"), 2112);
  // An empty policy caches nothing: selective equals full.
  EXPECT_EQ(saved(""), 1152);
  // matmul,gelu: 8064 + 3072 = 11136.
  EXPECT_EQ(saved("matmul,gelu"), 11136);
  EXPECT_EQ(saved("matmul", AttentionMode::kMath), 8064);
}

TEST(PredictTest, Gpt3Scale) {
  // GPT-3 175B: L=96, d=12288, H=96, B=1, T=2048.
  ModelConfig config = Config(96, 12288, 96, 1, 2048);
  ASSERT_OK_AND_ASSIGN(Prediction p, Predict(config, {}));
  // n_params = 96 x (12 x 12288^2 + 13 x 12288) = 96 x 1812099072 = 173961510912.
  EXPECT_EQ(p.n_params, 173961510912);
  // none: 4 x 2048 x (96 x (16*12288 + 4 + 96) + 12288) = 8192 x 18896256.
  EXPECT_EQ(p.variants[0].saved_bytes, 154798129152);
  // full: 8192 x 12288 x 97 = 9764339712.
  EXPECT_EQ(p.variants[1].saved_bytes, 9764339712);
}

TEST(PredictTest, IdenticalLayersScaleLinearly) {
  // 6000 layers of the default: none = 4096 x (6000 x 2056 + 128).
  ModelConfig config;
  config.layers = 6000;
  ASSERT_OK_AND_ASSIGN(Prediction p, Predict(config, {}));
  EXPECT_EQ(p.variants[0].saved_bytes, int64_t{4096} * (6000 * 2056 + 128));
  // every_2: 3000 checkpointed (128) + 3000 plain (2056) + loss 128.
  EXPECT_EQ(p.variants[2].saved_bytes, int64_t{4096} * (3000 * 128 + 3000 * 2056 + 128));
}

TEST(PredictTest, BadInput) {
  ModelConfig config;
  config.width = 130;
  EXPECT_STATUS(Predict(config, {}), absl::StatusCode::kInvalidArgument,
                "--width 130 is not divisible by --heads 4");
  config = ModelConfig{};
  config.layers = 0;
  EXPECT_STATUS(Predict(config, {}), absl::StatusCode::kInvalidArgument, "--layers");
  config = ModelConfig{};
  config.batch = -3;
  EXPECT_STATUS(Predict(config, {}), absl::StatusCode::kInvalidArgument, "--batch");
  config = ModelConfig{};
  config.seq = 0;
  EXPECT_STATUS(Predict(config, {}), absl::StatusCode::kInvalidArgument, "--seq");
  config = ModelConfig{};
  config.heads = 0;
  EXPECT_STATUS(Predict(config, {}), absl::StatusCode::kInvalidArgument, "--heads");

  PredictOptions math;
  math.attention = AttentionMode::kMath;
  math.variants = Variants("selective", "attention");
  EXPECT_STATUS(Predict(ModelConfig{}, math), absl::StatusCode::kInvalidArgument,
                "--policy attention");
}

TEST(PredictTest, OverflowIsAnError) {
  // 2^40 x 2^30 tokens x 128 x 4 B does not fit in int64.
  ModelConfig config;
  config.batch = int64_t{1} << 40;
  config.seq = int64_t{1} << 30;
  EXPECT_STATUS(Predict(config, {}), absl::StatusCode::kOutOfRange, "overflow");
  // Parameters alone: width 2^32 gives 12 x 2^64 parameters.
  config = ModelConfig{};
  config.width = int64_t{1} << 32;
  EXPECT_STATUS(Predict(config, {}), absl::StatusCode::kOutOfRange, "overflow");
}

TEST(ParseVariantsTest, NamesAndErrors) {
  ASSERT_OK_AND_ASSIGN(std::vector<Variant> v,
                       ParseVariants("none,every_k,every_5,selective", 3, "gelu"));
  ASSERT_EQ(v.size(), 4u);
  EXPECT_EQ(v[1].Name(), "every_3");
  EXPECT_EQ(v[2].Name(), "every_5");
  EXPECT_TRUE(v[3].policy.Saves(OpKind::kGelu));
  EXPECT_FALSE(v[3].policy.Saves(OpKind::kMatmul));
  EXPECT_STATUS(ParseVariants("none,fast", 2, "matmul"), absl::StatusCode::kInvalidArgument,
                "unknown variant 'fast'");
  EXPECT_STATUS(ParseVariants("every_k", 0, "matmul"), absl::StatusCode::kInvalidArgument,
                "--every must be >= 1");
  EXPECT_STATUS(ParseVariants("every_0", 2, "matmul"), absl::StatusCode::kInvalidArgument,
                "every_0");
  EXPECT_STATUS(ParseVariants("none,none", 2, "matmul"), absl::StatusCode::kInvalidArgument,
                "twice");
  EXPECT_STATUS(ParseVariants("selective", 2, "softmax"), absl::StatusCode::kInvalidArgument,
                "--policy: unknown op kind 'softmax'");
  EXPECT_STATUS(ParseVariants("", 2, "matmul"), absl::StatusCode::kInvalidArgument,
                "at least one");
}

}  // namespace
}  // namespace memledger

namespace memledger {
namespace {

ModelConfig Preset(const char* name) {
  absl::StatusOr<ModelConfig> config = ModelFromPreset(name);
  EXPECT_TRUE(config.ok()) << config.status();
  return *config;
}

TEST(PredictFamiliesTest, TinyLlamaByHand) {
  // tiny-llama: L=2, d=32, H=4, kv=2, d_head=8, F=64, V=96; B=16, T=64: N = 1024 tokens.
  // Per layer and token (fp32 elements): x 32 (pow and mul keep it), rsqrt 1, normed 32,
  // h 32 (q/k/v mm keep it), q after RoPE 32, k after RoPE and v at their 2 kv heads
  // 2 x 16 (transformers 5.23 passes enable_gqa to SDPA: no repeat_kv), SDPA out 32 and
  // logsumexp 4, x after the residual 32, rsqrt 1, normed 32, h 32, gate 64 (silu), silu
  // 64 and up 64 (mul), their product 64 (down mm): 550 -> 550 x 4 x 1024 = 2,252,800
  // per layer. RoPE's cos and sin, (1, 64, 8) each: 2 x 2,048 once.
  // Embedding: input_ids 1024 x 8 = 8,192. Head and loss: x 32, rsqrt 1, normed 32, h 32
  // = 97 x 4,096 = 397,312; log-probs 1024 x 96 x 4 = 393,216; labels 8,192; total
  // weight 4. none = 4,505,600 + 4,096 + 8,192 + 397,312 + 393,216 + 8,192 + 4 = 5,316,612.
  PredictOptions options;
  options.variants = Variants("none,full");
  ASSERT_OK_AND_ASSIGN(Prediction p, Predict(Preset("tiny-llama"), options));
  EXPECT_EQ(p.variants[0].saved_bytes, 5316612);
  EXPECT_EQ(p.variants[0].embedding_bytes, 8192);
  EXPECT_EQ(p.variants[0].head_loss_bytes, 397312 + 393216 + 8192 + 4);
  EXPECT_EQ(p.variants[0].layers_bytes, 2 * 2252800 + 4096);
  // full: each layer saves its input (32 x 4,096 = 131,072) and holds cos, sin (4,096
  // once) and the position ids ((1, 64) int64: 512 once), which transformers binds into
  // the checkpointed call: held, not saved. The last hidden states are the head's (in
  // head_loss): 2 x 131,072 + 8,192 + 798,724 = 1,069,060 saved; held after the forward,
  // less the 8,192 B of token ids, plus cos, sin, the position ids and two 5,056-byte RNG
  // states: 1,069,060 - 8,192 + 4,096 + 512 + 10,112 = 1,075,588.
  EXPECT_EQ(p.variants[1].saved_bytes, 1069060);
  EXPECT_EQ(p.variants[1].held_after_forward_bytes, 1075588);
  // none: no checkpoint, so exactly the saved bytes less the input.
  EXPECT_EQ(p.variants[0].held_after_forward_bytes, 5316612 - 8192);
}

TEST(PredictFamiliesTest, FrozenEmbeddingsAndHeadByHand) {
  // tiny-llama as in TinyLlamaByHand (N = 1024 tokens, d = 32, V = 96), its embedding and
  // LM head frozen: 2 x 96 x 32 = 6,144 parameters in 2 tensors without a gradient or
  // AdamW's state (exp_avg, exp_avg_sq: 8 B a parameter; step: 4 B a tensor).
  PredictOptions options;
  options.variants = Variants("none,full");
  ASSERT_OK_AND_ASSIGN(Prediction all, Predict(Preset("tiny-llama"), options));
  ModelConfig frozen = Preset("tiny-llama");
  frozen.freeze = {.embeddings = true, .lm_head = true};
  ASSERT_OK_AND_ASSIGN(Prediction p, Predict(frozen, options));
  EXPECT_EQ(p.param_bytes, all.param_bytes);
  EXPECT_EQ(p.n_trainable_params, all.n_params - 6144);
  EXPECT_EQ(p.frozen_param_bytes, 6144 * 4);
  EXPECT_EQ(p.grad_bytes, all.grad_bytes - 6144 * 4);
  EXPECT_EQ(p.optimizer_state_bytes, all.optimizer_state_bytes - 6144 * 8 - 2 * 4);
  // none: the embedding keeps no token ids (8,192 B), the head's matmul not its input h
  // (32 x 4,096 = 131,072 B), and the first layer, whose input needs no gradient, neither
  // its input nor its rsqrt (33 x 4,096 = 135,168 B): its norm's x * rsqrt has no node.
  EXPECT_EQ(p.variants[0].saved_bytes, 5316612 - 8192 - 131072 - 135168);
  EXPECT_EQ(p.variants[0].held_after_forward_bytes, p.variants[0].saved_bytes);
  // full: the checkpoints' hook makes the embeddings' output a leaf that requires grad,
  // which the first checkpoint saves as before: less only the ids and h. Held after the
  // forward as TinyLlamaByHand's, the ids being saved by nobody now.
  EXPECT_EQ(p.variants[1].saved_bytes, 1069060 - 8192 - 131072);
  EXPECT_EQ(p.variants[1].held_after_forward_bytes, 1075588 - 131072);
}

TEST(PredictFamiliesTest, LoraAdaptersAloneTrainByHand) {
  // tiny-llama (L = 2, d = 32, 4 heads of 8, 2 kv heads) with peft's default LoRA, r 8
  // on q_proj (32 -> 32) and v_proj (32 -> 16): lora_A (r, in) and lora_B (out, r) each,
  // 8 x 32 + 32 x 8 + 8 x 32 + 16 x 8 = 896 parameters a layer in 4 tensors, the only
  // ones that train (every base parameter is frozen).
  PredictOptions options;
  options.variants = Variants("none");
  ASSERT_OK_AND_ASSIGN(Prediction all, Predict(Preset("tiny-llama"), options));
  ModelConfig lora = Preset("tiny-llama");
  lora.lora.rank = 8;
  ASSERT_OK_AND_ASSIGN(Prediction p, Predict(lora, options));
  EXPECT_EQ(p.n_params, all.n_params + 2 * 896);
  EXPECT_EQ(p.n_trainable_params, 2 * 896);
  EXPECT_EQ(p.frozen_param_bytes, all.param_bytes);
  EXPECT_EQ(p.grad_bytes, 2 * 896 * 4);
  // AdamW: exp_avg and exp_avg_sq (8 B a parameter) and a 4-byte step per tensor.
  EXPECT_EQ(p.optimizer_state_bytes, 2 * 896 * 8 + 2 * 4 * 4);

  // On a bf16 model get_peft_model upcasts the adapters to fp32 (autocast_adapter_dtype):
  // the base's 2 B a parameter, the adapters' 4 B, and their gradients and AdamW's
  // moments in fp32 too.
  lora.dtype = DType::kBFloat16;
  ASSERT_OK_AND_ASSIGN(Prediction bf16, Predict(lora, options));
  EXPECT_EQ(bf16.frozen_param_bytes, all.param_bytes / 2);
  EXPECT_EQ(bf16.param_bytes, all.param_bytes / 2 + 2 * 896 * 4);
  EXPECT_EQ(bf16.grad_bytes, 2 * 896 * 4);
  EXPECT_EQ(bf16.optimizer_state_bytes, 2 * 896 * 8 + 2 * 4 * 4);
}

TEST(PredictFamiliesTest, OffloadedActivationsByHand) {
  // tiny-llama (L = 2, d = 32, V = 96) on CUDA, B = 4, T = 128 (N = 512 tokens), the
  // forward under save_on_cpu: each SavedVariable is its own host copy, a weight's too.
  // Under full checkpointing the layers pack only their inputs (save_inputs): 2 x N x 32
  // x 4 = 131,072 B. The embedding packs its token ids (N x 8 = 4,096). The head: the
  // final RMSNorm's pow keeps x (65,536), rsqrt its result (N x 4 = 2,048), x * rsqrt
  // both (67,584), weight * normed both (128 + 65,536); lm_head's mm its flat input and
  // W^T (65,536 + 96 x 32 x 4 = 12,288); log_softmax its result (N x 96 x 4 = 196,608),
  // nll_loss the same log-probabilities again, the shifted labels (4,096) and
  // total_weight (4): 675,972. In all 811,140 B.
  ModelConfig config = Preset("tiny-llama");
  config.batch = 4;
  config.seq = 128;
  config.device = Device::kCuda;
  config.offload_activations = true;
  PredictOptions options;
  options.variants = Variants("none,full");
  ASSERT_OK_AND_ASSIGN(Prediction p, Predict(config, options));
  EXPECT_EQ(p.variants[1].offloaded_bytes, 811140);
  // Without checkpointing every layer's saves go to the host instead of its input:
  // more than the layers' inputs alone.
  EXPECT_GT(p.variants[0].offloaded_bytes, 811140);
  config.offload_activations = false;
  ASSERT_OK_AND_ASSIGN(Prediction kept, Predict(config, options));
  EXPECT_EQ(kept.variants[0].offloaded_bytes, 0);
  EXPECT_LT(p.variants[0].peak->bytes, kept.variants[0].peak->bytes);
}

TEST(PredictFamiliesTest, TinyGpt2ByHand) {
  // tiny-gpt2: L=2, d=32, H=4, F=128, V=96, 128 positions; B=16, T=64: N = 1024.
  // Per layer and token: x 32, mean+rstd 2, ln_1 out 32 (c_attn addmm), c_attn out 96
  // (q, k, v are its views), out 32, logsumexp 4, x1 32, mean+rstd 2, ln_2 out 32; then
  // gelu_new (NewGELUActivation, plain ops): c_fc out 128 (pow keeps it), 0.5 x 128 and
  // 1 + tanh 128 (the last mul keeps both), tanh 128 (its backward keeps the result),
  // gelu_new out 128 (c_proj): 904 x 4,096 = 3,702,784. Embedding: input_ids 8,192 and
  // position ids 64 x 8 = 512. Head: x 32, mean+rstd 2, ln_f out 32 = 66 x 4,096 =
  // 270,336; log-probs 393,216; labels 8,192; total weight 4.
  // Without use_cache none = 7,405,568 + 8,704 + 270,336 + 393,216 + 8,192 + 4 =
  // 8,086,020. The three multiplications by a number also keep their wrapped numbers
  // (8 B each, float64), which no saved-tensor hook sees: held after the forward, not
  // saved. With use_cache (GPT2Config's default) SDPA reads and keeps the DynamicCache's
  // contiguous copies of k and v instead of c_attn's views, whose output q still views:
  // 2 x 32 more per token and layer, 2 x 64 x 4,096 = 524,288 -> 8,610,308. Checkpointing
  // turns the cache off: full is the same either way.
  PredictOptions options;
  options.variants = Variants("none,full");
  ModelConfig cached = Preset("tiny-gpt2");
  ASSERT_TRUE(cached.use_cache);
  ModelConfig uncached = cached;
  uncached.use_cache = false;
  ASSERT_OK_AND_ASSIGN(Prediction p, Predict(uncached, options));
  EXPECT_EQ(p.variants[0].saved_bytes, 8086020);
  EXPECT_EQ(p.variants[0].held_after_forward_bytes, 8086020 - 8192 + 2 * 3 * 8);
  EXPECT_EQ(p.variants[0].embedding_bytes, 8704);
  ASSERT_OK_AND_ASSIGN(Prediction c, Predict(cached, options));
  EXPECT_EQ(c.variants[0].saved_bytes, 8610308);
  EXPECT_EQ(c.saved_bytes_none, 8610308);
  EXPECT_EQ(c.variants[0].held_after_forward_bytes, 8610308 - 8192 + 2 * 3 * 8);
  EXPECT_EQ(c.variants[1].saved_bytes, p.variants[1].saved_bytes);
  EXPECT_EQ(c.variants[1].held_after_forward_bytes, p.variants[1].held_after_forward_bytes);
  EXPECT_DOUBLE_EQ(c.variants[1].saved_ratio_vs_none,
                   static_cast<double>(c.variants[1].saved_bytes) / 8610308);
}

// Every segment's Parameters() (the registration order torch.optim steps) names each
// parameter tensor exactly once: a name RegistrationOrder misses would drop a tensor
// from the optimizer's step.
TEST(PredictFamiliesTest, ParameterOrderNamesEveryParameterOnce) {
  ModelConfig qwen2 = Preset("tiny-llama");
  qwen2.qkv_bias = true;
  for (const ModelConfig& config : {ModelConfig(), Preset("tiny-llama"), qwen2,
                                    Preset("tiny-gpt2")}) {
    const ModelGraphs graphs = BuildModelGraphs(config, AttentionMode::kFlash);
    std::vector<const BlockGraph*> segments = {&graphs.Layer(0), &graphs.epilogue};
    if (graphs.prologue.has_value()) segments.push_back(&*graphs.prologue);
    for (const BlockGraph* graph : segments) {
      std::vector<int> order = graph->Parameters(), all;
      for (size_t t = 0; t < graph->tensors.size(); ++t) {
        if (graph->tensors[t].is_parameter) all.push_back(static_cast<int>(t));
      }
      std::sort(order.begin(), order.end());
      EXPECT_EQ(order, all) << FamilyName(config.family);
    }
  }
}

// What the real stack does that is not modelled yet is said, per run: nothing for the
// study, Llama or GPT-2 (its dropouts and use_cache are modelled), with or without
// checkpointing, in fp32; oneDNN's scratchpads in low precision.
TEST(PredictFamiliesTest, CaveatsNameWhatTheRealStackDoesBesides) {
  auto caveats = [](const ModelConfig& config, const char* variants) {
    PredictOptions options;
    options.variants = Variants(variants);
    options.peak = false;
    absl::StatusOr<Prediction> p = Predict(config, options);
    EXPECT_TRUE(p.ok()) << p.status();
    std::string all;
    for (const std::string& caveat : p->caveats) all += caveat.substr(0, caveat.find(':')) + ";";
    return all;
  };
  ModelConfig study;
  EXPECT_EQ(caveats(study, "none"), "");
  EXPECT_EQ(caveats(study, "none,full"), "");
  study.dtype = DType::kBFloat16;
  EXPECT_EQ(caveats(study, "none"), "low precision;");
  EXPECT_EQ(caveats(Preset("tiny-llama"), "none,full"), "");
  EXPECT_EQ(caveats(Preset("gpt2"), "none"), "");
  EXPECT_EQ(caveats(Preset("gpt2"), "full"), "");
  EXPECT_EQ(caveats(Preset("tiny-gpt2"), "full"), "");
}

// A data-parallel rank without ZeRO says that torch's DDP keeps its buckets, which the
// reduction predicted does not (tests/ddp_witness_test.py measures them); ZeRO's flat
// buffer and a pipeline alone say nothing of it.
// Ranks without ZeRO run torch's DDP (its buckets are modelled: ranks_test); the
// prediction says what it assumes where torch leaves a choice: no_sync before each
// chunk's last micro-batch, and on CUDA the buckets' split.
TEST(PredictFamiliesTest, DdpRanksSayWhatTheyAssume) {
  auto caveats = [](int64_t dp, int64_t pp, int64_t zero, int64_t micro_batches,
                    Device device) {
    ParallelSpec parallel;
    parallel.dp = dp;
    parallel.pp = pp;
    parallel.zero = zero;
    parallel.micro_batches = micro_batches;
    ModelConfig config = Preset("tiny-llama");
    config.device = device;
    PredictOptions options;
    options.peak = false;
    absl::StatusOr<DistributedPrediction> p = PredictDistributed(config, parallel, options);
    EXPECT_TRUE(p.ok()) << p.status();
    std::string all;
    for (const std::string& caveat : p->whole.caveats) {
      if (caveat.rfind("dp:", 0) != 0 || caveat.find("DynamicCache") != std::string::npos) {
        continue;
      }
      all += caveat.find("no_sync") != std::string::npos   ? "no_sync;"
             : caveat.find("reverse") != std::string::npos ? "split;"
                                                            : "other;";
    }
    return all;
  };
  EXPECT_EQ(caveats(2, 1, 0, 1, Device::kCpu), "");
  EXPECT_EQ(caveats(2, 2, 0, 2, Device::kCpu), "no_sync;");
  EXPECT_EQ(caveats(2, 1, 0, 1, Device::kCuda), "split;");
  EXPECT_EQ(caveats(2, 1, 1, 2, Device::kCpu), "");
  EXPECT_EQ(caveats(1, 2, 0, 2, Device::kCpu), "");
}

// GPT-2's DynamicCache holds keys and values of its own in training (transformers keeps
// it with use_cache): the ranks are predicted without it and say so; Llama's cache holds
// the tensors saved anyway, nothing of its own, so nothing is said.
TEST(PredictFamiliesTest, DdpAndFsdpRanksSayTheyDropAPayingCache) {
  for (const auto& [preset, says] : {std::pair<const char*, bool>{"tiny-gpt2", true},
                                     {"tiny-llama", false}}) {
    for (const bool fsdp : {false, true}) {
      SCOPED_TRACE(absl::StrCat(preset, fsdp ? " fsdp" : " ddp"));
      ParallelSpec parallel;
      parallel.dp = 2;
      parallel.fsdp.enabled = fsdp;
      PredictOptions options;
      options.peak = false;
      ASSERT_OK_AND_ASSIGN(DistributedPrediction p,
                           PredictDistributed(Preset(preset), parallel, options));
      bool said = false;
      for (const std::string& caveat : p.whole.caveats) {
        said = said || caveat.find("DynamicCache") != std::string::npos;
      }
      EXPECT_EQ(said, says);
    }
  }
}

TEST(PredictFamiliesTest, TiedHeadCountsOnceAndGqaShrinksKv) {
  ModelConfig untied = Preset("tiny-llama");
  ModelConfig tied = untied;
  tied.tie_embeddings = true;
  ASSERT_OK_AND_ASSIGN(Prediction a, Predict(untied, {}));
  ASSERT_OK_AND_ASSIGN(Prediction b, Predict(tied, {}));
  EXPECT_EQ(a.n_params - b.n_params, 96 * 32);  // the LM head's V x d
  // SDPA keeps k after RoPE and v_proj's output at their kv heads (enable_gqa, no
  // repeat_kv): with kv heads == heads 2 x 32 elements per token instead of 2 x 16, 2
  // layers x 32 x 4 B x 1024 tokens = 262,144 B more, while the k and v projections grow
  // from 2 x 512 to 2 x 1024 parameters per layer.
  ModelConfig mha = untied;
  mha.kv_heads = 4;
  ASSERT_OK_AND_ASSIGN(Prediction c, Predict(mha, {}));
  EXPECT_EQ(c.n_params - a.n_params, 2 * 2 * 512);
  EXPECT_EQ(c.variants[0].saved_bytes - a.variants[0].saved_bytes, 262144);
}

TEST(PredictFamiliesTest, PoliciesTheFamilyLacksAreRejected) {
  PredictOptions options;
  options.variants = Variants("selective", "gelu");
  // The layer graphs' policy ops: Llama's linears (matmul), the flash op and silu
  // (RMSNorm is plain ops); transformers' GPT-2's Conv1Ds, the flash op and its
  // LayerNorms (gelu_new is plain ops).
  EXPECT_STATUS(Predict(Preset("tiny-llama"), options), absl::StatusCode::kInvalidArgument,
                "--policy gelu is not an op of this llama model (its layers' policy ops: "
                "matmul, attention, silu)");
  options.variants = Variants("selective", "silu,gelu");
  EXPECT_STATUS(Predict(Preset("tiny-gpt2"), options), absl::StatusCode::kInvalidArgument,
                "--policy gelu,silu are not ops of this gpt2 model (its layers' policy ops: "
                "matmul, attention, layer_norm)");
  // Found by //fuzz:predict_fuzzer: more heads than width leaves no head dimension.
  ModelConfig no_head_dim = Preset("tiny-llama");
  no_head_dim.heads = 64;
  no_head_dim.kv_heads = 64;
  no_head_dim.head_dim = 0;
  EXPECT_STATUS(Predict(no_head_dim, {}), absl::StatusCode::kInvalidArgument,
                "--head_dim would be --width 32 / --heads 64 = 0");
  ModelConfig long_gpt2 = Preset("tiny-gpt2");
  long_gpt2.seq = 129;
  EXPECT_STATUS(Predict(long_gpt2, {}), absl::StatusCode::kInvalidArgument,
                "--seq 129 exceeds the model's 128 learned positions");
}

}  // namespace
}  // namespace memledger

namespace memledger {
namespace {

TEST(PredictPrecisionTest, OptimizerStateByHand) {
  // The study's 1,189,632 parameters.
  ModelConfig config;
  PredictOptions options;
  options.variants = Variants("none");
  // fp32 AdamW: 2 moments x 4 B = 9,517,056 (the study's adamw_state_bytes), and
  // torch.optim's 0-dim fp32 step per parameter tensor: 6 layers x 12 tensors x 4 B =
  // 288 B.
  ASSERT_OK_AND_ASSIGN(Prediction adamw, Predict(config, options));
  EXPECT_EQ(adamw.optimizer_state_bytes, 9517056 + 288);
  EXPECT_EQ(adamw.adamw_state_bytes, 9517056);
  // SGD without momentum holds nothing; with momentum one buffer, 4,758,528.
  options.optimizer.kind = OptimizerKind::kSgd;
  ASSERT_OK_AND_ASSIGN(Prediction sgd, Predict(config, options));
  EXPECT_EQ(sgd.optimizer_state_bytes, 0);
  EXPECT_EQ(sgd.adamw_state_bytes, 0);
  options.optimizer.momentum = 0.9;
  ASSERT_OK_AND_ASSIGN(Prediction momentum, Predict(config, options));
  EXPECT_EQ(momentum.optimizer_state_bytes, 4758528);
  // bf16 Adam: parameters and gradients 2 B each (2,379,264), moments 2 x 2 B, the
  // steps fp32 still.
  config.dtype = DType::kBFloat16;
  options.optimizer = {OptimizerKind::kAdam, 0, false};
  ASSERT_OK_AND_ASSIGN(Prediction bf16, Predict(config, options));
  EXPECT_EQ(bf16.param_bytes, 2379264);
  EXPECT_EQ(bf16.grad_bytes, 2379264);
  EXPECT_EQ(bf16.optimizer_state_bytes, 4758528 + 288);
  // With fp32 master weights: the copies 4 B and fp32 moments 2 x 4 B = 12 B each:
  // 14,275,584, and the steps.
  options.optimizer.master_weights = true;
  ASSERT_OK_AND_ASSIGN(Prediction master, Predict(config, options));
  EXPECT_EQ(master.optimizer_state_bytes, 14275584 + 288);
}

TEST(PredictPrecisionTest, Bf16TinyLlamaKeepsFp32WherePyTorchDoes) {
  // tiny-llama in bf16 (N = 1024 tokens). Each RMSNorm keeps its fp32 upcast of x
  // (32 x 4 B), its fp32 rsqrt (4 B) and the bf16 normed (32 x 2 B), and the bf16 x is
  // kept by nobody; its output h (64 B) is kept by the next matmuls: 260 B. Per layer:
  // 2 norms 520 + q 64 + k, v at their 2 kv heads 2 x 32 (enable_gqa) + SDPA out 64 +
  // fp32 logsumexp 4 x 4 + MLP 4 x 128 = 1,240 B -> 1,269,760 per layer. cos, sin in
  // bf16: 2 x 64 x 8 x 2 = 2,048. Embedding
  // 8,192. Head: final norm 260 x 1024 = 266,240; the log-probs of logits.float(),
  // 1024 x 96 x 4 = 393,216; labels 8,192; total weight 4.
  // none = 2,539,520 + 2,048 + 8,192 + 266,240 + 393,216 + 8,192 + 4 = 3,217,412.
  ModelConfig config = Preset("tiny-llama");
  config.dtype = DType::kBFloat16;
  PredictOptions options;
  options.variants = Variants("none");
  ASSERT_OK_AND_ASSIGN(Prediction p, Predict(config, options));
  EXPECT_EQ(p.variants[0].saved_bytes, 3217412);
}

TEST(PredictPrecisionTest, UnsupportedCombinationsAreRejected) {
  PredictOptions options;
  options.optimizer.master_weights = true;
  EXPECT_STATUS(Predict(ModelConfig(), options), absl::StatusCode::kInvalidArgument,
                "--master_weights needs --dtype=bf16 or fp16");
  options.optimizer = {OptimizerKind::kAdamW, 0.9, false};
  EXPECT_STATUS(Predict(ModelConfig(), options), absl::StatusCode::kInvalidArgument,
                "--momentum applies to --optimizer=sgd, not adamw");
  options.optimizer = {OptimizerKind::kSgd, -1, false};
  EXPECT_STATUS(Predict(ModelConfig(), options), absl::StatusCode::kInvalidArgument,
                "--momentum must be >= 0");
}

}  // namespace
}  // namespace memledger

namespace memledger {
namespace {

TEST(PredictPrecisionTest, AutocastKeepsCastCopiesOfInputsAndWeights) {
  // The study's block, L=1, d=8, H=1, B=1, T=2, under bf16 autocast. Per token: x fp32
  // 32 B and ln1's fp32 mean, rstd 8 B; qkv's bf16 copy of its input 16 B (addmm's mat1);
  // qkv out bf16 48 B (q, k, v); SDPA out bf16 16 B (also proj's input) and logsumexp
  // fp32 4 B; x1 = x + proj (bf16), promoted to fp32, 32 B and ln2's stats 8 B; fc1's
  // input copy 16 B; fc1 out bf16 64 B (gelu); gelu out bf16 64 B (fc2); the loss's y
  // fp32 32 B: 340 B x 2 tokens = 680. Each matmul keeps its bf16 weight copy (no
  // parameter): qkv 24 x 8 x 2 = 384, proj 128, fc1 512, fc2 512 = 1,536. none = 2,216.
  ModelConfig config = StudyModel(/*layers=*/1, /*width=*/8, /*heads=*/1,
                                  /*batch=*/1, /*seq=*/2);
  config.amp = DType::kBFloat16;
  PredictOptions options;
  options.variants = Variants("none");
  ASSERT_OK_AND_ASSIGN(Prediction p, Predict(config, options));
  EXPECT_EQ(p.variants[0].saved_bytes, 2216);
  EXPECT_EQ(p.variants[0].weight_copy_bytes, 1536);
  // By dtype, per token: bf16 input copies 16 + 16, qkv 48, SDPA out 16, fc1 out 64,
  // gelu out 64 = 224, x 2 tokens = 448, plus the weight copies 1,536: 1,984; fp32 x 32,
  // ln1 stats 8, logsumexp 4, x1 32, ln2 stats 8, y 32 = 116, x 2 = 232. 1,984 + 232 =
  // 2,216.
  EXPECT_EQ(p.variants[0].saved_by_dtype[static_cast<int>(DType::kBFloat16)], 1984);
  EXPECT_EQ(p.variants[0].saved_by_dtype[static_cast<int>(DType::kFloat32)], 232);
  // Parameters, gradients and AdamW's state stay fp32 under autocast: 872 x 4 B, and
  // the 12 parameter tensors' 4-byte steps.
  EXPECT_EQ(p.param_bytes, 3488);
  EXPECT_EQ(p.optimizer_state_bytes, 2 * 3488 + 12 * 4);
  config.dtype = DType::kBFloat16;
  EXPECT_STATUS(Predict(config, options), absl::StatusCode::kInvalidArgument,
                "--amp=bf16 needs --dtype=fp32");
}

}  // namespace
}  // namespace memledger

namespace memledger {
namespace {

// One tensor-parallel rank's step, composed from a short model's stretches (Predict),
// is the rank's step replayed whole (PredictRanks at dp 1, whose peaks
// verify_ranks_test measures on Gloo ranks): the vocabulary-parallel ops and, with
// sequence parallelism, the gathers compose like any other.
TEST(PredictTensorParallelTest, OneRanksComposedPeakIsItsReplayedStep) {
  for (const char* model : {"tiny-llama", "tiny-gpt2"}) {
    for (bool sp : {false, true}) {
      ModelConfig config = *ModelFromPreset(model);
      config.layers = 6;
      config.batch = 2;
      config.seq = 16;
      ParallelSpec tensor_parallel;
      tensor_parallel.tp = 2;
      tensor_parallel.sp = sp;
      config.shard = ShardOf(tensor_parallel);
      config.use_cache = false;  // ranks keep no DynamicCache (PredictRanks)
      SCOPED_TRACE(absl::StrCat(model, sp ? " --sp" : ""));
      ASSERT_OK_AND_ASSIGN(Prediction p, Predict(config, PredictOptions()));
      ASSERT_OK_AND_ASSIGN(RanksPrediction ranks,
                           PredictRanks(config, tensor_parallel, PredictOptions()));
      ASSERT_EQ(ranks.kinds[0].variants.size(), p.variants.size());
      for (size_t v = 0; v < p.variants.size(); ++v) {
        ASSERT_TRUE(p.variants[v].peak.has_value()) << p.variants[v].peak_unavailable;
        ASSERT_TRUE(ranks.kinds[0].variants[v].held.peak.has_value());
        EXPECT_EQ(p.variants[v].peak->bytes, ranks.kinds[0].variants[v].held.peak->bytes)
            << p.variants[v].variant.Name();
      }
    }
  }
}

// A plan spells out one choice per layer; the same choices as a periodic variant must
// predict the same. The two paths are independent: the plan's saved bytes are counted
// layer by layer (the periodic variant's in closed form), and its peak is replayed layer
// by layer (the periodic variant's composed from a short model's stretches).

TEST(PredictPlanTest, APlanOfAVariantsChoicesPredictsLikeTheVariant) {
  ModelConfig study = Config(1, 32, 2, 2, 16);
  int compared = 0;
  for (ModelConfig config : {study, Preset("tiny-llama"), Preset("tiny-gpt2")}) {
    for (AttentionMode attention : {AttentionMode::kFlash, AttentionMode::kMath}) {
      for (int64_t layers : {1, 2, 7}) {
        config.layers = layers;
        config.batch = 2;
        config.seq = 16;
        PredictOptions options;
        options.attention = attention;
        options.variants = Variants("none,full,every_2,every_3,selective");
        for (Variant& v : options.variants) {
          if (v.kind == VariantKind::kSelective && config.family == Family::kLlama) {
            v.policy = SavePolicy{OpKind::kMatmul, OpKind::kSilu};
          }
        }
        ASSERT_OK_AND_ASSIGN(Prediction periodic, Predict(config, options));
        for (const VariantPrediction& expected : periodic.variants) {
          std::vector<LayerChoice> choices;
          for (int64_t i = 0; i < layers; ++i) choices.push_back(expected.variant.At(i));
          PredictOptions plan_options = options;
          plan_options.variants = {PlanVariant(choices)};
          ASSERT_OK_AND_ASSIGN(Prediction plan, Predict(config, plan_options));
          const VariantPrediction& got = plan.variants[0];
          const std::string what =
              absl::StrCat(FamilyName(config.family), " ", AttentionModeName(attention), " L",
                           layers, " ", expected.variant.Name());
          EXPECT_EQ(got.saved_bytes, expected.saved_bytes) << what;
          EXPECT_EQ(got.cache_bytes, expected.cache_bytes) << what;
          EXPECT_EQ(got.layers_bytes, expected.layers_bytes) << what;
          EXPECT_EQ(got.head_loss_bytes, expected.head_loss_bytes) << what;
          EXPECT_EQ(got.saved_by_dtype, expected.saved_by_dtype) << what;
          ASSERT_TRUE(got.peak.has_value() && expected.peak.has_value()) << what;
          EXPECT_EQ(got.peak->bytes, expected.peak->bytes) << what;
          EXPECT_EQ(got.peak->op, expected.peak->op) << what;
          EXPECT_EQ(got.peak->by_category, expected.peak->by_category) << what;
          ++compared;
        }
      }
    }
  }
  EXPECT_EQ(compared, 3 * 2 * 3 * 5);
}

TEST(PredictPlanTest, LayerChoicesParseAndPlansAreChecked) {
  ASSERT_OK_AND_ASSIGN(LayerChoice none, ParseLayerChoice("none"));
  EXPECT_FALSE(none.checkpointed);
  ASSERT_OK_AND_ASSIGN(LayerChoice full, ParseLayerChoice("full"));
  EXPECT_TRUE(full.checkpointed && full.policy.empty());
  ASSERT_OK_AND_ASSIGN(LayerChoice sel, ParseLayerChoice("selective:matmul,gelu"));
  EXPECT_TRUE(sel.policy.Saves(OpKind::kMatmul) && sel.policy.Saves(OpKind::kGelu));
  EXPECT_EQ(sel.Name(), "selective:matmul,gelu");
  EXPECT_EQ(full.Name(), "full");
  EXPECT_STATUS(ParseLayerChoice("half"), absl::StatusCode::kInvalidArgument,
                "unknown layer choice 'half'");
  EXPECT_STATUS(ParseLayerChoice("selective:softmax"), absl::StatusCode::kInvalidArgument,
                "softmax");

  PredictOptions options;
  options.variants = {PlanVariant({none, full})};
  EXPECT_STATUS(Predict(Config(3, 32, 2, 2, 16), options), absl::StatusCode::kInvalidArgument,
                "the plan has 2 layer choices but --layers is 3");
  LayerChoice silu{true, SavePolicy{OpKind::kSilu}};
  options.variants = {PlanVariant({none, silu, full})};
  EXPECT_STATUS(Predict(Config(3, 32, 2, 2, 16), options), absl::StatusCode::kInvalidArgument,
                "silu");
}

}  // namespace
}  // namespace memledger
