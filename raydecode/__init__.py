"""raydecode: latency-specialized Kimi K3 decode on Ray. This root package holds only the CLI."""
__version__ = "0.1.0"
