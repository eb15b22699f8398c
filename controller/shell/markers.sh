# shellcheck shell=sh
# rgt_markers MARKERS ENV_NAMES (controller/deploy/guess.py): which of the profiles' marker files
# exist on the box and which variable names the box's init process (/proc/1/environ) holds; both
# arguments newline-separated. Prints "file PATH" and "env NAME" lines; never a variable's value.
rgt_markers() {
  printf '%s\n' "$1" | while IFS= read -r m; do
    [ -n "$m" ] && [ -e "$m" ] && printf 'file %s\n' "$m"
  done
  [ -n "$2" ] || return 0
  # Names only: everything from the first '=' on is dropped before anything is compared.
  tr '\000' '\n' </proc/1/environ 2>/dev/null | sed 's/=.*//' | while IFS= read -r v; do
    [ -n "$v" ] && printf '%s\n' "$2" | grep -Fxq -- "$v" && printf 'env %s\n' "$v"
  done
  return 0
}
