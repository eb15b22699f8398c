# shellcheck shell=sh
# $1 box home, $2 name, $3 id: point deploys/<name>/current at releases/<id> by renaming a new
# link over the old one (rename(2) is atomic: readers see the old link or the new one).
# Then the release the link named before goes where the run's spec has moved off it too and
# nothing else names it (rgt_release_left, release_use.sh, prepended: it keeps one the job
# wrote in): else every redeploy of changed code left one more release that no `rgt down`
# removed. Without a spec naming <id> (a Slurm job not yet started) nothing is removed.
set -eu
umask 077
d="$1/deploys/$2"
[ -f "$1/releases/$3/.rgt-release" ] || { echo "no complete release $3 on the box" >&2; exit 3; }
mkdir -p "$d"
was=$(readlink "$d/current" 2>/dev/null) || was=
tmp="$d/.current-$$"
rm -f -- "$tmp"
ln -s "../../releases/$3" "$tmp"
switched() {
  case "$was" in ../../releases/"$3"|../../releases/"$3"/|"") exit 0;; esac
  case "$was" in ../../releases/*) ;; *) exit 0;; esac
  [ "$(rgt_release_named "$1/runs/$2" "$1/releases")" = "$1/releases/$3" ] || exit 0
  # In a subshell: the functions' variables are the shell's own; a failure there is no
  # failure of the switch, which is done.
  (rgt_locked "$1/deploys" rgt_release_left "$1/releases/${was##*/}" "$1/runs/$2" "$d") || true
  exit 0
}
if mv -T -- "$tmp" "$d/current" 2>/dev/null; then switched "$@"; fi
for py in python3 python; do   # an mv without -T (busybox) would move the link into the old target
  if command -v "$py" >/dev/null 2>&1 &&
     "$py" -c 'import os, sys; os.replace(sys.argv[1], sys.argv[2])' "$tmp" "$d/current"; then
    switched "$@"
  fi
done
rm -f -- "$tmp"
echo "no way to replace a link atomically here (no mv -T, no python)" >&2; exit 4
