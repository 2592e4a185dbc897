#!/usr/bin/env bash
# Fill the offline wheelhouse that the Dockerfile installs from (`pip install --no-index`).
#
#   scripts/build_wheelhouse.sh [OUT_DIR]          # default OUT_DIR: build/wheelhouse
#
# Environment:
#   VARIANT=cpu|gpu   cpu (default): torch 2.13.0 CPU build from TORCH_WHEELS (no network for it).
#                     gpu: CUDA torch 2.13.0 and onnxruntime-gpu from the package index (needs
#                     network access to them; not possible on an air-gapped build machine).
#   TORCH_WHEELS      folder holding the local torch CPU wheel (default /opt/wheels).
#   PYTHON            a CPython 3.11 on linux/x86_64 to resolve with (default: .venv/bin/python,
#                     else python3) -- the image's interpreter is 3.11 too, so wheels match.
#
# Writes OUT_DIR/*.whl (every third-party dependency, build backend included, binary wheels only)
# and OUT_DIR/requirements.lock (what was resolved, for review and reproducibility). The
# project's own wheels (limelight, limelight-client) are built inside the image's builder stage.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/build/wheelhouse}"
VARIANT="${VARIANT:-cpu}"
TORCH_WHEELS="${TORCH_WHEELS:-/opt/wheels}"
TORCH_VERSION="2.13.0"
ORT_VERSION="1.32.0"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

"$PYTHON" - <<'EOF'
import platform, sys
if sys.version_info[:2] != (3, 11) or platform.machine() != "x86_64":
    sys.exit(f"need CPython 3.11 on x86_64 to match the image, got {sys.version} {platform.machine()}")
EOF

mkdir -p "$OUT"
# Start clean of older pins but keep unchanged wheels: pip skips files it already has.
find "$OUT" -maxdepth 1 -name 'limelight*' -delete

case "$VARIANT" in
  cpu)
    TORCH_WHL="$(ls "$TORCH_WHEELS"/torch-"$TORCH_VERSION"+cpu-cp311-*.whl 2>/dev/null | head -n1 || true)"
    if [[ -z "$TORCH_WHL" ]]; then
      echo "no torch $TORCH_VERSION CPU wheel in $TORCH_WHEELS (set TORCH_WHEELS)" >&2
      exit 1
    fi
    # The CPU torch wheel must win over any CUDA build of the same version on an index.
    TORCH_REQ="torch @ file://$TORCH_WHL"
    EXTRA=()
    ;;
  gpu)
    TORCH_REQ="torch==$TORCH_VERSION"
    EXTRA=("onnxruntime-gpu==$ORT_VERSION")
    ;;
  *)
    echo "VARIANT must be cpu or gpu, got '$VARIANT'" >&2
    exit 2
    ;;
esac

# Resolve (the local SDK stands in for `limelight-client`, so no index is asked for it), then
# add what older 3.11 patch releases need on top (Debian bookworm's python3 is 3.11.2, where
# redis wants async-timeout), resolve again, record the set and download exactly that set.
REPORT="$(mktemp)"
EXTRA_REQS="$(mktemp)"
trap 'rm -f "$REPORT" "$EXTRA_REQS"' EXIT
: >"$EXTRA_REQS"
for pass in 1 2; do
  "$PYTHON" -m pip install --quiet --dry-run --ignore-installed --only-binary=:all: \
    --report "$REPORT" "$TORCH_REQ" "$ROOT/client" "$ROOT" "${EXTRA[@]}" "setuptools>=69" \
    "wheel" -r "$EXTRA_REQS"
  [[ "$pass" == 2 ]] && break
  "$PYTHON" - "$REPORT" "$EXTRA_REQS" <<'PY'
import json, sys
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

report = json.load(open(sys.argv[1]))
have = {canonicalize_name(i["metadata"]["name"]) for i in report["install"]}
env = default_environment() | {"python_full_version": "3.11.0", "python_version": "3.11"}
extra = set()
for item in report["install"]:
    for spec in item["metadata"].get("requires_dist", []):
        req = Requirement(spec)
        if req.marker is None or "extra" in str(req.marker):
            continue
        if req.marker.evaluate(env) and canonicalize_name(req.name) not in have:
            extra.add(f"{req.name}{req.specifier}")
open(sys.argv[2], "w").write("".join(f"{r}\n" for r in sorted(extra)))
PY
done
"$PYTHON" - "$REPORT" "$OUT/requirements.lock" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
lines = []
for item in report["install"]:
    name = item["metadata"]["name"]
    if name.lower().replace("_", "-") in {"limelight", "limelight-client"}:
        continue
    lines.append(f"{name}=={item['metadata']['version']}")
open(sys.argv[2], "w").write("\n".join(sorted(lines, key=str.lower)) + "\n")
PY
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$OUT" \
  --find-links "$TORCH_WHEELS" -r "$OUT/requirements.lock"
echo "wheelhouse: $OUT ($(ls "$OUT"/*.whl | wc -l) wheels, $(du -sh "$OUT" | cut -f1))"
