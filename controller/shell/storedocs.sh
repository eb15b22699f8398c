# controller/results/boxdocs.py: the documents of a file:// store on the box, as functions; the
# caller appends the call (`rgt_docs "$@"`, `rgt_listing "$@"` or `rgt_logdocs "$@"`). A failed read exits 45.

# rgt_doc FILE: "F SIZE" and the file's bytes, or "N" when there is no such file.
rgt_doc() {
  # shellcheck disable=SC2086 # unquoted: a BSD wc pads the count with spaces
  if [ -f "$1" ]; then s=$(wc -c < "$1") || exit 45; echo "F" $s; cat -- "$1" || exit 45
  else echo N; fi
}

# rgt_docs LATEST CHECKPOINTS FILE...: each FILE as rgt_doc prints it; then, when LATEST (may
# be empty) names a step in rgt's own format of it, "S STEP" and that step's MANIFEST.json.
rgt_docs() {
  latest=$1; checkpoints=$2; shift 2
  for f do rgt_doc "$f"; done
  if [ -n "$latest" ] && [ -f "$latest" ]; then
    step=$(sed -n 's/^ *"step": *\([0-9][0-9]*\),\{0,1\}$/\1/p' "$latest" | head -n 1)
    if [ -n "$step" ]; then echo "S $step"; rgt_doc "$checkpoints/$step/MANIFEST.json"; fi
  fi
}

# rgt_listing RUN: the steps with a MANIFEST ("S STEP") and each quarantine record ("Q STEP",
# then the record as rgt_doc prints it) of the run's directory RUN in the store.
rgt_listing() {
  for m in "$1"/checkpoints/*/MANIFEST.json; do
    [ -f "$m" ] || continue; s=${m%/MANIFEST.json}; echo "S ${s##*/}"
  done
  for q in "$1"/quarantine/*.json; do
    [ -f "$q" ] || continue; n=${q##*/}; echo "Q ${n%.json}"; rgt_doc "$q"
  done
}

# rgt_logdocs RUN: each log document of the run's directory RUN in the store ("L NAME", then the
# document as rgt_doc prints it): RUN/logs/e<epoch>.json, one per agent that sealed the job's logs.
rgt_logdocs() {
  for d in "$1"/logs/e*.json; do
    [ -f "$d" ] || continue; echo "L ${d##*/}"; rgt_doc "$d"
  done
}
