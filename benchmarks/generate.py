"""CPU benchmark of greedy decoding with SmolLM2-135M-Instruct (Q4_1 GGUF): qkv against
transformers and llama.cpp.

Three parts:
1. Decoding speed. `qkv.load("smollm2").generate(prompt, N)` as a user calls it (precision
   "auto": the file's own Q4_1 and Q8_0 blocks multiplied by 8-bit activations with qkv's
   native kernels, every token after the prompt's in one native call, `NativeStep`; with
   QKV_NATIVE=0, torch's CPU int4 kernel with inputs rounded to bfloat16 through FastStep), the
   same with precision="loaded" (float32: transformers' arithmetic), transformers'
   `AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)` and `model.generate(ids,
   max_new_tokens=N, min_new_tokens=N, do_sample=False)` in float32 on the same prompt ids,
   and llama.cpp (llama-cpp-python, where installed) on the same file with the same prompt
   ids and thread count, greedy, computing with its own Q4_1 and 8-bit arithmetic. N new
   tokens (64; 16 with --quick); each time includes reading the prompt (llama-cpp-python
   would keep the cache of a prompt it read before: it is reset, so that it reads it too),
   and each token's time after the prompt is given apart. First the
   continuations are compared token for token (qkv's from `qkv.generate.decode_steps`, the
   loop `generate` runs). The prompt is one whose greedy continuation holds no
   end-of-sequence token within 64 tokens, so all do the same work.
   Targets (issue 18): the default >= 1x llama.cpp and >= 3x transformers; float32 >= 2x
   transformers with its tokens (issue 39: the default >= 1.3x llama.cpp). Each is also set
   beside the memory-bandwidth floor: its weights' bytes read once a token at the memory's
   measured read speed. 1b: each new token's time after a 4,000-token prompt, qkv default
   against llama.cpp (issue 39: >= 1x), beside the floor of the weights and the float16 cache
   read once a token. The first lines name the CPU, qkv's kernel variant and llama.cpp's
   build (its own system info).
2. Loading. Each load runs in a fresh process that imports torch and the library first, then
   times only the load call; the process's wall time (interpreter start, imports and load) is
   reported too. qkv's cache of dequantized weights lives in a fresh temporary
   XDG_CACHE_HOME, so the first qkv load is cold; a second qkv process then finds it warm.
   Targets: qkv cold load <= 1/5 of transformers' load; qkv cached load < 2 s.
3. Cold start: from starting `qkv generate PROMPT -n 4` (a fresh process, the cache warm) to
   its first generated character on stdout. Target: within 2 s.

Timing: warm-up calls, then the median of --repeats calls timed with time.perf_counter;
the peers are interleaved call by call (in a rotating order) so drift in the machine affects
them alike. --profile adds torch.profiler's table of qkv's decoding ops.

    python benchmarks/generate.py [--quick] [--repeats N] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

import qkv
from qkv import native
from qkv.generate import Sampling, decode_steps
from qkv.io.embedded import embedded_path
from qkv.nn.quant_linear import in_generation
from qkv.nn.quantized import choose_int8_inputs
from timing import CORES, machine, time_peers

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def load_transformers():
    from transformers import AutoModelForCausalLM

    path = embedded_path("smollm2")
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )


def bench_decode(quick: bool, repeats: int, profile: bool) -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    N = 16 if quick else 64
    ours = qkv.load("smollm2")
    with contextlib.redirect_stderr(io.StringIO()):  # transformers' GGUF progress bar
        theirs = load_transformers().eval()
    ids, mask = ours.tokenizer.encode_batch([PROMPT], padding_side="left")  # (1, T)
    T = ids.shape[1]
    hf_generate = partial(
        theirs.generate,
        ids,
        attention_mask=mask,
        max_new_tokens=N,
        min_new_tokens=N,
        do_sample=False,
        pad_token_id=theirs.generation_config.eos_token_id,
    )

    print(f"1. Greedy decoding: prompt of {T} tokens, {N} new tokens, batch 1")
    if in_generation():
        print("qkv default: the file's own blocks times 8-bit activations (qkv's kernels)")
    else:
        inputs, why = choose_int8_inputs()
        print(f"qkv default's 8-bit LM head: {inputs} inputs, since {why}")
    their_tokens = hf_generate()[0, T:].tolist()
    print(f"transformers' continuation: {ours.tokenizer.decode(their_tokens)!r}")
    fns = {"transformers": hf_generate}
    tokens_of = {}
    for name, precision in (("qkv float32", "loaded"), ("qkv default", "auto")):
        model, why = ours.generation_model(precision)
        tokens_of[name] = [int(t) for t in decode_steps(model, ids, None, Sampling(), N)]
        text_ok = ours.generate(PROMPT, N, precision=precision) == ours.tokenizer.decode(
            tokens_of[name])  # fmt: skip
        print(f"{name} ({why}): {agreement(tokens_of[name], their_tokens, N)} transformers' "
              f"tokens; generate's text is these tokens': {text_ok}")  # fmt: skip
        fns[name] = partial(ours.generate, PROMPT, N, precision=precision)

    llama = llama_cpp_decode(ids[0].tolist(), N)
    if llama is None:
        print("llama.cpp: llama_cpp is not installed (make bench installs it); not measured")
    else:
        fns["llama.cpp"], (tokens, version) = llama
        ours_too = agreement(tokens, tokens_of["qkv default"], N)
        print(f"llama.cpp (llama-cpp-python {version}, the same file, its own Q4_1 and 8-bit "
              f"arithmetic): {agreement(tokens, their_tokens, N)} transformers' float32 "
              f"tokens; {ours_too} qkv default's")  # fmt: skip

    seconds = time_peers(fns, repeats)
    rate = {name: N / s for name, s in seconds.items()}
    for name in fns:
        print(f"{name:>12}: {rate[name]:7.2f} tokens/s  ({1e3 * seconds[name] / N:6.1f} ms/token)")
    targets = [("qkv default", "llama.cpp", 1.3), ("qkv default", "transformers", 3),
               ("qkv float32", "transformers", 2), ("qkv float32", "llama.cpp", 1)]  # fmt: skip
    for name, peer, target in targets:
        if peer in rate:
            ratio = rate[name] / rate[peer]
            verdict = "PASS" if ratio >= target else "MISS"
            print(f"{name}/{peer}: {ratio:.2f}x; target >= {target}x -> {verdict}")
    if llama is not None:
        after_the_prompt(ours, ids, seconds, repeats, N)
    floor(ours, rate)
    if llama is not None:
        bench_long(ours, quick, 1 if quick else 3)
    if profile:
        profile_decode(ours, N)


def after_the_prompt(ours, ids, seconds: dict, repeats: int, N: int) -> None:
    """Each new token's time once the prompt is read: (N tokens' time - 1 token's) / (N - 1),
    the 1-token calls timed like the N-token ones (the prompt read, then one token)."""
    one_token = {"qkv default": partial(ours.generate, PROMPT, 1),
                 "llama.cpp": llama_cpp_decode(ids[0].tolist(), 1)[0]}  # fmt: skip
    first = time_peers(one_token, repeats)
    each = {name: (seconds[name] - first[name]) / (N - 1) for name in one_token}
    print(f"reading the prompt and the first token: qkv default {1e3 * first['qkv default']:.1f}"
          f" ms, llama.cpp {1e3 * first['llama.cpp']:.1f} ms; each token after: qkv default "
          f"{1e3 * each['qkv default']:.2f} ms, llama.cpp {1e3 * each['llama.cpp']:.2f} ms "
          f"({each['llama.cpp'] / each['qkv default']:.2f}x)")  # fmt: skip


LONG = 4000  # tokens of the long prompt


def long_prompt(ours, length: int) -> list[int]:
    """`length` tokens of prose: the article qkv grew from, repeated as needed."""
    text = (Path(qkv.__file__).parents[2] / "docs" / "article.txt").read_text()
    ids = ours.tokenizer.encode(text).ids
    return (ids * (length // len(ids) + 1))[:length]


def bench_long(ours, quick: bool, repeats: int) -> None:
    """Each new token's time after a 4,000-token prompt (the prompt read once a call, the
    tokens after the first timed within the call), qkv default against llama.cpp; each beside
    its floor, the weights and the cache of keys and values (float16 on both sides) read
    once a token."""
    import llama_cpp

    from timing import read_bandwidth

    N = 16 if quick else 32
    ids = long_prompt(ours, LONG)
    model, _ = ours.generation_model("auto")
    llm = llama_cpp.Llama(model_path=str(embedded_path("smollm2")), n_ctx=LONG + N + 8,
                          n_batch=512, n_threads=CORES, n_threads_batch=CORES,
                          verbose=False)  # fmt: skip

    def qkv_each() -> float:
        stamps = [time.perf_counter() for _ in
                  decode_steps(model, torch.tensor([ids]), None, Sampling(), N)]  # fmt: skip
        return (stamps[-1] - stamps[0]) / (N - 1)

    def llama_each() -> float:
        llm.reset()
        stamps = []
        for _ in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == N:
                break
        return (stamps[-1] - stamps[0]) / (N - 1)

    each = {"qkv default": [], "llama.cpp": []}
    calls = {"qkv default": qkv_each, "llama.cpp": llama_each}
    for r in range(repeats):
        for name in list(calls)[r % 2 :] + list(calls)[: r % 2]:
            each[name].append(calls[name]())
    each = {name: statistics.median(t) for name, t in each.items()}
    cfg = model.config
    heads = cfg.block.num_kv_heads or cfg.block.num_heads
    head_size = cfg.block.head_dim or cfg.block.width // cfg.block.num_heads
    cache = cfg.num_layers * 2 * heads * head_size * 2 * (LONG + N // 2)  # float16
    bandwidth = read_bandwidth()
    sizes = {"qkv default": read_per_token(model) + cache,
             "llama.cpp": embedded_path("smollm2").stat().st_size + cache}  # fmt: skip
    ratio = each["llama.cpp"] / each["qkv default"]
    print(f"\n1b. After a {LONG}-token prompt, each of {N - 1} new tokens, median of {repeats}: "
          f"qkv default {1e3 * each['qkv default']:.2f} ms, llama.cpp "
          f"{1e3 * each['llama.cpp']:.2f} ms: {ratio:.2f}x; target >= 1x -> "
          f"{'PASS' if ratio >= 1 else 'MISS'}")  # fmt: skip
    print(f"memory read {bandwidth:.1f} GB/s; a token reads its weights and the cache "
          f"({cache / 1e6:.0f} MB of keys and values) once:")  # fmt: skip
    for name, size in sizes.items():
        least = size / bandwidth / 1e9
        print(
            f"{name:>12}: {size / 1e6:4.0f} MB a token, floor {1e3 * least:4.1f} ms, takes "
            f"{1e3 * each[name]:5.1f} ms: {least / each[name]:.0%} of the floor's speed"
        )


def agreement(tokens: list[int], reference: list[int], N: int) -> str:
    """'all 64 of' or 'the first 17 of': how many leading tokens agree."""
    same = next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=True)) if a != b),
                None)  # fmt: skip
    return f"all {N} of its tokens are" if same is None else f"the first {same} of its tokens are"


def llama_cpp_decode(ids: list[int], N: int, path: Path | None = None):
    """(a call that decodes N greedy tokens after `ids` with llama.cpp on `path` (the embedded
    file by default), (its tokens, its version)), or None where llama-cpp-python is not
    installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    path = path or embedded_path("smollm2")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_batch=512,
                          n_threads=CORES, n_threads_batch=CORES, verbose=False)  # fmt: skip

    def decode() -> list[int]:
        # generate(reset=True) keeps the cache of a prompt it has read before and reads only
        # what follows it; qkv reads the prompt on every call, so llama.cpp does too
        llm.reset()
        out = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True):
            out.append(int(token))
            if len(out) == N:
                return out
        return out

    return decode, (decode(), llama_cpp.__version__)


def read_per_token(model) -> int:
    """The bytes of weights a decoding step reads: every parameter and buffer once, but the
    token matrix, of which the lookup reads one row (unless it is also the LM head)."""
    tokens = model.embed.tokens.weight
    head = getattr(model.lm_head, "weight", None)
    held = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    if head is not tokens:
        held.pop(id(tokens))
    return sum(t.numel() * t.element_size() for t in held.values())


def floor(ours, rate: dict) -> None:
    """How far each is from reading every weight once per token at the memory's speed."""
    from timing import read_bandwidth

    bandwidth = read_bandwidth()
    path = embedded_path("smollm2")
    sizes = {"qkv float32": read_per_token(ours.generation_model("loaded")[0]),
             "llama.cpp": path.stat().st_size,  # its weights as stored: Q4_1, the head 8-bit
             "qkv default": read_per_token(ours.generation_model("auto")[0])}  # fmt: skip
    print(f"memory read {bandwidth:.1f} GB/s; the floor of a token is its weights read once:")
    for name, size in sizes.items():
        if name in rate:
            least = size / bandwidth / 1e9
            speed = rate[name] * least  # the share of the floor's tokens/s it reaches
            took = 1e3 / rate[name]
            print(f"{name:>12}: {size / 1e6:4.0f} MB a token, floor {1e3 * least:4.1f} ms, "
                  f"takes {took:5.1f} ms: {speed:.0%} of the floor's speed")  # fmt: skip


def profile_decode(ours, N: int) -> None:
    """Where qkv's decoding time goes, by torch op, over one generate call."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        ours.generate(PROMPT, N)
    print(f"\nqkv generate({N} tokens) under torch.profiler, top ops by self CPU time:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


# What each load imports on first use: imported before the timer starts, so it times loading.
PRELOAD = {
    "qkv": ["qkv.pretrained", "qkv.io.gguf", "qkv.io.tokenizer"],
    "transformers": [
        "transformers.modeling_gguf_pytorch_utils",
        "transformers.models.llama.modeling_llama",
    ],
}


def load_child(library: str) -> None:
    """Run in a fresh process: import, then time one load; print its seconds."""
    torch.set_num_threads(CORES)
    for module in PRELOAD[library]:
        importlib.import_module(module)
    if library == "transformers":
        from transformers.utils import logging

        logging.disable_progress_bar()
    start = time.perf_counter()
    qkv.load("smollm2") if library == "qkv" else load_transformers()
    print(time.perf_counter() - start)


def run_child(library: str, cache: str) -> tuple[float, float]:
    """(seconds of the load call, wall seconds of the whole process)."""
    env = {**os.environ, "XDG_CACHE_HOME": cache, "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    cmd = [sys.executable, __file__, "--load-child", library]
    result = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    wall = time.perf_counter() - start
    return float(result.stdout.strip().splitlines()[-1]), wall


def bench_load(quick: bool) -> None:
    rounds = 1 if quick else 3
    cells = ("transformers", "qkv cold", "qkv cached")
    loads: dict[str, list[float]] = {cell: [] for cell in cells}
    walls: dict[str, list[float]] = {cell: [] for cell in cells}
    for _ in range(rounds):
        with tempfile.TemporaryDirectory(prefix="qkv-bench-cache-") as cache:
            for cell in cells:  # qkv cold must come before qkv cached: it fills the cache
                load, wall = run_child(cell.split()[0], cache)
                loads[cell].append(load)
                walls[cell].append(wall)
    print(f"\n2. Loading, a fresh process per load, median of {rounds}")
    header = f"{'':>12} | {'load s':>7} | {'import+load wall s':>18}"
    print(header)
    print("-" * len(header))
    load = {cell: statistics.median(loads[cell]) for cell in cells}
    for cell in cells:
        print(f"{cell:>12} | {load[cell]:>7.2f} | {statistics.median(walls[cell]):>18.2f}")
    ratio = load["qkv cold"] / load["transformers"]
    print(
        f"qkv cold / transformers load: {ratio:.3f}; target <= 0.2 -> "
        f"{'PASS' if ratio <= 0.2 else 'MISS'}"
    )
    cached = load["qkv cached"]
    print(f"qkv cached load: {cached:.2f} s; target < 2 s -> {'PASS' if cached < 2 else 'MISS'}")


def bench_cold_start(quick: bool) -> None:
    """Seconds from starting `qkv generate` to its first generated character, cache warm:
    qkv's cache of weights, and Python's of compiled modules (PYTHONDONTWRITEBYTECODE, set in
    some sandboxes, would compile every module of qkv's again in each run: 0.5-0.8 s more on
    a 2-core Zen 4 VM)."""
    qkv.load("smollm2")  # fills the cache of dequantized weights, if it is empty
    command = [str(Path(sys.executable).with_name("qkv")), "generate", PROMPT, "-n", "4"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run(command, capture_output=True, env=env, check=True)  # writes the bytecode
    times = []
    for _ in range(1 if quick else 5):
        start = time.perf_counter()
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              env=env) as run:  # fmt: skip
            seen = b""
            while len(seen) <= len(PROMPT.encode()):  # the prompt is echoed first
                byte = run.stdout.read(1)
                if not byte:
                    raise RuntimeError(f"qkv generate printed only {seen!r}")
                seen += byte
            times.append(time.perf_counter() - start)
            run.wait()
    first = statistics.median(times)
    print(f"\n3. Cold start: `qkv generate` to its first generated character, cache warm, "
          f"median of {len(times)}: {first:.2f} s; target <= 2 s -> "
          f"{'PASS' if first <= 2 else 'MISS'}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 new tokens, one load round")
    parser.add_argument("--repeats", type=int, default=None, help="timed generate calls each")
    parser.add_argument("--profile", action="store_true", help="profile qkv's decoding")
    parser.add_argument("--load-child", choices=("qkv", "transformers"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_child:
        load_child(args.load_child)
        return
    import transformers

    repeats = args.repeats or (3 if args.quick else 5)
    torch.set_num_threads(CORES)
    print(machine())
    print(native.describe())
    with contextlib.suppress(ImportError):
        import llama_cpp

        print(f"llama.cpp: {llama_cpp.llama_print_system_info().decode().strip()}")
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"qkv {qkv.__version__}, {torch.get_num_threads()} threads, float32, "
        f"median of {repeats} interleaved calls"
    )
    bench_decode(args.quick, repeats, args.profile)
    bench_load(args.quick)
    bench_cold_start(args.quick)


if __name__ == "__main__":
    main()
