"""Round bookkeeping of `pocketdiff distill`: the plan of rounds, which are complete, resume checks."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

from pocketdiff.errors import PocketdiffError
from pocketdiff.models import DISTILL_META
from pocketdiff.outputs import read_json

from .distill_config import Config, round_schedule

__all__ = ["RoundSpec", "completed_rounds", "plan_rounds", "round_schedule"]


@dataclasses.dataclass
class RoundSpec:
    index: int  # 0 = guided stage (or the consistency stage), 1.. = progressive rounds
    stage: str  # "guided" | "progressive" | "consistency"
    steps: int  # the student's sampling steps (consistency: the largest of consistency.sample_steps)
    teacher_steps: Optional[int]  # the teacher's grid (None for the guided stage: any timestep; consistency: solver_steps)
    max_steps: int  # optimizer steps

    @property
    def name(self) -> str:
        return f"round-{self.index}"


def plan_rounds(cfg: Config) -> list[RoundSpec]:
    """Every round of the recipe, in order (method consistency: its one stage, round-0)."""
    if cfg.method == "consistency":
        c = cfg.consistency
        return [RoundSpec(0, "consistency", max(c.sample_steps), c.solver_steps, c.train.max_steps)]
    rounds = []
    if cfg.guided.enabled:
        rounds.append(RoundSpec(0, "guided", cfg.progressive.start_steps, None, cfg.guided.train.max_steps))
    teacher = cfg.progressive.start_steps
    overrides = list(cfg.progressive.round_max_steps)
    for i, n in enumerate(round_schedule(cfg.progressive.start_steps, cfg.progressive.final_steps)):
        max_steps = overrides[i] if overrides else cfg.progressive.train.max_steps
        rounds.append(RoundSpec(i + 1, "progressive", n, teacher, max_steps))
        teacher = n
    return rounds


def completed_rounds(out: Path, plan: list[RoundSpec]) -> int:
    """How many leading rounds are complete (their pipeline folder exists, with its metadata)."""
    done = 0
    for spec in plan:
        if not (out / spec.name / DISTILL_META).is_file():
            break
        done += 1
    return done


def _plan_record(cfg: Config, plan: list[RoundSpec]) -> dict:
    return {
        "teacher": cfg.model.pretrained or f"built:{cfg.model.arch}",
        "rounds": [dataclasses.asdict(s) for s in plan],
        "student_prediction_type": cfg.student_prediction_type,
        "timestep_spacing": cfg.timestep_spacing,
        "guidance": dataclasses.asdict(cfg.guidance),
        "seed": cfg.seed,
        # non-default settings only (an older run's record is unchanged, so its folders still resume)
        **({"top_step_input": cfg.progressive.top_step_input} if cfg.progressive.top_step_input != "data" else {}),
        **({"consistency": {k: getattr(cfg.consistency, k) for k in ("solver_steps", "timestep_scaling", "target_ema_decay", "huber_c")}}
           if cfg.method == "consistency" else {}),
        **({"student": cfg.student.record()} if cfg.student.enabled else {}),
    }


def _check_resume(out: Path, cfg: Config, plan: list[RoundSpec], resume: Optional[str]) -> int:
    """Number of complete rounds to skip; refuses a resume whose recipe changed."""
    record_path = out / "distill_plan.json"
    record = _plan_record(cfg, plan)
    done = completed_rounds(out, plan)
    if resume is None:
        if done or record_path.exists():
            raise PocketdiffError(f"{out} already holds a distillation run; pass --resume latest to continue it (or --overwrite)")
        return 0
    if record_path.is_file():
        old = read_json(record_path, "--resume")
        if old != json.loads(json.dumps(record)):
            raise PocketdiffError(f"{out}: the recipe changed since the interrupted run (rounds, guidance, teacher or seed differ); "
                                  "resume with the same config or start a new output folder")
    if resume != "latest":
        ckpt = Path(resume)
        owner = ckpt.parent.name if ckpt.parent.name.startswith("round-") else None
        if owner is None:
            raise PocketdiffError(f"--resume {resume}: expected 'latest' or DIR/checkpoints/round-K/checkpoint-S")
        k = int(owner.split("-")[1])
        if k < done:
            raise PocketdiffError(f"--resume {resume}: {owner} is already complete ({out / owner} exists)")
        if k > done:
            raise PocketdiffError(f"--resume {resume}: round-{done} is not complete yet")
    return done
