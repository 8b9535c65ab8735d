"""shardbridge.checkpoint."""
