"""What train.py reads before it builds anything, read and checked first: a typo must cost seconds, not the
minutes a cluster spends loading a model and starting DeepSpeed before the first file is opened.

    inputs = preflight(cfg)      # every row file read (one pass each), the model folder, the index; or InputError
    SSPTrainer(cfg, inputs)      # then the run folder and the checkpoint to resume from (training/engine/run_state.py),
                                 # before the model is built

The row files are --train_data (proposer rows), --qa_data, --eval_data and --pool_init; each is read whole,
and every file's first few bad rows are listed in one error. The model folder must hold a causal LM with
weights that open and a tokenizer (training/settings/input_checks.py); a retriever index must be a finished one whose
manifest fits its folder, with its encoder at hand (retrieval/manifest.py). A path that does not exist is left
to validate_args, which names it (and --dry_run lists it as not on this machine). No torch is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from inference.data import load_eval_rows, load_proposer_rows
from retrieval.manifest import check_index
from training.settings.config import needs_critic
from training.settings.input_checks import model_folder_errors
from utils.errors import InputError


@dataclass
class TrainInputs:
    """The rows a run trains, mixes in, evaluates and seeds its question pool with, read and checked."""
    rows: list = field(default_factory=list)       # ProposerRow of --train_data (self-play on)
    qa_rows: list = field(default_factory=list)    # EvalRow of --qa_data
    eval_rows: list = field(default_factory=list)  # EvalRow of --eval_data (comma-separated files)
    pool_rows: list = field(default_factory=list)  # EvalRow of --pool_init


def read_inputs(cfg) -> tuple[TrainInputs, list[str]]:
    """Every row file the run uses, read; and the errors found in them (each file's own RowError). Files that
    do not exist are skipped here: validate_args names them."""
    sp, inputs, errs = cfg.selfplay, TrainInputs(), []

    def read(flag: str, path: str, loader, **kw) -> list:
        if not path or not Path(path).exists():
            return []
        try:
            return loader(path, **kw)
        except InputError as e:
            errs.append(f"{flag}: {e}")
            return []

    if sp.self_play_enable:
        inputs.rows = read("--train_data", sp.train_data, load_proposer_rows)
    inputs.qa_rows = read("--qa_data", sp.qa_data, load_eval_rows)
    inputs.pool_rows = read("--pool_init", sp.pool_init, load_eval_rows)
    for p in (p.strip() for p in cfg.eval.eval_data.split(",")):
        inputs.eval_rows += read("--eval_data", p, load_eval_rows, limit=cfg.eval.eval_limit)
    return inputs, errs


def model_errors(cfg) -> list[str]:
    """The policy's folder (and the critic's, when it starts from another): a causal LM that loads."""
    errs = model_folder_errors(cfg.model.model_path)
    c = cfg.critic
    if needs_critic(cfg) and c.critic_model_path:
        errs += model_folder_errors(c.critic_model_path, flag="--critic_model_path", role="the critic",
                                    tokenizer=False)
    return errs


def index_errors(cfg) -> list[str]:
    """The in-process retriever's index (when a role searches it): finished, its manifest fits its folder, a
    dense index's encoder and FAISS file at hand. Nothing is loaded."""
    s = cfg.search
    if "retriever" not in (s.proposer_search, s.solver_search) or s.retriever_url or not Path(s.index).exists():
        return []
    try:
        check_index(s.index)
    except InputError as e:
        return [f"--index: {e}"]
    return []


def input_errors(cfg) -> tuple[TrainInputs, list[str]]:
    """The rows, and every problem of the model folder, the index and the row files."""
    inputs, row_errs = read_inputs(cfg)
    return inputs, model_errors(cfg) + index_errors(cfg) + row_errs


def preflight(cfg) -> TrainInputs:
    """The run's rows, read and checked with its model folder and index; InputError listing every problem."""
    inputs, errs = input_errors(cfg)
    if errs:
        raise InputError("the run's inputs cannot be used:\n  - " + "\n  - ".join(errs))
    return inputs
