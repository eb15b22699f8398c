# shellcheck shell=sh
# A shell function: `rgt_look CHECK SPEC NAME AGENT...` runs the agent AGENT... (its argv, its
# environment first, as RunRecord.agent_argv gives it): its `status NAME --json`, with CHECK 1
# also `--with-version` (what its --version would say, in the same start), and only where that
# fails (no such run, an agent that does not know the flag, a broken one) its --version after
# it; then prints the run's SPEC (spec.json). Sections: @@version and @@version-rc (where
# --version ran), @@status, @@status-rc, @@spec (controller/deploy/look.py reads them).
rgt_look() {
  rgt_check=$1; rgt_spec=$2; rgt_name=$3; shift 3
  if [ "$rgt_check" = 1 ]; then
    rgt_st=$("$@" status "$rgt_name" --json --with-version 2>/dev/null); rgt_rc=$?
    if [ "$rgt_rc" != 0 ]; then
      echo "@@version"; "$@" --version 2>&1; printf '\n@@version-rc\n%s\n' "$?"
    fi
  else
    rgt_st=$("$@" status "$rgt_name" --json 2>/dev/null); rgt_rc=$?
  fi
  printf '@@status\n%s\n@@status-rc\n%s\n@@spec\n' "$rgt_st" "$rgt_rc"
  cat -- "$rgt_spec" 2>/dev/null
}
