"""``rgt smoke``: the job run on this laptop's CPU under a private agent, walked through the
checks of a real run (it starts, reports progress, checkpoints, seals, resumes after a
preemption on a fresh directory, optionally resumes exactly, leaves what ``rgt pull`` takes)
before any GPU is rented.

    checks.py   the checks' names, their one-line verdicts, and the pure facts they measure
    localbox.py the private agent: temporary RGT_HOME and store, `rgt-agent run` as a process,
                every process it started stopped by PID
    walk.py     the walk: the seven checks in order, the first failure ends it
"""
