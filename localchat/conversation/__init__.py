"""A turn over any backend: transcript and branches, cache preparation, read-ahead, shared prefix states."""
