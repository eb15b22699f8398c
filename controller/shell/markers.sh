# shellcheck shell=sh
# rgt_markers MARKERS ENV_NAMES [ENVIRON] (controller/deploy/guess.py): which of the profiles'
# marker files exist on the box and which variable names the box's init process holds (ENVIRON,
# by default /proc/1/environ); the first two newline-separated. Prints "file PATH" and "env NAME"
# lines; never a variable's value.
rgt_markers() {
  printf '%s\n' "$1" | while IFS= read -r m; do
    [ -n "$m" ] && [ -e "$m" ] && printf 'file %s\n' "$m"
  done
  [ -n "$2" ] || return 0
  # Names only: one line per variable (a newline in a value made \036 first, so no part of a
  # value starts a line), everything from the first '=' on dropped before anything is compared.
  rgt_env=$({ tr '\n\000' '\036\n' <"${3:-/proc/1/environ}" | sed 's/=.*//'; } 2>/dev/null)
  # Each name asked about is looked up by the shell itself: a container's init process holds
  # dozens of variables, and a process per variable (grep) cost the audit one after the other.
  rgt_nl='
'
  printf '%s\n' "$2" | while IFS= read -r n; do
    case "$rgt_nl$rgt_env$rgt_nl" in
      *"$rgt_nl$n$rgt_nl"*) [ -n "$n" ] && printf 'env %s\n' "$n" ;;
    esac
  done
  return 0
}
