"""Pick the CPU training/rollout dtype from a measurement on this machine, not from a constant.

    python -m utils.cpu_dtype              # prints bf16 or fp32 (train.py / sft.py spelling)
    python -m utils.cpu_dtype --form eval  # prints bfloat16 or float32 (eval.py spelling)
    python -m utils.cpu_dtype --verbose    # also the GFLOP/s it measured, on stderr
    python -m utils.cpu_dtype --keep_in runs/demo   # measure once per run folder, then reuse that answer

Why --keep_in: the measurement is a timing, and a timing near the 1.5x line can land either side on two calls
(CI's machine measured fp32 for a demo's first leg and bf16 for its resume, and train.py then refused to
mix the two runs). A run folder keeps its first answer in DIR/dtype, or in the model.dtype of a train.py
config.json already there, so a rerun resumes in the dtype it started in.

Why: the CPUs differ from box to box (docs/PLATFORM_NOTES.md, CPU dtype). On AMX Xeons bf16 GEMMs ran ~4x faster
than fp32, so bf16 halves an SFT; on AVX2-only EPYCs bf16 is no faster, and it costs accuracy
for nothing: one bf16 ulp near 1.0 is 0.0078, so small Adam steps never reach the stored
weights. bf16 is chosen only when it is clearly faster (--min_gain, default 1.5x).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

FORMS = {"train": ("bf16", "fp32"), "eval": ("bfloat16", "float32")}
KEEP_FILE = "dtype"


def choose(fp32_gflops: float, bf16_gflops: float, min_gain: float = 1.5) -> str:
    """'bf16' when bf16 GEMMs run at least `min_gain` times fp32's throughput, else 'fp32'."""
    if fp32_gflops <= 0 or bf16_gflops <= 0:
        raise ValueError(f"throughputs must be positive, got fp32={fp32_gflops} bf16={bf16_gflops}")
    return "bf16" if bf16_gflops >= min_gain * fp32_gflops else "fp32"


def gemm_gflops(dtype, n: int = 1024, reps: int = 5) -> float:
    """Median GFLOP/s of an n x n matmul in `dtype` on the current torch threads (one warm-up)."""
    import torch
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / sorted(times)[len(times) // 2] / 1e9


def kept(run_dir: Path) -> str | None:
    """The train-form dtype a run folder already settled on: DIR/dtype, else model.dtype of DIR/config.json."""
    f = run_dir / KEEP_FILE
    if f.is_file():
        pick = f.read_text().strip()
        if pick not in FORMS["train"]:
            raise SystemExit(f"cpu_dtype: {f} holds {pick!r}, not one of {FORMS['train']}; delete it to measure again")
        return pick
    cfg = run_dir / "config.json"
    if cfg.is_file():
        try:
            pick = (json.loads(cfg.read_text()).get("model") or {}).get("dtype")
        except (ValueError, AttributeError):
            return None
        if pick in FORMS["train"]:
            return pick
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--form", choices=sorted(FORMS), default="train", help="train: bf16/fp32; eval: bfloat16/float32")
    ap.add_argument("--min_gain", type=float, default=1.5, help="bf16 must be this many times faster to be chosen")
    ap.add_argument("--verbose", action="store_true", help="print the measured GFLOP/s to stderr")
    ap.add_argument("--keep_in", type=Path, default=None, metavar="DIR",
                    help=f"a run folder: reuse the dtype it settled on ({KEEP_FILE} or config.json), else measure "
                         f"and write DIR/{KEEP_FILE}")
    a = ap.parse_args(argv)
    pick = kept(a.keep_in) if a.keep_in else None
    if pick is not None:
        if a.verbose:
            print(f"cpu_dtype: {pick}, kept from the run in {a.keep_in} (delete {a.keep_in / KEEP_FILE} to measure "
                  f"again)", file=sys.stderr)
    else:
        import torch
        fp32, bf16 = gemm_gflops(torch.float32), gemm_gflops(torch.bfloat16)
        pick = choose(fp32, bf16, a.min_gain)
        if a.verbose:
            print(f"cpu_dtype: fp32 {fp32:.0f} GFLOP/s, bf16 {bf16:.0f} GFLOP/s on {torch.get_num_threads()} threads "
                  f"-> {pick}", file=sys.stderr)
        if a.keep_in:
            a.keep_in.mkdir(parents=True, exist_ok=True)
            (a.keep_in / KEEP_FILE).write_text(pick + "\n")
    print(FORMS[a.form][0] if pick == "bf16" else FORMS[a.form][1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
