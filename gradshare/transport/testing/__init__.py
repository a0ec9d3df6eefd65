"""Tools for tests and benchmarks of the transport: cores joined over an in-memory link (``memory``) and a
lossy UDP proxy (``fault_proxy``). Nothing in the training path imports them."""
