class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or does not match what is being loaded."""
