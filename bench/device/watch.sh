# On the GPU machine: wait up to $1 s for the job (or until /tmp/job.log matches $2), show its
# progress, and put the results under $OUT: one small tarball (logs, reports, metrics, profiles,
# recipe scores, docs/benchmarks*.json* as benches with --record left them) and returned drafts
# (bench/recipe.py --return --out /tmp/recipe-out).
set -u
end=$(( $(date +%s) + ${1:-500} ))
until [ -f /tmp/job.done ] || [ "$(date +%s)" -ge $end ] || { [ -n "${2:-}" ] && grep -q "${2:-}" /tmp/job.log; }; do
  sleep 5
done
cat /tmp/job.log
for f in /tmp/bench_*.log; do echo "=== $f"; tail -c 1500 "$f"; done
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader; df -h /tmp | tail -1
{ find /tmp/runs -maxdepth 4 \( -name 'report.json' -o -name 'result.json' -o -name 'metrics.jsonl' \
    -o -name 'manifest-*.json' \) -size -4M 2>/dev/null
  find /tmp/train-speed-bench /tmp/recipe-out -type f -size -8M \( -name 'profile*' -o -name '*.json' \) 2>/dev/null
  ls /tmp/bench_*.log /tmp/job.log
  ls /tmp/repo/docs/benchmarks.json /tmp/repo/docs/benchmarks-history.jsonl; } > /tmp/results.list 2>/dev/null  # --record's figures
tar -czf "$OUT/results.tgz" -T /tmp/results.list 2>/dev/null; ls -la "$OUT/results.tgz"
# Each flow run's exported drafts, unscored, as soon as its training is done (bench/recipe.py scores
# them only after its variants: a machine lost before the recipe ends still returns them), as
# /tmp/recipe-out/flow-RUN/drafts/TRAINING-FINGERPRINT (bench/validate_returned_draft.py serves it
# here): one per training of the run's folder, so a second training there (another seed) is returned too.
for result in /tmp/runs/*/train/*/result.json; do
  [ -f "$result" ] || continue
  run=$(echo "$result" | cut -d/ -f4); out=/tmp/recipe-out/flow-$run/drafts/$(echo "$result" | cut -d/ -f6)
  if [ -d "$(dirname "$result")/draft" ] && [ ! -f "$out/acceptance.json" ]; then
    mkdir -p "$out" && PYTHONPATH=/tmp/site:/tmp/repo python3 -c "import sys; from pathlib import Path; from bench.acceptance import \
split_for_return; split_for_return(Path(sys.argv[1]), Path(sys.argv[2]))" "$(dirname "$result")/draft" "$out" &&
      echo '{}' > "$out/acceptance.json"
  fi
done
# bench/recipe.py --return's drafts (OUT/drafts/NAME/ under /tmp/recipe-out), each once, as soon as it is
# complete (acceptance.json is written last), in one tarball of parts per call: here,
# `cat drafts-T.tar.part* | tar -x`, then bench/validate_returned_draft.py PATH/drafts/NAME per draft.
ready=$(find /tmp/recipe-out -path '*/drafts/*/acceptance.json' 2>/dev/null | while read -r f; do
  d=$(dirname "$f"); [ -f "/tmp/returned-$(echo "${d#/tmp/recipe-out/}" | tr / -)" ] || echo "${d#/tmp/recipe-out/}"; done)
if [ -n "$ready" ]; then
  stamp=$(date +%s)
  tar -C /tmp/recipe-out -cf /tmp/drafts.tar $ready && split -b 15M -d /tmp/drafts.tar "$OUT/drafts-$stamp.tar.part" &&
    for d in $ready; do touch "/tmp/returned-$(echo "$d" | tr / -)"; done && echo "returned drafts: $ready"
fi
# A finished regeneration comes back once (its journal and reports, in parts): the slowest stage
# need not run again if the machine is lost before the rest ends (setup.sh restores it).
for reg in /tmp/runs/*/regenerated/*/; do
  marker=/tmp/returned-$(basename "$reg")
  if [ -f "$reg/report.json" ] && [ ! -f "$marker" ]; then
    tar -C /tmp/runs -czf /tmp/regenerated.tgz --exclude=conversations.jsonl --exclude=failed.jsonl "${reg#/tmp/runs/}" &&
      split -b 15M -d /tmp/regenerated.tgz "$OUT/regenerated.tgz.part" && touch "$marker" &&
      echo "returned ${reg#/tmp/runs/} ($(du -h /tmp/regenerated.tgz | cut -f1))"
  fi
done
# The call before the device time runs out (third argument `keep`): the synthesis and regeneration
# journals as they stand, finished chunks only matter (both stages go on from them), so the next
# machine's flow starts where this one stopped. setup.sh restores them the same way.
if [ "${3:-}" = keep ] && ls -d /tmp/runs/*/synthesized /tmp/runs/*/regenerated >/dev/null 2>&1; then
  (cd /tmp/runs && ls -d */synthesized */regenerated 2>/dev/null) > /tmp/keep.list
  tar -C /tmp/runs -czf /tmp/kept.tgz --exclude=conversations.jsonl --exclude=failed.jsonl -T /tmp/keep.list &&
    split -b 15M -d /tmp/kept.tgz "$OUT/kept.tgz.part" &&
    echo "kept $(tr '\n' ' ' < /tmp/keep.list)($(du -h /tmp/kept.tgz | cut -f1))"
fi
[ -f /tmp/job.done ] && echo JOB_DONE
