# shellcheck shell=sh
# A shell function: `rgt_look CHECK SPEC NAME AGENT...` runs the agent AGENT... (its argv, its
# environment first, as RunRecord.agent_argv gives it): its --version when CHECK is 1, in the
# background while its `status NAME --json` runs (output kept until --version is done, so each
# section comes out whole and the two starts overlap), then prints the run's SPEC (spec.json).
# Sections: @@version, @@version-rc, @@status, @@status-rc, @@spec (controller/deploy/flow.py
# reads them).
rgt_look() {
  rgt_check=$1; rgt_spec=$2; rgt_name=$3; shift 3
  if [ "$rgt_check" = 1 ]; then
    { echo "@@version"; "$@" --version 2>&1; printf '\n@@version-rc\n%s\n' "$?"; } &
  fi
  rgt_st=$("$@" status "$rgt_name" --json 2>/dev/null); rgt_rc=$?
  wait
  printf '@@status\n%s\n@@status-rc\n%s\n@@spec\n' "$rgt_st" "$rgt_rc"
  cat -- "$rgt_spec" 2>/dev/null
}
