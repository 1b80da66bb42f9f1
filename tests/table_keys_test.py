"""Every number a table prints is a value of its JSON: predict's table (one process, a
tensor-parallel rank, the ranks of dp and pp layouts, CUDA, autocast, MoE, Gemma 3's
mask), the planner's and the layout search's, each rendered from the same request
through the C ABI ("format": "table" and "json"), which the CLIs print byte for byte.

How a table's number is matched against the JSON's values (strings such as op names are
taken out of the table first, so their digits are not numbers):
- "3.07 MiB", "32 B": HumanBytes (estimator/report/units.cc) of one of the JSON's integers;
- "(4026748 B)": the integer itself;
- "15.1%": a share in the JSON (shares are rounded to 4 places there);
- "1.6 us", "2.3 ms", "4 s": a JSON number in seconds, to the printed precision;
- any other number: a JSON number, to the printed precision.
A number equal to some other key's value passes too, so this finds sums and derived
numbers that have no key (it found the old "16-bit" and "integer, bool" columns, sums
of dtypes), not a number printed under the wrong key."""

import json
import os
import re
import sys
import unittest

sys.path.insert(0, os.path.join(os.environ.get("TEST_SRCDIR", "."), "memledger", "api"))
import memledger  # noqa: E402

UNITS = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"]
SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
NUMBER = re.compile(
    r"(?<![\w.\-/+])(-?\d[\d,]*(?:\.\d+)?(?:e[+-]\d+)?)"
    r"(%| B\b| KiB\b| MiB\b| GiB\b| TiB\b| PiB\b| EiB\b| s\b| ms\b| us\b)?(?![\w.])")


def human_bytes(n):
    """estimator/report/units.cc's HumanBytes, written again."""
    if n < 1024:
        return f"{n} B"
    value, unit = float(n), -1
    while value >= 1024 and unit < 5:
        value /= 1024
        unit += 1
    return f"{value:.2f} {UNITS[unit]}"


def leaves(value, out):
    if isinstance(value, dict):
        for v in value.values():
            leaves(v, out)
    elif isinstance(value, list):
        for v in value:
            leaves(v, out)
    else:
        out.append(value)
    return out


def printed_as(value, token):
    """Whether `value` printed with `token`'s precision gives `token`."""
    mantissa = token.split("e")[0]
    digits = len(mantissa.split(".")[1]) if "." in mantissa else 0
    t = float(token)
    if "e" in token:
        return abs(value - t) <= abs(t) * 0.5 * 10 ** -digits
    return abs(value - t) <= 0.5 * 10 ** -digits + 1e-9 * abs(t)


def numbers_without_keys(table, data):
    """The table's numbers that are none of `data`'s values."""
    values = leaves(data, [])
    for s in sorted({v for v in values if isinstance(v, str) and len(v) > 1}, key=len,
                    reverse=True):
        table = table.replace(s, " ")
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    integers = {v for v in numbers if isinstance(v, int)}
    humans = {human_bytes(v) for v in integers if v >= 0}
    missing = []
    for match in NUMBER.finditer(table):
        token, unit = match.group(1).replace(",", ""), (match.group(2) or "").strip()
        if unit == "B" and "." not in token and int(token) in integers:
            continue
        if unit in ["B"] + UNITS:
            found = f"{token} {unit}" in humans
        elif unit == "%":
            found = any(abs(100 * v - float(token)) <= 0.051 for v in numbers)
        elif unit in SECONDS:
            found = any(printed_as(v / SECONDS[unit], token) for v in numbers)
        else:
            found = any(printed_as(v, token) for v in numbers)
        if not found:
            missing.append(match.group(0))
    return missing


class CheckerTest(unittest.TestCase):
    def test_it_finds_a_number_without_a_key(self):
        table = "saved 3.07 MiB, 12345 bytes, 15.1% of it, op layer 1 (x)\n"
        data = {"saved": 3217444, "share": 0.1515, "op": "layer 1 (x)"}
        self.assertEqual(numbers_without_keys(table, data), ["12345"])
        self.assertEqual(numbers_without_keys("sum 6.14 MiB\n", data), ["6.14 MiB"])


class TableKeysTest(unittest.TestCase):
    def check(self, kind, **request):
        code, table = memledger._call(kind, json.dumps(dict(request, format="table")))
        self.assertEqual(code, 0, table)
        code, text = memledger._call(kind, json.dumps(dict(request, format="json")))
        self.assertEqual(code, 0, text)
        self.assertEqual(numbers_without_keys(table, json.loads(text)), [],
                         f"{kind} {request}:\n{table}")

    def test_predict(self):
        for request in [
                dict(),
                dict(model="tiny-llama", amp="bf16"),
                dict(model="tiny-llama", tp=2, sp=True),
                dict(model="tiny-qwen3-moe", experts_impl="eager"),
                dict(model="tiny-qwen3-moe", dtype="bf16"),  # int64 and int32 saved
                dict(model="tiny-gemma3", seq=1100, dtype="bf16"),  # past the window
        ]:
            with self.subTest(**request):
                self.check("predict", **request)

    def test_predict_on_cuda(self):
        for request in [
                dict(model="tiny-llama", dtype="bf16", device="cuda"),
                # flash keeps uint64 RNG tensors beside the int64 labels
                dict(model="tiny-gpt2", dtype="fp16", device="cuda", sdpa_backend="flash"),
                dict(model="tiny-llama", amp="bf16", device="cuda", sdpa_backend="efficient"),
        ]:
            with self.subTest(**request):
                self.check("predict", **request)

    def test_predict_per_rank(self):
        for request in [
                dict(model="tiny-llama", dp=2, zero=1),
                dict(model="tiny-llama", pp=2, micro_batches=4),
                dict(model="tiny-llama", dp=2, zero=3, dtype="bf16", device="cuda"),
        ]:
            with self.subTest(**request):
                self.check("predict", **request)

    def test_plan(self):
        self.check("plan", model="tiny-llama", budget_gib=0.004)
        self.check("plan", model="tiny-llama", budget_gib=0.004, dp=2, zero=1)

    def test_search(self):
        self.check("search", model="tiny-llama", gpus=4, global_batch=16,
                   gpu_memory_gib=0.01)


if __name__ == "__main__":
    unittest.main()
