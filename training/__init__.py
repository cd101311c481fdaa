"""Training: four rooms, each importing only the rooms below it (tests/test_import_graph.py holds that order).

    training.settings    the flags and their checks: declarations, Config, validation, preflight
    training.algorithm   the RL maths: packing, log-probs, loss, advantages, critic, distillation, the optimizer step
    training.engine      the running of a job: DeepSpeed engine, hybrid sync, checkpoints, run folder, export, memory plan
    training.loop        the step loop: trainer, refill rounds, the step's search tools, curriculum, SFT
"""

ROOMS = ("settings", "algorithm", "engine", "loop")  # lowest first: a room imports only rooms before it
