#!/usr/bin/env bash
# Runs each fuzzer named in the arguments for ${FUZZ_SECONDS:-30} s on a scratch copy of
# its seed corpus (fuzz/corpus/<fuzzer without _fuzzer>) and prints its executions per
# second. A crash, leak or sanitizer report fails the test; the reproducer is left in
# $TEST_UNDECLARED_OUTPUTS_DIR (bazel-testlogs/fuzz/fuzz_test/test.outputs).
set -euo pipefail
seconds="${FUZZ_SECONDS:-30}"
outputs="${TEST_UNDECLARED_OUTPUTS_DIR:-$TEST_TMPDIR}"
passed=0
failed=0
for fuzzer in "$@"; do
  name="${fuzzer%_fuzzer}"
  corpus="$TEST_TMPDIR/corpus_$name"
  mkdir -p "$corpus"
  cp fuzz/corpus/"$name"/* "$corpus"/
  log="$outputs/$fuzzer.log"
  # A dictionary (fuzz/dicts/<name>.dict): the tokens a careless or hostile input holds
  # (transformers' alias keys, control bytes, counts near INT64_MAX).
  dict=()
  [[ -f "fuzz/dicts/$name.dict" ]] && dict=(-dict="fuzz/dicts/$name.dict")
  if "fuzz/$fuzzer" -max_total_time="$seconds" -print_final_stats=1 -timeout=10 \
       -rss_limit_mb=2048 -artifact_prefix="$outputs/$fuzzer-" "${dict[@]}" "$corpus" \
       > "$log" 2>&1; then
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
    echo "$fuzzer: $runs runs in ${seconds} s, $speed exec/s, no findings"
    ((++passed))
  else
    echo "$fuzzer: FAILED; its log:" >&2
    tail -40 "$log" >&2
    ((++failed))
  fi
done
echo "fuzz_test: $passed passed, $failed failed"
((failed == 0))
