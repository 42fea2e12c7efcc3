"""The app's own measurements for ``bench --only ui`` and ``zerowait``: the bench's only
Textual code, imported only when those parts run (the rest of the bench never loads the
app). ``measure`` times the app against a headless run; ``startup_probe`` is the process
that starts the app as the ``localchat`` command does."""
