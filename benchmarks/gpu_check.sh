#!/usr/bin/env bash
# GPU check: bf16 sampling and one GRPO training step of a small real-shaped Qwen-Image at 512x512,
# peak memory against `spotlight memory`, our Ulysses SP, diffusers' context parallelism, xfuser's USP,
# and our processor with parallel.sp_backend=xfuser against ours (check sp_backend_xfuser).
# Prints ONE JSON line on stdout (last line); what each figure means is in benchmarks/gpu_check.py's
# docstring. It never hangs: the Python run has a time limit (GPU_CHECK_TIMEOUT, default 360 s) and
# each multi-process check its own deadline; a check that fails records {"error": ...} and the rest
# still run; on a timeout or crash the JSON holds every check finished so far plus "error".
#
# On a lent GPU machine (bare, no package registry) in one call:
#   1. once, on the development machine, in the repo root (pip works there):
#        bash benchmarks/gpu_check.sh --fetch-wheels
#      downloads the wheels the GPU image lacks or holds at other versions (diffusers, xfuser,
#      transformers, peft, the hub stack; ~29 MB) into .whl/ and adds /.whl/ to .git/info/exclude
#      (the tree carried is <= 64 MiB).
#   2. device run tool:  command "bash benchmarks/gpu_check.sh", carry [".whl"], timeout_s 420.
#      The JSON also lands in $OUT/gpu_check.json and the log in $OUT/gpu_check.log.
#   Expected: well under 3 minutes on one H200 after the machine starts (2 transformer blocks).
# Elsewhere:
#   - a GPU host with a registry: `bash scripts/setup.sh` (or GPU_CHECK_SETUP=1, which runs it and
#     adds the `gpu` extra, xfuser) gives the .venv this script then uses; without wheels or a
#     set-up, a missing package is reported as {"error": ...} and nothing is installed;
#   - a CPU-only machine: `bash benchmarks/gpu_check.sh --device cpu --tiny` (the CI smoke run).
# Arguments after the options below go to gpu_check.py (--layers N, --skip CHECKS, --device, --tiny).
# Environment: PYTHON (default: .venv/bin/python if present, else python3), GPU_CHECK_TIMEOUT,
# GPU_CHECK_SETUP, OUT (where the JSON and log go; default a temporary folder).
set -uo pipefail
cd "$(dirname "$0")/.."

# diffusers and the xDiT stack are missing on the lent image; transformers, peft and the hub stack
# under them are there but older (transformers 5.17 needs hub 1.x), so the versions the CPU test suite
# runs are carried too: the GPU figures then come from the same library code as the tests.
WHEELS="diffusers==0.42.1 xfuser==0.7.0 yunchang==0.6.4 distvae==0.1.0 transformers==5.25.0 peft==0.21.2"
WHEELS="$WHEELS huggingface_hub==2.4.0 hf-xet==1.8.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5"
WHEELS="$WHEELS kernels==0.19.1 tomlkit==0.15.3 regex==2026.11.19 click==8.5.1"

if [ "${1:-}" = "--fetch-wheels" ]; then
    set -e
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl $WHEELS
    exclude="$(git rev-parse --git-dir)/info/exclude"
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
    ls -l .whl
    exit 0
fi

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
OUT_DIR=${OUT:-$(mktemp -d)}
mkdir -p "$OUT_DIR"
JSON=$OUT_DIR/gpu_check.json
LOG=$OUT_DIR/gpu_check.log
LIMIT=${GPU_CHECK_TIMEOUT:-360}
rm -f "$JSON"
: > "$LOG"

# Install what is missing: carried wheels (no registry on the lent machine), or, only when asked
# (GPU_CHECK_SETUP=1), the project's own set-up into .venv; never into an interpreter by surprise.
have() { "$PY" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" "$@" 2>>"$LOG"; }
CORE="torch diffusers transformers peft yaml scipy"
if ls .whl/*.whl >/dev/null 2>&1 && ! have $CORE xfuser yunchang; then
    echo "gpu_check.sh: installing .whl/ into /tmp/gpu_check_site" >&2
    "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu_check_site .whl/*.whl >>"$LOG" 2>&1
    export PYTHONPATH=/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}
elif ! have $CORE && [ "${GPU_CHECK_SETUP:-0}" = 1 ]; then
    echo "gpu_check.sh: bash scripts/setup.sh, then pip install -e .[gpu] into .venv" >&2
    bash scripts/setup.sh >>"$LOG" 2>&1 && PY=.venv/bin/python
    "$PY" -m pip install --quiet -e ".[gpu]" >>"$LOG" 2>&1 || echo "gpu_check.sh: xfuser did not install" >&2
fi
if ! have $CORE; then
    msg="$PY lacks one of: $CORE. Lent machine: run 'bash benchmarks/gpu_check.sh --fetch-wheels'"
    msg="$msg on the development machine and carry .whl; a host with a registry: GPU_CHECK_SETUP=1"
    "$PY" -c 'import json, sys; print(json.dumps({"error": sys.argv[1]}))' "$msg" 2>/dev/null || echo "{\"error\": \"$msg\"}"
    exit 0
fi

export PYTHONUNBUFFERED=1
timeout -k 15 "$LIMIT" "$PY" benchmarks/gpu_check.py --out "$JSON" "$@" 2>>"$LOG" >/dev/null
rc=$?

# The one JSON line: the finished file, or whatever was recorded before a timeout or crash.
"$PY" - "$JSON" "$rc" "$LIMIT" "$LOG" <<'EOF'
import json, sys
from pathlib import Path
path, rc, limit, log = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
result = json.loads(path.read_text()) if path.is_file() else {}
if rc in (124, 137):
    result["error"] = f"gpu_check.py timed out after {limit} s; checks after the last one listed did not run"
elif rc != 0:
    tail = log.read_text(errors="replace")[-1500:] if log.is_file() else ""
    result["error"] = f"gpu_check.py exited with {rc}: {tail}"
path.write_text(json.dumps(result) + "\n")
print(json.dumps(result))
EOF
