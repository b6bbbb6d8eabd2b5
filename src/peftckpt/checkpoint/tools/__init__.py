"""Offline tools on a checkpoint (no process group): verify, inspect, a tensor reader for the exports."""
