#!/usr/bin/env bash
# study_wall_time: whole-process wall time of `verify --skip_timing` against the
# reference study (../shared/seed/22_memory_accounting.py) run with --skip-timing, on
# this machine and the pinned torch release, and whether the two agree on every number
# they both report. The study needs the full torch wheel (with its CUDA runtime wheels,
# about 5 GB): it goes into a throwaway venv, never into the project.
#
#   ./bazelw run //verify:study_wall_time -- [--runs=N] [--venv=DIR] [--study=PATH]
#
# Prints each run's seconds, the medians and their ratio (target: verify <= 0.5 x study).
set -euo pipefail

runs=3
venv="${TMPDIR:-/tmp}/memledger-study-venv"
workspace="${BUILD_WORKSPACE_DIRECTORY:-$(pwd)}"
study="${MEMLEDGER_STUDY:-$workspace/../shared/seed/22_memory_accounting.py}"
for arg in "$@"; do
  case "$arg" in
    --runs=*) runs="${arg#--runs=}" ;;
    --venv=*) venv="${arg#--venv=}" ;;
    --study=*) study="${arg#--study=}" ;;
    *) echo "study_wall_time: unknown argument $arg (see the header of this script)" >&2; exit 2 ;;
  esac
done
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || { echo "study_wall_time: --runs must be >= 1" >&2; exit 2; }
[[ -f "$study" ]] || { echo "study_wall_time: no study at $study (--study=PATH)" >&2; exit 2; }
verify="$(pwd)/verify/verify"
torch_version=$(sed -n 's/^torch==\([0-9][0-9.]*\).*/\1/p' "$workspace/third_party/torch_requirements.txt")

if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c "import torch, numpy" 2>/dev/null; then
  echo "study_wall_time: installing torch==$torch_version (full wheel) into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "torch==$torch_version" numpy >&2
fi

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
seconds() {  # seconds COMMAND...: wall time of one run, output to $out/last.json
  local start end
  start=$(date +%s.%N)
  "$@" > "$out/last.json" 2>/dev/null
  end=$(date +%s.%N)
  awk -v a="$start" -v b="$end" 'BEGIN { printf "%.3f\n", b - a }'
}
median() { sort -g | awk '{v[NR]=$1} END {print (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2)}'; }

: > "$out/study.txt"; : > "$out/verify.txt"
for ((i = 1; i <= runs; i++)); do
  seconds "$venv/bin/python" "$study" --skip-timing >> "$out/study.txt"
  cp "$out/last.json" "$out/study.json"
  seconds "$verify" --skip_timing >> "$out/verify.txt"
  cp "$out/last.json" "$out/verify.json"
done
study_median=$(median < "$out/study.txt")
verify_median=$(median < "$out/verify.txt")
echo "study  --skip-timing (s): $(paste -sd' ' "$out/study.txt")  median $study_median"
echo "verify --skip_timing (s): $(paste -sd' ' "$out/verify.txt")  median $verify_median"
awk -v v="$verify_median" -v s="$study_median" \
  'BEGIN { printf "verify / study = %.3f (target <= 0.5)\n", v / s }'
"$venv/bin/python" - "$out/study.json" "$out/verify.json" <<'PY'
import json, sys
study, verify = (json.load(open(p)) for p in sys.argv[1:])
keys = [k for k in study if k != "time_s"]
differ = [k for k in keys if study[k] != verify.get(k)]
if differ:
    print("the study's and verify's JSON differ on", ", ".join(differ))
else:
    print("the study's and verify's JSON agree on", ", ".join(keys))
sys.exit(1 if differ else 0)
PY
