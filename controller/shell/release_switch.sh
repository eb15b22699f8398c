# shellcheck shell=sh
# $1 box home, $2 name, $3 id: point deploys/<name>/current at releases/<id> by renaming a new
# link over the old one (rename(2) is atomic: readers see the old link or the new one).
set -eu
umask 077
d="$1/deploys/$2"
[ -f "$1/releases/$3/.rgt-release" ] || { echo "no complete release $3 on the box" >&2; exit 3; }
mkdir -p "$d"
tmp="$d/.current-$$"
rm -f -- "$tmp"
ln -s "../../releases/$3" "$tmp"
if mv -T -- "$tmp" "$d/current" 2>/dev/null; then exit 0; fi
for py in python3 python; do   # an mv without -T (busybox) would move the link into the old target
  if command -v "$py" >/dev/null 2>&1 &&
     "$py" -c 'import os, sys; os.replace(sys.argv[1], sys.argv[2])' "$tmp" "$d/current"; then
    exit 0
  fi
done
rm -f -- "$tmp"
echo "no way to replace a link atomically here (no mv -T, no python)" >&2; exit 4
