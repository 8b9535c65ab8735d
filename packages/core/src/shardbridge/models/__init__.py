"""shardbridge.models."""
