# controller/observe.py: one round trip for `rgt status` and `rgt watch`: the agent's status,
# then the box's view of what limits the run, each section after its @@ line.
# $1 the run's directory, $2 its workdir, $3... the agent's argv of `rgt-agent status NAME --json`.
rd=$1; wd=$2; shift 2
echo "@@status"; "$@" 2>/dev/null
# The newest seal, or a restore after it (a new box's restored step is in the store).
echo "@@sealed"; grep -h -E '"kind": "(sealed|restored)"' "$rd/events.jsonl" 2>/dev/null | tail -n 1
echo "@@events"; tail -n 8 "$rd/events.jsonl" 2>/dev/null
echo "@@disk"; df -Pk "$wd" 2>/dev/null | tail -n 1; df -Pi "$wd" 2>/dev/null | tail -n 1
echo "@@mem"; grep -E '^(MemTotal|MemAvailable):' /proc/meminfo 2>/dev/null
echo "@@gpu"; nvidia-smi --query-gpu=utilization.gpu,memory.used,memory.total \
  --format=csv,noheader,nounits 2>/dev/null
echo "@@now"; date +%s
