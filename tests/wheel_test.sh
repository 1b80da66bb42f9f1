#!/usr/bin/env bash
# The wheel as a new user installs it: `pip install --no-index` into a fresh venv, then
# `import memledger` and the `memledger` command, from a directory and an environment
# with none of Bazel's outputs (env -i: no LD_LIBRARY_PATH, no PYTHONPATH). The module's
# Abseil libraries must come from the wheel's memledger.libs/, not the machine's.
set -euo pipefail
wheel="$(realpath "$1")"
venv="$TEST_TMPDIR/venv"
python3 -m venv "$venv"
"$venv/bin/pip" install --no-index --no-deps --quiet "$wheel"
cd "$TEST_TMPDIR"
run() { env -i PATH="$venv/bin:/usr/bin:/bin" HOME="$TEST_TMPDIR" "$@"; }
fail() { echo "FAIL: $*" >&2; exit 1; }

site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')"
ldd "$site/memledger.so" | grep libabsl_ | grep -v "$site/memledger.libs/" &&
  fail "an Abseil library resolved outside the wheel"
ldd "$site/memledger.so" | grep -q "not found" && fail "a library of the module is missing"

# The Python module: the README's example, and predict_many.
run python -c '
import memledger
p = memledger.predict(model="llama-3-8b", batch=1, seq=8192, amp="bf16")
assert p["n_params"] == 8030261248, p["n_params"]
assert memledger.__version__.startswith("memledger 1 (torch 2.15.0, transformers 5.23.0)")
many = memledger.predict_many([dict(batch=b) for b in (1, 2, 4)], peak=False)
assert [m["saved_bytes"] for m in many] == [memledger.predict(batch=b)["saved_bytes"] for b in (1, 2, 4)]
' || fail "import memledger"

# The command: predict's JSON, its table, its exit codes, and plan's.
out="$(run memledger predict --model=llama-3-8b --seq=4096)" || fail "memledger predict"
echo "$out" | run python -c 'import json, sys; d = json.load(sys.stdin); assert d["n_params"] == 8030261248' ||
  fail "memledger predict's JSON"
run memledger predict --model=tiny-llama --format=table | grep -q "^peak of the step" ||
  fail "memledger predict --format=table"
set +e
run memledger predict --seq=0 2> err.txt; code=$?
set -e
[[ $code == 2 && "$(cat err.txt)" == "error: --seq must be >= 1, got 0" ]] ||
  fail "bad input: exit $code, $(cat err.txt)"
set +e
run memledger plan --budget_gib=0.001 2> err.txt; code=$?
set -e
[[ $code == 3 ]] || fail "no plan fits: exit $code, $(cat err.txt)"
run memledger plan --budget_gib=1 | grep -q '"plan"' || fail "memledger plan"
run memledger --help | grep -q "checkpointing: --variants" || fail "memledger --help"
# Each command's --help: its Bazel CLI's, grouped, with meanings and defaults, less the
# flags only the Bazel CLI takes, which it names.
run memledger predict --help > help.txt || fail "memledger predict --help"
grep -q "^  memledger predict --layers=96" help.txt || fail "predict --help's example: $(head help.txt)"
grep -q "^output:" help.txt && grep -q "^  --snapshot_out" help.txt &&
  grep -q "^  --batch (default 16)" help.txt || fail "predict --help's flags: $(cat help.txt)"
grep -q "^  --sweep" help.txt && fail "predict --help lists --sweep, which it does not take"
grep -q "Only the Bazel CLI (./bazelw run //:predict --) takes --budget_gib, --cpu_threads, --sweep." help.txt ||
  fail "predict --help's last line: $(tail -2 help.txt)"
run memledger plan --help | grep -q "^  --flops_per_second" || fail "memledger plan --help"
run memledger search --help | grep -q "^  --chart_svg" || fail "memledger search --help"
set +e
run memledger predict --sweep=batch:1..4 2> err.txt; code=$?
set -e
[[ $code == 2 && "$(cat err.txt)" == "error: --sweep is the Bazel CLI's (./bazelw run //:predict -- --sweep=...); memledger predict does not take it" ]] ||
  fail "--sweep: exit $code, $(cat err.txt)"
# The files predict writes beside its output, as the Bazel CLI writes them.
run memledger predict --model=tiny-llama --variants=full --format=table --json_out=p.json \
  --timeline_svg=t.svg --snapshot_out=s.pickle > table.txt || fail "predict's files"
[[ "$(cat p.json)" == "$(run memledger predict --model=tiny-llama --variants=full)" ]] ||
  fail "--json_out is not predict's JSON"
grep -q "^peak of the step" table.txt || fail "predict's table beside its files"
grep -q "<svg" t.svg || fail "--timeline_svg"
run python -c '
import pickle
s = pickle.load(open("s.pickle", "rb"))
assert {"segments", "device_traces"} <= set(s), sorted(s)
' || fail "--snapshot_out"
# A snapshot of four variants is bad input: exit 2, and no file is written.
set +e
run memledger predict --model=tiny-llama --json_out=none.json --snapshot_out=four.pickle 2> err.txt
code=$?
set -e
[[ $code == 2 && ! -e four.pickle && ! -e none.json ]] ||
  fail "--snapshot_out of four variants: exit $code, $(cat err.txt)"
run memledger plan --model=tiny-llama --budget_gib=0.01 --flops_per_second=1e12 |
  grep -q '"step_seconds"' || fail "memledger plan --flops_per_second"
run memledger search --model=tiny-llama --gpus=2 --global_batch=2 --chart_svg=chart.svg |
  grep -q '"layouts"' || fail "memledger search"
grep -q "<svg" chart.svg || fail "memledger search --chart_svg"
set +e
run memledger search --model=tiny-llama --gpus=2 --global_batch=2 --gpu_memory_gib=0.000001 2> err.txt
code=$?
set -e
[[ $code == 3 ]] || fail "no layout fits: exit $code, $(cat err.txt)"
# predict_many's rate from the installed wheel, printed for the record (a timed number
# is no assertion: //api:python_benchmark measures it).
run python -c '
import time, memledger
requests = [dict(batch=b, seq=8 * s) for b in range(1, 65) for s in range(1, 201)]  # distinct
memledger.predict_many(requests[:640], peak=False)
rates = []
for _ in range(5):  # the median of five calls, as python_benchmark takes it
    start = time.perf_counter()
    memledger.predict_many(requests, peak=False)
    rates.append(len(requests) / (time.perf_counter() - start))
print(f"wheel_test: predict_many(peak=False), 12,800 distinct requests: {sorted(rates)[2]:,.0f}/s "
      f"(the median of 5; the first call {rates[0]:,.0f}/s)")
'
echo "wheel_test: installed in a fresh venv; module and command work"
