"""The gateway's routers, one small module per concern."""
