"""Where a training run's metrics go: one JSON record per step in OUT/train_log.jsonl (the run's own record, cut
back to the checkpoint's step on resuming), the progress bar, TensorBoard event files and a wandb offline run when
asked (--report-to), and the curves drawn from the log at the end (OUT/train_curves.png)."""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from eyas.train.checkpointing import RunDir
from eyas.train.config import TrainConfig


def read_log(path: Path) -> list[dict]:
    """The records of a train_log.jsonl; a last line cut short by a kill is dropped."""
    records = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def scalars(record: dict) -> dict[str, float]:
    """A step record's numbers under TensorBoard-style tag names (train/loss, train/acc_per_step/0, ...)."""
    out = {}
    for key, value in record.items():
        if isinstance(value, bool) or key == "step":
            continue
        if isinstance(value, (int, float)):
            out[f"train/{key}"] = float(value)
        elif isinstance(value, list):
            out.update({f"train/{key}/{k}": float(v) for k, v in enumerate(value)})
    return out


class StepReport:
    """A run's reporting: every step appended to the log, the bar's loss and accuracy refreshed every `log_every`
    steps, the same numbers to the loggers of --report-to; on rank 0 only (the other ranks' bars are off). Checked
    on creation, before the target loads: a logger that is not installed fails then, not after the first step."""

    def __init__(self, run_dir: RunDir, cfg: TrainConfig, rank: int) -> None:
        self.run_dir, self.cfg, self.on = run_dir, cfg, rank == 0
        self.loggers: list = []
        self.bar = None
        for name in cfg.report_to:
            _importable(name)

    def cut_log(self, step: int) -> None:
        """Drop the log's records past `step`, the checkpoint's: those steps are about to be rerun."""
        log = self.run_dir.log
        if self.on and log.exists():
            kept = [r for r in read_log(log) if r["step"] <= step]
            log.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def start(self, step: int) -> None:
        """The bar and the loggers, after `step`, the checkpoint's (TensorBoard's reader drops the events an earlier
        run wrote past it: those steps are about to be rerun)."""
        self.bar = tqdm(total=self.cfg.max_steps, initial=step, desc="train", unit="step", disable=not self.on)
        if not self.on:
            return
        if "tensorboard" in self.cfg.report_to:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(self.run_dir.tensorboard, purge_step=step + 1 if step else None)
            self.loggers.append(_TensorBoard(writer))
        if "wandb" in self.cfg.report_to:
            self.loggers.append(_Wandb(self.run_dir, self.cfg))

    def step(self, record: dict) -> None:
        self.bar.update(1)
        if not self.on:
            return
        with open(self.run_dir.log, "a") as f:
            f.write(json.dumps(record) + "\n")
        numbers = scalars(record)
        for logger in self.loggers:
            logger.log(numbers, record["step"])
        if record["step"] % self.cfg.log_every == 0 or "eval_acceptance_length" in record:
            postfix = {"loss": record["loss"], "acc0": record["acc_per_step"][0]}
            if "eval_acceptance_length" in record:
                postfix["AL"] = record["eval_acceptance_length"]
            self.bar.set_postfix(postfix)

    def close(self) -> None:
        """The bar off the terminal line and the loggers flushed (on any error too)."""
        if self.bar is not None:
            self.bar.close()
        for logger in self.loggers:
            logger.close()
        self.loggers = []

    def plot(self) -> None:
        if self.on:
            plot_log(self.run_dir.log, self.run_dir.curves,
                     title=f"{self.cfg.draft_arch} draft for {Path(self.cfg.target).name}")


def _importable(name: str) -> None:
    import importlib.util

    module = {"tensorboard": "tensorboard", "wandb": "wandb"}[name]
    if importlib.util.find_spec(module) is None:
        extra = "pip install tensorboard (or eyas[tensorboard])" if name == "tensorboard" else "pip install wandb"
        raise ValueError(f"--report-to {name} needs the {module} package, which is not installed: {extra}")


class _TensorBoard:
    def __init__(self, writer) -> None:
        self.writer = writer

    def log(self, numbers: dict[str, float], step: int) -> None:
        for tag, value in numbers.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    """An offline wandb run under OUT/wandb (`wandb sync` uploads it): nothing leaves the machine."""

    def __init__(self, run_dir: RunDir, cfg: TrainConfig) -> None:
        import wandb

        from eyas.train.config import recipe_settings

        run_dir.wandb.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(mode="offline", dir=str(run_dir.out), project="eyas", name=run_dir.out.name,
                              config=recipe_settings(cfg))

    def log(self, numbers: dict[str, float], step: int) -> None:
        self.run.log(numbers, step=step)

    def close(self) -> None:
        self.run.finish()


def smoothed(values: list[float], span: int) -> list[float]:
    """Exponential moving average with the usual span (alpha = 2 / (span + 1)), started at the first value."""
    alpha, out = 2 / (span + 1), []
    for v in values:
        out.append(v if not out else out[-1] + alpha * (v - out[-1]))
    return out


def plot_log(log_path: Path, png: Path, title: str = "") -> None:
    """Loss and per-position accuracy (raw, faint, and smoothed) and, when the run measured it, the acceptance
    length through the engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_log(log_path)
    if not records:
        return
    steps = [r["step"] for r in records]
    evals = [(r["step"], r["eval_acceptance_length"]) for r in records if "eval_acceptance_length" in r]
    span = max(1, len(records) // 25)
    fig, axes = plt.subplots(1, 3 if evals else 2, figsize=(16 if evals else 11, 4))
    ax_loss, ax_acc = axes[0], axes[1]
    losses = [r["loss"] for r in records]
    ax_loss.plot(steps, losses, color="C0", alpha=0.25, linewidth=0.8)
    ax_loss.plot(steps, smoothed(losses, span), color="C0", label=f"moving average ({span} steps)")
    ax_loss.set(xlabel="step", ylabel="TTT loss (decay-weighted)", title="loss")
    ax_loss.legend(fontsize=8)
    for k in range(len(records[0]["acc_per_step"])):
        acc = [r["acc_per_step"][k] for r in records]
        ax_acc.plot(steps, acc, color=f"C{k}", alpha=0.2, linewidth=0.8)
        ax_acc.plot(steps, smoothed(acc, span), color=f"C{k}", label=f"TTT step {k}")
    ax_acc.set(xlabel="step", ylabel="top-1 agreement with the target", title="accuracy per TTT position")
    ax_acc.legend(fontsize=8)
    if evals:
        axes[2].plot(*zip(*evals), marker="o", color="C3")
        axes[2].set(xlabel="step", ylabel="tokens per verify step", title="acceptance length (greedy, K=3)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
