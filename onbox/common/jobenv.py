"""The names the job and the agent meet at, owned here: the environment the agent gives a job
(and rgt's own processes), and the marker that makes a checkpoint directory complete.

The agent sets them (onbox/agent/runner.py), the training API and the framework callbacks read
them (onbox/train/), and the daemon keeps them out of rgt's own processes' inherited
environment (onbox/agent/daemon.py). A name typed anywhere else is a fact retyped.
"""

HOME = "RGT_HOME"  # rgt's state directory on the box (default ~/.rgt)
RUN = "RGT_RUN"  # the run's name
RUN_DIR = "RGT_RUN_DIR"  # $RGT_HOME/runs/NAME
CKPT_DIR = "RGT_CKPT_DIR"  # where the job writes its checkpoints (the sealer watches it)
RESUME_FROM = "RGT_RESUME_FROM"  # the checkpoint an attempt resumes from ("" for none)
ATTEMPT = "RGT_ATTEMPT"  # the attempt's number, 1, 2, ...
ATTEMPT_TAG = "RGT_ATTEMPT_TAG"  # the tag that finds the attempt's processes in /proc
CKPT_TRIGGER = "RGT_CKPT_TRIGGER"  # how the agent asks for a checkpoint: signal:NAME, file, none
MTBF = "RGT_MTBF"  # seconds between failures, for the "auto" checkpoint interval
USER_PYTHONPATH = "RGT_USER_PYTHONPATH"  # the job's own PYTHONPATH, before rgt's lib
PROFILES_DIR = "RGT_PROFILES_DIR"  # profiles that add to or override the shipped ones
METADATA_URL = "RGT_METADATA_URL"  # the cloud metadata server's base URL (notice poller; tests)
NOTICE_POLL = "RGT_NOTICE_POLL"  # seconds between preemption-notice polls (default 5)
# Where the job's faulthandler hook (rgt's sitecustomize, onbox/health/stackhook.py) writes every
# thread's stack when the agent sends STACKS_SIGNAL (the stall probe, onbox/health/stacks.py).
STACKS_FILE = "RGT_STACKS_FILE"
# SIGRTMIN+4 under glibc (whose SIGRTMIN is 34: 32 and 33 are its own). A fixed number, so the
# hook and the probe agree without signal.SIGRTMIN (Python 3.11+). Its default action kills:
# the probe sends it only to a process whose SigCgt shows the hook's handler.
STACKS_SIGNAL = 38

# The last file written into a complete rgt checkpoint directory (the training API writes it,
# onbox/train/ckptdir.py; the sealer's discovery looks for it, onbox/sealing/discovery.py).
COMPLETE_MARKER = ".rgt-complete"
