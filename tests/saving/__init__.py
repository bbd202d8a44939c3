"""Saving, restoring and resuming: configs, .keras files, checkpoints, SavedModel, preemption."""
