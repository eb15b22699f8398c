# shellcheck shell=sh
# Which runs use a release on the box, as functions: `rgt down` (controller/shell/down.sh) keeps
# a release another run uses; a deploy whose start failed removes the release it pushed when
# nothing uses it (controller/deploy/leftrelease.py). The caller appends the call.
#
# A release a run's own spec names is never removed by a failed start: the start claimed the run
# (runs/N/spec.json names the release) before it failed, and `rgt deploy T --name N` with no
# command starts that spec again. One that nothing names any longer (a later start moved the
# spec off it) goes at that start, failed or not, and at `rgt down` of the run
# (rgt_release_left), unless the job wrote in it: only down shows what would be lost there.
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
# another's, another run's spec, or the run's own spec, whatever the run's state (the start
# claimed the run before it failed: starting its spec again runs there). Prints one word:
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
  if [ -f "$run/spec.json" ] && grep -qF "/$rels/$rel" "$run/spec.json"; then
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

# rgt_release_named RUN_DIR RELEASES: the release directory under RELEASES that the run's spec
# names as its workdir (where its next start without a command runs), printed; nothing when
# there is no spec or its workdir is no release there. spec.json is written with indent=1
# (onbox/common/durable.py write_json): a key of the top level, and only one, starts its line
# with exactly one space; a workdir JSON had to escape is no release's path, and is left alone.
rgt_release_named() {
  [ -f "$1/spec.json" ] || return 0
  rgt_w=$(sed -n 's/^ "workdir": "\([^"\\]*\)",\{0,1\}$/\1/p' "$1/spec.json" 2>/dev/null) ||
    return 0
  rgt_w=${rgt_w%/}; rgt_id=${rgt_w##*/}
  case "$rgt_id" in *[!0-9a-f]*) return 0;; esac   # a release's id: 16 hex digits
  if [ "${#rgt_id}" -eq 16 ] && [ "$rgt_w" = "${2%/}/$rgt_id" ]; then printf '%s\n' "$rgt_w"; fi
}

# rgt_release_written RELEASE: whether a job wrote a file in RELEASE since its push marked it
# complete (its ctime later than the marker's; the push writes the marker last). A file with
# more than one link is another release's too (a push hard-links unchanged files), which that
# push touched, not the job; Python's bytecode caches come back by themselves.
rgt_release_written() {
  [ -n "$(find "$1" -name __pycache__ -prune -o -type f -links 1 -cnewer "$1/.rgt-release" \
    ! -path "$1/.rgt-release" -print 2>/dev/null | head -n 1)" ]
}

# rgt_release_left RELEASE RUN_DIR DEPLOY [down]: remove the complete RELEASE when nothing names
# it any longer (the run's spec moved off it): neither the deploy's own current nor pending link,
# nor the run's own spec (unless "down": the run goes), nor anything rgt_release_used looks at,
# and the job wrote nothing in it (rgt_release_written: what `rgt down` removes of that it shows
# first). Run under rgt_locked.
rgt_release_left() {
  rgt_left=${1%/}; rgt_lid=${rgt_left##*/}; rgt_lrels=${rgt_left%/*}; rgt_lrels=${rgt_lrels##*/}
  [ -f "$rgt_left/.rgt-release" ] || return 0
  for rgt_l in current pending; do
    rgt_t=$(readlink "$3/$rgt_l" 2>/dev/null) || continue
    case "$rgt_t" in */"$rgt_lrels"/"$rgt_lid"|*/"$rgt_lrels"/"$rgt_lid"/) return 0;; esac
  done
  if [ "${4-}" != down ] && [ -f "$2/spec.json" ] && grep -qF "/$rgt_lrels/$rgt_lid" "$2/spec.json"
  then return 0; fi
  if rgt_release_used "$2" "$3" "$rgt_left" || rgt_release_written "$rgt_left"; then return 0; fi
  rgt_release_remove "$rgt_left" 2>/dev/null || return 0
}
