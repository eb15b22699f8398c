# shellcheck shell=sh
# A shell function, for a script of its own or the audit's (controller/deploy/install.py probe):
# `rgt_python_probe HOME PYTHON CODE VERSION SHA256 EXTRAS` resolves PYTHON as the agent will run
# it (a name on PATH, or a path: a relative one made absolute) and runs CODE (python_probe.py)
# with it: to report the Python and, when VERSION is not "", to find the install of that wheel
# under HOME/agent. It prints "missing" and why on the next line when there is no such executable
# file; else "path " and the path in hex (byte for byte, whatever it holds), what the probe
# printed (stderr too: its JSON comes last) and "rc N", N the probe's exit status.
rgt_python_probe() {
  rgt_home=$1; rgt_py=$2; rgt_code=$3; shift 3
  case "$rgt_py" in
    /*) ;;
    */*) rgt_py="$(pwd)/$rgt_py" ;;
    *) if ! rgt_py=$(command -v "$rgt_py" 2>/dev/null); then
         printf 'missing\nnot on PATH (%s)\n' "$PATH"; return 0
       fi ;;
  esac
  if [ ! -f "$rgt_py" ] || [ ! -x "$rgt_py" ]; then
    printf 'missing\n%s is not an executable file\n' "$rgt_py"; return 0
  fi
  printf 'path '; printf '%s' "$rgt_py" | od -An -v -tx1 | tr -d ' \n'; echo
  if [ -n "$1" ]; then "$rgt_py" -c "$rgt_code" "$rgt_py" "$rgt_home/agent" "$@" 2>&1
  else "$rgt_py" -c "$rgt_code" "$rgt_py" 2>&1; fi
  echo "rc $?"
}
