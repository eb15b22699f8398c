# shellcheck shell=sh
# Which runs use a release on the box, as functions: `rgt down` (controller/shell/down.sh) keeps
# a release another run uses; a deploy whose start failed removes the release it pushed when
# nothing uses it (controller/deploy/leftrelease.py). The caller appends the call.

# rgt_release_used RUN_DIR DEPLOY RELEASE: whether another deploy's current link or another
# run's spec names RELEASE (then it stays when this run is removed).
rgt_release_used() {
  run=$1; deploy=$2; release=$3
  rel=${release##*/}          # the release's id
  rels=${release%/*}; rels=${rels##*/}   # the name of the releases directory
  for d in "${deploy%/*}"/*/; do
    [ -d "$d" ] || continue
    [ "${d%/}" = "${deploy%/}" ] && continue
    t=$(readlink "$d/current" 2>/dev/null) || continue
    case "$t" in */"$rels"/"$rel"|*/"$rels"/"$rel"/) return 0;; esac
  done
  for s in "${run%/*}"/*/spec.json; do
    if [ ! -f "$s" ] || [ "$s" = "$run/spec.json" ]; then continue; fi
    grep -qF "/$rels/$rel" "$s" && return 0
  done
  return 1
}

# rgt_release_drop RELEASE RUN_DIR DEPLOY: after a failed start of run RUN_DIR in RELEASE, which
# that deploy pushed, remove RELEASE unless something uses it: the deploy's own current link or
# another's, another run's spec, or the run's own spec while the run is not FAILED (a start
# refused as preempted or stopped, or another start of it, may run it there). Prints one word:
# removed, gone (no complete release there), current, used, run, or failed (rm could not).
# Renamed aside as a .tmp- push first, so releases/<id> is whole or absent, never a torn
# directory with its marker; a removal cut off there goes with the next push's stale ones.
rgt_release_drop() {
  release=${1%/}; run=$2; deploy=$3
  rel=${release##*/}; rels=${release%/*}; rels=${rels##*/}
  if [ ! -f "$release/.rgt-release" ]; then echo gone; return 0; fi
  t=$(readlink "$deploy/current" 2>/dev/null) &&
    case "$t" in */"$rels"/"$rel"|*/"$rels"/"$rel"/) echo current; return 0;; esac
  if rgt_release_used "$run" "$deploy" "$release"; then echo used; return 0; fi
  # state.json is written with indent=1 (onbox/common/durable.py write_json): a key of the
  # top level, and only one, starts its line with exactly one space.
  if [ -f "$run/spec.json" ] && grep -qF "/$rels/$rel" "$run/spec.json" &&
     ! grep -q '^ "state": "FAILED"' "$run/state.json" 2>/dev/null; then
    echo run; return 0
  fi
  aside="${release%/*}/.tmp-$rel-dropped$$"
  mv -- "$release" "$aside" 2>/dev/null || { echo failed; return 0; }
  find "$aside" -type d ! -perm -u+w -exec chmod u+w {} + 2>/dev/null
  rm -rf -- "$aside" 2>/dev/null
  echo removed
}
