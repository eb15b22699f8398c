"""`rgt emit`: a job file turned into what another engine runs (a Kubernetes Job manifest, a
SkyPilot task), with rgt's agent inside it and its guarantees carried over."""
