# Runs each "NAME TIMEOUT_S COMMAND" line of a command file in order (# lines skipped), each
# command's output in /tmp/bench_NAME.log; touches /tmp/job.done at the end.
export PYTHONPATH=/tmp/site:/tmp/repo PYTHONUNBUFFERED=1 EAGLE3_CACHE_DIR=/tmp/cache/eagle3-pipeline
export NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false PREFECT_HOME=/tmp/prefect
cd /tmp/repo
while read -r name limit cmd; do
  case "$name" in ''|\#*) continue;; esac
  echo "$(date +%T) start $name: $cmd"
  timeout "$limit" bash -c "$cmd" > "/tmp/bench_$name.log" 2>&1
  rc=$?  # before $(date) runs, which sets $? again (124: the time limit)
  echo "$(date +%T) end $name rc=$rc"
done < "$1"
touch /tmp/job.done
