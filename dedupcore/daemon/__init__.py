"""The local daemon: wire protocol and server."""
