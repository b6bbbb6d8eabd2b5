"""Whether a checkpoint is whole and fits the model: integrity of the stored structure, the load-time fit checks, the strictness modes."""
