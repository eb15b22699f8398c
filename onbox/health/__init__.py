"""The health wing: probes of the live run (disk, memory, GPU, progress and hangs, training
signals, the sealing pipeline and the platform's clocks), each returning a ``Verdict``; the
watcher that runs them off the agent's loop and turns each change into an event; the bounded
time series of samples the run report draws; notifications sent from the box.

It imports the ground floor (onbox.common) and the agent's read-only pieces (procfs, cgroup,
the spec); the agent imports it, never the other way round for what changes state: a probe
asks for an action (restart, fail, free room), the agent's loop carries it out.
"""
