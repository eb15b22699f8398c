"""The agent wing: supervision of one run (states, supervisor, runner, shim, procfs, lock,
daemon, classify, cgroup, journal, observe) and the agent's use of sealing (sealservice,
resumecheck). May import ``onbox.common`` and ``onbox.sealing``; never ``onbox.train``."""
