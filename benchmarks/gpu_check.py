"""The pilot's CUDA path, proved in one command on a lent GPU (at most 8 minutes on one card).

    python benchmarks/gpu_check.py --prepare     # here, online: the wheels the GPU image lacks
    python benchmarks/gpu_check.py               # there: the check (refuses without a GPU)
    python benchmarks/gpu_check.py --cpu-half    # anywhere: every section's code on the CPU

On the GPU machine (no network; its image has torch, transformers, peft, accelerate, lightning,
pandas and matplotlib), install the carried wheels first - `make gpu-check` prints the line.
Sections, each with its own time limit; one failing is a row with its error, never the end:
  env         torch, CUDA, the card, the determinism settings 07 relies on
  counter     03's allocated and reserved columns against the allocator's own event trace
              (torch.cuda.memory._record_memory_history), replayed phase by phase
  prediction  the fake-tensor prediction against the measured CUDA peak over
              memory_prediction.py's grid (fp32, bf16 autocast, checkpointing, HF families, LoRA)
  oom         a gate asked for a micro-batch that cannot fit (the allocator capped to stand for
              a smaller card): recorded as the row's finding with the figure it reached
  speed       the 8 B LoRA campaign (examples/llama_lora_campaign.py's shape) trained for real,
              last and alone: its MFU against what 08's speed references assume for this card
  pilot       `make pilot`'s nine notebooks --smoke on cuda, and the LoRA twin's 03, 05, 07
              and 08 (--twin-only), verdicts;
              05's bf16 / fp16 variants and 07's resume read from those runs
It ends with one `name: value` line per figure (gpu_pilot_verdicts, gpu_counter_vs_allocator_pct,
gpu_prediction_max_abs_error_pct, gpu_resume_exact, gpu_oom_recorded, gpu_speed_vs_catalog, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the examples package; benchmarks' sibling scripts

# The GPU image's Python packages (device README: KINDS.md, read 2026-11-17): never carried.
IMAGE = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio
attrs botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
coverage cycler cython einops filelock flatbuffers fonttools frozenlist fsspec grpcio h11 h5py
hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl ml-dtypes mpmath msgpack multidict mypy-extensions networkx ninja
numba numpy opencv-python-headless packaging pandas pathspec patsy peft pillow pip pluggy
portalocker prometheus-client propcache protobuf psutil pyarrow py-cpuinfo pygments pyparsing
pytest pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich
safetensors scipy sentencepiece setuptools shellingham simplejson six sortedcontainers sympy
tabulate tensorboard tensorboard-data-server threadpoolctl tiktoken timm tokenizers toolz torch
torchaudio torchmetrics torchvision tqdm transformers triton typer typing-extensions urllib3
werkzeug wheel wrapt xxhash yarl zipp tzdata pytz""".split())
# What the pilot needs there beyond the image: papermill's kernels, nbval, pydantic, TRL.
NEEDED = ["papermill", "nbclient", "nbformat", "ipykernel", "jupyter_client", "nbval",
          "pydantic", "trl", "datasets", "ipywidgets"]
WHEELS = ROOT / ".whl"
WHEEL_LIMIT = 56 * 2**20  # the device's working tree travels within 64 MiB
INSTALL = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
           "--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD")
FIGURES = ("gpu_pilot_verdicts", "gpu_twin_verdicts", "gpu_counter_vs_allocator_pct",
           "gpu_prediction_max_abs_error_pct", "gpu_variants", "gpu_resume_exact",
           "gpu_oom_recorded", "gpu_speed_vs_catalog")


def _key(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def closure(names: list[str]) -> dict[str, str]:
    """The installed distributions `names` need (their requirements, recursively, markers
    evaluated for this interpreter), less the GPU image's own: {name: version}."""
    from packaging.requirements import Requirement

    found: dict[str, str] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        if _key(name) in IMAGE or _key(name) in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        found[_key(name)] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return dict(sorted(found.items()))


def prepare(dry_run: bool = False) -> int:
    """Download, here, the wheels (Python 3.12, manylinux x86-64) of what the pilot needs and
    the GPU image lacks, at the versions this venv tests, into .whl/ (ignored)."""
    pins = closure(NEEDED)
    print(f"{len(pins)} packages to carry: " + ", ".join(f"{n}=={v}" for n, v in pins.items()))
    if dry_run:
        return 0
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34)]
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version=3.12", "--implementation=cp", *platforms,
               "--platform=manylinux2014_x86_64", "--platform=any", "-d", tmp,
               *[f"{n}=={v}" for n, v in pins.items()]]
        done = subprocess.run(cmd, timeout=900)
        if done.returncode:
            print("error: pip could not download every wheel (above); fix: pin a version "
                  "with a Python 3.12 manylinux wheel, or run where PyPI is reachable")
            return done.returncode
        size = sum(p.stat().st_size for p in Path(tmp).iterdir())
        if size > WHEEL_LIMIT:
            print(f"error: the wheels take {size / 2**20:.1f} MiB, over the "
                  f"{WHEEL_LIMIT / 2**20:.0f} MiB the device carries; fix: drop a package "
                  "from NEEDED")
            return 1
        if WHEELS.exists():
            for old in WHEELS.glob("*.whl"):
                old.unlink()
        WHEELS.mkdir(exist_ok=True)
        for wheel in Path(tmp).iterdir():
            wheel.rename(WHEELS / wheel.name)
    print(f"{len(pins)} wheels, {size / 2**20:.1f} MiB in {WHEELS.relative_to(ROOT)}/; on the "
          f"GPU machine (carry .whl):\n  {INSTALL} && python3 benchmarks/gpu_check.py")
    return 0


# --- sections ---------------------------------------------------------------------------------
class Check:
    """Figures, in the order they were found, and one table row per section."""

    def __init__(self, device: str, quick: bool, out: Path, deadline: float):
        self.device, self.quick, self.out, self.deadline = device, quick, out, deadline
        self.figures: dict[str, Any] = {}
        self.rows: list[dict[str, Any]] = []

    def section(self, name: str, body: Callable[["Check"], str]) -> None:
        start = time.perf_counter()
        try:
            status, finding = "ok", body(self)
        except Exception as exc:  # a section that breaks is a row, the next section runs
            status, finding = "error", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        self.rows.append({"section": name, "status": status,
                          "seconds": round(time.perf_counter() - start, 1), "finding": finding})
        print(f"[{name}] {status} in {self.rows[-1]['seconds']} s: {finding}", flush=True)


def env(c: Check) -> str:
    import torch

    parts = [f"torch {torch.__version__}"]
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        parts += [f"{p.name} {p.total_memory / 2**30:.0f} GiB", f"CUDA {torch.version.cuda}",
                  f"cuDNN {torch.backends.cudnn.version()}"]
    parts.append(f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG', 'unset')}")
    from workbook.training.memory import cublas_workspace_bytes
    held = cublas_workspace_bytes(torch.device(c.device, 0) if c.device == "cuda" else
                                  torch.device("cpu"))
    c.figures["gpu_cublas_workspace_bytes"] = held
    parts.append(f"cuBLAS workspaces {held / 2**20:.2f} MiB")
    c.figures["gpu_device"] = parts[1] if len(parts) > 2 else "none"
    return "; ".join(parts)


def _trace_peaks(before: dict, after: dict, start: int) -> tuple[int, int]:
    """Peak allocated and reserved bytes between two allocator snapshots, replayed from the
    allocator's event trace (alloc/free and segment events) from the first snapshot's state."""
    def state(snap):
        segs = snap["segments"]
        return (sum(b["size"] for s in segs for b in s["blocks"]
                    if b["state"] == "active_allocated"), sum(s["total_size"] for s in segs))
    allocated, reserved = state(before)
    peak_a, peak_r = allocated, reserved
    for event in after["device_traces"][0][start:]:
        action, size = event["action"], event["size"]
        allocated += {"alloc": size, "free_completed": -size}.get(action, 0)
        reserved += {"segment_alloc": size, "segment_map": size, "segment_free": -size,
                     "segment_unmap": -size}.get(action, 0)
        peak_a, peak_r = max(peak_a, allocated), max(peak_r, reserved)
    return peak_a, peak_r


def _sample_gates(device: str, micro_batch: int = 4, length: int = 0, **settings: Any):
    """The gates of the generation sample at a small shape, in this process."""
    from workbook import encode_examples, load_examples, load_task, split_examples
    from workbook.notebooks.gates import GateRun, GateSettings
    from workbook.training.loop import UpdateShape

    task = load_task("workbook.samples.generation:task")
    splits = split_examples(task, load_examples(task))
    train = encode_examples(task, splits["train"][:200])
    val = encode_examples(task, splits["validation"][:32])
    shape = UpdateShape(micro_batch, 2, "fp32", False)
    gate_settings = GateSettings(shape, eval_batch=8, length=length, device=device,
                                 input_updates=1, **settings)
    with tempfile.TemporaryDirectory() as tmp:
        return GateRun(task, gate_settings, train, val, Path(tmp)).run(training_only=True)


def counter(c: Check) -> str:
    """03's counters against the allocator's own events, replayed around the same phases."""
    import torch

    from workbook.notebooks import gates
    if c.device != "cuda":
        report = _sample_gates(c.device, micro_batch=2)
        c.figures["gpu_counter_vs_allocator_pct"] = "n/a (no GPU: the CPU counter ran)"
        return f"{len(report.rows)} phases measured by the CPU profiler counter"
    replayed: list[tuple[int, int]] = []
    project = gates.measure

    @contextlib.contextmanager
    def traced(device, baseline=()):
        torch.cuda.synchronize()
        before = torch.cuda.memory._snapshot()
        start = len(before["device_traces"][0])
        with project(device, baseline) as holder:
            yield holder
        after = torch.cuda.memory._snapshot()
        replayed.append(_trace_peaks(before, after, start))

    torch.cuda.memory._record_memory_history(context=None, stacks="python",
                                              max_entries=2_000_000)
    gates.measure = traced
    try:
        report = _sample_gates("cuda", micro_batch=8, length=256)
    finally:
        gates.measure = project
        torch.cuda.memory._record_memory_history(enabled=None)
    worst, lines = 0.0, []
    measured = [row for row in report.rows if row.peak_allocated_bytes is not None]
    for row, (alloc, reserved) in zip(measured, replayed, strict=True):
        for ours, theirs in ((row.peak_allocated_bytes, alloc),
                             (row.peak_reserved_bytes, reserved)):
            if ours is not None and theirs:
                worst = max(worst, abs(ours - theirs) / theirs * 100)
        lines.append(f"{row.phase}: {row.peak_allocated_bytes}/{alloc} allocated, "
                     f"{row.peak_reserved_bytes}/{reserved} reserved")
    c.figures["gpu_counter_vs_allocator_pct"] = round(worst, 3)
    (c.out / "counter.txt").write_text("\n".join(lines) + "\n")
    return f"{len(lines)} phases; worst {worst:.3f}% ({'; '.join(lines[:3])} ...)"


def prediction(c: Check) -> str:
    """memory_prediction.py's grid on this device (one batch of rows when quick)."""
    import memory_prediction as mp

    grid = [*mp.QUICK, *mp.HF[:2], *mp.HF[6:7], *mp.LORA] if not c.quick else [mp.QUICK[0]]
    table, skipped = mp.measure_grid(grid, c.device)
    table.to_csv(c.out / "prediction.csv", index=False)
    if table.empty:
        c.figures["gpu_prediction_max_abs_error_pct"] = f"none predicted ({len(skipped)} not)"
        return f"no phase predicted: {'; '.join(skipped[:4])}"
    worst = table.error_pct.abs().max()
    c.figures["gpu_prediction_max_abs_error_pct"] = round(float(worst), 3)
    top = table.loc[table.error_pct.abs().idxmax()]
    return (f"{len(table)} phase peaks over {len(grid)} configurations, {len(skipped)} not "
            f"predicted; worst {worst:.3f}% ({top.config} {top.phase}: predicted "
            f"{top.predicted_peak_bytes}, measured {top.measured_peak_bytes})")


def oom(c: Check) -> str:
    """A gate asked for what cannot fit: the row says out of memory with the figure reached."""
    import torch

    if c.device != "cuda":
        c.figures["gpu_oom_recorded"] = "n/a (no GPU)"
        return "skipped: the CPU has no allocator limit to reach"
    cap = 2 * 2**30  # the allocator capped at 2 GiB: a small card
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0)
                                               .total_memory)
    try:
        report = _sample_gates("cuda", micro_batch=200, length=1024)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    failed = [r for r in report.rows if r.detail.startswith("out of memory")]
    if not failed:
        c.figures["gpu_oom_recorded"] = "no: no row ran out of memory"
        return "no row ran out of memory at micro-batch 200 x 1024 under a 2 GiB cap"
    row = failed[0]
    reached = f"{row.peak_reserved_bytes / 2**30:.2f} GiB reserved" \
        if row.peak_reserved_bytes else "no reading"
    c.figures["gpu_oom_recorded"] = f"yes: {row.phase} ({reached} of a 2 GiB cap)"
    return f"{len(failed)} rows out of memory, first {row.phase}: {row.detail[:120]}"


def speed(c: Check) -> str:
    """The LoRA campaign trained for real on this card, against 08's reference MFU."""
    import torch
    from peft import LoraConfig, get_peft_model
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    import workbook as wb
    from workbook.notebooks.rental.speeds import gpu_of_device, read_speeds
    gpu_run = c.device == "cuda"
    shape = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8) \
        if gpu_run else dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    micro_batch, length = (4, 2048) if gpu_run else (2, 64)
    torch.manual_seed(0)

    def build(device: str):
        with torch.device(device):
            base = LlamaForCausalLM(LlamaConfig(**shape))
        base = base.to(torch.bfloat16)
        return get_peft_model(base, LoraConfig(r=16, lora_alpha=32,
                                               target_modules="all-linear",
                                               modules_to_save=["lm_head"],
                                               task_type="CAUSAL_LM"))

    def step_of(model, ids):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    # counted as 08 counts (torch.utils.flop_counter) on the meta device (nothing allocated),
    # through eager attention: the counter's SDPA formula refuses grouped key-value heads
    meta = build("meta")
    meta.base_model.model.set_attn_implementation("eager")
    ids = torch.zeros(micro_batch, length, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as flops:  # forward and backward (an update's FLOPs)
        meta(input_ids=ids, labels=ids).loss.backward()
    model = build(c.device)
    parameters = sum(p.numel() for n, p in model.named_parameters()
                     if "lora_" not in n and "modules_to_save" not in n)
    step = step_of(model, torch.randint(0, shape["vocab_size"], (micro_batch, length),
                                        device=c.device))
    for _ in range(2):
        step()
    sync = torch.cuda.synchronize if gpu_run else (lambda: None)
    sync()
    times = []
    for _ in range(5 if gpu_run else 2):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    seconds = sorted(times)[len(times) // 2]
    p8 = wb.params.of("08_rental_plan")
    name = torch.cuda.get_device_name(0) if gpu_run else ""
    gpu = gpu_of_device(name, p8["gpus"]) if gpu_run else None
    tokens_s = micro_batch * length / seconds
    if gpu is None:
        c.figures["gpu_speed_vs_catalog"] = f"n/a ({name or 'CPU'} is not in 08's list)"
        return f"{parameters / 1e6:.1f} M parameters, {tokens_s:.0f} tokens/s on {c.device}"
    peak = p8["gpu_tflops"][gpu] * 1e12
    mfu = flops.get_total_flops() / seconds / peak
    assumed = read_speeds(None, p8["gpus"]).estimate(gpu, parameters, "single")
    ratio = mfu / assumed.mfu
    c.figures["gpu_speed_vs_catalog"] = round(ratio, 3)
    c.figures["gpu_campaign_tokens_per_s"] = round(tokens_s)
    return (f"{parameters / 1e9:.2f} B LoRA, micro-batch {micro_batch} x {length}: "
            f"{seconds * 1000:.0f} ms/update, {tokens_s:.0f} tokens/s, MFU {mfu:.3f} measured "
            f"against {assumed.mfu:.3f} assumed by 08 ({assumed.basis}: {assumed.words[:90]})")


def _pilot(c: Check, out: Path, task: str | None, only: str | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "workbook", "pilot", "--smoke", "--device", c.device,
           "--out", str(out)] + (["--task", task] if task else []) + \
        (["--only", only] if only else [])
    log = open(out.with_suffix(".log"), "w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _verdicts(run: Path) -> dict[str, str]:
    index = run / "index.json"
    if not index.is_file():
        return {}
    return {row["notebook"][:2]: row["verdict"] for row in json.loads(index.read_text())
            ["notebooks"]}


def pilots(c: Check, started: dict[str, tuple[subprocess.Popen, Path]]) -> str:
    """Wait (within the deadline) for the pilot runs started at the beginning; read them."""
    words = []
    for figure, (proc, run) in started.items():
        try:
            proc.wait(timeout=max(c.deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=30)
        verdicts = _verdicts(run)
        c.figures[figure] = " ".join(f"{k}:{v}" for k, v in verdicts.items()) or \
            f"none (exit {proc.returncode}; see {run.with_suffix('.log').name})"
        words.append(f"{figure}: {sum(v == 'pass' for v in verdicts.values())}/"
                     f"{len(verdicts)} pass (exit {proc.returncode})")
    from workbook.notebooks import registry

    sample = started["gpu_pilot_verdicts"][1]
    variants = sample / "05_memory_variants" / "variants.csv"
    if variants.is_file():
        import pandas as pd

        table = pd.read_csv(variants)
        keep = [col for col in ("id", "status", "peak_bytes", "memory_ratio",
                                "time_per_update_s", "time_ratio", "flags") if col in table]
        picked = table[table.id.isin(["control", "bf16", "fp16+scaler"])][keep]
        picked.to_csv(c.out / "variants.csv", index=False)
        c.figures["gpu_variants"] = " | ".join(
            " ".join(str(v) for v in row) for row in picked.itertuples(index=False))
    for stem, figure in (("07_resume_reload", "gpu_resume_exact"),
                         ("09_data_parallel", "gpu_parallel")):
        if (sample / stem / "summary.json").is_file():
            c.figures[figure] = registry.verdict_line(sample / stem)
    return "; ".join(words)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", action="store_true", help="download the wheels, here")
    parser.add_argument("--dry-run", action="store_true", help="with --prepare: list only")
    parser.add_argument("--cpu-half", action="store_true",
                        help="no GPU: every section's code on the CPU, small")
    parser.add_argument("--budget", type=float, default=450, help="seconds for the whole check")
    parser.add_argument("--twin-only", default="03,05,07,08",
                        help="the LoRA twin's notebooks (its 01-04 passed on an H200 in 330 s)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/gpu-check")))
    args = parser.parse_args(argv)
    if args.prepare:
        return prepare(args.dry_run)
    import torch

    if not torch.cuda.is_available() and not args.cpu_half:
        print("error: no CUDA GPU is visible; fix: run it on a GPU machine (after --prepare's "
              "install line), or --cpu-half to exercise its code on the CPU")
        return 2
    device = "cpu" if args.cpu_half else "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    c = Check(device, args.cpu_half, args.out, time.monotonic() + args.budget)
    started: dict[str, tuple[subprocess.Popen, Path]] = {}
    if not args.cpu_half:  # the pilots run beside the in-process sections
        for figure, task, only in (
                ("gpu_pilot_verdicts", None, None),
                ("gpu_twin_verdicts", "examples.llama_lora_campaign:task", args.twin_only)):
            run = args.out / figure.split("_")[1]
            started[figure] = (_pilot(c, run, task, only), run)
    try:
        for name, body in (("env", env), ("counter", counter), ("oom", oom),
                           ("prediction", prediction)):
            c.section(name, body)
        if started:
            c.section("pilot", lambda c: pilots(c, started))
        # last, alone on the card: the 8 B model fills most of it (run beside the pilots on an
        # H200, it starved them: 09 out of memory, 07 not exact)
        c.section("speed", speed)
    finally:
        for proc, _ in started.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
    import pandas as pd

    pd.set_option("display.width", 200)
    pd.set_option("display.max_colwidth", 120)
    print(pd.DataFrame(c.rows).to_string(index=False))
    for name in FIGURES:
        c.figures.setdefault(name, "n/a (no GPU)" if args.cpu_half else "not measured")
    (args.out / "figures.json").write_text(json.dumps(c.figures, indent=1, default=str))
    for name, value in c.figures.items():  # the CPU half's figures are named for it
        print(f"{name.replace('gpu_', 'cpu_half_', 1) if args.cpu_half else name}: {value}")
    return 0 if all(r["status"] == "ok" for r in c.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
