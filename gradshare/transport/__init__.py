"""UDP transport: wire format, AEAD, sans-I/O relay/peer cores, relay server, peer client."""
