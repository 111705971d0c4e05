"""The benchmarks behind ``localrl bench``: side-by-side timings and peaks (a GRPO step against TRL's, the
prompt-cache forward, export, rollouts, agent steps, distributed), and each phase of a step in a fresh process
against the memory planner's prediction. Each prints ratios measured in one run, and runs in CI at a tiny size."""
