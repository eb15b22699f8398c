# shellcheck shell=sh
# A shell function for a script that must change nothing (the audit's): `rgt_release_seen HOME ID
# NAME` prints "have 1" (release ID complete, deploys/NAME/current on it), "have 0" (complete, the
# link elsewhere or absent; NAME may be "") or "none" (not complete: push_release prepares it).
rgt_release_seen() {
  if [ ! -f "$1/releases/$2/.rgt-release" ]; then echo none; return 0; fi
  if [ -n "$3" ] && [ "$(readlink "$1/deploys/$3/current" 2>/dev/null)" = "../../releases/$2" ]
  then echo "have 1"; else echo "have 0"; fi
}
