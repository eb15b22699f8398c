# controller/results/down.py: the shell of `rgt down` on the box, as functions, after those of
# release_use.sh (rgt_release_used); the caller appends the call (`rgt_sizes "$@"`,
# `rgt_real "$@"`, `rgt_job_files "$@"` or `rgt_remove "$@"`).

# rgt_sizes DIR...: every file under the given directories as NUL-terminated (size, path) pairs.
rgt_sizes() {
  for d do
    [ -d "$d" ] || continue
    # shellcheck disable=SC2016 # the inner sh expands them, once per batch of files
    find "$d" -type f -exec sh -c 'for f do s=$(wc -c < "$f") || continue
      printf "%s\0%s\0" $s "$f"; done' rgt {} +
  done
}

# rgt_real DIR...: where each directory physically is on the box (every symlink on its path
# followed), as NUL-terminated fields; an empty one for a path that is no directory there. A
# checkpoint dir linked to a data disk is not removed with the run dir, whatever its name.
rgt_real() {
  for d do
    if r=$(cd -P -- "$d" 2>/dev/null && pwd -P && echo x); then r=${r%??}; else r=; fi
    printf '%s\0' "$r"
  done
}

# rgt_job_files RUN_DIR DEPLOY RELEASE: first, as one NUL-terminated word, what rgt_remove does
# with RELEASE (the release the job runs in): "removed", "unmarked" (removed, but it has no
# marker: what the job wrote cannot be told from what was pushed), "kept" (another run uses it)
# or "none" (no directory there); then, when "removed", what the job wrote in it (its workdir,
# and a checkpoint dir the job has there, the release itself included), as rgt_sizes prints
# it: every file changed after the release was marked complete (a push writes its marker last;
# ctime cannot be set back), so no pushed file unless the job changed it. Python's bytecode
# caches are left out: they come back by themselves.
rgt_job_files() {
  release=$3
  if [ ! -d "$release" ]; then printf 'none\0'; return 0; fi
  if rgt_release_used "$@"; then printf 'kept\0'; return 0; fi
  if [ ! -f "$release/.rgt-release" ]; then printf 'unmarked\0'; return 0; fi
  printf 'removed\0'
  # shellcheck disable=SC2016 # the inner sh expands them, once per batch of files
  find "$release" -name __pycache__ -prune -o -type f -cnewer "$release/.rgt-release" \
    ! -path "$release/.rgt-release" -exec sh -c 'for f do s=$(wc -c < "$f") || continue
      printf "%s\0%s\0" $s "$f"; done' rgt {} +
}

# rgt_remove RUN_DIR SECRETS DEPLOY RELEASE STAGED: remove the run's files, every path given by
# its owner (onbox.common.rundir.RunDir, controller/deploy/release.py); RELEASE may be empty
# (none); STAGED is the secrets a deploy cut off before its start left for that start. The
# release the run's spec names, where it is not RELEASE (a redeploy whose start failed after it
# claimed the run pushed it), goes too where nothing else names it (rgt_release_left), before
# RELEASE: removing RELEASE first would change the files the two share (hard links), which
# would then look written by the job. Every step may have been done already; the status says
# whether nothing of the run is left.
rgt_remove() {
  run=$1; secrets=$2; deploy=$3; release=$4; staged=$5
  named=$(rgt_release_named "$run" "${deploy%/*/*}/releases")
  rm -f -- "$secrets" "$staged"
  rm -rf -- "$deploy"
  if [ -n "$named" ] && [ "$named" != "${release%/}" ]; then
    # In a subshell: the functions' names are this one's own (run, deploy, release).
    (rgt_locked "${deploy%/*}" rgt_release_left "$named" "$run" "$deploy" down)
  fi
  if [ -n "$release" ] && [ -d "$release" ]; then
    rgt_locked "${deploy%/*}" rgt_release_remove_unused "$run" "$deploy" "$release"
  fi
  rm -rf -- "$run"
  [ ! -e "$run" ] && [ ! -e "$secrets" ] && [ ! -e "$deploy" ] && [ ! -e "$staged" ]
}
