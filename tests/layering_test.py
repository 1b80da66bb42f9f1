"""estimator/'s folders follow the flow of a prediction, and each folder includes only
from itself and the folders before it:

    spec -> graph -> families -> request -> saved -> step -> predict -> report -> cli

spec is the vocabulary (ModelConfig, config.json keys), graph the op graphs and ATen's
rules, families each model family's graphs and reader, request a run resolved and
validated against the families, saved what autograd keeps, step the step's simulation,
predict the buckets and ranks, report what is written, cli the predict binary. A header
of a later folder included by an earlier one fails here, naming both files.
"""
import os
import re
import unittest

ORDER = ["spec", "graph", "families", "request", "saved", "step", "predict", "report", "cli"]
INCLUDE = re.compile(r'^#include "estimator/([a-z_]+)/', re.MULTILINE)


class LayeringTest(unittest.TestCase):
    def test_each_folder_includes_only_from_earlier_ones(self):
        root = "estimator"
        folders = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
        self.assertEqual(folders, sorted(ORDER), "a folder of estimator/ is not in ORDER")
        checked = 0
        for folder in ORDER:
            for name in sorted(os.listdir(os.path.join(root, folder))):
                path = os.path.join(root, folder, name)
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                for target in INCLUDE.findall(text):
                    self.assertIn(target, ORDER, f"{path} includes estimator/{target}/")
                    self.assertLessEqual(
                        ORDER.index(target), ORDER.index(folder),
                        f"{path} ({folder}/) includes estimator/{target}/, which comes later")
                checked += 1
        self.assertGreater(checked, 60)  # every source file was read


if __name__ == "__main__":
    unittest.main()
