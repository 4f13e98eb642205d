"""CPU benchmark of one knockout: qkv's `hide(..., table=False, compare=False)` (a word hidden
from every word in every layer and head) and `ablate` of one head (compare=False), each one
forward pass, against one masked forward pass of `transformers` on the same model.

The question a knockout answers is "what does the model predict without this?": one forward
with the change, its next token read at the last position. Before compare=False, qkv ran the
clean forward too (to measure the change), twice the work of the peer; this script times both.

- qkv: `qkv.load("smollm2")` (the embedded SmolLM2-135M GGUF file, float32, backend "auto");
  `hide(pretrained, text, "river", table=False, compare=False)` and
  `ablate(pretrained, text, [(LAYER, HEAD)], compare=False)`; also `hide(..., table=False)`
  with its comparison (clean run + knockout), as every knockout ran before.
- the peer: transformers' LlamaForCausalLM from the same GGUF file (as tests' smollm2_hf
  fixture loads it), float32, attn_implementation="eager", one forward with a 4D additive mask
  (0 where a query may attend, the dtype's minimum where not: causal, and the key word's
  tokens hidden from every query) and logits_to_keep=1 (the LM head at the last position only,
  as qkv reads it); and one forward with the head's slice of o_proj's input zeroed (a
  forward pre-hook), the peer of the ablation.

Both sides read the same token ids (qkv's tokenizer). The knockouts must agree with the
peer's (the next token's log-probabilities at the last position, to < 1e-3: qkv and
transformers dequantize the GGUF file themselves and sum in other orders), else the script
exits non-zero. Timing: `timing.time_peers`, the calls interleaved in rotating order, the
best (the least time) of --repeats calls each after a warm-up. By default the time is this
process's CPU time on one thread (`--clock cpu --threads 1`): the work each side does, which
a machine shared with other work (the load average is printed) disturbs far less than wall
time; `--clock wall --threads N` measures wall time on N threads.

    python benchmarks/knockout.py [--repeats N] [--clock cpu|wall] [--threads N]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
from functools import partial

import torch

import qkv
from qkv.inspect.ablate import ablate
from qkv.inspect.hide import hide
from qkv.inspect.runs import word_span
from qkv.io.embedded import embedded_path
from timing import CORES, machine, time_peers

SHORT = "The river rose in the night, and by morning the bank was under water."
LONG = (
    "We walked for hours along the old towpath, past the mill, the lock and the row of "
    "cottages where the boatmen once lived. The water was high after a week of rain, brown "
    "and fast, carrying branches and leaves down towards the town. Children threw sticks "
    "from the bridge and raced to the other side to see whose came out first. By the "
    "afternoon the clouds had cleared, the fields steamed in the sun, and the river had "
    "begun to fall again, leaving a line of mud and reeds along the bank."
)
KEY = "river"
LAYER, HEAD = 3, 4  # the head ablated
BOUND = 1e-3  # largest allowed |qkv - peer| of the next token's top log-probabilities


def load() -> str:
    """The machine's load average over 1, 5 and 15 minutes (other work shares these cores)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1, 5, 15 min)"


def load_peer():
    import transformers

    transformers.logging.set_verbosity_error()
    path = embedded_path("smollm2")
    with contextlib.redirect_stderr(io.StringIO()):  # loading progress bars
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
        )
    return model.eval()


def hidden_mask(T: int, key: tuple[int, int]) -> torch.Tensor:
    """(1, 1, T, T) float32, additive: causal, and the key's tokens hidden from every query."""
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    allowed[:, slice(*key)] = False
    mask = torch.zeros(T, T).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return mask[None, None]


def peer_masked(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One masked forward: the log-probabilities (vocab,) of the next token after the last."""
    with torch.inference_mode():
        logits = model(ids, attention_mask=mask, logits_to_keep=1).logits[0, -1]
    return logits.double().log_softmax(-1)


def peer_ablated(model, ids: torch.Tensor, head_dim: int) -> torch.Tensor:
    """One forward with head HEAD of layer LAYER zeroed before o_proj."""

    def zero_head(module, args):
        (x,) = args  # (B, T, H * D)
        x = x.clone()
        x[..., HEAD * head_dim : (HEAD + 1) * head_dim] = 0
        return (x,)

    o_proj = model.model.layers[LAYER].self_attn.o_proj
    handle = o_proj.register_forward_pre_hook(zero_head)
    try:
        with torch.inference_mode():
            logits = model(ids, logits_to_keep=1).logits[0, -1]
    finally:
        handle.remove()
    return logits.double().log_softmax(-1)


def gap(ours, theirs: torch.Tensor) -> float:
    """The largest |difference| of the log-probabilities of qkv's top next tokens."""
    return max(abs(t.logprob - float(theirs[t.id])) for t in ours)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="timed calls each (10)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="this process's CPU time (default), or wall time")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help=f"torch threads (1; {CORES} here)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    import transformers

    print(machine())
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, qkv "
          f"{qkv.__version__}; float32; {args.clock} time on {args.threads} thread(s), best of "
          f"{args.repeats} interleaved calls after a "
          f"warm-up; load average at start: {load()}")  # fmt: skip
    pretrained, peer = qkv.load("smollm2"), load_peer()
    head_dim = peer.config.hidden_size // peer.config.num_attention_heads
    failed, rows = [], []
    for label, text in (("short", SHORT), ("long", LONG)):
        encoded = pretrained.encode(text)
        ids = torch.tensor([encoded.ids])
        T, key = ids.shape[1], word_span(encoded, KEY, "the key word")
        mask = hidden_mask(T, key)
        fns = {
            "qkv hide, compare=False": partial(hide, pretrained, text, KEY, table=False,
                                               compare=False),
            "qkv ablate 1 head, compare=False": partial(ablate, pretrained, text,
                                                        [(LAYER, HEAD)], compare=False),
            "qkv hide, compare=True (before)": partial(hide, pretrained, text, KEY, table=False),
            "transformers masked forward": partial(peer_masked, peer, ids, mask),
            "transformers head zeroed": partial(peer_ablated, peer, ids, head_dim),
        }  # fmt: skip
        hidden, ablated = (
            fns["qkv hide, compare=False"](),
            fns["qkv ablate 1 head, compare=False"](),
        )
        checks = {
            "hide": gap(hidden.after, fns["transformers masked forward"]()),
            "ablate": gap(ablated.after, fns["transformers head zeroed"]()),
        }
        for name, found in checks.items():
            if not found < BOUND:
                failed.append(f"{label} {name}: max |qkv - transformers| {found:.1e} >= {BOUND}")
        seconds = time_peers(fns, args.repeats, warmup=1, statistic=min, clock=clock)
        rows.append((label, T, seconds, checks))
    peer_name = "transformers masked forward"
    for label, T, seconds, checks in rows:
        print(f"\n{label} text, {T} tokens; '{KEY}' hidden from every word in all 30 x 9 heads, "
              f"or layer {LAYER} head {HEAD} ablated:")  # fmt: skip
        for name, s in seconds.items():
            ratio = s / seconds[peer_name]
            print(f"  {name:<34} {1000 * s:8.1f} ms   {ratio:5.2f} x the masked forward")
        print("  next-token log-probabilities, max |qkv - transformers|: "
              + ", ".join(f"{name} {value:.1e}" for name, value in checks.items()))  # fmt: skip
    print(f"\nknockouts agree with transformers (< {BOUND}): {'FAIL' if failed else 'PASS'}")
    print(f"load average at end: {load()}")
    for problem in failed:
        print(problem, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
