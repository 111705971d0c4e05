"""The commands whose work is more than parse-and-call, one module each; ``localrl.cli`` parses the command
line and calls them. None of them imports the CLI or the terminal UI."""
