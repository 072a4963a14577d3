"""What leaves scaleout for other tools: a cell's checkpoint as a Hugging Face Llama directory
(`export`, writing through `hf_files`). Reads checkpoints and the core's parameter table; never runs
a trainer."""
