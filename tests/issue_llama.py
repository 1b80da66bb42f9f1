"""Issue 62's 2-layer Llama, which the DDP and FSDP2 witness tests train on Gloo ranks
(tests/ddp_witness_test.py, tests/fsdp2_witness_test.py; tests/ranks_test.cc's
IssueLlama is the same model in memledger's terms)."""

CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "vocab_size": 512, "tie_word_embeddings": False}
# Its parameters, by hand: embed_tokens and lm_head 512 x 64 = 32,768 each; a layer's
# q 64 x 64 = 4,096, k and v 32 x 64 = 2,048 each, o 4,096, gate, up and down
# 160 x 64 = 10,240 each, two norms of 64: 43,136; the final norm 64.
# 2 x 32,768 + 2 x 43,136 + 64 = 151,872 fp32 elements, 607,488 B, in 2 x 9 + 3 = 21
# tensors.
PARAM_BYTES = 151872 * 4
TENSORS = 21
