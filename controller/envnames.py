"""The names of the laptop's own environment that rgt reads, owned here (the job's and the
agent's are onbox.common.jobenv's)."""

CONTROLLER_HOME = "RGT_CONTROLLER_HOME"  # the laptop's state: registry, known_hosts, ssh sockets
BOX_HOME = "RGT_BOX_HOME"  # RGT_HOME to use on the box instead of ~/.rgt there
SSH_KEEPALIVE = "RGT_SSH_KEEPALIVE"  # seconds between ssh keepalives (default 15)
SSH_CONFIG = "RGT_SSH_CONFIG"  # an ssh config file to use instead of ~/.ssh/config (tests)
