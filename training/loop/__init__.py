"""The step loop: the SSP trainer, refill rounds, the step's search tools, the simulated-search curriculum, the SFT."""
