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
# Removed as rgt_release_remove removes one (renamed aside first).
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
  rgt_release_remove "$release" 2>/dev/null || { echo failed; return 0; }
  echo removed
}

# rgt_release_remove RELEASE: remove the release directory RELEASE; fails when it could not be
# renamed aside. Renamed first, as a .tmp- push, so that releases/<id> is whole or absent: an
# rm cut off in place (a `rgt down` whose link dropped) left a torn directory that could still
# hold its marker, which the next push of the same code took as complete and ran in. What is
# left aside goes with the next push's stale ones (release_prepare.sh).
rgt_release_remove() {
  # Names of its own: sh has no local variables, and the callers' $release stays theirs.
  rgt_gone=${1%/}
  rgt_aside="${rgt_gone%/*}/.tmp-${rgt_gone##*/}-removed$$"
  mv -- "$rgt_gone" "$rgt_aside" || return 1
  # Only directories need write permission to be emptied; files may be hard links that
  # other releases share, so their modes are left alone.
  find "$rgt_aside" -type d ! -perm -u+w -exec chmod u+w {} + 2>/dev/null
  rm -rf -- "$rgt_aside"
}
