"""How a checkpoint lies on disk: the formats, the manifest, checksums, staging/commit/tracker layout, the run lock, safe reading of DCP metadata."""
