# controller/boxrun.py: a run's status and spec.json in one round trip.
# $1 the run's spec.json; $2... the agent's argv of `rgt-agent status NAME --json`.
# Prints what status prints, its exit status on a line of its own after a marker, then "N" when
# there is no spec.json, or "F" and its bytes to the end.
spec=$1; shift
"$@"
printf '\nrgt-status-rc %s\n' "$?"
[ -f "$spec" ] || { echo N; exit 0; }
echo F
exec cat -- "$spec"
