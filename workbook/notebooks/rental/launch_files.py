"""Notebook 08's launch files: for the recommended plan and each priced plan, in `launch/` of
its folder, a SkyPilot task YAML (on demand; on spot too when the catalog has a spot offer and
07 verified the resume), a torchrun script for one's own cluster and the checked settings as
one JSON file - the settings the pilot checked carried, never re-typed. A plan the pilot could
not verify (a notebook failed, or the plan does not fit its GPU) gets no file, and
`launch/index.json` says why."""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import yaml

from ...storage.files import write_json, write_text
from ..registry import RESUME, summary_of
from .conclusions import first_failure
from .plans import plain_count
from .prices import ALIASES

FOLDER = "launch"
PLACEHOLDER = "train.py"  # 08's `entry_point` default: the user's own script replaces it
# the notebook's GPU names as SkyPilot spells its accelerators (the catalog's names, `ALIASES`)
SKY_NAMES = {gpu: name.upper() for name, gpu in ALIASES.items() if name == "a100"}
# the environment variables a training script reads, and the settings they carry
ENVS = {"MICRO_BATCH": "micro_batch", "ACCUMULATION": "accumulation",
        "PRECISION": "precision", "ACTIVATION_CHECKPOINTING": "activation_checkpointing",
        "LEARNING_RATE": "learning_rate", "MAX_LENGTH": "max_length", "UPDATES": "updates",
        "EVAL_EVERY": "eval_every", "CHECKPOINT_EVERY": "checkpoint_every",
        "CHECKPOINT_DIR": "checkpoint_dir", "RESUME_FROM": "resume_from", "SEED": "seed"}


@dataclass
class Launch:
    """One plan as it launches: where (`gpu` x `gpus` over `nodes`), how (`strategy`), on spot
    too (`spot`: a spot offer exists and 07 verified the resume) and the checked `settings`
    (per GPU for the micro-batch and accumulation)."""

    name: str  # its folder under launch/
    role: str  # "recommended", or the plan's variant and GPU in words
    gpu: str
    gpus: int
    nodes: int
    strategy: str
    spot: bool
    settings: dict[str, Any]
    packages: list[str] = field(default_factory=list)  # pip requirements of `setup`

    @property
    def per_node(self) -> int:
        return math.ceil(self.gpus / self.nodes)

    def sky_task(self, entry_point: str, spot: bool) -> dict[str, Any]:
        """The SkyPilot task (a dict for its YAML): resources, nodes, envs, setup and run."""
        return {"name": f"{self.name}{'-spot' * spot}".lower(),
                "resources": {"accelerators": f"{SKY_NAMES.get(self.gpu, self.gpu)}:"
                                              f"{self.per_node}",
                              "use_spot": spot, "disk_size": disk_gb(self.settings)},
                "num_nodes": self.nodes, "workdir": ".",
                "envs": {**self.envs(), "ENTRY_POINT": entry_point},
                "setup": "set -e\npip install " + " ".join(map(shlex.quote, self.packages)) + "\n",
                "run": "set -e\n" + torchrun(
                    '"$SKYPILOT_NUM_NODES"', '"$SKYPILOT_NUM_GPUS_PER_NODE"',
                    '"$SKYPILOT_NODE_RANK"',
                    "\"$(echo \"$SKYPILOT_NODE_IPS\" | head -n1)\"") + "\n"}

    def envs(self) -> dict[str, str]:
        """The settings as environment variables (strings; '' for one not known)."""
        return {env: shown(self.settings.get(key)) for env, key in ENVS.items()}

    def script(self, entry_point: str) -> str:
        """A torchrun script for one's own cluster: the settings exported, then torchrun."""
        exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in self.envs().items())
        return (f"#!/usr/bin/env bash\n# {self.role}: {self.gpus} x {self.gpu}, {self.strategy}"
                f"\n# Run on each of the {self.nodes} node(s): NODE_RANK=<0..{self.nodes - 1}> "
                "MASTER_ADDR=<the first node's address> bash torchrun.sh\n"
                f"{placeholder_note(entry_point)}{unset_note(self.settings)}"
                "set -euo pipefail\n" + exports +
                f"\nexport ENTRY_POINT={shlex.quote(entry_point)}\n" + torchrun(
                    str(self.nodes), str(self.per_node), '"${NODE_RANK:-0}"',
                    '"${MASTER_ADDR:-127.0.0.1}"') + "\n")


def torchrun(nodes: str, per_node: str, rank: str, master: str) -> str:
    return (f"torchrun --nnodes={nodes} --nproc_per_node={per_node} --node_rank={rank} "
            f'--master_addr={master} --master_port=29500 "$ENTRY_POINT"')


def placeholder_note(entry_point: str) -> str:
    return (f"# ENTRY POINT: {entry_point} is a placeholder - set 08's entry_point parameter (or "
            "ENTRY_POINT here) to your own training script\n"
            if entry_point == PLACEHOLDER else "")


def unset_note(settings: dict[str, Any]) -> str:
    return ("" if settings.get("learning_rate") is not None else
            f"# LEARNING_RATE is empty: {settings.get('learning_rate_from')} - set it\n")


def shown(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    return f"{value:g}" if isinstance(value, float) else str(value)


def disk_gb(settings: dict[str, Any]) -> int:
    """The disk to ask for: three checkpoints of weights and Adam's two moments in fp32 (16
    bytes a parameter) and 100 GB for the system and the data, at least 256 GB (assumed)."""
    need = 3 * 16 * (settings.get("parameters") or 0) / 1e9 + 100
    return max(256, int(math.ceil(need / 64) * 64))


def folder_name(*parts: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", "-".join(parts)).strip("-.") or "plan"


def launches(sheet: pd.DataFrame, plans: pd.DataFrame, chosen: dict | None,
             options: pd.DataFrame, study: dict, base: dict[str, Any], packages: list[str],
             run_dir: Path) -> tuple[list[Launch], dict[str, str]]:
    """The plans that launch and the ones that do not, with why ({name: why}): the
    recommended plan (the chosen candidate on the GPU the decision recommends, at the rate
    planned on) and every priced plan (a variant on a GPU priced, `plans`). `base` holds the
    settings every plan shares (updates, eval_every, checkpoint_every, seed, parameters...).
    Nothing launches when a notebook before 08 did not pass (`first_failure`) or no
    candidate fits."""
    failure = first_failure(run_dir)
    if failure:
        return [], {"every plan": f"{failure}; fix it and run the pilot again"}
    if chosen is None:
        return [], {"every plan": "no candidate fits the GPU planned on"}
    resume = summary_of(run_dir, RESUME.stem) or {}
    resumed = resume.get("verdict") == "pass"
    out, refused = [], {}
    lr, lr_from = (study["lr"], "06's study") if study.get("lr") is not None else \
        (base.get("task_lr"), "the task's lr") if base.get("task_lr") else \
        (None, f"none: {study.get('short', '06 did not run')} and the task gives no lr")
    wanted = [("recommended", chosen["candidate"],
               options.set_index("candidate").cheapest_gpu.get(chosen["candidate"]), lr,
               lr_from, "")]
    for r in plans.drop_duplicates(["variant", "gpu"]).itertuples():
        lr = None if pd.isna(r.lr) else float(r.lr)
        wanted.append((f"{r.variant} on the {r.gpu}", r.candidate, r.gpu, lr, r.lr_from,
                       r.variant))
    for role, candidate, gpu_name, lr, lr_from, variant in wanted:
        name = "recommended" if role == "recommended" else folder_name(variant, gpu_name)
        match = sheet[(sheet.candidate == candidate) & (sheet.gpu == gpu_name)]
        if match.empty or not bool(match.iloc[0].fits):
            refused[name] = (f"candidate {candidate} does not fit the {gpu_name}" if len(match)
                             else f"candidate {candidate} has no row for the {gpu_name}")
            continue
        row = match.iloc[0]
        gpus = plain_count(row.get("gpus")) or 1
        settings = {**base, "plan": role, "candidate": candidate, "variant": variant or None,
                    "gpu": gpu_name, "gpus": gpus, "nodes": plain_count(row.get("nodes")) or 1,
                    "strategy": row.strategy, "precision": row.precision,
                    "micro_batch": int(row.micro_batch), "accumulation": int(row.accumulation),
                    "activation_checkpointing": bool(row.activation_checkpointing),
                    "examples_per_update": plain_count(row.get("examples_per_update")),
                    "max_length": plain_count(row.get("max_length")),
                    "learning_rate": lr, "learning_rate_from": lr_from or None,
                    "checkpoint_dir": f"checkpoints/{name}",
                    "resume_from": f"checkpoints/{name}",
                    "required_gib_per_gpu": float(row.required_gib),
                    "budget_hours": None if pd.isna(row.budget_hours) else
                    float(row.budget_hours)}
        spot = resumed and not pd.isna(row.get("spot_cost"))
        out.append(Launch(name, role, gpu_name, gpus, settings["nodes"], row.strategy, spot,
                          settings, packages))
    return out, refused


def packages_of(imports: list[tuple[str, str | None, str | None]]) -> list[str]:
    """What `setup` installs: the torch version the pilot ran (its CUDA build on the rental)
    and the distributions the task's module imports, at the versions here (the workbook itself
    is not needed to train)."""
    pins = {"torch": torch.__version__.split("+")[0]}
    for _, dist, version in imports:
        if dist and version and dist.lower() not in ("workbook", "torch"):
            pins[dist] = version
    return [f"{d}=={v}" for d, v in pins.items()]


def write(out_dir: Path, plans: list[Launch], refused: dict[str, str],
          entry_point: str) -> dict[str, Any]:
    """The launch files under `out_dir/launch/` and their index (`index.json`: which files
    each plan has, which plans have none and why); the index is returned."""
    folder = Path(out_dir) / FOLDER
    index: dict[str, Any] = {"entry_point": entry_point,
                             "entry_point_is_placeholder": entry_point == PLACEHOLDER,
                             "plans": [], "not_written": refused}
    for plan in plans:
        where = folder / plan.name
        where.mkdir(parents=True, exist_ok=True)
        files = {"sky": sky_yaml(where / "sky.yaml", plan, entry_point, False)}
        if plan.spot:
            files["sky_spot"] = sky_yaml(where / "sky-spot.yaml", plan, entry_point, True)
        files["torchrun"] = write_text(where / "torchrun.sh", plan.script(entry_point))
        files["settings"] = write_json(where / "settings.json",
                                       {**plan.settings, "entry_point": entry_point})
        index["plans"].append({**{k: v for k, v in asdict(plan).items()
                                  if k not in ("settings", "packages")},
                               "files": {k: str(p.relative_to(out_dir))
                                         for k, p in files.items()}})
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "index.json", index)
    return index


def sky_yaml(path: Path, plan: Launch, entry_point: str, spot: bool) -> Path:
    head = (f"# SkyPilot task written by the pilot's notebook 08: {plan.role}, {plan.gpus} x "
            f"{plan.gpu}, {plan.strategy}{', on spot' if spot else ''}.\n"
            "# sky launch -c <cluster> " + path.name + " (from your project's folder: workdir "
            "is synced)\n" + placeholder_note(entry_point) +
            ("# On spot the VM can be taken back: keep CHECKPOINT_DIR on a bucket (file_mounts) "
             "and use `sky jobs launch`, which restarts the run; it resumes from RESUME_FROM.\n"
             if spot else "") + unset_note(plan.settings))
    return write_text(path, head + yaml.dump(plan.sky_task(entry_point, spot), Dumper=Blocks,
                                             sort_keys=False, width=100))


class Blocks(yaml.SafeDumper):
    """YAML with multi-line strings (setup, run) as literal blocks, as people write them."""


Blocks.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def words(index: dict[str, Any] | None) -> str:
    """The launch files in a few words, for summary.json."""
    if not index:
        return "not written"
    plans = index.get("plans") or []
    refused = index.get("not_written") or {}
    said = f"written for {len(plans)} plan{'s' * (len(plans) != 1)} ({FOLDER}/)" if plans \
        else "none written"
    return said + "".join(f"; {name}: not written, {why}" for name, why in refused.items())
