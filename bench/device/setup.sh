# On the GPU machine, in the repository's root, once per carried folder of bench/device/pack.py:
# installs its wheels into /tmp/site and stashes its demo-asset parts; once all parts are there,
# rebuilds the demo's asset wheels in the pipeline's cache. Then says what imports.
set -u
CACHE=/tmp/cache/eagle3-pipeline
mkdir -p /tmp/site /tmp/carry-parts $CACHE/wheels
for folder in .carry/*/; do
  marker=/tmp/site/.installed-$(basename "$folder")  # a folder left from an earlier call: done already
  if [ ! -f "$marker" ] && ls "$folder"*.whl >/dev/null 2>&1; then
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$folder"*.whl > /tmp/pip.log 2>&1; then
      echo "installed $(ls "$folder"*.whl | wc -l) wheels from $folder"; touch "$marker"
    else
      grep -v -i warning /tmp/pip.log | tail -3; echo "FAILED to install the wheels of $folder"
    fi
  fi
  cp "$folder"demo-assets.* /tmp/carry-parts/ 2>/dev/null
done
if [ -f /tmp/carry-parts/demo-assets.parts ]; then
  want=$(cat /tmp/carry-parts/demo-assets.parts); have=$(ls /tmp/carry-parts/demo-assets.tar.part* 2>/dev/null | wc -l)
  if [ "$have" -eq "$want" ]; then
    cat /tmp/carry-parts/demo-assets.tar.part* | tar -xf - -C $CACHE/wheels && echo "demo asset wheels in $CACHE/wheels"
  else
    echo "demo assets: $have of $want parts here"
  fi
fi
for kind in regenerated kept; do  # what watch.sh brought back from an earlier machine: its chunks are done
  if ls .carry/*/$kind.tgz.part* >/dev/null 2>&1 && [ ! -f /tmp/$kind.restored ]; then
    mkdir -p /tmp/runs && cat .carry/*/$kind.tgz.part* | tar -xzf - -C /tmp/runs && touch /tmp/$kind.restored &&
      echo "restored $kind: $(cd /tmp/runs && ls -d */synthesized/*/ */regenerated/*/ 2>/dev/null | tr '\n' ' ')"
  fi
done
PYTHONPATH=/tmp/site python3 - <<'PY'
import importlib
missing = []
for m in ["prefect", "speculators", "datasets", "pydantic", "gguf", "xxhash", "torch", "transformers"]:
    try:
        importlib.import_module(m)
    except Exception as e:
        missing.append(f"{m} ({e!r:.120})")
print("imports: " + ("all fine" if not missing else "MISSING " + ", ".join(missing)))
PY
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; df -h /tmp | tail -1
