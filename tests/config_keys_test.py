"""Every key of every configuration class memledger reads is modelled or refused
(issue 53): for each model_type the families read (the registry's list, from predict's
own error), transformers 5.23.0's configuration class with its defaults is written as a
config.json, and `predict --config_keys` must know each of its keys: read by the
family's reader, or listed as not changing memory with a reason (FamilyDef::
inert_config_keys and the keys every transformers config has). A key that is neither
fails here, naming it: read it, refuse it, or say why it changes no memory.

Run with the reference stack's Python: run_reference_python.sh PYTHON this PREDICT."""
import json
import os
import re
import subprocess
import sys
import tempfile
import unittest

from transformers import CONFIG_MAPPING

PREDICT = sys.argv.pop(1) if len(sys.argv) > 1 else "estimator/predict"


def predict(*args):
    return subprocess.run([PREDICT, *args], capture_output=True, text=True)


def model_types(directory):
    """The model_types the registry's readers take, from the refusal of one they do not:
    "'x' is not supported (llama, mistral, ...)"."""
    path = os.path.join(directory, "unknown.json")
    with open(path, "w") as f:
        json.dump({"model_type": "no-such-type"}, f)
    out = predict(f"--model={path}", "--config_keys")
    found = re.search(r"is not supported \(([^)]*)\)", out.stderr)
    assert found, out.stderr
    return [t.strip() for t in found.group(1).split(",")]


# A small config.json of each model_type whose configuration class has an attribute_map,
# and a value for each alias other than its key's: transformers builds the model with the
# alias's value (or, where the class's field is the alias, the key's), and so must
# memledger count it.
SMALL = {
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 32, "vocab_size": 128},
    "mixtral": {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
                "num_experts_per_tok": 2, "num_local_experts": 4},
    "qwen3_moe": {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                  "num_local_experts": 4},
}
ALIAS_VALUES = {"hidden_size": 128, "num_hidden_layers": 3, "num_attention_heads": 8,
                "max_position_embeddings": 48, "num_experts": 6}


def transformers_parameters(config):
    """The parameter count of transformers' own causal LM built from `config`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    return sum(p.numel() for p in model.parameters())


def default_config_report(directory, model_type):
    """--config_keys's report on the config.json transformers writes for `model_type`'s
    configuration class with its defaults."""
    path = os.path.join(directory, f"{model_type}.config.json")
    with open(path, "w") as f:
        json.dump(CONFIG_MAPPING[model_type]().to_dict(), f, default=str)
    out = predict(f"--model={path}", "--config_keys")
    if out.returncode != 0:
        raise AssertionError(f"{model_type}: {out.stderr}")
    return json.loads(out.stdout)


class ConfigKeysTest(unittest.TestCase):
    def test_aliases_are_transformers_attribute_maps_and_count_as_transformers_does(self):
        directory = tempfile.mkdtemp()
        for model_type in model_types(directory):
            attribute_map = dict(CONFIG_MAPPING[model_type].attribute_map)
            report = default_config_report(directory, model_type)
            self.assertEqual(report["aliases"], attribute_map, model_type)
            for alias, key in attribute_map.items():
                if key in report["not_read"]:  # a key that changes no memory (a token id)
                    continue
                self.assertIn(model_type, SMALL, "give it a small config to count")
                base = {"model_type": model_type, **SMALL[model_type]}
                alone = {k: v for k, v in base.items() if k != key}
                for written in ({**base, alias: ALIAS_VALUES[alias]},
                                {**alone, alias: ALIAS_VALUES[alias]}):
                    with self.subTest(model_type=model_type, config=written):
                        path = os.path.join(directory, f"{model_type}.{alias}.json")
                        with open(path, "w") as f:
                            json.dump(written, f)
                        out = predict(f"--model={path}", "--seq=8", "--batch=1")
                        self.assertEqual(out.returncode, 0, out.stderr)
                        self.assertEqual(json.loads(out.stdout)["n_params"],
                                         transformers_parameters(written))

    def test_every_configuration_class_key_is_read_refused_or_inert(self):
        directory = tempfile.mkdtemp()
        types = model_types(directory)
        self.assertGreaterEqual(len(types), 10, types)
        for model_type in types:
            with self.subTest(model_type=model_type):
                report = default_config_report(directory, model_type)
                self.assertEqual(report["unknown"], [],
                                 f"{model_type}: keys neither read, refused nor inert")
                for key, why in report["not_read"].items():
                    self.assertTrue(why, f"{model_type}: {key} has no reason")
                # The sizes are read, not waved through.
                self.assertTrue(set(report["read"]) & {"hidden_size", "n_embd",
                                                       "text_config.hidden_size"},
                                report["read"])

    def test_an_unknown_key_is_reported(self):
        directory = tempfile.mkdtemp()
        config = CONFIG_MAPPING["llama"]().to_dict()
        config["my_new_key"] = 3
        path = os.path.join(directory, "llama.json")
        with open(path, "w") as f:
            json.dump(config, f, default=str)
        out = predict(f"--model={path}", "--config_keys")
        self.assertEqual(out.returncode, 0, out.stderr)
        report = json.loads(out.stdout)
        self.assertEqual(report["unknown"], ["my_new_key"])
        self.assertIn("hidden_size", report["read"])
        self.assertIn("pretraining_tp", report["not_read"])


if __name__ == "__main__":
    unittest.main()
