"""Scoring throughput and peak memory of `assay score`'s kernel against a plain matrix product.

Each case runs in its own subprocess so its peak resident memory (ru_maxrss) is its own:
  matmul     the whole [N, D] fp32 matrix in RAM, one `queries @ rows.T` (the floor)
  <mode>     the streaming kernel over the .npy index on disk (warm page cache; --dtype float16
             or float32, the two `assay build --store_dtype` choices), as `assay score` runs it:
             map chunk -> fp32 blocks -> GEMM (+ the mode's row norms) -> running top-k, or for
             inner, influence and cosine on fp16 rows: fp16 GEMM -> exact scores of the rows
             that may reach the top k (the rows' norms come from the index's norms.npy)
Usage: python bench/bench_score.py [--rows 100000] [--dim 3584] [--queries 4] [--repeats 3] [--rounds 3]
                                   [--dtype float16] [--chunk_mib 32 64] [--block_mib 0.5 1]
                                   [--fp32_reads blocks|mapped]
Ratios are medians over rounds of each case's time over the matmul's time in the same round:
`vs matmul` for the median of the passes after the first, `1st pass` for a process's first
pass (the only one an `assay score` run makes), both over the matmul's warm time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from machine import header, machine  # noqa: E402

MODULE_DIM = 256  # p = 16 per side


def make_index(path: Path, rows: int, dim: int, seed: int = 0, dtype: str = "float16") -> None:
    """A synthetic index file, written in chunks (never whole in RAM)."""
    rng = np.random.default_rng(seed)
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.dtype(dtype), shape=(rows, dim))
    for start in range(0, rows, 8192):
        stop = min(start + 8192, rows)
        out[start:stop] = rng.standard_normal((stop - start, dim), dtype=np.float32) * 1e-2
    out.flush()


def whitening(dim: int, queries: torch.Tensor, seed: int = 1):
    """TrackStar's whitening from synthetic training statistics, mixed with the queries (λ = 0.3)."""
    from assay.attribution.precondition import build_whitening

    gen = torch.Generator().manual_seed(seed)
    slices = {f"m{i}": slice(s, s + MODULE_DIM) for i, s in enumerate(range(0, dim, MODULE_DIM))}
    sums = {}
    for name in slices:
        a = torch.randn(MODULE_DIM, MODULE_DIM, generator=gen)
        sums[name] = a @ a.T
    return build_whitening(sums, 1000, queries, slices, 0.3, 0.1)


def rss_mib(field: str = "VmRSS") -> float:
    """Resident memory now (VmRSS) or its peak (VmHWM) in MiB, of this process image only.

    (ru_maxrss would include the parent's peak: Linux keeps it across fork + exec.)
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_case(
    case: str,
    path: Path,
    queries: int,
    repeats: int,
    chunk_mib: int = 0,
    block_mib: float = 0,
    reads: str = "",
) -> dict:
    from assay.attribution import kernel
    from assay.attribution import rows as rows_module
    from assay.attribution.kernel import ArrayRows, plan_queries, score_rows
    from assay.attribution.score import auto_chunk_rows
    from assay.core.memory import return_freed_memory

    return_freed_memory()  # as the `assay` command does
    if block_mib:
        kernel.BLOCK_BYTES = int(block_mib * 2**20)
    if reads:  # every chunk of an fp32 index read this way, not as the kernel's trial chooses
        rows_module.FileReads.way = lambda self, chunk: reads  # type: ignore[method-assign]

    rows = np.load(path, mmap_mode="r")
    n, dim = rows.shape
    before = rss_mib()
    q = torch.randn(queries, dim, generator=torch.Generator().manual_seed(2))
    times, extra = [], {}
    chunk = auto_chunk_rows(dim, chunk_mib) if chunk_mib else auto_chunk_rows(dim)
    if case == "matmul":
        full = torch.from_numpy(np.array(rows, dtype=np.float32))  # the whole matrix in RAM (a copy)
        for _ in range(repeats + 1):
            t = time.perf_counter()
            _ = q @ full.T
            times.append(time.perf_counter() - t)
    else:
        mode = case.split("-")[0]
        white = whitening(dim, q) if mode in ("trackstar", "influence") else None
        source = ArrayRows(rows)
        base = None
        if case == "trackstar-cached":  # the cached per-row norms (the parent's one-time pass)
            base = np.load(path.with_name("base_norms.npy"))
        norms = np.load(path.with_name("norms.npy"))  # what `assay build` writes beside the rows
        plan = plan_queries(q, mode, "none", white, base, norms)
        extra["screened"] = plan.screen is not None and rows.dtype == np.float16
        picked: list[int] = []
        if extra["screened"]:  # count the rows each chunk scores exactly after the fp16 screen
            real = kernel.screened_chunk

            def counting(*args):
                scores, positions = real(*args)
                picked.append(len(positions))
                return scores, positions

            kernel.screened_chunk = counting
        for _ in range(repeats + 1):
            t = time.perf_counter()
            score_rows(source, plan, top_k=10, chunk_rows=chunk)
            times.append(time.perf_counter() - t)
        if picked:
            extra["rescored_per_chunk"] = float(np.mean(picked))
    best = float(np.median(times[1:]))  # later passes: warm kernels and page tables
    peak = rss_mib("VmHWM")
    return {
        "case": case,
        "rows": n,
        "dim": dim,
        "queries": queries,
        "seconds": best,
        "first_seconds": times[0],  # the one pass an `assay score` process makes
        "rows_per_s": n / best,
        "peak_rss_mib": peak,
        "rss_before_mib": before,
        "chunk_rows": chunk,
        **extra,
    }


def write_row_norms(path: Path) -> None:
    """norms.npy as `assay build` writes it: each stored row's norm."""
    from assay.attribution.kernel import ArrayRows, row_norms

    np.save(path.with_name("norms.npy"), row_norms(ArrayRows(np.load(path, mmap_mode="r"))))


def norm_pass(path: Path, queries: int) -> float:
    """The one-time pass `assay score` caches: each row's ‖(R_train + δI)^{-1/2} t‖²."""
    from assay.attribution.kernel import ArrayRows, base_sq_norms
    from assay.attribution.score import auto_chunk_rows

    rows = np.load(path, mmap_mode="r")
    q = torch.randn(queries, rows.shape[1], generator=torch.Generator().manual_seed(2))
    start = time.perf_counter()
    norms = base_sq_norms(ArrayRows(rows), whitening(rows.shape[1], q), auto_chunk_rows(rows.shape[1]))
    seconds = time.perf_counter() - start
    np.save(path.with_name("base_norms.npy"), norms)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=3584)
    ap.add_argument("--queries", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    ap.add_argument("--cases", default="matmul,inner,cosine,influence,trackstar,trackstar-cached")
    ap.add_argument(
        "--chunk_mib",
        type=int,
        nargs="+",
        default=[0],
        help="rows per chunk as MiB of fp32 (0: assay score's own choice); several are compared",
    )
    ap.add_argument(
        "--block_mib",
        type=float,
        nargs="+",
        default=[0],
        help="the exact path's block of fp32 rows per GEMM (cached TrackStar's per bmm), MiB "
        "(0: the kernel's own)",
    )
    ap.add_argument(
        "--fp32_reads",
        choices=["blocks", "mapped"],
        default="",
        help="read every chunk of an fp32 index this way (default: as the kernel's timed trial chooses)",
    )
    ap.add_argument("--out", default="", help="also write the machine and the results as JSON here")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:  # child process: one measurement
        sizes = (args.chunk_mib[0], args.block_mib[0])
        print(
            json.dumps(
                run_case(args.case, Path(args.path), args.queries, args.repeats, *sizes, args.fp32_reads)
            )
        )
        return
    info = machine()
    print(header(info), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gradients.npy"
        make_index(path, args.rows, args.dim, dtype=args.dtype)
        size = path.stat().st_size / 2**20
        print(
            f"index: {args.rows:,} rows x {args.dim} {args.dtype} = {size:,.0f} MiB; {args.queries} queries; "
            f"torch threads {torch.get_num_threads()}"
        )
        write_row_norms(path)
        norms_seconds = None
        if "trackstar-cached" in args.cases.split(","):
            norms_seconds = norm_pass(path, args.queries)
        runs: dict[str, list[dict]] = {}
        specs: dict[str, tuple[str, int, int]] = {}  # name -> (case, chunk MiB, block MiB)
        for case in args.cases.split(","):
            for chunk in [0] if case == "matmul" else args.chunk_mib:
                for block in [0] if case == "matmul" else args.block_mib:
                    name = case + (f"@{chunk}MiB" if len(args.chunk_mib) > 1 and case != "matmul" else "")
                    name += f"@block{block}MiB" if len(args.block_mib) > 1 and case != "matmul" else ""
                    runs[name], specs[name] = [], (case, chunk, block)
        for _ in range(args.rounds):  # cases interleaved, so load drift on a shared machine hits all alike
            for name in runs:
                case, chunk, block = specs[name]
                cmd = [sys.executable, __file__, "--case", case, "--path", str(path)]
                cmd += ["--queries", str(args.queries), "--repeats", str(args.repeats)]
                cmd += ["--chunk_mib", str(chunk), "--block_mib", str(block)]
                cmd += ["--fp32_reads", args.fp32_reads] if args.fp32_reads else []
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                runs[name].append(json.loads(out.strip().splitlines()[-1]))
        results = []
        for name, rs in runs.items():
            r = {**rs[0], "case": name}
            r["seconds"] = float(np.median([x["seconds"] for x in rs]))
            r["rows_per_s"] = r["rows"] / r["seconds"]
            if "matmul" in runs:  # median over rounds of the same-round ratio
                r["ratio"] = float(
                    np.median([x["seconds"] / m["seconds"] for x, m in zip(rs, runs["matmul"])])
                )
                r["first_ratio"] = float(
                    np.median([x["first_seconds"] / m["seconds"] for x, m in zip(rs, runs["matmul"])])
                )
            results.append(r)
        base = "matmul" in runs
        head = f"{'case':<24} {'rows/s':>12} {'seconds':>8} {'vs matmul':>9} {'1st pass':>8}"
        print(head + f" {'peak RSS MiB':>12} {'above imports':>14}")
        for r in results:
            ratio = f"{r['ratio']:.2f}x" if base else "-"
            first = f"{r['first_ratio']:.2f}x" if base else "-"
            line = f"{r['case']:<24} {r['rows_per_s']:>12,.0f} {r['seconds']:>8.3f} {ratio:>9} {first:>8} "
            line += f"{r['peak_rss_mib']:>12,.0f} {r['peak_rss_mib'] - r['rss_before_mib']:>14,.0f}"
            if r["case"].startswith("trackstar-cached"):
                line += f"   (after a one-time norm pass of {norms_seconds:.1f} s, cached)"
            if r.get("screened"):
                exact = f"{r['rescored_per_chunk']:.0f} of {r['chunk_rows']:,}"
                line += f"   (fp16 screen; {exact} rows per chunk re-scored exactly)"
            print(line)
    if args.out:
        record = {"machine": info, "args": vars(args), "norm_pass_s": norms_seconds, "results": results}
        Path(args.out).write_text(json.dumps(record, indent=2, default=float) + "\n")


if __name__ == "__main__":
    main()
