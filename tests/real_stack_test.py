"""Conformance: predict against the real stack (transformers 5.23.0, torch 2.15.0).

Each case is one small config trained one step by verify/witness.py (the real
AutoModelForCausalLM, or the unchanged reference study; torch.utils.checkpoint through
gradient_checkpointing_enable; torch.optim), and predicted by //estimator:predict from
the same config.json. Every bucket must agree byte for byte: parameters, gradients, the
optimizer's state (every tensor of opt.state), saved bytes (saved-tensor hooks), bytes
held after the forward and the step's peak (the profiler's memory events).

The cases cover each value of each axis at least once, and the pairs that interact
(checkpointing variant x implementation, optimizer x implementation x dtype); they run
in one process. What the real stack does that memledger does not model yet is listed in
KNOWN_GAPS; those buckets are compared and printed with the reason, and every other
bucket must agree.

Run by Bazel with the reference stack's Python (tests/BUILD.bazel):
    python tests/real_stack_test.py PREDICT_BINARY
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import unittest
import warnings
from pathlib import Path

HERE = Path(os.path.realpath(__file__)).parent
sys.path.insert(0, str(HERE.parent / "verify"))
import witness  # noqa: E402  (verify/witness.py)

PREDICT = None  # set from argv

# Small configs, one per family (sizes in memledger's terms).
FAMILIES = {
    "study": dict(family="study", layers=2, width=32, heads=2),
    "llama_gqa": dict(family="llama", layers=2, width=64, heads=4, kv_heads=2,
                      intermediate=128, vocab=128),
    "llama_mha": dict(family="llama", layers=2, width=64, heads=4, kv_heads=4,
                      intermediate=128, vocab=128),
    "llama_mqa": dict(family="llama", layers=2, width=64, heads=4, kv_heads=1,
                      intermediate=96, vocab=96),
    "mistral": dict(family="mistral", layers=2, width=64, heads=4, kv_heads=2,
                    intermediate=128, vocab=128),
    "qwen2_tied": dict(family="qwen2", layers=2, width=64, heads=4, kv_heads=2,
                       intermediate=128, vocab=128, tied=True),
    # GPT-2 with gelu_new, without its dropouts, and with GPT2Config's (0.1 each).
    "gpt2_nodrop": dict(family="gpt2", layers=2, width=64, heads=4, intermediate=256,
                        vocab=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "gpt2": dict(family="gpt2", layers=2, width=64, heads=4, intermediate=256, vocab=128),
    "gpt2_nocache": dict(family="gpt2", layers=2, width=64, heads=4, intermediate=256,
                         vocab=128, use_cache=False),
    # Qwen3: q_norm and k_norm per head; 4 heads of 32 on a 64-wide model, and (tied)
    # without head_dim, which Qwen3Config then sets to 128.
    "qwen3": dict(family="qwen3", layers=2, width=64, heads=4, kv_heads=2, head_dim=32,
                  intermediate=128, vocab=128),
    "qwen3_tied": dict(family="qwen3", layers=2, width=64, heads=4, kv_heads=1,
                       intermediate=96, vocab=96, tied=True),
    # Gemma 3's text model: two sliding-window layers and a global one (their own RoPE
    # tables), tied as Gemma3TextConfig is by default; and untied, 5 : 1 from
    # sliding_window_pattern over 7 layers, the 7th sliding again.
    "gemma3": dict(family="gemma3_text", layers=3, width=64, heads=4, kv_heads=2,
                   head_dim=32, intermediate=128, vocab=128, tied=True, sliding_window=512,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    "gemma3_pattern": dict(family="gemma3_text", layers=7, width=32, heads=2, kv_heads=1,
                           head_dim=16, intermediate=64, vocab=96, sliding_window=256,
                           sliding_window_pattern=6),
    # Shorter than the 5 : 1 pattern: three sliding layers and no global one, so neither
    # the global rotary's buffers nor its tables.
    "gemma3_short": dict(family="gemma3_text", layers=3, width=32, heads=2, kv_heads=1,
                         head_dim=16, intermediate=64, vocab=96, sliding_window=256,
                         sliding_window_pattern=6),
    # Gemma 3 at seq >= sliding_window (16 >= 8, and 64): the sliding layers attend
    # through transformers' (B, 1, T, T) mask, so SDPA copies the kv heads and keeps the
    # additive mask.
    "gemma3_window": dict(family="gemma3_text", layers=3, width=64, heads=4, kv_heads=2,
                          head_dim=32, intermediate=128, vocab=128, tied=True,
                          sliding_window=8,
                          layer_types=["sliding_attention", "sliding_attention",
                                       "full_attention"]),
    # Llama and Qwen3 in bf16 under SGD with a short vocabulary, where the layers'
    # backward holds the peak (not the head's, nor the optimizer's): LlamaModel's
    # inputs_embeds held to its return while the first layer saves only its norm's fp32
    # copy, and (Qwen3) the q/k norms' fresh arguments held to their return.
    "llama_forward": dict(family="llama", layers=3, width=32, heads=4, kv_heads=2,
                          intermediate=64, vocab=16),
    "qwen3_forward": dict(family="qwen3", layers=3, width=32, heads=4, kv_heads=2,
                          head_dim=16, intermediate=64, vocab=16),
    # Gemma 3 small enough (SGD, a short vocabulary) that the forward and the layers'
    # backward hold the peak: the q, k and v projections made before their norms, a norm's
    # argument held to its return (nn.Module.__call__'s *args), inputs_embeds held to the
    # decoder's return, and (vocab 96) the tied weight's two gradients summed in its
    # AccumulateGrad's input buffer.
    "gemma3_forward": dict(family="gemma3_text", layers=3, width=32, heads=4, kv_heads=2,
                           head_dim=16, intermediate=64, vocab=16, tied=True,
                           sliding_window=8, layer_types=["sliding_attention",
                                                          "sliding_attention",
                                                          "full_attention"]),
    "gemma3_forward_tied": dict(family="gemma3_text", layers=3, width=32, heads=4,
                                kv_heads=2, head_dim=16, intermediate=64, vocab=96, tied=True,
                                sliding_window=8, layer_types=["sliding_attention",
                                                               "sliding_attention",
                                                               "full_attention"]),
    # OLMo 3: norms after attention and the MLP (the weight in fp32 before the cast), q/k
    # norms over the whole projections, fp32 RoPE tables cast back after RoPE; 3 sliding
    # : 1 full by default (olmo3, untied as Olmo3Config is), past its window (olmo3_window,
    # tied), and small enough with SGD that the layers' forward and backward peak.
    "olmo3": dict(family="olmo3", layers=4, width=64, heads=4, kv_heads=2, head_dim=16,
                  intermediate=128, vocab=128, sliding_window=512),
    "olmo3_window": dict(family="olmo3", layers=3, width=64, heads=4, kv_heads=2,
                         head_dim=16, intermediate=128, vocab=128, tied=True, sliding_window=8,
                         layer_types=["sliding_attention", "sliding_attention",
                                      "full_attention"]),
    "olmo3_forward": dict(family="olmo3", layers=3, width=32, heads=4, kv_heads=2, head_dim=8,
                          intermediate=64, vocab=16, sliding_window=8,
                          layer_types=["sliding_attention", "sliding_attention",
                                       "full_attention"]),
    # Sparse mixtures of experts (transformers 5.23's default grouped_mm experts): Qwen3-MoE
    # with q/k norms, renormalised top-k weights cast back to the model's dtype, and a
    # dense first layer (mlp_only_layers); Mixtral with fp32 top-k weights on every layer.
    "qwen3_moe": dict(family="qwen3_moe", layers=3, width=64, heads=4, kv_heads=2,
                      head_dim=16, intermediate=96, vocab=128, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      mlp_only_layers=[0]),
    "qwen3_moe_plain": dict(family="qwen3_moe", layers=2, width=32, heads=2, kv_heads=1,
                            intermediate=64, vocab=96, num_experts=8, num_experts_per_tok=3,
                            moe_intermediate_size=16),
    "mixtral": dict(family="mixtral", layers=2, width=64, heads=4, kv_heads=2,
                    intermediate=48, vocab=128, num_local_experts=4, num_experts_per_tok=2),
    # Llama's attention_bias (q, k, v and o) and mlp_bias (gate, up and down): plain
    # nn.Linear(bias=True) (modeling_llama.py:158-160, 219-229); Qwen3's attention_bias.
    "llama_bias": dict(family="llama", layers=2, width=64, heads=4, kv_heads=2,
                       intermediate=128, vocab=128, attention_bias=True),
    "llama_mlp_bias": dict(family="llama", layers=2, width=64, heads=4, kv_heads=2,
                           intermediate=128, vocab=128, mlp_bias=True),
    "llama_all_bias": dict(family="llama", layers=3, width=32, heads=4, kv_heads=2,
                           intermediate=64, vocab=16, attention_bias=True, mlp_bias=True),
    "qwen3_bias": dict(family="qwen3", layers=2, width=64, heads=4, kv_heads=2, head_dim=16,
                       intermediate=128, vocab=128, attention_bias=True),
}

# The keys a family spec passes to config.json as they are.
PASSED_KEYS = ("sliding_window", "layer_types", "sliding_window_pattern", "num_experts",
               "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
               "norm_topk_prob", "mlp_only_layers", "attention_bias", "mlp_bias")


def hf_config(spec):
    """The transformers config.json of a family spec."""
    if spec["family"] == "gpt2":
        config = {"model_type": "gpt2", "n_embd": spec["width"], "n_layer": spec["layers"],
                  "n_head": spec["heads"], "n_inner": spec["intermediate"],
                  "vocab_size": spec["vocab"], "n_positions": 256}
        for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "use_cache"):
            if key in spec:
                config[key] = spec[key]
        return config
    config = {
        "model_type": spec["family"],
        "hidden_size": spec["width"],
        "intermediate_size": spec["intermediate"],
        "num_hidden_layers": spec["layers"],
        "num_attention_heads": spec["heads"],
        "num_key_value_heads": spec["kv_heads"],
        "vocab_size": spec["vocab"],
        "max_position_embeddings": 512,
        "tie_word_embeddings": spec.get("tied", False),
    }
    if "head_dim" in spec:
        config["head_dim"] = spec["head_dim"]
    if spec["family"] == "mistral":
        config["sliding_window"] = None
    for key in PASSED_KEYS:
        if key in spec:
            config[key] = spec[key]
    return config


def model_case_and_flags(model, tmp):
    """The witness's case keys and predict's model flags for FAMILIES[model]: the study's
    sizes, or a transformers config.json written into `tmp`."""
    spec = FAMILIES[model]
    if spec["family"] == "study":
        return (dict(study=True, layers=spec["layers"], width=spec["width"],
                     heads=spec["heads"]),
                [f"--layers={spec['layers']}", f"--width={spec['width']}",
                 f"--heads={spec['heads']}"])
    config = hf_config(spec)
    path = Path(tmp) / (model + ".json")
    path.write_text(json.dumps(config))
    return dict(config=config), [f"--model={path}"]


def case_id(case):
    parts = [case["model"], case["variant"], case["checkpoint_impl"], case["dtype"],
             "amp" + case["amp"], case["optimizer"], case["optimizer_impl"]]
    if not case["mkldnn"]:
        parts.append("no_mkldnn")
    if case["experts_impl"]:
        parts.append(case["experts_impl"])
    if case["same_token"]:
        parts.append("same_token")
    if case["seq"] != 16:
        parts.append(f"seq{case['seq']}")
    if case["batch"] != 2:
        parts.append(f"batch{case['batch']}")
    if case["freeze"]:
        parts.append("freeze_" + "+".join(case["freeze"]))
    if case["lora"]:
        lora = case["lora"]
        parts.append(f"lora_r{lora['r']}_{lora['targets']}" +
                     (f"_dropout{lora['dropout']}" if lora["dropout"] else "") +
                     ("_dora" if lora["dora"] else ""))
    return "/".join(parts)


def run_case(case, tmp):
    """(predicted, measured) bucket dicts for one case."""
    measure = {**witness.DEFAULTS, "batch": case["batch"], "seq": case["seq"],
               "variant": case["variant"], "checkpoint_impl": case["checkpoint_impl"],
               "dtype": case["dtype"], "amp": case["amp"], "optimizer": case["optimizer"],
               "optimizer_impl": case["optimizer_impl"], "momentum": case["momentum"],
               "mkldnn": case["mkldnn"], "same_token": case["same_token"],
               "freeze": case["freeze"]}
    flags = []
    if case["freeze"]:
        flags.append("--freeze=" + ",".join(case["freeze"]))
    if case["lora"]:
        lora = case["lora"]
        targets = lora["targets"]
        measure["lora"] = {"r": lora["r"], "alpha": 2 * lora["r"], "dropout": lora["dropout"],
                           "targets": targets if targets == "all-linear" else targets.split(","),
                           "dora": lora["dora"]}
        flags += [f"--lora_rank={lora['r']}", f"--lora_alpha={2 * lora['r']}",
                  f"--lora_dropout={lora['dropout']}", f"--lora_targets={targets}"]
        if lora["dora"]:
            flags.append("--use_dora")
    if case["experts_impl"]:
        # The eager experts' sizes are the step's routing: the witness reports it, and
        # predict reads it (--routing=PATH).
        measure.update(experts_impl=case["experts_impl"], record_routing=True)
        flags.append(f"--experts_impl={case['experts_impl']}")
    model_case, model_flags = model_case_and_flags(case["model"], tmp)
    measure.update(model_case)
    flags += model_flags
    flags += [f"--batch={case['batch']}", f"--seq={case['seq']}",
              f"--variants={case['variant']}", f"--dtype={case['dtype']}",
              f"--amp={case['amp']}", f"--optimizer={case['optimizer']}",
              f"--optimizer_impl={case['optimizer_impl']}",
              f"--checkpoint_impl={case['checkpoint_impl']}"]
    if case["optimizer"] == "sgd":
        flags.append(f"--momentum={case['momentum']}")
    w = witness.measure(measure)
    if "routing" in w:
        routing = Path(tmp) / (case["model"] + ".routing.json")
        routing.write_text(json.dumps(w["routing"]))
        flags.append(f"--routing={routing}")
    out = subprocess.run([PREDICT] + flags, capture_output=True, text=True)
    if out.returncode != 0:
        raise AssertionError(f"predict {' '.join(flags)}: {out.stderr.strip()}")
    p = json.loads(out.stdout)
    v = case["variant"]
    predicted = {
        "param_bytes": p["param_bytes"],
        "grad_bytes": p["grad_bytes"],
        "optimizer_state_bytes": p["optimizer_state_bytes"],
        f"saved_bytes.{v}": p["saved_bytes"][v],
        f"held_after_forward_bytes.{v}": p["held_after_forward_bytes"][v],
        f"peak_bytes.{v}": p["peak_bytes"][v],
    }
    measured = {
        "param_bytes": w["param_bytes"],
        "grad_bytes": w["grad_bytes"],
        "optimizer_state_bytes": w["optimizer_state_bytes"],
        f"saved_bytes.{v}": w["saved_bytes"],
        f"held_after_forward_bytes.{v}": w["held_after_forward"],
        f"peak_bytes.{v}": w["peak_bytes"],
    }
    return predicted, measured


def mismatches(predicted, measured):
    """The buckets that differ, each as 'bucket: predicted P, measured M'."""
    return [f"{bucket}: predicted {predicted[bucket]}, measured {measured[bucket]}"
            for bucket in predicted if predicted[bucket] != measured[bucket]]


def L(r, targets="q_proj,v_proj", dropout=0.0, dora=False):
    """A LoRA case's adapters (peft's LoraConfig; use_dora: DoRA)."""
    return {"r": r, "targets": targets, "dropout": dropout, "dora": dora}


def c(model, variant="none", checkpoint_impl="non_reentrant", dtype="fp32", amp="none",
      optimizer="adamw", optimizer_impl="for_loop", momentum=0.0, batch=2, seq=16,
      mkldnn=None, experts_impl=None, same_token=False, freeze=(), lora=None):
    # Low precision runs with oneDNN off unless told (see KNOWN_GAPS).
    if mkldnn is None:
        mkldnn = dtype == "fp32" and amp == "none"
    return dict(model=model, variant=variant, checkpoint_impl=checkpoint_impl, dtype=dtype,
                amp=amp, optimizer=optimizer, optimizer_impl=optimizer_impl,
                momentum=momentum, batch=batch, seq=seq, mkldnn=mkldnn,
                experts_impl=experts_impl, same_token=same_token, freeze=tuple(freeze),
                lora=lora)


# The covering set. Every family, variant, dtype and optimizer implementation appears;
# optimizer x implementation and optimizer x dtype pairs are each covered.
CASES = [
    # Families without checkpointing (fp32, AdamW for-loop).
    c("study"), c("llama_gqa"), c("llama_mha"), c("llama_mqa"), c("mistral"),
    c("qwen2_tied"),
    # Variants x the checkpoint's implementations.
    c("study", "full"), c("study", "every_2"), c("study", "selective"),
    c("llama_gqa", "full"), c("llama_gqa", "every_2"), c("llama_gqa", "selective"),
    c("llama_mha", "full", "reentrant"), c("llama_gqa", "every_2", "reentrant"),
    # Optimizers x implementations x dtypes.
    c("llama_gqa", optimizer_impl="foreach"), c("llama_gqa", optimizer_impl="fused"),
    c("study", optimizer="adam", optimizer_impl="foreach"),
    c("study", optimizer="adam", optimizer_impl="fused", dtype="bf16"),
    c("llama_mha", optimizer="adam", dtype="fp16"),
    c("study", optimizer="sgd", momentum=0.9),
    c("llama_gqa", optimizer="sgd", momentum=0.9, optimizer_impl="foreach", dtype="bf16"),
    c("qwen2_tied", optimizer="sgd", momentum=0.9, optimizer_impl="fused"),
    c("mistral", optimizer="sgd", optimizer_impl="foreach", dtype="fp16"),
    c("llama_gqa", dtype="bf16"), c("study", dtype="fp16", optimizer_impl="fused"),
    c("llama_gqa", "full", dtype="bf16", optimizer_impl="foreach"),
    # Autocast. Without checkpointing at seq 64 the step peaks in the head's forward,
    # under use_cache's fp32 keys and values (the values promoted to the keys' dtype).
    c("study", amp="bf16"), c("llama_gqa", amp="bf16"), c("llama_mha", amp="bf16", seq=64),
    # bf16 without checkpointing at seq 64.
    c("llama_gqa", dtype="bf16", seq=64),
    c("llama_mha", "full", amp="bf16", optimizer_impl="fused"),
    # oneDNN on, as it is by default.
    c("study", dtype="bf16", mkldnn=True),
    # GPT-2 (gelu_new), without its dropouts: without checkpointing and with both
    # implementations.
    c("gpt2_nodrop"), c("gpt2_nodrop", "full"), c("gpt2_nodrop", "every_2", "reentrant"),
    c("gpt2_nodrop", "every_2", dtype="bf16", optimizer_impl="foreach"),
    # GPT-2 with GPT2Config's dropouts (0.1 each; SDPA runs its math kernel): every
    # variant, both implementations, each dtype and autocast.
    c("gpt2"), c("gpt2_nocache", seq=24), c("gpt2", "full"), c("gpt2", "selective"),
    c("gpt2", "every_2", "reentrant"), c("gpt2", "full", "reentrant", dtype="fp16"),
    c("gpt2_nocache", dtype="bf16", optimizer_impl="fused"),
    c("gpt2", "every_2", dtype="bf16", optimizer_impl="foreach"),
    c("gpt2", "full", amp="bf16", seq=24), c("gpt2_nocache", amp="bf16"),
    # Qwen3 (q/k norms): every variant, both implementations, each dtype and autocast.
    c("qwen3"), c("qwen3", "full"), c("qwen3", "every_2"), c("qwen3", "selective"),
    c("qwen3_tied"), c("qwen3_tied", "every_2", "reentrant"),
    c("qwen3", dtype="bf16"), c("qwen3", "full", dtype="bf16", optimizer_impl="foreach"),
    c("qwen3_tied", "selective", dtype="bf16"), c("qwen3", amp="bf16"),
    c("qwen3", "selective", amp="bf16", optimizer_impl="fused"),
    c("qwen3_tied", dtype="fp16", optimizer="sgd", momentum=0.9),
    # Gemma 3 (sliding and global layers): every variant, both implementations, each
    # dtype and autocast, with and without use_cache's sliding-window cache layers.
    c("gemma3"), c("gemma3", "full"), c("gemma3", "every_2"), c("gemma3", "selective"),
    c("gemma3", "every_2", "reentrant"), c("gemma3", dtype="bf16"),
    c("gemma3", "full", dtype="bf16", optimizer_impl="foreach"), c("gemma3", amp="bf16"),
    c("gemma3_pattern"), c("gemma3_pattern", "every_2", dtype="fp16"),
    c("gemma3_pattern", "selective", dtype="bf16"), c("gemma3_pattern", amp="bf16"),
    # Gemma 3 through the sliding-window mask: seq 16 and 64 over a window of 8 (at 8,
    # the boundary, masked too; at 7 not), every variant, both implementations, each
    # dtype and autocast.
    c("gemma3_short"), c("gemma3_short", "every_2", dtype="bf16"),
    c("gemma3_window"), c("gemma3_window", seq=8), c("gemma3_window", seq=7),
    c("gemma3_window", "full"), c("gemma3_window", "every_2"),
    c("gemma3_window", "selective"), c("gemma3_window", "every_2", "reentrant"),
    c("gemma3_window", dtype="bf16"), c("gemma3_window", amp="bf16"),
    c("gemma3_window", "full", dtype="bf16", optimizer_impl="foreach"),
    c("gemma3_window", dtype="fp16", seq=64),
    c("gemma3_window", "selective", amp="bf16", seq=32),
    # Llama and Qwen3 where the layers' backward peaks (see FAMILIES).
    c("llama_forward", dtype="bf16", optimizer="sgd", seq=8),
    c("qwen3_forward", dtype="bf16", optimizer="sgd", seq=8),
    c("qwen3_forward", "full", amp="bf16", optimizer="sgd", seq=8),
    # Gemma 3 where the forward and the layers' backward peak (see FAMILIES).
    c("gemma3_forward", dtype="bf16", optimizer="sgd", batch=1, seq=8),
    c("gemma3_forward", dtype="bf16", optimizer="sgd", seq=8),
    # Its forward peaks at a norm's `+ eps` inside a selective checkpoint, whose Python
    # dispatch mode wraps the number a second time (8 B).
    c("gemma3_forward", "selective", dtype="bf16", optimizer="sgd", seq=8),
    c("gemma3_forward", "full", amp="bf16", optimizer="sgd", batch=1, seq=8),
    c("gemma3_forward_tied", dtype="bf16", optimizer="sgd", batch=1, seq=8),
    # OLMo 3: every variant, both implementations, each dtype and autocast, through its
    # window (seq 7, 8, 16, 64) and where the layers peak; selective in bf16 stops its
    # recompute at the post-feedforward norm's weight * hs, before the weight's fp32 copy.
    c("olmo3"), c("olmo3", "full"), c("olmo3", "every_2"), c("olmo3", "selective"),
    c("olmo3", "every_2", "reentrant"), c("olmo3", dtype="bf16"), c("olmo3", amp="bf16"),
    c("olmo3", "full", dtype="bf16", optimizer_impl="foreach"),
    c("olmo3", "selective", amp="bf16", optimizer_impl="fused"),
    c("olmo3", dtype="fp16", optimizer="sgd", momentum=0.9),
    c("olmo3_window"), c("olmo3_window", seq=8), c("olmo3_window", seq=7),
    c("olmo3_window", "full"), c("olmo3_window", "selective"),
    c("olmo3_window", "every_2", "reentrant"), c("olmo3_window", dtype="bf16"),
    c("olmo3_window", amp="bf16"), c("olmo3_window", dtype="fp16", seq=64),
    c("olmo3_forward", dtype="bf16", optimizer="sgd", seq=8),
    c("olmo3_forward", dtype="bf16", optimizer="sgd", batch=1, seq=8),
    c("olmo3_forward", "selective", dtype="bf16", optimizer="sgd", seq=8),
    c("olmo3_forward", "full", amp="bf16", optimizer="sgd", batch=1, seq=8),
    # Sparse mixtures of experts (grouped_mm experts; a dense first layer in qwen3_moe):
    # every variant, both implementations, each dtype and autocast, the optimizers; fp16
    # with SGD peaks in Mixtral's fp32-weighted experts' MulBackward0.
    c("qwen3_moe"), c("qwen3_moe", "full"), c("qwen3_moe", "every_2"),
    c("qwen3_moe", "selective"), c("qwen3_moe", "every_2", "reentrant"),
    c("qwen3_moe", dtype="bf16"), c("qwen3_moe", amp="bf16"),
    c("qwen3_moe_plain", optimizer_impl="foreach"), c("qwen3_moe_plain", dtype="bf16", seq=64),
    c("mixtral"), c("mixtral", dtype="bf16"), c("mixtral", amp="bf16"),
    c("mixtral", "selective", dtype="bf16"), c("mixtral", "full", dtype="fp16"),
    c("mixtral", dtype="fp16", optimizer="sgd", momentum=0.9),
    c("mixtral", "full", "reentrant", optimizer_impl="fused"),
    # The eager experts (a loop over the experts hit), predicted with the step's routing
    # (--routing=PATH from the witness): every variant, both implementations, each dtype
    # and autocast; Mixtral's fp32 weights promote each expert's rows.
    c("qwen3_moe", experts_impl="eager"), c("qwen3_moe", "full", experts_impl="eager"),
    c("qwen3_moe", "every_2", "reentrant", experts_impl="eager"),
    c("qwen3_moe", "selective", experts_impl="eager"),
    c("qwen3_moe", dtype="bf16", experts_impl="eager"),
    c("qwen3_moe", amp="bf16", experts_impl="eager"),
    c("qwen3_moe_plain", seq=64, optimizer_impl="foreach", experts_impl="eager"),
    c("mixtral", experts_impl="eager"), c("mixtral", dtype="bf16", experts_impl="eager"),
    c("mixtral", amp="bf16", experts_impl="eager"),
    c("mixtral", dtype="fp16", optimizer="sgd", momentum=0.9, experts_impl="eager"),
    # Every position the same token, so every token routes to the same experts.
    c("qwen3_moe_plain", same_token=True), c("mixtral", dtype="bf16", same_token=True),
    c("qwen3_moe_plain", experts_impl="eager", same_token=True),
    # Llama's and Qwen3's biases: every variant, both implementations, each dtype and
    # autocast; llama_all_bias small enough (SGD, a short vocabulary) that the layers peak.
    c("llama_bias"), c("llama_bias", "full"), c("llama_bias", "selective"),
    c("llama_bias", "every_2", "reentrant"), c("llama_bias", amp="bf16"),
    c("llama_bias", dtype="bf16", optimizer_impl="foreach"),
    c("llama_mlp_bias"), c("llama_mlp_bias", "selective"), c("llama_mlp_bias", amp="bf16"),
    c("llama_mlp_bias", "full", dtype="fp16", optimizer_impl="fused"),
    c("llama_all_bias", dtype="bf16", optimizer="sgd", seq=8),
    c("llama_all_bias", "selective", amp="bf16", optimizer="sgd", seq=8),
    c("qwen3_bias"), c("qwen3_bias", "full", amp="bf16"),
    # Frozen embeddings and LM head (--freeze; requires_grad_(False) in the witness): no
    # gradient nor optimizer state for them, and their matmuls save nothing for the
    # weight's gradient. Without checkpointing the first layer's input needs no gradient;
    # with it, activation_checkpointing_enable's enable_input_require_grads hook makes the
    # embeddings' output a leaf that does, held with its .grad until the loss dies. A
    # tied head freezes the embedding (qwen2_tied, and GPT-2's wte but not wpe); GPT-2's
    # leaf is wte's output, before its position embeddings and dropout; Gemma 3's the
    # scaled lookup. Each family, variant, implementation, dtype and autocast.
    c("llama_gqa", freeze=["embeddings"]), c("llama_gqa", "full", freeze=["embeddings"]),
    c("llama_gqa", freeze=["lm_head"]), c("llama_gqa", "selective", freeze=["lm_head"]),
    c("llama_gqa", "every_2", "reentrant", freeze=["embeddings", "lm_head"]),
    c("llama_gqa", "full", dtype="bf16", freeze=["embeddings", "lm_head"]),
    c("llama_mha", amp="bf16", freeze=["embeddings", "lm_head"]),
    c("qwen2_tied", "full", freeze=["lm_head"]), c("qwen3_tied", freeze=["embeddings"]),
    c("qwen3", "selective", amp="bf16", freeze=["embeddings"]),
    c("gpt2", freeze=["embeddings"]), c("gpt2", "full", freeze=["embeddings"]),
    c("gpt2", "every_2", "reentrant", freeze=["lm_head"]),
    c("gemma3", "selective", freeze=["embeddings"]), c("gemma3_window", freeze=["lm_head"]),
    c("olmo3", "full", freeze=["embeddings", "lm_head"]),
    c("qwen3_moe", "full", freeze=["embeddings"]), c("mixtral", freeze=["lm_head"]),
    c("llama_forward", dtype="bf16", optimizer="sgd", seq=8, freeze=["embeddings"]),
    # peft's LoRA (get_peft_model, LoraConfig(r, lora_alpha=2r, lora_dropout,
    # target_modules)): every base parameter frozen, lora_A and lora_B on each target,
    # their scaling a Python float (MulBackward0 keeps it, wrapped). peft's default
    # targets (q_proj, v_proj) and all-linear, r 8 and 64, with and without dropout,
    # every variant, both implementations and autocast; Qwen3, Gemma 3, OLMo 3 and a
    # mixture of experts (whose experts are no nn.Linear: their attention is adapted).
    c("llama_gqa", lora=L(8)), c("llama_gqa", "full", lora=L(8)),
    c("llama_gqa", "selective", lora=L(8)),
    c("llama_gqa", "every_2", "reentrant", lora=L(8)),
    c("llama_gqa", lora=L(64, "all-linear")), c("llama_gqa", "full", lora=L(64, "all-linear")),
    c("llama_gqa", lora=L(8, "all-linear", 0.1)),
    c("llama_gqa", "full", lora=L(8, "all-linear", 0.1)),
    c("llama_gqa", "full", lora=L(8, "q_proj,k_proj,v_proj,o_proj", 0.1)),
    # down_proj, the layer's last module, under a checkpoint whose recompute stops at
    # lora_B: peft's forward holds its input x (and x's cast) to its return.
    c("llama_mha", "full", amp="bf16", lora=L(8, "all-linear")),
    c("llama_mha", "full", lora=L(8, "down_proj", 0.1)),
    c("llama_gqa", amp="bf16", optimizer_impl="foreach", lora=L(16)),
    c("qwen3", "selective", lora=L(8, "all-linear")), c("gemma3", "full", lora=L(8, "all-linear")),
    c("olmo3", lora=L(8)), c("qwen3_moe", "full", lora=L(8)),
    c("llama_mha", "full", amp="bf16", lora=L(8, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj")),
    # A frozen k_proj's k takes no gradient, so the flash backward's grad_k dies with its
    # node; the peak is the optimizer's, after the last layer's backward (it was 4,096 B
    # high while grad_k lived on).
    c("llama_gqa", optimizer_impl="foreach", lora=L(128)),
    # On a bf16 (or fp16) model the adapters are fp32 (get_peft_model's
    # autocast_adapter_dtype): peft casts x up for them and the sum back.
    c("llama_gqa", dtype="bf16", lora=L(8)), c("llama_gqa", "full", dtype="bf16", lora=L(8, "all-linear")),
    c("llama_gqa", "selective", dtype="bf16", lora=L(8, "all-linear", 0.1)),
    c("llama_gqa", "every_2", dtype="bf16", lora=L(64, "all-linear", 0.1)),
    c("llama_gqa", dtype="bf16", optimizer_impl="foreach", lora=L(64)),
    c("llama_gqa", "full", "reentrant", dtype="bf16", lora=L(8, "all-linear", 0.1)),
    c("llama_gqa", dtype="fp16", optimizer_impl="foreach", lora=L(8, "all-linear")),
    c("qwen3", "selective", dtype="bf16", lora=L(8, "all-linear")),
    c("gemma3", dtype="bf16", lora=L(8, "all-linear", 0.1)),
    c("olmo3", "full", dtype="bf16", lora=L(16, "all-linear")),
    c("qwen3_moe", dtype="bf16", lora=L(8, "q_proj,k_proj,v_proj,o_proj", 0.1)),
    # GPT-2's Conv1D in peft's lora.Linear (dispatch_default sets fan_in_fan_out, which
    # changes no forward). With the adapter's dropout on mlp.c_proj the peak is inside
    # the block's MLP, where GPT2Block's `attn_output` local is still alive.
    c("gpt2_nodrop", lora=L(8, "c_attn")), c("gpt2_nodrop", "full", lora=L(8, "all-linear")),
    c("gpt2", lora=L(8, "all-linear", 0.1)), c("gpt2_nodrop", lora=L(8, "mlp.c_proj", 0.1)),
    c("gpt2_nodrop", "selective", dtype="bf16", lora=L(8, "all-linear")),
    c("gpt2_nodrop", "every_2", "reentrant", lora=L(16, "c_attn,c_proj")),
    c("gpt2_nodrop", amp="bf16", lora=L(8, "c_fc,c_proj", 0.1)),
    # DoRA (use_dora): a magnitude vector per target, and each forward rebuilds
    # lora_B(lora_A(eye(in))).T, whose nodes the loss never reaches (the weight norm reads
    # it detached): what they save lives to DoraLinearLayer.forward's return, or, in a
    # non-reentrant recompute, whose hook returns it, to the recompute's early stop.
    c("llama_gqa", lora=L(8, dora=True)), c("llama_gqa", "full", lora=L(8, "all-linear", dora=True)),
    c("llama_gqa", "selective", lora=L(64, dora=True)),
    c("llama_gqa", dtype="bf16", lora=L(8, "all-linear", 0.1, dora=True)),
    c("llama_gqa", "every_2", "reentrant", lora=L(8, "all-linear", dora=True)),
    c("llama_gqa", freeze=["embeddings"], lora=L(8, dora=True)),
    c("llama_mha", "full", amp="bf16", lora=L(8, "all-linear", 0.1, dora=True)),
    c("qwen3", "selective", amp="bf16", lora=L(8, "all-linear", dora=True)),
    c("qwen3", "full", dtype="bf16", lora=L(64, dora=True)),
    c("qwen3_moe", "full", dtype="bf16", lora=L(8, "q_proj,k_proj,v_proj,o_proj", 0.1, dora=True)),
    # qwen2's biased q, k and v: base_result - bias, a new tensor.
    c("qwen2_tied", lora=L(8, "all-linear", dora=True)),
    c("gemma3", "selective", lora=L(8, "all-linear", dora=True)),
    c("olmo3", dtype="bf16", lora=L(8, "all-linear", dora=True)),
    c("llama_gqa", dtype="fp16", optimizer_impl="foreach", lora=L(8, dora=True)),
    # GPT-2's Conv1D: peft's transpose wraps weight.T in a new Parameter that requires
    # grad, so the weight norm's node saves the adapted weight; `.detach()` right after
    # the norm lets it go where the norm's return would have.
    c("gpt2_nodrop", lora=L(8, "c_attn", dora=True)),
    c("gpt2_nodrop", "full", lora=L(8, "all-linear", dora=True)),
]

# What memledger does not model yet, each with the bucket it moves. A case listed here is
# still run and its other buckets must agree.
KNOWN_GAPS = {
    # With oneDNN (torch.backends.mkldnn.enabled, the default) bf16/fp16 matmuls
    # allocate a scratchpad whose size depends on the CPU's ISA; memledger predicts
    # ATen's own gemm (runtime/threads.h).
    "peak_bytes/mkldnn": "oneDNN's matmul scratchpads",
}


def gap_for(case, bucket):
    """The KNOWN_GAPS entry that explains `bucket` of `case`, or None."""
    variant = case["variant"]
    low_precision = case["dtype"] != "fp32" or case["amp"] != "none"
    if bucket == f"peak_bytes.{variant}" and low_precision and case["mkldnn"]:
        return KNOWN_GAPS["peak_bytes/mkldnn"]
    return None


def is_study(case):
    return FAMILIES[case["model"]]["family"] == "study"


def skip_without_study(test):
    """Skips `test` where the reference study is not here (witness.study_skip_reason)."""
    reason = witness.study_skip_reason()
    if reason:
        test.skipTest(reason)


class RealStackTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        warnings.filterwarnings("ignore")
        cls.tmp = tempfile.mkdtemp()

    def test_cases_are_exact(self):
        failures, rows = [], []
        study_missing = witness.study_skip_reason()
        skipped = [case for case in CASES if study_missing and is_study(case)]
        if skipped:
            print(f"skipped {len(skipped)} study cases: {study_missing}", flush=True)
        for case in CASES:
            if study_missing and is_study(case):
                continue
            predicted, measured = run_case(case, self.tmp)
            for line in mismatches(predicted, measured):
                bucket = line.split(":")[0]
                gap = gap_for(case, bucket)
                rows.append(f"{case_id(case)}  {line}" + (f"  (known: {gap})" if gap else ""))
                if gap is None:
                    failures.append(f"{case_id(case)}: {line}")
            print(f"{case_id(case)}: " + ("exact" if not mismatches(predicted, measured)
                                          else "differs"), flush=True)
        print("\n".join(rows))
        self.assertEqual(failures, [], "\n".join(failures))

    def test_the_witness_counts_by_hand(self):
        skip_without_study(self)
        # The study's 2 layers at width 32: 2 x (12 d^2 + 13 d) = 25,408 fp32 parameters
        # (101,632 B) in 2 x 12 tensors. AdamW's state: exp_avg and exp_avg_sq of each,
        # 2 x 101,632, and a 0-dim fp32 step per tensor, 24 x 4 = 96: 203,360 B. SGD
        # without momentum keeps nothing. Input (2, 16, 32) fp32 = 4,096 B, kept by the
        # first layer's LayerNorm; `none` then holds what it saved less that input.
        base = {**witness.DEFAULTS, "study": True, "layers": 2, "width": 32, "heads": 2,
                "batch": 2, "seq": 16}
        adamw = witness.measure(base)
        self.assertEqual(adamw["param_bytes"], 101632)
        self.assertEqual(adamw["grad_bytes"], 101632)
        self.assertEqual(adamw["optimizer_state_bytes"], 203360)
        self.assertEqual(adamw["optimizer_step_tensor_bytes"], 96)
        self.assertEqual(adamw["input_bytes"], 4096)
        self.assertEqual(adamw["held_after_forward"], adamw["saved_bytes"] - 4096)
        sgd = witness.measure({**base, "optimizer": "sgd"})
        self.assertEqual(sgd["optimizer_state_bytes"], 0)

    def test_routing_moves_only_the_eager_experts_peak(self):
        # grouped_mm: a step whose tokens all route to the same experts measures what a
        # step of random tokens does, bucket by bucket. Eager: predicted with the balanced
        # split instead of the step's routing, the saved bytes still agree (each expert's
        # rows sum to the same total) and the peak does not.
        _, spread = run_case(c("qwen3_moe_plain"), self.tmp)
        _, same = run_case(c("qwen3_moe_plain", same_token=True), self.tmp)
        self.assertEqual(spread, same)
        case = c("qwen3_moe_plain", experts_impl="eager")
        _, measured = run_case(case, self.tmp)
        spec = FAMILIES[case["model"]]
        path = Path(self.tmp) / "balanced.json"
        path.write_text(json.dumps(hf_config(spec)))
        out = subprocess.run([PREDICT, f"--model={path}", "--batch=2", "--seq=16",
                              "--variants=none", "--optimizer_impl=for_loop",
                              "--experts_impl=eager", "--routing=balanced"],
                             capture_output=True, text=True, check=True)
        balanced = json.loads(out.stdout)
        self.assertEqual(balanced["saved_bytes"]["none"], measured["saved_bytes.none"])
        self.assertNotEqual(balanced["peak_bytes"]["none"], measured["peak_bytes.none"])

    def test_a_wrong_rule_fails_naming_the_bucket(self):
        skip_without_study(self)
        # The comparison's failure path: predict a for-loop AdamW step, measure a
        # foreach one. foreach's step holds a square root of every exp_avg_sq at once, so
        # only the peak differs, and the report names it.
        case = c("study", optimizer_impl="for_loop")
        predicted, _ = run_case(case, self.tmp)
        _, measured = run_case({**case, "optimizer_impl": "foreach"}, self.tmp)
        found = mismatches(predicted, measured)
        self.assertEqual(len(found), 1, found)
        self.assertTrue(found[0].startswith("peak_bytes.none: predicted"), found)


if __name__ == "__main__":
    PREDICT = os.path.realpath(sys.argv.pop(1))
    unittest.main()
