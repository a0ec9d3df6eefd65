"""The relay's side of the protocol, sans I/O: ``core.RelayCore`` and the parts it composes (admission and
the attempt, the update log, liveness, STATUS pages, the rank table, snapshot serving, the training
observer's seam). Nothing here imports the peer's side (``protocol/peer/``)."""
