"""The command line: ``localchat`` and its commands."""
