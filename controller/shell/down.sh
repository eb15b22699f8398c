# controller/results/down.py: the shell of `rgt down` on the box, as two functions; the caller
# appends the call (`rgt_sizes "$@"` or `rgt_remove "$@"`).

# rgt_sizes DIR...: every file under the given directories as NUL-terminated (size, path) pairs.
rgt_sizes() {
  for d do
    [ -d "$d" ] || continue
    # shellcheck disable=SC2016 # the inner sh expands them, once per batch of files
    find "$d" -type f -exec sh -c 'for f do s=$(wc -c < "$f") || continue
      printf "%s\0%s\0" $s "$f"; done' rgt {} +
  done
}

# rgt_remove RUN_DIR SECRETS DEPLOY RELEASE: remove the run's files, every path given by its
# owner (onbox.common.rundir.RunDir, controller/deploy/release.py); RELEASE may be empty (none).
# Every step may have been done already; the status says whether nothing of the run is left.
rgt_remove() {
  run=$1; secrets=$2; deploy=$3; release=$4
  rm -f -- "$secrets"
  rm -rf -- "$deploy"
  if [ -n "$release" ] && [ -d "$release" ]; then
    used=
    rel=${release##*/}          # the release's id
    rels=${release%/*}; rels=${rels##*/}   # the name of the releases directory
    for d in "${deploy%/*}"/*/; do
      [ -d "$d" ] || continue
      t=$(readlink "$d/current" 2>/dev/null) || continue
      case "$t" in */"$rels"/"$rel"|*/"$rels"/"$rel"/) used=1;; esac
    done
    for s in "${run%/*}"/*/spec.json; do
      if [ ! -f "$s" ] || [ "$s" = "$run/spec.json" ]; then continue; fi
      grep -qF "/$rels/$rel" "$s" && used=1
    done
    if [ -z "$used" ]; then
      # Only directories need write permission to be emptied; files may be hard links that
      # other releases share, so their modes are left alone.
      find "$release" -type d ! -perm -u+w -exec chmod u+w {} + 2>/dev/null
      rm -rf -- "$release"
    fi
  fi
  rm -rf -- "$run"
  [ ! -e "$run" ] && [ ! -e "$secrets" ] && [ ! -e "$deploy" ]
}
