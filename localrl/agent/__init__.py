"""The terminal agent's interactive side: the tool-call protocol (shared with agent training), a person's
approval rules, and the approval session that runs a model's commands in the sandbox."""
