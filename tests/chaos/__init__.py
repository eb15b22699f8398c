"""The chaos suite: real faults (signals, crashes, full disks, a store killed mid-upload)
against real agents and real stores, each scenario checked against the invariants of
tests/chaos/invariants.py from the store's own bytes."""
