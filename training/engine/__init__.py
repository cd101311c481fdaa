"""The running of a job: the DeepSpeed engine, hybrid vLLM sync, checkpoints, the run folder, HF export, the memory plan."""
