"""One module per wire API: each turns its request into one ``GenerationRequest`` and the
typed events of the reply (``server.events``) into its own wire shape."""
