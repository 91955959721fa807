# On the GPU machine: copy the repository to /tmp/repo and run the command file's lines there,
# detached, so they outlive this call (a call may last 10 minutes; the machine stays while calls
# follow each other). Usage: bash bench/device/launch.sh COMMANDS_FILE [seconds to wait and show]
set -u
rm -rf /tmp/repo && mkdir -p /tmp/repo
tar --exclude=./.carry --exclude=./.git -cf - . | tar -xf - -C /tmp/repo
rm -f /tmp/job.done
cd /tmp/repo && setsid nohup bash bench/device/job.sh "$1" > /tmp/job.log 2>&1 < /dev/null &
sleep "${2:-5}"; cat /tmp/job.log
