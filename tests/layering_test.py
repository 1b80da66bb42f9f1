"""estimator/'s folders follow the flow of a prediction, and each folder includes only
from itself and the folders before it:

    spec -> graph -> families -> request -> parallel -> saved -> step -> predict -> report
    -> cli

spec is the vocabulary (ModelConfig, config.json keys), graph the op graphs and ATen's
rules, families each model family's graphs and reader, request a run resolved and
validated against the families, parallel the parallel strategies' own rules (DDP's
buckets), saved what autograd keeps, step the step's simulation,
predict the buckets and ranks, report what is written, cli the predict binary. A header
of a later folder included by an earlier one fails here, naming both files.
"""
import os
import re
import unittest

ORDER = ["spec", "graph", "families", "request", "parallel", "saved", "step", "predict",
         "report", "cli"]
INCLUDE = re.compile(r'^#include "estimator/([a-z_]+)/', re.MULTILINE)
# A family's own names, which only its folders (and the registries' lists) may use.
FAMILY_TOKEN = re.compile(r"\bFamily::k[A-Z]\w*|\b\w+(?<!Runtime)(?<!Of)Family\(\)|"
                          r"\b\w+RuntimeFamily\(\)")


def shared_code_lines():
    """(path, line number, the line's code before any // comment) of every C++ file
    outside the families' folders."""
    for top in ("estimator", "runtime", "planner", "verify", "api"):
        for parent, _, names in os.walk(top):
            if "/families" in parent or parent.endswith("families"):
                continue
            for name in sorted(names):
                if not name.endswith((".cc", ".h")):
                    continue
                path = os.path.join(parent, name)
                with open(path, encoding="utf-8") as f:
                    for number, line in enumerate(f, 1):
                        yield path, number, line.split("//", 1)[0]


class LayeringTest(unittest.TestCase):
    def test_each_folder_includes_only_from_earlier_ones(self):
        root = "estimator"
        folders = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
        self.assertEqual(folders, sorted(ORDER), "a folder of estimator/ is not in ORDER")
        checked = 0
        for folder in ORDER:
            # A folder's files and its subfolders' (a family's folder under families/).
            paths = sorted(os.path.join(parent, name)
                           for parent, _, names in os.walk(os.path.join(root, folder))
                           for name in names)
            for path in paths:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                for target in INCLUDE.findall(text):
                    self.assertIn(target, ORDER, f"{path} includes estimator/{target}/")
                    self.assertLessEqual(
                        ORDER.index(target), ORDER.index(folder),
                        f"{path} ({folder}/) includes estimator/{target}/, which comes later")
                checked += 1
        self.assertGreater(checked, 60)  # every source file was read

    def test_shared_code_names_no_family(self):
        # Outside a family's folders, code names no family: it asks the registry
        # (FamilyOf, Families, FamilyNames) and the FamilyDef's capabilities. Comments may.
        found = [f"{path}:{number}: {token}"
                 for path, number, code in shared_code_lines()
                 for token in FAMILY_TOKEN.findall(code)]
        self.assertEqual(found, [], "\n".join(found))

    def test_step_names_no_family_and_asks_no_capability(self):
        # The step simulator runs graphs: the model's own tensors too are the family's
        # graphs (ModelGraphs::tensors_*_prologue), so estimator/step/ names no family,
        # not even in a comment, and asks no FamilyDef capability.
        with open("estimator/spec/families.inc", encoding="utf-8") as f:
            registered = re.findall(r"^MEMLEDGER_FAMILY\((\w+)\)", f.read(), re.MULTILINE)
        self.assertGreaterEqual(len(registered), 5)
        # The registry's families, and the model types they read under other names.
        names = [n for n in registered if n != "Study"] + [
            "Mistral", "Qwen", "Mixtral", "GPT-2", "Gemma", "OLMo"]
        forbidden = re.compile(r"\b(" + "|".join(re.escape(n) for n in names) + r")|"
                               r"\bFamilyOf\(|\bFamilyDef\b", re.IGNORECASE)
        found = []
        for name in sorted(os.listdir("estimator/step")):
            path = os.path.join("estimator/step", name)
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    for match in forbidden.finditer(line):
                        found.append(f"{path}:{number}: {match.group(0)}")
        self.assertEqual(found, [], "\n".join(found))

    def test_shared_code_declares_no_family_function_and_lists_no_model_type(self):
        # A family's own functions (LlamaShardOf) are declared in its folder's headers,
        # and messages list families or presets by asking the registry (FamilyNames,
        # PresetNamesWith), never from a hand-written list such as "(qwen3_moe, mixtral)"
        # that the next family would make false. The study is left out of the names: its
        # name is also the reference study's, whose policy and report head shared code
        # names (StudyPolicy, StudyJsonHead).
        with open("estimator/spec/families.inc", encoding="utf-8") as f:
            registered = re.findall(r"^MEMLEDGER_FAMILY\((\w+)\)", f.read(), re.MULTILINE)
        own_name = re.compile(r"\b(" + "|".join(n for n in registered if n != "Study") +
                              r")[A-Z]\w*")
        model_types = set()
        for parent, _, names in os.walk("estimator/families"):
            for name in names:
                with open(os.path.join(parent, name), encoding="utf-8") as f:
                    for listed in re.findall(r"\.model_types = \{([^}]*)\}", f.read()):
                        model_types.update(re.findall(r'"(\w+)"', listed))
        self.assertGreaterEqual(len(model_types), 8)
        model_type = re.compile(r"\b(" + "|".join(sorted(model_types)) + r")\b")
        found = []
        for path, number, code in shared_code_lines():
            for match in own_name.finditer(code):
                found.append(f"{path}:{number}: {match.group(0)}")
            if os.path.dirname(path) not in ("estimator/graph", "estimator/request"):
                continue  # the folders that validate and read
            for literal in re.findall(r'"((?:[^"\\]|\\.)*)"', code):
                if model_type.search(literal):
                    found.append(f"{path}:{number}: \"{literal}\"")
        self.assertEqual(found, [], "\n".join(found))


if __name__ == "__main__":
    unittest.main()
