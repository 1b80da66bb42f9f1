#!/usr/bin/env bash
# run_reference_python.sh PYTHON SCRIPT ARGS...: runs SCRIPT with the pinned reference
# stack's Python (@reference_stack//:python), for tests whose ground truth is the real
# transformers / torch.utils.checkpoint / torch.optim step.
set -euo pipefail
python="$1"
shift
exec "$python" "$@"
