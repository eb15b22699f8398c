"""The names of the laptop's own environment that rgt reads, owned here (the job's and the
agent's are onbox.common.jobenv's)."""

CONTROLLER_HOME = "RGT_CONTROLLER_HOME"  # the laptop's state: registry, known_hosts, ssh sockets
BOX_HOME = "RGT_BOX_HOME"  # RGT_HOME to use on the box instead of ~/.rgt there
SSH_KEEPALIVE = "RGT_SSH_KEEPALIVE"  # seconds between ssh keepalives (default 15)
SSH_CONFIG = "RGT_SSH_CONFIG"  # an ssh config file to use instead of ~/.ssh/config (tests)

# The meter-stop (controller/meter): each provider's API key, and its base URL (tests point it at
# a fake). The keys are read here and sent to the provider only: never logged nor journaled.
RUNPOD_API_KEY = "RUNPOD_API_KEY"
VAST_API_KEY = "VAST_API_KEY"
LAMBDA_API_KEY = "LAMBDA_API_KEY"
PAPERSPACE_API_KEY = "PAPERSPACE_API_KEY"
RUNPOD_API = "RGT_RUNPOD_API"
VAST_API = "RGT_VAST_API"
LAMBDA_API = "RGT_LAMBDA_API"
PAPERSPACE_API = "RGT_PAPERSPACE_API"
METER_TIMEOUT = "RGT_METER_TIMEOUT"  # seconds one API call may take (default 30)
METER_WAIT = "RGT_METER_WAIT"  # seconds down polls for the resource to go (default 600)
