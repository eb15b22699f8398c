"""The ground floor every onbox wing (and the laptop) uses: errors and exit codes, durable
writes, the run directory's paths, the job environment's names, paths from outside, the
redactor, progress reports and the test-only crash points. Imports no other wing."""
