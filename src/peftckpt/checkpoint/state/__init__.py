"""What a checkpoint holds: its sections and storage keys, the trainable-only filter, the base fingerprint."""
