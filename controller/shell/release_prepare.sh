# shellcheck shell=sh
# Makes a push's temporary directory (controller/deploy/release.py push_release). $1 box home,
# $2 id, $3 minutes after which a .tmp- release is stale, $4 deploy name (or "").
# Prints "have <1|0>" when the release is complete (1: the deploy's current link already points
# at it), else "new <tmp suffix> <rsync 0|1> <link-dest id>". The deploy (when named) holds the
# release from here, found or pushed (deploys/<name>/pending: release_use.sh, which comes first).
set -eu
umask 077
rel="$1/releases"; id="$2"
mkdir -p "$rel"
have() {
  cur=0
  if [ -n "$4" ] && [ "$(readlink "$1/deploys/$4/current" 2>/dev/null)" = "../../releases/$id" ]
  then cur=1; fi
  echo "have $cur"; exit 0
}
if [ -n "$4" ]; then rgt_locked "$1/deploys" rgt_release_point "$rel/$id" "$1/deploys/$4"; fi
if [ -f "$rel/$id/.rgt-release" ]; then have "$@"; fi
for t in "$rel"/.tmp-*; do
  [ -d "$t" ] || continue
  # A push in progress changes some inode in its directory at least every few seconds (ctime: rsync
  # and tar set mtimes back to the laptop's, never ctimes). If find cannot tell, keep it.
  if recent=$(find "$t" -cmin "-$3" -print 2>/dev/null); then
    [ -n "$recent" ] || rm -rf -- "$t"
  fi
done
if [ -e "$rel/$id" ] || [ -L "$rel/$id" ]; then
  # no marker: not made by a finished push (those rename a marked directory into place)
  [ -f "$rel/$id/.rgt-release" ] && have "$@"
  rm -rf -- "${rel:?}/${id:?}"
fi
tmp=$(mktemp -d "$rel/.tmp-$id-XXXXXXXX")
chmod 700 "$tmp"
has_rsync=0; command -v rsync >/dev/null 2>&1 && has_rsync=1
prev=""
if [ -n "$4" ] && [ -f "$1/deploys/$4/current/.rgt-release" ]; then
  prev=$(readlink "$1/deploys/$4/current"); prev=${prev##*/}
fi
if [ -z "$prev" ]; then
  newest=""
  for m in "$rel"/*/.rgt-release; do
    [ -f "$m" ] || continue
    # the newest complete release: find's -newer, as test's -nt is not POSIX
    if [ -z "$newest" ] || [ -n "$(find "$m" -prune -newer "$newest" 2>/dev/null)" ]; then
      newest=$m
    fi
  done
  prev=${newest%/.rgt-release}; prev=${prev##*/}
fi
echo "new ${tmp##*/.tmp-"$id"-} $has_rsync ${prev:--}"
