"""The sealing wing: what a complete checkpoint is, sealing it to a store with fencing, the
store-side documents (manifest, LATEST, epochs, pins), restore onto a fresh box, safe low-disk
deletes, and the stores themselves (``onbox.sealing.stores``). Imports ``onbox.common`` only."""
