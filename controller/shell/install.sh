# shellcheck shell=sh
# Installs the agent (controller/deploy/install.py install_agent). $1 python, $2 install dir,
# $3 requirement, $4 find-links dir for --offline ("" otherwise), $5 marker for a venv install,
# $6 marker for a --target install, $7 the launcher, $8 "1" to discard an existing install.
# Prints "reused", "venv" or "target"; exit 20 when pip failed, 21 when the box has neither a
# working venv module nor pip, 23 ("busy") when the directory must be replaced but a process
# still runs from it.
set -u
umask 077   # the agent's install, like every directory of rgt's on the box, is the user's alone
py="$1"; dir="$2"; req="$3"; links="$4"; mark_venv="$5"; mark_target="$6"; launcher="$7"
mkdir -p "${dir%/*}"
exec 9>>"$dir.lock"
if command -v flock >/dev/null 2>&1; then flock 9; fi   # one install at a time; none: go on
if [ "$8" != 1 ] && [ -f "$dir/.rgt-agent.json" ]; then echo reused; exit 0; fi
# Every agent and shim loads its setproctitle extension from its install, so a process that maps
# a file of this directory runs from it: removing the directory would pull its files from under
# a live run (a respawned agent would not start). The caller installs next to it instead.
if [ -e "$dir" ]; then
  real=$(cd "$dir" 2>/dev/null && pwd -P) || real=$dir
  if grep -qsF -e "$dir/" -e "$real/" /proc/[0-9]*/maps; then echo busy; exit 23; fi
fi
rm -rf -- "$dir"
mkdir -p "$dir" || exit 22
log="$dir/install.log"
# The box's pip configuration (its index, its mirrors) applies; what would send the install
# elsewhere (user site) or refuse it does not.
export PIP_USER=0 PIP_REQUIRE_VIRTUALENV=0 PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
if [ -n "$links" ]; then set -- --no-index --find-links "$links"; else set --; fi
mark() {
  printf '%s\n' "$1" > "$dir/.rgt-agent.json.part" &&
    mv -f "$dir/.rgt-agent.json.part" "$dir/.rgt-agent.json"
}
vpy="$dir/venv/bin/python"
# The venv gets no pip of its own when the box Python's pip can install into it (pip 22.3 or
# newer: --python): bootstrapping one (ensurepip unpacks and compiles pip) took most of an
# install's time. Else (that pip too old to know --python, or no pip beside the box Python) the
# venv's own pip, as `python -m venv` would make it. The box's pip is not asked first whether it
# can: each pip run with --python starts two Pythons, a second of the install. Neither pip run
# writes bytecode of its own into the image.
vpip() {
  if [ "$via" = box ]; then PYTHONDONTWRITEBYTECODE=1 "$py" -m pip --python "$vpy" "$@"
  else "$vpy" -m pip "$@"; fi
}
vinstall() { vpip install --no-warn-script-location "$@" "$req" >>"$log" 2>&1; }
via=""
if "$py" -m venv --without-pip "$dir/venv" >"$log" 2>&1; then via=box; fi
if [ "$via" = box ] && ! vinstall "$@"; then
  if ! grep -qs -e "no such option: --python" -e "No module named pip" "$log"; then
    tail -n 40 "$log" >&2; exit 20
  fi
  echo "--- the box's pip cannot install into the venv: the venv's own pip" >>"$log"
  if via=own; "$vpy" -m ensurepip --upgrade --default-pip >>"$log" 2>&1; then
    vinstall "$@" || { tail -n 40 "$log" >&2; exit 20; }
  else via=""; fi
fi
if [ -n "$via" ]; then
  # A venv filled by the box's pip still answers `venv/bin/pip install X` (what the agent's
  # remedies ask for an optional extra): a two-line script running that pip into the venv.
  if [ "$via" = box ]; then
    qpy=$(printf '%s' "$py" | sed "s/'/'\\\\''/g"); qvpy=$(printf '%s' "$vpy" | sed "s/'/'\\\\''/g")
    printf "#!/bin/sh\nexec '%s' -m pip --python '%s' \"\$@\"\n" "$qpy" "$qvpy" \
      > "$dir/venv/bin/pip" && chmod 755 "$dir/venv/bin/pip" || exit 22
  fi
  mark "$mark_venv" || exit 22
  echo venv; exit 0
fi
echo "--- no working venv module: pip install --target" >>"$log"
rm -rf -- "$dir/venv"
if ! "$py" -m pip --version >>"$log" 2>&1; then tail -n 20 "$log" >&2; exit 21; fi
if ! "$py" -m pip install --target "$dir/lib" --no-warn-script-location "$@" "$req" \
    >>"$log" 2>&1; then
  tail -n 40 "$log" >&2; exit 20
fi
mkdir -p "$dir/bin" && printf '%s' "$launcher" > "$dir/bin/rgt-agent" || exit 22
mark "$mark_target" || exit 22
echo target
