#!/usr/bin/env bash
# Download the wheels of wheels.txt for a CPython 3.12 / manylinux x86-64 GPU machine into
# DEST/<folder>/, plus SmolLM2's tokenizer files (no weights) into DEST/smollm2/.
#   bash launch/gpu_check/fetch_wheels.sh DEST     # then: WHEELS=DEST make test-gpu-quick
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:?usage: fetch_wheels.sh DEST}
PY=${PYTHON:-python}
platform=(--python-version 3.12 --implementation cp --only-binary=:all:)
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
  manylinux_2_17_x86_64 manylinux2014_x86_64 any; do
  platform+=(--platform "$tag")
done
grep -v '^#' launch/gpu_check/wheels.txt | while read -r folder specs; do
  folder=${folder%:}
  mkdir -p "$DEST/$folder"
  for spec in $specs; do
    # antlr4-python3-runtime has no wheel on PyPI: build its pure-Python one.
    "$PY" -m pip download -q --no-deps "${platform[@]}" -d "$DEST/$folder" "$spec" \
      || "$PY" -m pip wheel -q --no-deps -w "$DEST/$folder" "$spec"
  done
done
mkdir -p "$DEST/smollm2"
"$PY" - "$DEST/smollm2" <<'PY'
import shutil, sys
from pathlib import Path
from gymrl.config.schema.policy import PolicyConfig
from gymrl.model.loading import ensure_smollm2_checkpoint
folder = ensure_smollm2_checkpoint(PolicyConfig.model_fields["model_cache_dir"].default)
for path in folder.iterdir():
    if path.suffix in {".json", ".jinja"}:
        shutil.copy(path, Path(sys.argv[1]) / path.name)
PY
du -sh "$DEST"
