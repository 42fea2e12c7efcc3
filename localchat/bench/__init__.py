"""``localchat bench``: speed and memory figures against their targets."""
