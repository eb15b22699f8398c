# controller/results/boxfiles.py: the files of a run without a store, listed and hashed on the
# box. Arguments in pairs: KIND PATH (a file, or a directory listed whole).
# In the checkpoint dir and the logs, hidden and temporary names are skipped, as the sealer
# skips them (torn writes live there). An output is taken whole, as the completion seal takes
# it (.hydra/, run.lock are the job's results): the pull lists only a run that has ended, whose
# agent has let go of it, so nothing under it is still being written.
# The path asked for itself is followed when it is a symlink to a directory (find -H), as the
# completion seal follows a declared output (an outputs/ or ckpt/ linked to a data disk is a
# user's choice: listed from the link, find -P printed nothing under it); nothing below it is.
# The paths printed still start with the path asked for, as the laptop requires. A checkpoint
# dir that is such a link comes first as "root", kind, where it leads (cd -P), its path: a link
# in it to that real path leads into it (the seal resolves it so, onbox/common/links.py).
# Each file comes out as four NUL-terminated fields: kind, sha256, size, path. A symlink in the
# checkpoint dir or the outputs (followed by no one here) as four too: "link", kind, its target
# as readlink gives it (a trailing newline kept; empty where readlink failed: no link has an
# empty target), path; the laptop decides which it makes.
# shellcheck disable=SC2016 # expanded by the sh that runs it, once per batch of files
hash_files='for f do h=$(sha256sum < "$f") || exit 45; s=$(wc -c < "$f") || exit 45
  printf "%s\0%s\0%s\0%s\0" "$K" "${h%% *}" $s "$f"; done'
# A readlink that fails is not an error of the listing: its link comes out with an empty target,
# which the laptop reports as one whose target could not be read on the box (boxlinks.py);
# the status of $(...) is echo's, so there is no "|| exit 45" here to pretend otherwise.
# shellcheck disable=SC2016
show_links='for f do t=$(readlink "$f"; echo x); t=${t%x}
  printf "link\0%s\0%s\0%s\0" "$K" "${t%?}" "$f"; done'
while [ $# -ge 2 ]; do
  K=$1; p=$2; shift 2; export K
  if [ -f "$p" ]; then sh -c "$hash_files" rgt "$p" || exit 45
  elif [ -d "$p" ] && [ "$K" = output ]; then
    find -H "$p" -mindepth 1 \( -type f -exec sh -c "$hash_files" rgt {} + \) \
      -o \( -type l -exec sh -c "$show_links" rgt {} + \) || exit 45
  elif [ -d "$p" ]; then
    if [ "$K" = checkpoint ] && [ -L "$p" ]; then
      r=$(cd -P -- "$p" && pwd -P && echo x) || exit 45
      printf "root\0%s\0%s\0%s\0" "$K" "${r%??}" "$p"
    fi
    links=$show_links; [ "$K" = log ] && links=:  # a link among the logs is no job's log
    find -H "$p" -mindepth 1 \( -name '.*' -o -name '*.tmp' -o -name '*.tmp.*' -o -name '*.partial' \
      -o -name '*.part' -o -name '*.lock' -o -name '*~' -o -name '*.rgt-*' \) -prune \
      -o \( -type f -exec sh -c "$hash_files" rgt {} + \) \
      -o \( -type l -exec sh -c "$links" rgt {} + \) || exit 45
  fi
done
