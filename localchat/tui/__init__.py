"""The Textual app. Only this subpackage imports Textual; it calls the runtime in thread workers."""
