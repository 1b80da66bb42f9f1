#!/usr/bin/env bash
# bazelw with stand-in dpkg-query, id, apt-get and bazel on PATH: quiet and exec'ing
# bazel when nothing is missing; naming the missing packages and the command when it
# cannot install them; installing them when root.
set -euo pipefail

bazelw="$(pwd)/bazelw"
stubs="$TEST_TMPDIR/stubs"
mkdir -p "$stubs"
fail() { echo "FAIL: $*" >&2; exit 1; }

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
cat > "$stubs/bazel" <<'STUB'
#!/usr/bin/env bash
echo "bazel ran with: $*"
STUB
chmod +x "$stubs"/*
export PATH="$stubs:$PATH"

# Nothing missing: no output from the wrapper, bazel gets the arguments.
out=$(MISSING="" "$bazelw" test //x 2>&1)
[[ "$out" == "bazel ran with: test //x" ]] || fail "quiet run printed: $out"

# Not root: names the packages and the command, exits non-zero, never runs bazel.
set +e
out=$(MISSING="libtorch-dev rapidjson-dev" FAKE_UID=1000 "$bazelw" test //x 2>&1)
rc=$?
set -e
[[ $rc -ne 0 ]] || fail "non-root with missing packages exited 0"
[[ "$out" == *"missing Debian packages: libtorch-dev rapidjson-dev"* ]] || fail "no package list: $out"
[[ "$out" == *"apt-get install -y --no-install-recommends libtorch-dev rapidjson-dev"* ]] ||
  fail "no install command: $out"
[[ "$out" != *"bazel ran"* ]] || fail "bazel ran despite missing packages"

# Root: apt-get update once, then a non-interactive install of just the missing ones.
rm -f "$TEST_TMPDIR/apt.log"
out=$(MISSING="libabsl-dev" "$bazelw" build //y 2>&1)
[[ "$out" == *"bazel ran with: build //y"* ]] || fail "bazel did not run after install: $out"
[[ $(grep -c '^apt-get .*update' "$TEST_TMPDIR/apt.log") -eq 1 ]] || fail "update count"
grep -q -- 'install -y -q --no-install-recommends libabsl-dev$' "$TEST_TMPDIR/apt.log" ||
  fail "install line: $(cat "$TEST_TMPDIR/apt.log")"

# Root but the archive is unreachable: says so, with the command, exits non-zero.
set +e
out=$(MISSING="libabsl-dev" APT_FAILS=1 "$bazelw" build //y 2>&1)
rc=$?
set -e
[[ $rc -ne 0 ]] || fail "failed install exited 0"
[[ "$out" == *"could not install: libabsl-dev"* ]] || fail "no failure message: $out"
echo "bazelw_test: 4 passed, 0 failed"
