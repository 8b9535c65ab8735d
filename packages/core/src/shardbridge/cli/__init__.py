"""shardbridge.cli."""
