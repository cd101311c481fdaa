"""Evaluate a search agent (the solver role) on QA sets: EM, F1, sub-EM and judge accuracy.

Launch lines:

    # the bundled sets, SmolLM2, the in-process BM25 index (what scripts/eval.sh runs)
    python eval.py --model data/models/SmolLM2-135M-Instruct --data data/eval/*.jsonl \\
        --index data/indexes/bm25 --out_dir runs/eval/smollm2

    # a training checkpoint's HF export: the rollout protocol comes from runs/x/config.json (below);
    # a retrieval server, an LLM judge server (scripts/start_judge.sh)
    python eval.py --model runs/x/checkpoints/step_000100/hf --data nq_test.parquet hotpotqa_dev.parquet \\
        --retriever_url http://127.0.0.1:8000 --judge_url http://127.0.0.1:8001 --out_dir runs/x/eval_100

    # a quick slice, no search tool, the HF reference engine
    python eval.py --model M --data d.jsonl --limit 20 --engine hf --out_dir /tmp/ev

Rows: JSONL or parquet with question, golden_answers, data_source (inference/data.py reads
Search-R1/FlashRAG rows too). A --data folder stands for the benchmarks it holds (inference/benchmarks.py):
FlashRAG's <benchmark>/test.jsonl (dev when there is no test; the folder names the benchmark), <benchmark>.jsonl or
.parquet, Search-R1's test.parquet. The reports give one row per benchmark (data source) in SSP's Table 1 order (NQ,
TriviaQA, PopQA, HotpotQA, 2Wiki, MuSiQue, Bamboogle, then others) with EM, the LLM judge's accuracy and their
unweighted average ("## Benchmarks"; results.json "benchmarks"):

    python eval.py --model runs/x --data data/benchmarks --judge_url http://127.0.0.1:8001 --out_dir runs/x/bench

Rollouts are greedy by default (temperature 0), one per question, through the same multi-turn loop as
training (inference/rollout.py), so numbers measure the policy the trainer produces. Without --judge_url the
judge column is exact match (no server). Outputs in --out_dir: results.json (protocol + metrics), results.md
(the protocol, a table per data source and overall, the benchmarks, the title heuristic), examples.jsonl (one
line per question), config.json (the resolved flags); a folder that already holds any of them is refused
unless --overwrite is given. The loop, the metrics and the reports live in inference/evaluate.py, which
the trainer calls for its periodic eval; this file is the command line over it.

Title heuristic (issue 21): a policy can score by answering with the title of the first retrieved
document, so every report measures against that. Per data source: title_baseline_em (Doc 1's title of
the rollout's own first search as the answer), question_title_em (the question itself searched once with
the same backend and topk, Doc 1's title as the answer; policy-free, None without a search tool),
title_copy_at {"1", "2", ..} (the prediction equals Doc k's title of the last search), title_copy_any,
title_ceiling (some retrieved title is a golden answer) and searches_hist (share per number of searches);
results.md shows them in its "## Title heuristic" table, examples.jsonl keeps each rollout's doc_titles.

The protocol follows the run: when --model lies in a train.py run folder (the folder itself, its
checkpoints/, checkpoints/step_N, or checkpoints/step_N/hf; the first two mean the latest checkpoint),
the run's config.json supplies every rollout-protocol setting not given on the command line: dtype,
template, max_turns, max_tokens_per_turn, max_total_tokens, max_info_tokens, max_model_len, topk and
the solver's search backend (with its index or retriever_url, sim_url, sim_model). Precedence: a flag
given on the command line, then the run's config.json, then eval's default. The training temperature
is not taken (eval stays greedy unless --temperature says otherwise). --no_run_config ignores the run;
a model outside a run is evaluated with the defaults. A retriever_url taken from the run at which nothing
answers (a server the run stopped, as scripts/demo_cpu.sh's) gives way to the run's index when that is built
here, and the notice and the settings' source say so. A table of every setting, its value and its
source (flag / run config.json / eval default) is printed first and saved in results.json ("settings")
and results.md. train.py's flag spellings work too: --vllm_tp, --rollout_engine, --eval_data a,b,
--eval_limit, --solver_search, --dtype bf16/fp32, --overwrite true/false.

Headroom (--samples K --temperature T): RL on a sampled policy mostly turns pass@k into
pass@1, so the SFT model's pass@K (a question counts if any of K samples is right) against
its greedy EM bounds what RL can gain. Each question is then rolled out K times, each its
own multi-turn rollout with its own seed, and every data source gains pass@K, mean@K (the
accuracy over all samples) and pass@k_unbiased (Chen et al. 2021, k = 1, 2, 4, .., K);
correct = the judge column. The other metrics become means over all samples, and each
examples.jsonl line holds its question's K predictions, verdicts, responses as lists.

    python eval.py --model runs/sft/hf --data data/eval/*.jsonl --index data/indexes/bm25 \\
        --samples 8 --temperature 1.0 --out_dir runs/eval/sft_pass8
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

# Project modules that load no torch / vLLM / transformers / numpy, so --help and a refused input stay fast (the
# engines import vLLM or transformers when one is built); the retrievers, which do, are imported where used.
from inference.benchmarks import eval_files
from inference.data import EvalRow, load_eval_rows
from inference.engine_api import RolloutEngine, TokenGenerator
from inference.engines import VLLMEngine
from inference.evaluate import EvalConfig, evaluate, markdown_report, prompt_budget_error, protocol_lines, write_outputs
from inference.hf_engine import HFEngine
from inference.judge import Judge
from inference.prompts import TEMPLATES
from inference.rollout import ROLLOUT_FLAGS, RolloutConfig, rollout_flag_errors
from inference.simulated_search import SimulatedSearch
from retrieval.manifest import check_index
from training.settings.config import Config, RolloutArgs, SearchArgs, add_field_flags, parse_bool
from training.settings.input_checks import model_folder_errors, model_path_errors, report_to_errors
from utils.dist import keep_unused_imports_out, local_device
from utils.errors import InputError, entry_point_error
from utils.logging import configure_logging, log_summary
from utils.trackers import eval_summary

# What main() writes into --out_dir. Any of them already there is refused without --overwrite; other
# files (scripts/eval.sh tees its eval.log there first, a --judge_cache may live there) are left alone.
OUTPUTS = ("results.json", "results.md", "examples.jsonl", "config.json")


# ---- the run's rollout protocol ---------------------------------------------------------------

STEP_RE = re.compile(r"^step_\d+$")  # a checkpoint's tag (training/engine/checkpoint.py tag_for)
# eval flag -> (group, field) of the run's config.json (training/settings/config.py Config.to_dict()): the rollout
# protocol the run trained under. Not the training temperature: eval stays greedy unless --temperature says
# otherwise. The search backend (solver_search and its index / retriever_url / sim_url / sim_model) is
# resolved as one unit in parse_args.
RUN_PROTOCOL = {
    "dtype": ("model", "dtype"), "template": ("model", "template"), "max_turns": ("rollout", "max_turns"),
    "max_tokens_per_turn": ("rollout", "max_tokens_per_turn"), "max_total_tokens": ("rollout", "max_total_tokens"),
    "max_info_tokens": ("rollout", "max_info_tokens"), "max_model_len": ("rollout", "max_model_len"),
    "topk": ("search", "topk"),
}
DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}  # train.py's spellings -> eval's (torch's)
FLAG, RUN, DEFAULT = "flag", "run config.json", "eval default"  # where a setting came from
SETTINGS = ("model", "dtype", "template", "max_turns", "max_tokens_per_turn", "max_total_tokens", "max_info_tokens",
            "max_model_len", "topk", "solver_search", "index", "retriever_url", "sim_url", "sim_model", "temperature")
_UNSET = object()


def train_config(path: Path) -> dict | None:
    """The dict of a train.py config.json; None when absent, unreadable, or another config.json (an HF model's)."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) and all(isinstance(d.get(g), dict) for g in ("model", "rollout", "search")) else None


def locate_run(model: str) -> tuple[str, Path | None]:
    """(the HF folder to load, the run folder that holds it, or None). --model may be a checkpoint's HF
    export (<run>/checkpoints/step_N/hf), the checkpoint (step_N: its hf/), the run's checkpoints/ folder or
    the run folder (both: the latest checkpoint's hf/). Only these places count: an HF folder elsewhere below
    a run folder (runs/x/sft/hf) belongs to no run. Raises ValueError when a run's checkpoint has no hf/."""
    p = Path(model).resolve()
    if p.name == "hf" and STEP_RE.match(p.parent.name) and p.parent.parent.name == "checkpoints":
        return model, p.parents[2]
    if STEP_RE.match(p.name) and p.parent.name == "checkpoints":
        hf, run = Path(model) / "hf", p.parents[1]
    elif p.name == "checkpoints" or train_config(p / "config.json") is not None:
        ck = Path(model) if p.name == "checkpoints" else Path(model) / "checkpoints"
        if not (ck / "latest").is_file():
            raise ValueError(f"--model {model} is a run folder with no complete checkpoint ({ck / 'latest'} is missing)")
        hf, run = ck / (ck / "latest").read_text().strip() / "hf", p.parent if p.name == "checkpoints" else p
        if not hf.parent.is_dir():  # a damaged latest: name the newest export instead of a missing folder's
            have = sorted((d for d in ck.glob("step_*") if STEP_RE.match(d.name) and (d / "hf/config.json").is_file()))
            raise ValueError(f"--model {model}: {ck / 'latest'} names {hf.parent.name}, which is missing"
                             + (f"; pass --model {have[-1] / 'hf'} (the newest export)" if have else ""))
    else:
        return model, None
    if not (hf / "config.json").is_file():
        raise ValueError(f"--model {model}: {hf} holds no HF export (train with --export_hf true), so there is no "
                         "model to load")
    return str(hf), run


def _find_index(path: str) -> str | None:
    """The run's --index as seen from here: relative to this folder, else to the repo (where train.py runs)."""
    for p in (Path(path), Path(__file__).resolve().parent / path):
        if (p / "manifest.json").exists():
            return str(p)
    return None


def _answers(url: str, timeout: float = 5.0) -> bool:
    """Whether anything answers at `url` (any HTTP status: a loading server's 503, Search-R1's 404 on /health)."""
    import httpx  # lazy, as retrieval.client

    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=timeout)
        return True
    except httpx.TransportError:
        return False


def fall_back_from_a_stopped_retriever(a: argparse.Namespace) -> None:
    """A retriever_url taken from the run's config.json (no flag named a backend) at which nothing answers: a
    server the run started and stopped, as scripts/demo_cpu.sh's on port 8765. Rather than wait 300 s for it,
    search the run's --index in-process when that is a built index here (the demo's server served it), and say
    so, on stderr and in the settings' source; without one, stop at once and name the fixes (InputError)."""
    if a.sources.get("retriever_url") != RUN or _answers(a.retriever_url):
        return
    url, run = a.retriever_url, train_config(Path(a.run_config))
    index = _find_index(str(run["search"].get("index") or ""))
    if index is None:
        raise InputError(f"the run's retriever {url} ({a.run_config}) does not answer, and the run's --index "
                         f"{run['search'].get('index')!r} is not a built index here; start that retriever again "
                         "(scripts/start_retriever.sh), or pass --retriever_url URL or --index DIR")
    print(f"eval.py: nothing answers at the run's retriever {url} ({a.run_config}; a server the run stopped, as "
          f"scripts/demo_cpu.sh's); searching the run's --index {index} in-process instead, which is what that "
          "server served only if it was started on that index. Start the server again, or pass --retriever_url "
          "or --index, to choose.", file=sys.stderr, flush=True)
    a.retriever_url, a.index = None, index
    del a.sources["retriever_url"]
    a.sources["index"] = f"{RUN} (its retriever_url {url} did not answer)"


def settings_table(a: argparse.Namespace) -> str:
    """Each resolved setting, its value and where it came from (a flag, the run's config.json, eval's default)."""
    rows = [(k, str(getattr(a, k)), a.sources[k]) for k in SETTINGS if k in a.sources]
    w = [max(len(r[i]) for r in rows + [("setting", "value", "source")]) for i in range(2)]
    head = f"Settings (run config: {a.run_config or 'none'}):"
    return "\n".join([head, f"  {'setting':<{w[0]}}  {'value':<{w[1]}}  source"]
                     + [f"  {k:<{w[0]}}  {v:<{w[1]}}  {s}" for k, v, s in rows])


def settings_dict(a: argparse.Namespace) -> dict:
    """{setting: {"value", "source"}}: the resolved settings and where each came from (see parse_args)."""
    return {k: {"value": getattr(a, k), "source": a.sources[k]} for k in SETTINGS if k in a.sources}


# ---- command line ------------------------------------------------------------------------------

class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every flag's default."""


def build_parser() -> argparse.ArgumentParser:
    # train.py's booleans (true/false, yes/no, 1/0, on/off) and its flags, declared once in training/settings/settings_play.py
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    # model and engine
    p.add_argument("--model", required=True, help="HF model folder to evaluate, or a training run's: its folder, "
                   "checkpoints/, a checkpoint (step_N) or its export (checkpoints/step_N/hf); the first two take the "
                   "latest checkpoint")
    p.add_argument("--no_run_config", action="store_true", help="do not take the rollout protocol from the "
                   "config.json of the run that holds --model")
    add_field_flags(p, RolloutArgs, ["rollout_engine"], dests={"rollout_engine": "engine"},
                    aliases={"rollout_engine": ("--engine",)})
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"],
                   help="model dtype, torch's or train.py's spelling (bf16 greedy differs from fp32); in a run, the run's")
    add_field_flags(p, RolloutArgs, ["kv_cache_mb", "vllm_tp"], dests={"vllm_tp": "tp"}, aliases={"vllm_tp": ("--tp",)},
                    metavars={"vllm_tp": "N"})
    p.add_argument("--seed", type=int, default=0, help="engine seed (matters only with --temperature > 0)")
    # data
    p.add_argument("--data", nargs="+", default=None, help="eval files: JSONL or parquet rows with question, "
                   "golden_answers, data_source; or a folder of benchmarks (FlashRAG's <benchmark>/test.jsonl, "
                   "<benchmark>.jsonl / .parquet, Search-R1's test.parquet) (this or --eval_data is required)")
    p.add_argument("--eval_data", default=None, help="train.py's spelling: comma-separated eval files (added to --data)")
    p.add_argument("--eval_limit", "--limit", dest="limit", type=int, default=None,
                   help="use only the first N rows of each file (a quick slice)")
    p.add_argument("--out_dir", required=True, help="folder for results.json, results.md, examples.jsonl and config.json")
    p.add_argument("--overwrite", nargs="?", const=True, default=False, type=parse_bool, metavar="BOOL",
                   help="replace the outputs of an earlier eval in --out_dir (without it such a folder is refused); "
                   "--overwrite alone = true")
    # search backend (at most one)
    s = p.add_argument_group("search backend (at most one; default: the run's solver backend, else no search tool)")
    s.add_argument("--solver_search", default=None, choices=["retriever", "simulated", "self", "none"],
                   help="train.py's spelling of the backend: retriever (--index or --retriever_url), simulated "
                   "(= --simulated), self (= --self_search), none (no search tool)")
    s.add_argument("--index", default=None, help="in-process retriever: an index folder built by retrieval/build_index.py")
    s.add_argument("--retriever_url", default=None, help="retrieval server URL (Search-R1 /retrieve API), e.g. "
                   "http://127.0.0.1:8000")
    s.add_argument("--self_search", action="store_true", help="SSRL self-search: the model writes its own "
                   "<information>; no tool")
    s.add_argument("--simulated", action="store_true", help="ZeroSearch simulated search: an LLM writes the documents")
    s.add_argument("--sim_url", default=None, help="simulator server (OpenAI-compatible); default: the evaluated "
                   "model in-process")
    s.add_argument("--sim_model", default=None, help="simulator model name on --sim_url")
    s.add_argument("--sim_noise", type=float, default=0.0, help="chance of a noisy simulated document (0 = all useful)")
    # rollout protocol
    r = p.add_argument_group("rollout protocol (with --model in a training run, its config.json supplies what is "
                             "not given here; these defaults apply outside a run)")
    # train.py's flags (training/settings/settings_play.py): one name, default and help each
    add_field_flags(r, SearchArgs, ["topk"])
    add_field_flags(r, RolloutArgs, ["max_turns", "max_tokens_per_turn", "max_total_tokens", "max_info_tokens",
                                     "max_model_len", "rollout_schedule", "max_inflight"])
    r.add_argument("--template", default=EvalConfig.template, choices=list(TEMPLATES),
                   help="prompt chat template (inference/prompts.py)")
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples (never taken from the run)")
    r.add_argument("--samples", type=int, default=EvalConfig.samples, help="rollouts per question (needs --temperature > 0 when > 1); "
                   "K > 1 reports pass@K and mean@K: RL mostly turns pass@k into pass@1, so the gap between pass@K "
                   "and greedy EM is the headroom RL can harvest")
    r.add_argument("--batch_size", type=int, default=EvalConfig.batch_size, help="rollouts per batch (questions x --samples)")
    # judge
    p.add_argument("--judge_url", default=None, help="OpenAI-compatible judge server; without it the judge is exact match")
    p.add_argument("--judge_model", default=None, help="served judge model name (none: the server's first model)")
    p.add_argument("--judge_cache", default=None, help="SQLite file caching verdicts across runs")
    p.add_argument("--report_to", default="none", help="also log the per-source table as a run summary: a comma "
                   "list of wandb, mlflow (train.py's flag; tensorboard is taken and writes nothing here), or none; "
                   "a tracker that fails warns and the eval goes on")
    return p


def explicit_flags(p: argparse.ArgumentParser, argv: list[str] | None, dests: Sequence[str]) -> set[str]:
    """The dests given on the command line (any spelling, abbreviations included): parsed again with every
    default set to a sentinel, whatever is not the sentinel was given."""
    p.set_defaults(**{d: _UNSET for d in dests})
    given = p.parse_args(argv)
    return {d for d in dests if getattr(given, d) is not _UNSET}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse, then resolve each protocol setting: a flag given on the command line, else the value in the
    config.json of the training run that holds --model (unless --no_run_config), else eval's default."""
    p = build_parser()
    a = p.parse_args(argv)
    given = explicit_flags(p, argv, list(vars(a)))
    a.data = (a.data or []) + [f for f in (a.eval_data or "").split(",") if f.strip()]
    if not a.data:
        p.error("the eval files are required: --data FILE [FILE ...] or --eval_data FILE,FILE")
    given_model = a.model
    try:
        a.model, run_dir = locate_run(a.model)
    except ValueError as e:
        p.error(str(e))
    run = None if run_dir is None or a.no_run_config else train_config(run_dir / "config.json")
    a.run_config = str(run_dir / "config.json") if run is not None else None
    train_defaults = Config().to_dict()  # a field an older config.json lacks ran at train.py's default
    a.sources = {"model": FLAG if a.model == given_model else f"{FLAG} ({given_model})", "temperature": FLAG if "temperature" in given else DEFAULT}
    for dest, (group, name) in RUN_PROTOCOL.items():
        if dest in given or run is None:
            a.sources[dest] = FLAG if dest in given else DEFAULT
        else:
            setattr(a, dest, run[group].get(name, train_defaults[group][name]))
            a.sources[dest] = RUN
    a.dtype = DTYPES.get(a.dtype, a.dtype)

    # the search backend: what the flags name, else the run's solver backend, else none (or what --index /
    # --retriever_url imply); the run's index / retriever_url / sim_url / sim_model fill what the flags leave out
    chosen = [f for f, on in (("--index", a.index), ("--retriever_url", a.retriever_url), ("--self_search", a.self_search),
                               ("--simulated", a.simulated)) if on]
    if len(chosen) > 1:
        p.error(f"choose one search backend, got {' and '.join(chosen)}")
    implied = {"--index": "retriever", "--retriever_url": "retriever", "--self_search": "self", "--simulated": "simulated"}
    if chosen and a.solver_search and implied[chosen[0]] != a.solver_search:
        p.error(f"choose one search backend, got --solver_search {a.solver_search} and {chosen[0]}")
    rs = run["search"] if run is not None else {}
    if a.solver_search or chosen:
        kind, a.sources["solver_search"] = a.solver_search or implied[chosen[0]], FLAG
    elif run is not None:
        kind, a.sources["solver_search"] = rs.get("solver_search", train_defaults["search"]["solver_search"]), RUN
    else:
        kind, a.sources["solver_search"] = "none", DEFAULT
    a.solver_search, a.self_search, a.simulated = kind, kind == "self", kind == "simulated"
    if kind == "retriever":
        if a.index or a.retriever_url:
            a.sources["index" if a.index else "retriever_url"] = FLAG
        elif rs.get("retriever_url"):
            a.retriever_url, a.sources["retriever_url"] = rs["retriever_url"], RUN
        elif rs.get("index"):
            a.index = _find_index(rs["index"])
            if a.index is None:
                p.error(f"the run's solver searched the index {rs['index']} ({a.run_config}), which is not a built "
                        "index from here (no manifest.json); pass --index or --retriever_url, --solver_search none, "
                        "or --no_run_config")
            a.sources["index"] = RUN
        else:
            p.error("--solver_search retriever needs --index or --retriever_url")
    if kind == "simulated":
        for k in ("sim_url", "sim_model"):
            if getattr(a, k) or rs.get(k):
                a.sources[k] = FLAG if getattr(a, k) else RUN
                setattr(a, k, getattr(a, k) or rs[k])
    elif "sim_url" in given or "sim_model" in given:
        p.error("--sim_url/--sim_model configure --simulated, which is not set")

    if a.index and not (Path(a.index) / "manifest.json").exists():
        p.error(f"--index {a.index} is not a built index (no manifest.json); build one with "
                "`python -m retrieval.build_index --corpus FILE --out DIR --kind bm25`")
    taken = [n for n in OUTPUTS if (Path(a.out_dir) / n).exists()]
    if Path(a.out_dir).exists() and not Path(a.out_dir).is_dir():
        p.error(f"--out_dir {a.out_dir} is a file, not a folder")
    if taken and not a.overwrite:
        p.error(f"--out_dir {a.out_dir} already holds {', '.join(taken)} (an earlier eval, or another tool's "
                f"config.json); pass --overwrite to replace them, or pick another --out_dir")
    if a.limit is not None and a.limit < 1:
        p.error(f"--limit must be >= 1, got {a.limit}")
    for err in report_to_errors(a.report_to):
        p.error(err)
    if a.samples < 1:
        p.error(f"--samples must be >= 1, got {a.samples}")
    if a.samples > 1 and a.temperature <= 0:
        p.error(f"--samples {a.samples} needs --temperature > 0: greedy decoding (--temperature {a.temperature:g}) "
                "gives the same answer every time, so pass@K would equal greedy EM")
    for err in rollout_flag_errors({k: getattr(a, k) for k in ROLLOUT_FLAGS}):
        p.error(err)
    if a.batch_size < 1:
        p.error(f"--batch_size must be >= 1, got {a.batch_size}")
    if a.max_total_tokens > a.max_model_len and a.engine == "vllm":
        p.error(f"--max_total_tokens {a.max_total_tokens} exceeds --max_model_len {a.max_model_len}; raise the latter")
    return a


def read_inputs(a: argparse.Namespace) -> list[EvalRow]:
    """What the command line points at, checked as train.py checks it before anything is loaded, and the rows:
    every --data file is there and read whole (every file's bad rows listed), --model is a causal LM folder that
    loads (or a hub id), --index is a finished index whose manifest fits its folder, with a dense index's encoder
    and FAISS file at hand. InputError, one message, otherwise."""
    missing = [f for f in a.data if not Path(f).exists()]
    if missing:
        raise InputError(f"--data {' '.join(missing)}: no such file")
    try:  # a folder of benchmarks (FlashRAG's <benchmark>/test.jsonl, Search-R1's test.parquet): its eval files
        a.data = list(dict.fromkeys(f for d in a.data for f in eval_files(d)))
    except InputError as e:
        raise InputError(f"--data {e}") from None
    errs = model_path_errors(a.model) or model_folder_errors(a.model, flag="--model", role="the evaluated model")
    if errs:  # train.py's messages, in eval's spelling
        raise InputError("\n  - ".join([""] + errs if len(errs) > 1 else errs).replace("--model_path", "--model"))
    if a.index:
        try:
            check_index(a.index)
        except InputError as e:
            raise InputError(f"--index {a.index}: {e}") from None
    rows: list[EvalRow] = []
    errors = []
    for path in a.data:
        try:
            rows += load_eval_rows(path, limit=a.limit)
        except InputError as e:
            errors.append(str(e))
    if errors:
        raise InputError("\n".join(errors))
    return rows


def check_prompt_budget(a: argparse.Namespace, rows: list[EvalRow], rollout: RolloutConfig) -> None:
    """Every row's first prompt leaves room to answer: fewer tokens than min(--max_total_tokens, --max_model_len).
    Counted with the model's tokenizer before the model loads; InputError naming the file, the line and the limit."""
    from transformers import AutoTokenizer  # lazy: the cheap checks came first; the engine imports it anyway

    cfg = EvalConfig(rollout=rollout, template=a.template, progress=False)
    try:
        err = prompt_budget_error(AutoTokenizer.from_pretrained(a.model), rows, cfg, a.max_model_len)
    except InputError:
        raise
    except ValueError as e:  # render_chat: --template auto for a tokenizer without a chat template
        raise InputError(f"--template {a.template}: {e}") from None
    if err is not None:
        raise err


def build_search(a: argparse.Namespace, engine: TokenGenerator | None = None) -> tuple[Callable | None, str]:
    """The search backend's `search` and how the protocol names it."""
    if a.self_search:
        return None, "self-search (SSRL): the model writes its own <information>, masked; no tool"
    if a.simulated:
        sim = SimulatedSearch(url=a.sim_url, engine=None if a.sim_url else engine, model=a.sim_model,
                              noise_start=a.sim_noise, noise_end=a.sim_noise, seed=a.seed, template=a.template,
                              show_answer=False)  # never leak the golden answer to the model under test
        return sim.search, f"simulated search (ZeroSearch): {sim.describe()}"
    if a.index:
        from retrieval.retriever import load_retriever  # lazy: numpy, and bm25s or FAISS for the index

        r = load_retriever(a.index)
        desc = r.describe()
        return r.search, f"{desc.get('kind', r.kind)} index at {a.index} ({desc.get('count', len(r))} docs)"
    if a.retriever_url:
        from retrieval.client import RetrievalClient  # lazy: httpx

        return RetrievalClient(a.retriever_url, topk=a.topk).search, f"retrieval server at {a.retriever_url}"
    return None, "none (no search tool)"


def build_engine(a: argparse.Namespace) -> RolloutEngine:
    if a.engine == "hf":  # on this machine's GPU when it has one (it ran on the CPU even beside a GPU)
        return HFEngine(a.model, dtype=a.dtype, device=local_device(), max_model_len=a.max_model_len)
    return VLLMEngine(a.model, dtype=a.dtype, seed=a.seed, tensor_parallel_size=a.tp, max_model_len=a.max_model_len,
                      kv_cache_memory_bytes=(a.kv_cache_mb << 20) or None)


def main(argv: list[str] | None = None) -> int:
    keep_unused_imports_out()   # no sklearn import inside transformers (docs/PLATFORM_NOTES.md)
    a = parse_args(argv)
    rollout = RolloutConfig(max_turns=a.max_turns, max_total_tokens=a.max_total_tokens,
                            max_tokens_per_turn=a.max_tokens_per_turn, max_info_tokens=a.max_info_tokens,
                            topk=a.topk, temperature=a.temperature, seed=a.seed if a.temperature > 0 else None,
                            self_search=a.self_search, schedule=a.rollout_schedule, max_inflight=a.max_inflight)
    try:
        fall_back_from_a_stopped_retriever(a)
        rows = read_inputs(a)
        check_prompt_budget(a, rows, rollout)
    except InputError as e:  # a missing or wrong file, folder or row: one message (docs/TROUBLESHOOTING.md)
        return entry_point_error("eval.py", e)
    print(settings_table(a), flush=True)
    configure_logging(0)   # one process: info from the project's loggers; httpx's per-request info lines stay off
    # The engine comes before the retriever: bm25s imports numba/llvmlite, and vLLM's CPU start-up
    # scan of every module's globals trips over llvmlite's `lib` object (AttributeError).
    engine = build_engine(a)
    try:
        search_fn, retriever_desc = build_search(a, engine)
    except InputError as e:  # a dense index's encoder missing here: named, no traceback
        return entry_point_error("eval.py", e)
    judge = Judge(a.judge_url, model=a.judge_model, cache_path=a.judge_cache) if a.judge_url else Judge()
    protocol = {
        "model": str(Path(a.model).resolve()),
        "engine": f"{a.engine} ({a.dtype})",
        "retriever": retriever_desc,
        "topk": a.topk,
        "max_turns": a.max_turns,
        "token_caps": f"{a.max_tokens_per_turn}/turn, {a.max_info_tokens}/information block, {a.max_total_tokens} total",
        "template": a.template,
        "judge": judge.describe(),
        "sampling": ("greedy (temperature 0)" if a.temperature == 0 else f"temperature {a.temperature}, seed {a.seed}"
                     + (f", {a.samples} samples per question" if a.samples > 1 else "")),
        "examples": f"{len(rows)} from {', '.join(a.data)}" + (f" (first {a.limit} of each)" if a.limit else ""),
        "schedule": ("turn (simulated search is stateful: run_rollouts falls back)"
                     if a.simulated and a.rollout_schedule == "trajectory" else
                     a.rollout_schedule + (f", at most {a.max_inflight} sequences in flight"
                                           if a.rollout_schedule == "trajectory" and a.max_inflight else "")),
        "run_config": a.run_config or ("off (--no_run_config)" if a.no_run_config else "none (--model is in no run)"),
    }
    print("Evaluation protocol:\n" + "\n".join(protocol_lines(protocol)), flush=True)

    t0 = time.time()
    result = evaluate(engine, rows, search_fn, EvalConfig(rollout=rollout, template=a.template, judge=judge,
                                                          batch_size=a.batch_size, progress=True, samples=a.samples))
    protocol["eval_seconds"] = round(time.time() - t0, 1)
    out_dir = Path(a.out_dir)
    settings = settings_dict(a)
    write_outputs(out_dir, protocol, result, settings)
    (out_dir / "config.json").write_text(json.dumps(vars(a), indent=2) + "\n")
    print(markdown_report(protocol, result, settings))
    print(f"wrote {out_dir}/results.json, results.md, examples.jsonl", flush=True)
    if a.report_to != "none":
        values, table = eval_summary(result["per_source"], result["overall"])
        log_summary(a.report_to, out_dir, {**vars(a), "protocol": protocol}, values, {"eval/per_source": table},
                    run_name=f"eval-{out_dir.resolve().name}")
    judge.close()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
