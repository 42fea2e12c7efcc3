"""The chat screen's parts that are not widgets: a turn as its worker runs it, and the
tool round between replies."""
