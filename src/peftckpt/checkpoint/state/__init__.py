"""What a checkpoint holds: its sections and storage keys, the trainable-only filter, the one builder of a rank's
state (for the save and the load request alike), the base fingerprint."""
