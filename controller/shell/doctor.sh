# shellcheck shell=sh
# rgt doctor's one round trip (controller/doctor.py): reads the box, changing nothing but one
# probe file in the durable location, which it removes.
# $1 RGT_HOME ("": ~/.rgt), $2 the profile's work dir (a leading ~ is the box's $HOME), $3 the
# durable location (or ""), $4 the profile's Python (or "": python3), $5 the proxy hook (or ""),
# $6 the store's kind for the egress check (s3, hf or ""), $7 its endpoint when the box's
# environment names none, $8 a known URL for the proxy check (or ""), $9 seconds per network
# try, ${10} the probe file's name, ${11} ${12} rgt_markers' arguments (markers.sh, run before
# this script; "" "" lists none).
home=${1:-$HOME/.rgt}; work=$2; durable=$3; py=${4:-python3}; hook=$5; kind=$6; ep=$7
known=$8; t=$9; probe=${10}; mfiles=${11}; mnames=${12}
# shellcheck disable=SC2088 # the profile's literal "~", matched, not expanded
case $work in "~") work=$HOME ;; "~/"*) work=$HOME/${work#"~/"} ;; "") work=$HOME ;; esac
# The nearest existing directory at or above $1 (a path not made yet is on its parent's disk).
rgt_near() {
  p=$1; while [ ! -e "$p" ]; do p=$(dirname -- "$p"); done; printf '%s\n' "$p"
}
rgt_fs() {  # NAME PATH: its state, then the device, filesystem type and mount of what holds it
  if [ -d "$2" ]; then s=dir; elif [ -e "$2" ]; then s=notdir; else s=missing; fi
  n=$(rgt_near "$2")
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$s" "$(stat -c %d -- "$n" 2>/dev/null)" \
    "$(stat -f -c %T -- "$n" 2>/dev/null)" "$(df -P -- "$n" 2>/dev/null | tail -n 1 |
    awk '{print $NF}')" "$2"
}
rgt_get() {  # URL: "RC HTTP-CODE" of one bounded request (any HTTP answer is a reach)
  if command -v curl >/dev/null 2>&1; then
    c=$(curl -sS -o /dev/null -m "$t" -w '%{http_code}' -- "$1" 2>/dev/null); r=$?
    printf '%s %s\n' "$r" "${c:-000}"
  elif command -v wget >/dev/null 2>&1; then
    wget -q -T "$t" -t 1 -O /dev/null -- "$1" 2>/dev/null; printf '%s -\n' "$?"
  else
    echo "notool -"
  fi
}
echo "@@home"; printf '%s\n' "$HOME"
echo "@@markers"; rgt_markers "$mfiles" "$mnames"
echo "@@fs"; rgt_fs work "$work"; rgt_fs home "$home"
if [ -n "$durable" ]; then rgt_fs durable "$durable"; fi
echo "@@df"; if [ -n "$durable" ] && [ -d "$durable" ]; then
  df -Pk -- "$durable" | tail -n 1; df -Pi -- "$durable" | tail -n 1; fi
echo "@@probe"
if [ -n "$durable" ] && [ -d "$durable" ]; then
  f=$durable/$probe
  if err=$( { printf 'rgt doctor probe\n' >"$f"; } 2>&1 ); then
    # fsync the probe (coreutils sync FILE; else the whole system's) before calling it written.
    if sync -- "$f" 2>/dev/null || sync; then echo ok; else echo "fail sync failed"; fi
    rm -f -- "$f"
  else
    printf 'fail %s\n' "$err" | head -n 1
  fi
fi
echo "@@python"
if command -v -- "$py" >/dev/null 2>&1; then
  command -v -- "$py"
  "$py" -c 'import sys; print(sys.version.split()[0])' 2>&1 | tail -n 1
else
  echo "-"
fi
echo "@@gpu"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
echo "@@cuda"; nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -n 1
echo "@@proxy"
if [ -n "$hook" ]; then
  if [ -f "$hook" ]; then
    echo "hook present"
    # Sourced in a subshell, its output discarded: only whether it set a proxy is read.
    # shellcheck disable=SC1090 # the profile's hook, named at run time
    n=$( (. "$hook" >/dev/null 2>&1; env | grep -ci '^https\{0,1\}_proxy=') 2>/dev/null)
    printf 'set %s\n' "${n:-0}"
    if [ -n "$known" ]; then
      printf 'plain %s\n' "$( (unset http_proxy https_proxy HTTP_PROXY HTTPS_PROXY
        rgt_get "$known") )"
      # shellcheck disable=SC1090 # the profile's hook, named at run time
      printf 'with %s\n' "$( (. "$hook" >/dev/null 2>&1; rgt_get "$known") )"
    fi
  else
    echo "hook missing"
  fi
fi
echo "@@egress"
case $kind in
  s3) u=${AWS_ENDPOINT_URL_S3:-${AWS_ENDPOINT_URL:-$ep}} ;;
  hf) u=${HF_ENDPOINT:-$ep} ;;
  *) u= ;;
esac
if [ -n "$u" ]; then printf '%s %s\n' "$(rgt_get "$u")" "$u"; fi
exit 0
