"""What is stored: the SQLite store and its migrations, saved KV states, locks, exports."""
