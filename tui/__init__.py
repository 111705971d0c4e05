"""Terminal UI (Textual): training dashboard, chat and agent screens. Not built yet."""
