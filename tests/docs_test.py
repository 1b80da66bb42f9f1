"""The docs list what the registry has: every built-in model and every config.json
model_type that `predict --help` lists (from the families' registry, ModelFlagHelp) is
named in docs/flags.md's --model row, and nothing there is a model the registry lacks."""
import os
import re
import subprocess
import sys
import unittest

PREDICT = sys.argv.pop(1) if len(sys.argv) > 1 else "estimator/predict"


def model_help():
    """--model's help from `predict --help`, as one line."""
    out = subprocess.run([PREDICT, "--help"], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("--model"))
    text = []
    for line in lines[start + 1:]:
        if line.strip().startswith("--"):
            break
        text.append(line.strip())
    return " ".join(text)


class DocsTest(unittest.TestCase):
    def test_flags_md_names_every_model_of_the_registry(self):
        text = model_help()
        presets = re.search(r"a built-in name \(([^)]*)\)", text)
        types = re.search(r"model_type ([^)]*)\)", text)
        self.assertIsNotNone(presets, text)
        self.assertIsNotNone(types, text)
        names = [n.strip() for n in presets.group(1).split(",")]
        model_types = [t.strip() for t in types.group(1).split(",")]
        self.assertIn("tiny-olmo3", names)
        with open("docs/flags.md", encoding="utf-8") as f:
            row = next(line for line in f if line.startswith("| `--model` |"))
        documented = set(re.findall(r"`([a-z0-9][a-z0-9._-]*)`", row))
        missing = [n for n in names if n not in documented]
        self.assertEqual(missing, [], "presets the registry has and docs/flags.md does not")
        for model_type in model_types:
            self.assertRegex(row, rf"\b{re.escape(model_type)}\b", model_type)
        # Every backquoted built-in-looking name in the row is a preset (the row's other
        # backquoted words are flags and file names).
        looks_like_model = {n for n in documented
                            if re.match(r"^(tiny-|llama-|qwen|mistral|mixtral|gemma-|olmo-|"
                                        r"gpt2|megatron|study)", n)}
        self.assertEqual(sorted(looks_like_model - set(names)), [],
                         "docs/flags.md names models the registry does not have")


if __name__ == "__main__":
    unittest.main()
