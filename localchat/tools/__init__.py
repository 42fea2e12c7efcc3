"""Tools a model may call: MCP servers, the user's consent, and what a result may be."""
