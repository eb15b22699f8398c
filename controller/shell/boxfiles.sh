# controller/results/boxfiles.py: the files of a run without a store, listed and hashed on the
# box. Arguments in pairs: KIND PATH (a file, or a directory listed whole).
# In the checkpoint dir and the logs, hidden and temporary names are skipped, as the sealer
# skips them (torn writes live there). An output is taken whole, as the completion seal takes
# it (.hydra/, run.lock are the job's results): the pull lists only a run that has ended, whose
# agent has let go of it, so nothing under it is still being written.
# Each file comes out as four NUL-terminated fields: kind, sha256, size, path.
# shellcheck disable=SC2016 # expanded by the sh that runs it, once per batch of files
hash_files='for f do h=$(sha256sum < "$f") || exit 45; s=$(wc -c < "$f") || exit 45
  printf "%s\0%s\0%s\0%s\0" "$K" "${h%% *}" $s "$f"; done'
while [ $# -ge 2 ]; do
  K=$1; p=$2; shift 2; export K
  if [ -f "$p" ]; then sh -c "$hash_files" rgt "$p" || exit 45
  elif [ -d "$p" ] && [ "$K" = output ]; then
    find "$p" -mindepth 1 -type f -exec sh -c "$hash_files" rgt {} + || exit 45
  elif [ -d "$p" ]; then
    find "$p" -mindepth 1 \( -name '.*' -o -name '*.tmp' -o -name '*.tmp.*' -o -name '*.partial' \
      -o -name '*.part' -o -name '*.lock' -o -name '*~' -o -name '*.rgt-*' \) -prune \
      -o -type f -exec sh -c "$hash_files" rgt {} + || exit 45
  fi
done
