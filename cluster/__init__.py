"""Where ranks may run: NVLink-domain discovery, verification, node labels, placement."""
