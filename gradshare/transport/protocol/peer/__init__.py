"""A peer's side of the protocol, sans I/O: ``core.PeerCore`` and the parts it composes (the inbound log
and its NAKs, the snapshot download, its own updates until acknowledged). Nothing here imports the relay's
side (``protocol/relay/``)."""
