# shellcheck shell=sh
# Marks a pushed release complete and renames it into place. $1 box home, $2 id, $3 tmp suffix,
# $4 marker content. Prints "done" or "raced" (another push of the same code finished first: its
# release stands, ours is removed).
set -eu
umask 077
rel="$1/releases"; tmp="$rel/.tmp-$2-$3"; dst="$rel/$2"
chmod 700 "$tmp"   # rsync -a gave it the mode of the project's directory
printf '%s\n' "$4" > "$tmp/.rgt-release"
if [ -f "$dst/.rgt-release" ]; then rm -rf -- "$tmp"; echo raced; exit 0; fi
if mv -T -- "$tmp" "$dst" 2>/dev/null; then echo "done"; exit 0; fi
if [ -f "$dst/.rgt-release" ]; then rm -rf -- "$tmp"; echo raced; exit 0; fi
if [ ! -e "$dst" ] && mv -- "$tmp" "$dst"; then echo "done"; exit 0; fi
echo "cannot rename $tmp to $dst" >&2; exit 1
