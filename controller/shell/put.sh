# shellcheck shell=sh
# $1 dir, $2 file name: stdin into dir/name, atomically; nothing when it is already there.
set -eu
umask 077
[ -f "$1/$2" ] && { cat >/dev/null; exit 0; }
mkdir -p "$1"
cat > "$1/.$2.part.$$"
mv -f "$1/.$2.part.$$" "$1/$2"
