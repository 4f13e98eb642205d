"""The training loop: one loop for the causal, masked and sequence-to-sequence objectives.

`train(config, run)` builds the run's data and model, then repeats: a global batch of
`batch_size` sequences in `accumulate` micro-batches, the loss summed over every token to
predict and divided by how many there are in the whole global batch, AdamW (decay on
matrices and embeddings only), warmup then cosine decay, clipping. Every `eval_every`
steps it measures the loss on the validation split; every `checkpoint_every` steps, and
at the end, it writes a checkpoint. Under torchrun each process takes its rows of every
global batch (DistributedDataParallel, or FSDP with train.parallel = "fsdp"); the loss is
normalized by the global count of tokens, so N processes compute what one would.
"""

from __future__ import annotations

import copy
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.io.run_config import RunConfig
from qkv.models import Decoder, Encoder, EncoderDecoder
from qkv.train import checkpoint as ckpt
from qkv.train.arch import build_model, hf_config
from qkv.train.batches import IGNORE, Batches, shard
from qkv.train.data import prepare
from qkv.train.folder import open_run, undone_if_it_fails
from qkv.train.metrics import append_record, truncate_records
from qkv.train.progress import Progress


@dataclass
class RunResult:
    run: Path
    steps: int  # optimizer steps done in all
    losses: dict[int, float] = field(default_factory=dict)  # this session's training losses
    val_losses: dict[int, float] = field(default_factory=dict)
    checkpoint: Path | None = None
    seconds: float = 0.0  # wall time of this session's steps, evaluations and checkpoints


@dataclass
class Distributed:
    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def sum(self, value: float) -> float:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t)
        return float(t)


def train(
    config: RunConfig,
    run: str | os.PathLike[str],
    *,
    resume: bool = False,
    quiet: bool = False,
) -> RunResult:
    """Train `config` into the folder `run`; with resume, continue it from its last checkpoint.

    A new run needs `run` absent or empty; resuming needs a run folder whose config matches
    (only RESUMABLE keys such as train.steps may change). Returns the losses measured.
    A new run that fails before its first checkpoint leaves `run` as it found it, so the
    same command can be run again; a loss that stops being finite stops the run.
    """
    config.check()
    run = Path(run)
    dist = _distributed(config)
    try:
        with undone_if_it_fails(run, resume, dist.main):
            start = open_run(config, run, resume, dist)
            return _Trainer(config, run, dist, quiet).fit(start)
    finally:
        if dist.world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class _Trainer:
    def __init__(self, config: RunConfig, run: Path, dist: Distributed, quiet: bool):
        self.config, self.run, self.dist = config, run, dist
        self.quiet = quiet or not dist.main
        t = config.train
        self.tokenizer, train_data, val_data = prepare(config, run, dist)
        self.batches = Batches(config, self.tokenizer, train_data, val_data)
        if self.batches.micro % dist.world:
            raise ValueError(
                f"a micro-batch of {self.batches.micro} sequences (train.batch_size / "
                f"train.accumulate) does not split over {dist.world} processes"
            )
        self.hf = hf_config(config, self.tokenizer)
        model, self.family, self.model_config = build_model(config, self.hf)
        self.shadow = copy.deepcopy(model).eval()  # CPU copy the checkpoints export from
        self.model = model.to(dist.device)
        self.core = self.model  # the module whose parameters are trained
        if dist.world > 1 and t.parallel == "fsdp":
            self.core = _fully_shard(self.model)
        self.optimizer = torch.optim.AdamW(
            _param_groups(self.core, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
            fused=True,  # one kernel for every parameter: 29 -> 8 ms a step on 2 CPU cores
        )  # fmt: skip
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.forward = self.core
        if dist.world > 1 and t.parallel == "ddp":
            device_ids = [dist.device.index] if dist.device.type == "cuda" else None
            self.forward = nn.parallel.DistributedDataParallel(self.core, device_ids=device_ids)
        if t.compile:
            self.forward = torch.compile(self.forward)
        bf16 = t.precision == "bf16" or (t.precision == "auto" and dist.device.type == "cuda")
        self.autocast = (
            torch.autocast(dist.device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
        )

    def _lr_factor(self, step: int) -> float:
        """Linear warmup to lr, then cosine decay to min_lr at the last step."""
        t = self.config.train
        if step < t.warmup:
            return (step + 1) / (t.warmup + 1)
        progress = min(1.0, (step - t.warmup) / max(1, t.steps - t.warmup))
        low = t.min_lr / t.lr
        return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))

    # ------------------------------------------------------------------ the loop

    def fit(self, resume_from: Path | None) -> RunResult:
        t = self.config.train
        step = self._restore(resume_from) if resume_from is not None else 0
        result = RunResult(self.run, step)
        metrics = self.run / "metrics.jsonl"
        if self.dist.main:
            truncate_records(metrics, step)
        began_run = time.perf_counter()
        if step == t.steps == 0:  # the model before training, to compare the trained one with
            result.checkpoint = self._save(0)
        with Progress(t.steps, step, quiet=self.quiet) as progress:
            while step < t.steps:
                began = time.perf_counter()
                loss, tokens = self._step(step)
                step += 1
                self._stop_unless_finite(step, "loss", loss)
                elapsed = time.perf_counter() - began
                record = {"step": step, "loss": loss, "lr": self.schedule.get_last_lr()[0],
                          "tokens": tokens, "tokens_per_s": tokens / elapsed}  # fmt: skip
                result.losses[step] = loss
                if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
                    record["val_loss"] = result.val_losses[step] = self.evaluate()
                    self._stop_unless_finite(step, "validation loss", record["val_loss"])
                if self.dist.main:
                    append_record(metrics, record)
                progress.update(step, record)
                if step == t.steps or (t.checkpoint_every and step % t.checkpoint_every == 0):
                    result.checkpoint = self._save(step)
        if result.checkpoint is None and self.dist.main:  # a resume with nothing left to do
            result.checkpoint = ckpt.checkpoints(self.run)[-1]
        result.steps = step
        result.seconds = time.perf_counter() - began_run
        return result

    def _stop_unless_finite(self, step: int, what: str, value: float) -> None:
        """A NaN or infinite loss means the weights are lost: stop before it is logged or
        checkpointed (every process sees the same global value, so all stop together)."""
        if not math.isfinite(value):
            raise self._diverged(step, f"the {what} is {value}")

    def _diverged(self, step: int, what: str) -> ValueError:
        found = ckpt.checkpoints(self.run)
        last = f"step {ckpt.step_of(found[-1])}" if found else "none yet"
        t = self.config.train
        return ValueError(
            f"training diverged at step {step}: {what}; stopped, and the last checkpoint "
            f"({last}) is intact; try a smaller train.lr (now {t.lr:g}) or train.clip"
        )

    def _step(self, step: int) -> tuple[float, int]:
        """One optimizer step; returns the global mean loss and the tokens read."""
        t, dist = self.config.train, self.dist
        micro = [self.batches.train(step, m) for m in range(t.accumulate)]
        counts = [int((b["labels"] != IGNORE).sum()) for b in micro]  # over the global batch
        total = max(1, sum(counts))
        self.core.train()
        loss_sum, tokens = 0.0, 0
        for m, batch in enumerate(micro):
            tokens += sum(int(v.numel()) for k, v in batch.items() if k.endswith("ids"))
            mine = {k: v.to(dist.device) for k, v in shard(batch, dist.rank, dist.world).items()}
            # DDP: only the last micro-batch's backward averages gradients over processes
            last = m == len(micro) - 1
            quiet = not last and hasattr(self.forward, "no_sync")
            with self.forward.no_sync() if quiet else nullcontext():
                with self.autocast:
                    summed = _loss_sum(self.forward, mine, self.config.objective)
                # DDP and FSDP average gradients over processes: scale by world to get the sum
                (summed * (dist.world / total)).backward()
            loss_sum += float(summed.detach())
        if t.clip:
            nn.utils.clip_grad_norm_(self.core.parameters(), t.clip)
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        return dist.sum(loss_sum) / total, tokens

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss per predicted token over the validation batches."""
        self.core.eval()
        loss_sum, count = 0.0, 0
        for i in range(self.batches.val_batches()):
            batch = self.batches.val(i)
            count += int((batch["labels"] != IGNORE).sum())
            mine = shard(batch, self.dist.rank, self.dist.world)
            with self.autocast:
                summed = _loss_sum(self.core, {k: v.to(self.dist.device) for k, v in mine.items()},
                                   self.config.objective)  # fmt: skip
            loss_sum += float(summed)
        return self.dist.sum(loss_sum) / max(1, count)

    # ------------------------------------------------------------------ checkpoints

    def _full_state(self) -> tuple[dict, dict]:
        """The model's and optimizer's full states, on the CPU (collective under FSDP)."""
        if self.dist.world > 1 and self.config.train.parallel == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return get_state_dict(self.core, self.optimizer, options=options)
        state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        return state, self.optimizer.state_dict()

    def _save(self, step: int) -> Path | None:
        model_state, optimizer_state = self._full_state()
        # a finite loss can still come with an update that overflowed the weights
        broken = sum(not bool(torch.isfinite(v).all()) for v in model_state.values())
        if self.dist.sum(float(broken)):  # under FSDP only the first process holds them
            raise self._diverged(step, "the update made weights NaN or infinite")
        path = None
        if self.dist.main:
            trainer = {
                "step": step,
                "optimizer": optimizer_state,
                "schedule": self.schedule.state_dict(),
                "rng": ckpt.rng_state(),
                "world": self.dist.world,
            }
            path = ckpt.save(self.run, step, model_state, self.shadow, self.family,
                             self.model_config, self.hf, self.tokenizer, trainer,
                             self.config.train.keep)  # fmt: skip
        self.dist.barrier()
        return path

    def _restore(self, checkpoint: Path) -> int:
        """Load a checkpoint's weights, optimizer, schedule and generators; return its step."""
        trainer = ckpt.load_trainer(checkpoint)
        state = ckpt.load_weights(checkpoint, self.shadow, self.family, self.model_config)
        if self.dist.world > 1 and self.config.train.parallel == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            set_state_dict(self.core, self.optimizer, model_state_dict=state,
                           optim_state_dict=trainer["optimizer"],
                           options=StateDictOptions(full_state_dict=True))  # fmt: skip
        else:
            self.model.load_state_dict(state)
            self.optimizer.load_state_dict(trainer["optimizer"])
        self.schedule.load_state_dict(trainer["schedule"])
        ckpt.set_rng_state(trainer["rng"])
        return int(trainer["step"])


def _loss_sum(model: nn.Module, batch: dict[str, Tensor], objective: str) -> Tensor:
    """The summed cross-entropy of every label that is not IGNORE, in float32."""
    if objective == "seq2seq":
        logits = model(batch["source_ids"], batch["target_ids"], source_mask=batch["source_mask"],
                       target_mask=batch["target_mask"]).logits  # fmt: skip
    elif objective == "masked":
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"],
                       logits=True).logits  # fmt: skip
    else:
        logits = model(batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
    labels = batch["labels"]
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                           reduction="sum")  # fmt: skip


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; never biases and norm weights (1-D tensors)."""
    decay, no_decay = [], []
    for param in model.parameters():  # tied parameters appear once
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _distributed(config: RunConfig) -> Distributed:
    """This process's rank and device: under torchrun, join the process group."""
    wanted = config.train.device
    cuda = torch.cuda.is_available() if wanted == "auto" else wanted == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError("train.device is 'cuda' but torch sees no GPU")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Distributed(device=torch.device("cuda" if cuda else "cpu"))
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    return Distributed(rank, world, device)


def _fully_shard(model: nn.Module) -> nn.Module:
    """FSDP2: each block's parameters sharded over the processes, then the rest."""
    from torch.distributed.fsdp import fully_shard

    stacks = [model.encoder, model.decoder] if isinstance(model, EncoderDecoder) else [model]
    for stack in stacks:
        if isinstance(stack, Encoder | Decoder):
            for block in stack.blocks:
                fully_shard(block)
    fully_shard(model)
    return model
