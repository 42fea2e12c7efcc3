"""The chat screen's parts: its state and transcript, a turn streaming in, branches,
attachments."""
