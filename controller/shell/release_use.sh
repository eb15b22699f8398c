# shellcheck shell=sh
# Which runs use a release on the box, as functions: `rgt down` (controller/shell/down.sh) keeps
# a release another run uses; a deploy whose start failed removes the release it pushed when
# nothing uses it (controller/deploy/leftrelease.py). The caller appends the call.
#
# A deploy holds the release it is about to start in (deploys/<name>/pending names it) from
# before it trusts the release is there (its push, release_prepare.sh, or its start's shell,
# controller/deploy/boxstart.py START_SH) until its run's spec and current link name it: two
# deploys of the same code under two names share one release (its id is a hash of the code), and
# the one that found it complete must not lose it to the other's failed start, nor to `rgt down`
# of a third run in it. A hold, and the check and removal of a release, each run under the lock
# of the deploys directory, where the holds are (rgt_locked), so that they never interleave.

# rgt_locked DEPLOYS_DIR FUNCTION ARGS...: FUNCTION ARGS under an flock of DEPLOYS_DIR/.lock,
# held on fd 9 for that call alone (a brace group's redirection: in this shell, so that a cut
# that ends this shell ends the call too, and no process started after it inherits the lock);
# status 75 when the lock was not had within a minute. A box without flock(1) runs it unlocked.
rgt_locked() {
  rgt_lock=$1/.lock; shift
  if ! command -v flock >/dev/null 2>&1; then "$@"; return; fi
  (umask 077; mkdir -p "${rgt_lock%/*}") || return 75
  { flock -w 60 9 || return 75; "$@"; } 9>>"$rgt_lock"
}

# rgt_release_point RELEASE DEPLOY: DEPLOY/pending names RELEASE (complete or not yet).
rgt_release_point() {
  (umask 077; mkdir -p "$2") || return 1
  rm -f -- "$2/pending"
  rgt_at=${1%/}; rgt_rels=${rgt_at%/*}
  ln -s "../../${rgt_rels##*/}/${rgt_at##*/}" "$2/pending"
}

# rgt_release_hold RELEASE DEPLOY: DEPLOY/pending names RELEASE, which is there (status 0);
# status 1, and no such link, when it is not (another deploy's drop or `rgt down` removed it:
# renamed aside at once, rgt_release_remove).
rgt_release_hold() {
  rgt_release_point "$@" || return 1
  [ -d "${1%/}" ] && return 0
  rgt_release_unhold "$@"
  return 1
}

# rgt_release_unhold RELEASE DEPLOY: DEPLOY/pending no longer names RELEASE (a deploy that
# failed), and DEPLOY goes if nothing else is in it.
rgt_release_unhold() {
  rgt_at=${1%/}; rgt_rels=${rgt_at%/*}
  if [ "$(readlink "$2/pending" 2>/dev/null)" = "../../${rgt_rels##*/}/${rgt_at##*/}" ]; then
    rm -f -- "$2/pending"
  fi
  rmdir -- "$2" 2>/dev/null
  return 0
}

# rgt_release_used RUN_DIR DEPLOY RELEASE: whether another deploy's current or pending link or
# another run's spec names RELEASE (then it stays when this run is removed).
rgt_release_used() {
  run=$1; deploy=$2; release=$3
  rel=${release##*/}          # the release's id
  rels=${release%/*}; rels=${rels##*/}   # the name of the releases directory
  for d in "${deploy%/*}"/*/; do
    [ -d "$d" ] || continue
    [ "${d%/}" = "${deploy%/}" ] && continue
    for l in current pending; do
      t=$(readlink "$d/$l" 2>/dev/null) || continue
      case "$t" in */"$rels"/"$rel"|*/"$rels"/"$rel"/) return 0;; esac
    done
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
# Removed as rgt_release_remove removes one (renamed aside first). The deploy's own hold goes
# first: it failed. Run under rgt_locked.
rgt_release_drop() {
  release=${1%/}; run=$2; deploy=$3
  rel=${release##*/}; rels=${release%/*}; rels=${rels##*/}
  rgt_release_unhold "$release" "$deploy"
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

# rgt_release_remove_unused RUN_DIR DEPLOY RELEASE: remove RELEASE unless another deploy or run
# uses it (rgt_release_used), under rgt_locked (`rgt down`, controller/shell/down.sh).
rgt_release_remove_unused() {
  rgt_release_used "$@" || rgt_release_remove "$3"
}
