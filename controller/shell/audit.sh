# shellcheck shell=sh
# The audit's one round trip (controller/deploy/audit.py), run after the functions it calls:
# rgt_python_probe (python_probe.sh), rgt_release_seen (release_seen.sh), rgt_look (look.sh),
# rgt_markers (markers.sh).
# $1 RGT_HOME on the box ("": ~/.rgt), $2 a file:// store's path (or ""), $3.. $7 the Python
# probe's arguments (probe.probe_args: the Python, the probe's code, and the version, sha256
# and extras of the wheel whose install to look for, or ""), $8 a release id (or ""), $9 the
# deploy's name (or ""), ${10} ${11} rgt_markers' arguments (the profiles' marker files and
# init-variable names, newline-separated, or ""); then, optionally, rgt_look's arguments: the
# look at a run through the agent that ran it last time, saving a deploy of unchanged code its
# second round trip.
home=${1:-$HOME/.rgt}; durable=$2; rel=$8; name=$9
py=$3; code=$4; ver=$5; sha=$6; extras=$7; shift 9
mfiles=$1; mnames=$2; shift 2
# The look starts first and runs beside the rest (its Python start is most of the script's
# time), its output held in a temporary file until the end; without mktemp, after.
look_out=
if [ "$#" -gt 0 ] && look_out=$(mktemp 2>/dev/null); then
  rgt_look "$@" >"$look_out" 2>/dev/null &
  look_pid=$!
fi
echo "@@home"; printf '%s\n' "$HOME"
echo "@@python"
rgt_python_probe "$home" "$py" "$code" "$ver" "$sha" "$extras"
echo "@@gpu"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
  2>/dev/null
echo "@@df"; for d in "$home" "$durable"; do
  [ -n "$d" ] || continue; p=$d; while [ ! -e "$p" ]; do p=$(dirname "$p"); done
  printf '%s\n' "$d"; df -Pk "$p" | tail -n 1; df -Pi "$p" | tail -n 1; done
# (The shell's own read: a cat here was one process, two on cgroup v1, on every deploy.)
echo "@@cgroup"; { read -r cg </sys/fs/cgroup/memory.max ||
  read -r cg </sys/fs/cgroup/memory/memory.limit_in_bytes; } 2>/dev/null && printf '%s\n' "$cg"
echo "@@tools"; for t in rsync tar; do command -v "$t" >/dev/null 2>&1 && echo "$t"; done
echo "@@release"; if [ -n "$rel" ]; then rgt_release_seen "$home" "$rel" "$name"; fi
echo "@@markers"; rgt_markers "$mfiles" "$mnames"
echo "@@clock"; date +%s
if [ -n "$look_out" ]; then
  wait "$look_pid"; cat -- "$look_out"; rm -f -- "$look_out"
elif [ "$#" -gt 0 ]; then
  rgt_look "$@"
fi
