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

# The Python module: docs/api.md's example, and predict_many.
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
grep -q "^  --sweep" help.txt || fail "predict --help without --sweep"
run memledger plan --help > help.txt || fail "memledger plan --help"
grep -q "^  --flops_per_second" help.txt && grep -q "^  --frontier_svg" help.txt ||
  fail "memledger plan --help: $(cat help.txt)"
run memledger search --help > help.txt || fail "memledger search --help"
grep -q "^  --chart_svg" help.txt || fail "memledger search --help: $(cat help.txt)"
# search refuses --timeline_svg as //planner:search does, and its help does not list it.
grep -q "^  --timeline_svg" help.txt && fail "memledger search --help lists --timeline_svg"
set +e
run memledger search --gpus=2 --global_batch=2 --timeline_svg=x.svg 2> err.txt; code=$?
set -e
[[ $code == 2 && "$(cat err.txt)" == "error: --timeline_svg draws one step: run predict with a layout's flags" ]] ||
  fail "search --timeline_svg: exit $code, $(cat err.txt)"
# predict's sweep: a CSV row per point, --json_out the same rows.
run memledger predict --model=tiny-llama --variants=full --sweep=batch:1..4 --json_out=rows.csv > sweep.csv ||
  fail "memledger predict --sweep"
[[ $(wc -l < sweep.csv) == 4 ]] && grep -q "^tiny-llama,2,2,64,full," sweep.csv &&
  cmp -s sweep.csv rows.csv || fail "predict --sweep's rows: $(cat sweep.csv)"
# The planner's files: the JSON twice, the plan's step and the frontier.
run memledger plan --model=tiny-llama --budget_gib=0.01 --plan_out=plan.json --json_out=plan2.json \
  --timeline_svg=plan.svg --frontier_svg=frontier.svg > plan_stdout.json || fail "plan's files"
cmp -s plan.json plan_stdout.json && cmp -s plan2.json plan_stdout.json ||
  fail "--plan_out and --json_out are not plan's JSON"
grep -q "the plan" plan.svg && grep -q "<svg" frontier.svg || fail "plan's charts"
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
# The command's files are the binaries' (estimator/cli/output_files.h): a FIFO is refused
# and stays one, a link is written through, a full standard output is exit 2 with no file.
mkfifo fifo
set +e
run memledger predict --model=tiny-llama --json_out=fifo > /dev/null 2> err.txt
code=$?
set -e
[[ $code == 2 && -p fifo ]] && grep -q "is a FIFO, not a regular file" err.txt ||
  fail "--json_out=FIFO: exit $code, $(cat err.txt)"
echo old > target.json && ln -s target.json link.json
run memledger predict --model=tiny-llama --json_out=link.json > linked.json
[[ -L link.json ]] && cmp -s target.json linked.json || fail "--json_out through a link"
if [[ -e /dev/full ]]; then
  set +e
  run memledger predict --model=tiny-llama --json_out=full.json > /dev/full 2> err.txt
  code=$?
  set -e
  [[ $code == 2 && ! -e full.json ]] && grep -q "cannot write to standard output" err.txt &&
    ! grep -q Traceback err.txt || fail "stdout on /dev/full: exit $code, $(cat err.txt)"
fi
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
