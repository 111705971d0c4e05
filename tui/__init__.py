"""Terminal UI (Textual): Train, Chat and Agent screens over the library; see tui/app.py."""
