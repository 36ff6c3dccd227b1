"""The error type of checkpoint reading (config, weights, tokenizer, generation config)."""


class CheckpointError(ValueError):
    """A checkpoint directory, file or tensor does not fit what simsd expects; the message is
    one line naming the file (and the field, tensor or value)."""
