#!/usr/bin/env bash
# bazelw with stand-in dpkg-query, id, apt-get, python3 (pip) and bazel on PATH: quiet
# and exec'ing bazel when nothing is missing; naming what is missing and the command when
# it cannot install it; installing Debian packages when root and the torch wheel into its
# cache directory, atomically.
set -euo pipefail

bazelw="$(pwd)/bazelw"
stubs="$TEST_TMPDIR/stubs"
mkdir -p "$stubs"
fail() { echo "FAIL: $*" >&2; exit 1; }
passed=0
# expect_failure CMD...: runs CMD expecting a non-zero exit; its output goes to $out.
expect_failure() {
  set +e
  out=$("$@" 2>&1)
  local rc=$?
  set -e
  [[ $rc -ne 0 ]] || fail "exited 0: $*"
}

# dpkg-query reports every package installed except those in $MISSING.
cat > "$stubs/dpkg-query" <<'STUB'
#!/usr/bin/env bash
pkg="${@: -1}"
for m in ${MISSING:-}; do [[ "$m" == "$pkg" ]] && exit 1; done
printf 'install ok installed'
STUB
cat > "$stubs/id" <<'STUB'
#!/usr/bin/env bash
echo "${FAKE_UID:-0}"
STUB
cat > "$stubs/apt-get" <<'STUB'
#!/usr/bin/env bash
echo "apt-get $*" >> "$TEST_TMPDIR/apt.log"
[[ -z "${APT_FAILS:-}" ]]
STUB
# python3 -m pip: `--version` works; `install ... --target DIR` logs its arguments and
# lays out a wheel's torch/lib, or fails half-way when $PIP_FAILS is set.
cat > "$stubs/python3" <<'STUB'
#!/usr/bin/env bash
[[ "$1 $2" == "-m pip" ]] || exit 2
[[ "$3" == "--version" ]] && exit 0
echo "pip $*" >> "$TEST_TMPDIR/pip.log"
target=""
while (($#)); do [[ "$1" == "--target" ]] && target="$2"; shift; done
mkdir -p "$target/torch/lib"
[[ -z "${PIP_FAILS:-}" ]] || exit 1
touch "$target/torch/lib/libtorch_cpu.so"
[[ -n "${PIP_NO_TRANSFORMERS:-}" ]] || mkdir -p "$target/transformers"
STUB
cat > "$stubs/bazel" <<'STUB'
#!/usr/bin/env bash
echo "bazel ran with: $* (torch: $MEMLEDGER_TORCH_DIR, python: $MEMLEDGER_REFERENCE_PYTHON)"
STUB
chmod +x "$stubs"/*
export PATH="$stubs:$PATH"
export MEMLEDGER_CACHE_DIR="$TEST_TMPDIR/cache"

# The reference stack is not installed yet: pip installs exactly the pinned requirements
# with --no-deps into the cache, then bazel runs and is told where it is.
out=$(MISSING="" "$bazelw" test //x 2>&1)
[[ "$out" == *"installing the reference stack torch==2.15.0, transformers==5.23.0"* ]] ||
  fail "no install notice: $out"
grep -q -- "install -q --no-deps --no-compile --target $MEMLEDGER_CACHE_DIR/torch-2.15.0-.*\.partial\..* -r .*third_party/torch_requirements.txt" \
  "$TEST_TMPDIR/pip.log" || fail "pip line: $(cat "$TEST_TMPDIR/pip.log")"
torch_dir=$(echo "$MEMLEDGER_CACHE_DIR"/torch-2.15.0-*)
[[ -f "$torch_dir/torch/lib/libtorch_cpu.so" && -f "$torch_dir/.memledger-complete" ]] ||
  fail "no complete install in $torch_dir"
[[ "$out" == *"bazel ran with: test //x (torch: $torch_dir, python: $stubs/python3)"* ]] ||
  fail "bazel: $out"
((++passed))

# Everything installed: no output from the wrapper, no pip, bazel gets the arguments.
rm -f "$TEST_TMPDIR/pip.log"
out=$(MISSING="" "$bazelw" test //x 2>&1)
[[ "$out" == "bazel ran with: test //x (torch: $torch_dir, python: $stubs/python3)" ]] ||
  fail "quiet run printed: $out"
[[ ! -e "$TEST_TMPDIR/pip.log" ]] || fail "pip ran although torch is installed"
((++passed))

# pip fails half-way: says so with the exact command, leaves nothing behind, no bazel.
expect_failure env MEMLEDGER_CACHE_DIR="$TEST_TMPDIR/cache2" PIP_FAILS=1 "$bazelw" build //y
[[ "$out" == *"could not install torch==2.15.0, transformers==5.23.0"* ]] ||
  fail "no failure message: $out"
[[ "$out" == *"-m pip install --no-deps --no-compile --target $TEST_TMPDIR/cache2/torch-2.15.0-"* ]] ||
  fail "no pip command: $out"
[[ "$out" != *"bazel ran"* ]] || fail "bazel ran despite the failed install"
[[ -z "$(ls -A "$TEST_TMPDIR/cache2")" ]] || fail "left behind: $(ls "$TEST_TMPDIR/cache2")"
((++passed))

# pip "succeeds" without the Python stack's transformers: not a complete install either.
expect_failure env MEMLEDGER_CACHE_DIR="$TEST_TMPDIR/cache3" PIP_NO_TRANSFORMERS=1 "$bazelw" build //y
[[ "$out" == *"could not install torch==2.15.0, transformers==5.23.0"* ]] ||
  fail "no failure message without transformers: $out"
[[ -z "$(ls -A "$TEST_TMPDIR/cache3")" ]] || fail "left behind: $(ls "$TEST_TMPDIR/cache3")"
((++passed))

# Not root: names the packages and the command, exits non-zero, never runs bazel.
expect_failure env MISSING="libgtest-dev rapidjson-dev" FAKE_UID=1000 "$bazelw" test //x
[[ "$out" == *"missing Debian packages: libgtest-dev rapidjson-dev"* ]] || fail "no package list: $out"
[[ "$out" == *"apt-get install -y --no-install-recommends libgtest-dev rapidjson-dev"* ]] ||
  fail "no install command: $out"
[[ "$out" != *"bazel ran"* ]] || fail "bazel ran despite missing packages"
((++passed))

# Root: apt-get update once, then a non-interactive install of just the missing ones.
rm -f "$TEST_TMPDIR/apt.log"
out=$(MISSING="libabsl-dev" "$bazelw" build //y 2>&1)
[[ "$out" == *"bazel ran with: build //y"* ]] || fail "bazel did not run after install: $out"
[[ $(grep -c '^apt-get .*update' "$TEST_TMPDIR/apt.log") -eq 1 ]] || fail "update count"
grep -q -- 'install -y -q --no-install-recommends libabsl-dev$' "$TEST_TMPDIR/apt.log" ||
  fail "install line: $(cat "$TEST_TMPDIR/apt.log")"
((++passed))

# Root but the archive is unreachable: says so, with the command, exits non-zero.
expect_failure env MISSING="libabsl-dev" APT_FAILS=1 "$bazelw" build //y
[[ "$out" == *"could not install: libabsl-dev"* ]] || fail "no failure message: $out"
((++passed))
echo "bazelw_test: $passed passed, 0 failed"
