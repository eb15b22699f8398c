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

# rgt_remove RGT_HOME NAME RELEASE: remove the run's files (RELEASE may be empty: none). Every
# step may have been done already; the status says whether nothing of the run is left.
rgt_remove() {
  home=$1; name=$2; rel=$3
  rm -f -- "$home/secrets/$name"
  rm -rf -- "$home/deploys/$name"
  if [ -n "$rel" ] && [ -d "$home/releases/$rel" ]; then
    used=
    for d in "$home"/deploys/*/; do
      [ -d "$d" ] || continue
      t=$(readlink "$d/current" 2>/dev/null) || continue
      case "$t" in */releases/"$rel"|*/releases/"$rel"/) used=1;; esac
    done
    for s in "$home"/runs/*/spec.json; do
      if [ ! -f "$s" ] || [ "$s" = "$home/runs/$name/spec.json" ]; then continue; fi
      grep -qF "/releases/$rel" "$s" && used=1
    done
    if [ -z "$used" ]; then
      # Only directories need write permission to be emptied; files may be hard links that
      # other releases share, so their modes are left alone.
      find "$home/releases/$rel" -type d ! -perm -u+w -exec chmod u+w {} + 2>/dev/null
      rm -rf -- "$home/releases/$rel"
    fi
  fi
  rm -rf -- "$home/runs/$name"
  [ ! -e "$home/runs/$name" ] && [ ! -e "$home/secrets/$name" ] && [ ! -e "$home/deploys/$name" ]
}
