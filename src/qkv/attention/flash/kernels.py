"""The Triton kernels of the `flash` backend: FlashAttention-2, forward and backward.

Read top to bottom, in the order of Triton's fused-attention tutorial: the inner loop over
key tiles, the forward kernel, the backward kernels, then (in `function.py`) the autograd
function and the public functions.

One program of the forward kernel owns BLOCK_M queries of one head. It walks over the
keys BLOCK_N at a time and keeps, per query, the running maximum score `m`, the running
sum of exponentials `l` and the running weighted sum of values `acc` (the online softmax),
all in float32: the T x T matrix of weights never exists in memory. Scores are kept in
base 2 (`exp2` with the scale and log2(e) folded into one factor). At the end it writes
out = acc / l and the log-sum-exp lse = ln(sum_j exp(scale * q . k_j)) of each query.

The backward recomputes each tile of weights from q, k and that lse (p = exp(s - lse))
instead of storing them: one kernel per key tile accumulates dK and dV over every query
(and, for grouped KV heads, over every query head that shares the key head, so K and V
are never copied), another per query tile accumulates dQ over every key.

Every tensor is addressed through (batch, head, token, feature) strides, so the same
kernels read padded batches (B, H, T, D), views such as a transposed (B, T, H, D), and
packed variable-length batches (total tokens, H, D) whose sequences start at cumulative
offsets `cu_seqlens` (batch stride 0): a padded token is never loaded or computed.
"""

from __future__ import annotations

import contextlib

import triton
import triton.language as tl

from qkv.attention.flash.limits import interpreter_on

LOG2_E = 1.4426950408889634  # exp(x) = exp2(x * LOG2_E)
LN_2 = 0.6931471805599453  # ln(x) = log2(x) * LN_2
MIN_BLOCK = 16  # tl.dot needs every side of a tile to be 16 at least
# the same inside kernels: a compiled kernel reads only globals that are constexpr (the
# interpreter reads any, which is how a plain float here ran in every test and not on a GPU)
KERNEL_LOG2_E = tl.constexpr(LOG2_E)
KERNEL_LN_2 = tl.constexpr(LN_2)

# Tile shapes (BLOCK_M queries, BLOCK_N keys, warps, pipeline stages) that autotuning tries
# on a GPU. The backward's dK/dV kernel holds a key tile while it walks the queries, so it
# prefers short query tiles; its dQ kernel the other way round.
FORWARD_TILES = [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2)]
DKDV_TILES = [(32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 2)]
DQ_TILES = [(128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2)]
# The interpreter runs each program in Python: one small tile, so that a test's few dozen
# tokens still cross several tiles (the tails, the causal diagonal) and nothing is timed.
INTERPRETER_TILE = (MIN_BLOCK, MIN_BLOCK, 1, 1)
AUTOTUNE_KEY = ["HEAD_DIM", "CAUSAL", "HAS_MASK", "VARLEN", "TQ_BUCKET", "TK_BUCKET"]


interpreting = interpreter_on  # TRITON_INTERPRET=1: the kernels run on the CPU, as in tests


def launching() -> contextlib.AbstractContextManager:
    """The block to launch a kernel in: under the interpreter, with qkv's fixes to it (see
    interpreter.py) for that launch only; on a GPU, nothing."""
    if not interpreting():
        return contextlib.nullcontext()
    # Triton's interpreter module (and numpy) is loaded only where the interpreter runs.
    from qkv.attention.flash.interpreter import fixed_interpreter

    return fixed_interpreter()


def _configs(tiles: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    tiles = [INTERPRETER_TILE] if interpreting() else tiles
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps, num_stages=stages)
        for m, n, warps, stages in tiles
    ]


def _fits(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Drop the tiles that cannot pay: 256-wide heads overflow shared memory with large
    tiles and deep pipelines; 128-query tiles are mostly padding for short sequences."""
    args = {**named_args, **kwargs}
    kept = []
    for config in configs:
        m, n = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
        if args["HEAD_DIM"] > 128 and (m * n > 64 * 32 or config.num_stages > 2):
            continue
        if args["TQ_BUCKET"] <= 64 and m > 64:
            continue
        kept.append(config)
    return kept or configs[-1:]


def autotuned(tiles: list[tuple[int, int, int, int]]):
    """The decorator that picks each kernel's tile shape by timing `tiles` on the GPU."""
    return triton.autotune(
        configs=_configs(tiles), key=AUTOTUNE_KEY, prune_configs_by={"early_config_prune": _fits}
    )


# ---------------------------------------------------------------- the inner loop


@triton.jit
def _visible(rows, cols, q_len, k_len, causal_offset, CAUSAL: tl.constexpr):
    """(len(rows), len(cols)) True where query `rows` may see key `cols`: inside both
    sequences and, when causal, key j <= query i + (k_len - q_len)."""
    visible = (rows[:, None] < q_len) & (cols[None, :] < k_len)
    if CAUSAL:
        visible = visible & (cols[None, :] <= rows[:, None] + causal_offset)
    return visible


@triton.jit
def _attend_key_tiles(
    acc, l_i, m_i, q,
    k_ptrs, v_ptrs, mask_ptrs, stride_kt, stride_vt, stride_mk,
    offs_m, offs_n, offs_d, start, stop, q_len, k_len, causal_offset, scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CHECK_BOUNDS: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Fold the key tiles [start, stop) into the running (acc, l_i, m_i) of BLOCK_M queries.

    CHECK_BOUNDS is False for the tiles every query of the block may see whole (no causal
    cut, no sequence end inside): they skip building the mask.
    """
    for start_n in range(start, stop, BLOCK_N):
        cols = start_n + offs_n
        k_t = tl.load(
            k_ptrs + start_n * stride_kt,
            mask=(cols[None, :] < k_len) & (offs_d[:, None] < HEAD_DIM),
            other=0.0,
        )  # (BLOCK_D, BLOCK_N)  fmt: skip
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2  # (BLOCK_M, BLOCK_N)
        if CHECK_BOUNDS:
            s = tl.where(
                _visible(offs_m, cols, q_len, k_len, causal_offset, CAUSAL), s, -float("inf")
            )
        if HAS_MASK:
            allowed = tl.load(
                mask_ptrs + start_n * stride_mk,
                mask=(offs_m[:, None] < q_len) & (cols[None, :] < k_len), other=0,
            )  # fmt: skip
            s = tl.where(allowed != 0, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A query that has seen no key yet keeps m = -inf; subtracting 0 instead keeps
        # exp2 at exactly 0 for its hidden keys rather than exp2(-inf - -inf) = NaN.
        m_shift = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])  # (BLOCK_M, BLOCK_N) unnormalized weights
        alpha = tl.exp2(m_i - m_shift)  # rescales what was summed under the old maximum
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptrs + start_n * stride_vt,
            mask=(cols[:, None] < k_len) & (offs_d[None, :] < HEAD_DIM),
            other=0.0,
        )  # (BLOCK_N, BLOCK_D)  fmt: skip
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _sequence(CU_Q, CU_K, b, Tq, Tk, VARLEN: tl.constexpr):
    """Where batch element b's queries and keys start (in tokens) and how many there are."""
    if VARLEN:
        q_start = tl.load(CU_Q + b)
        q_len = tl.load(CU_Q + b + 1) - q_start
        k_start = tl.load(CU_K + b)
        k_len = tl.load(CU_K + b + 1) - k_start
    else:
        q_start, q_len, k_start, k_len = 0, Tq, 0, Tk
    return q_start, q_len, k_start, k_len


@triton.jit
def _query_program(CU_Q, CU_K, H, Tq, Tk, VARLEN: tl.constexpr):
    """A program of a (query tiles, B * H) grid: its tile, batch element, head, and where
    that batch element's queries and keys lie."""
    b = tl.program_id(1) // H
    q_start, q_len, k_start, k_len = _sequence(CU_Q, CU_K, b, Tq, Tk, VARLEN)
    h = (tl.program_id(1) % H).to(tl.int64)
    return tl.program_id(0), b.to(tl.int64), h, q_start, q_len, k_start, k_len


@triton.jit
def _key_stop(pid_m, k_len, causal_offset, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """One past the last key any query of tile pid_m may see."""
    stop = k_len
    if CAUSAL:
        stop = tl.minimum(k_len, pid_m * BLOCK_M + BLOCK_M + causal_offset)
    return stop


# ---------------------------------------------------------------- the forward kernel


@autotuned(FORWARD_TILES)
@triton.jit
def forward_kernel(
    Q, K, V, Out, LSE, MASK, CU_Q, CU_K,
    sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd,
    sob, soh, sot, sod, slb, slh, slt, smb, smh, smq, smk,
    H, GROUP, Tq, Tk, scale_log2, TQ_BUCKET, TK_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Out and LSE for BLOCK_M queries of one (batch, head): grid (query tiles, B * H)."""
    pid_m, b, h, q_start, q_len, k_start, k_len = _query_program(CU_Q, CU_K, H, Tq, Tk, VARLEN)
    if pid_m * BLOCK_M >= q_len:
        return
    kv_h = h // GROUP  # grouped-query attention: query head h reads key/value head h // GROUP
    causal_offset = k_len - q_len  # queries are aligned to the end of the keys

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = Q + b * sqb + h * sqh + (q_start + offs_m[:, None]) * sqt + offs_d[None, :] * sqd
    k_ptrs = K + b * skb + kv_h * skh + (k_start + offs_n[None, :]) * skt + offs_d[:, None] * skd
    v_ptrs = V + b * svb + kv_h * svh + (k_start + offs_n[:, None]) * svt + offs_d[None, :] * svd
    mask_ptrs = MASK + b * smb + h * smh + offs_m[:, None] * smq + offs_n[None, :] * smk
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM), other=0.0)

    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys past the last query's horizon are never visited; below the first query's
    # horizon, whole tiles are visible to every query of the block and skip the mask.
    stop = _key_stop(pid_m, k_len, causal_offset, BLOCK_M, CAUSAL)
    whole = k_len
    if CAUSAL:
        whole = tl.maximum(tl.minimum(k_len, pid_m * BLOCK_M + causal_offset + 1), 0)
    whole = (whole // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _attend_key_tiles(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_ptrs, skt, svt, smk,
        offs_m, offs_n, offs_d, 0, whole, q_len, k_len, causal_offset, scale_log2,
        HEAD_DIM, BLOCK_N, False, CAUSAL, HAS_MASK, DOT_PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _attend_key_tiles(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_ptrs, skt, svt, smk,
        offs_m, offs_n, offs_d, whole, stop, q_len, k_len, causal_offset, scale_log2,
        HEAD_DIM, BLOCK_N, True, CAUSAL, HAS_MASK, DOT_PRECISION,
    )  # fmt: skip

    # A query that saw no key (l = 0) gets zeros and lse = -inf, the log of an empty sum.
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * KERNEL_LN_2, -float("inf"))
    o_ptrs = Out + b * sob + h * soh + (q_start + offs_m[:, None]) * sot + offs_d[None, :] * sod
    tl.store(o_ptrs, out.to(Out.dtype.element_ty),
             mask=(offs_m[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM))  # fmt: skip
    tl.store(LSE + b * slb + h * slh + (q_start + offs_m) * slt, lse, mask=offs_m < q_len)


# ---------------------------------------------------------------- the backward kernels


@triton.jit
def backward_delta_kernel(
    Out, dOut, Delta, CU_Q, CU_K,
    sob, soh, sot, sod, sdb, sdh, sdt, sdd, slb, slh, slt,
    H, Tq, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    VARLEN: tl.constexpr,
):  # fmt: skip
    """delta_i = sum_d out_id * dout_id, the term every weight's gradient subtracts."""
    pid_m, b, h, q_start, q_len, _, _ = _query_program(CU_Q, CU_K, H, Tq, Tq, VARLEN)
    if pid_m * BLOCK_M >= q_len:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = q_start + offs_m[:, None]
    inside = (offs_m[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(
        Out + b * sob + h * soh + rows * sot + offs_d[None, :] * sod, mask=inside, other=0.0
    )
    do = tl.load(
        dOut + b * sdb + h * sdh + rows * sdt + offs_d[None, :] * sdd, mask=inside, other=0.0
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + b * slb + h * slh + (q_start + offs_m) * slt, delta, mask=offs_m < q_len)


@triton.jit
def _weights_tile(q_t, k, lse_ptrs, mask_ptrs, offs_m, offs_n, q_len, k_len, causal_offset,
                  scale_log2, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):  # fmt: skip
    """The weights p^T (BLOCK_N keys, BLOCK_M queries), recomputed from q, k and the lse."""
    s_t = tl.dot(k, q_t, input_precision=DOT_PRECISION) * scale_log2  # (BLOCK_N, BLOCK_M)
    visible = tl.trans(_visible(offs_m, offs_n, q_len, k_len, causal_offset, CAUSAL))
    if HAS_MASK:
        visible = visible & (tl.load(mask_ptrs, mask=visible, other=0) != 0)
    lse = tl.load(lse_ptrs, mask=offs_m < q_len, other=0.0) * KERNEL_LOG2_E
    lse = tl.where(lse == -float("inf"), 0.0, lse)  # a query that saw no key: all p are 0
    return tl.exp2(tl.where(visible, s_t, -float("inf")) - lse[None, :])


@autotuned(DKDV_TILES)
@triton.jit
def backward_dkdv_kernel(
    Q, K, V, dOut, LSE, Delta, dK, dV, MASK, CU_Q, CU_K,
    sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd,
    sdb, sdh, sdt, sdd, slb, slh, slt, smb, smh, smq, smk,
    sdkb, sdkh, sdkt, sdkd, sdvb, sdvh, sdvt, sdvd,
    HKV, GROUP, Tq, Tk, scale, scale_log2, TQ_BUCKET, TK_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """dK and dV for BLOCK_N keys of one key/value head: grid (key tiles, B * Hkv).

    The loop runs over every query head of the group that reads this key head, so the
    gradients of shared keys and values are summed here, in registers, with no atomics.
    """
    pid_n = tl.program_id(0)
    b = tl.program_id(1) // HKV
    kv_h = tl.program_id(1) % HKV
    q_start, q_len, k_start, k_len = _sequence(CU_Q, CU_K, b, Tq, Tk, VARLEN)
    if pid_n * BLOCK_N >= k_len:
        return
    b, kv_h = b.to(tl.int64), kv_h.to(tl.int64)
    causal_offset = k_len - q_len
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kv_inside = (offs_n[:, None] < k_len) & (offs_d[None, :] < HEAD_DIM)
    keys = k_start + offs_n[:, None]
    k = tl.load(
        K + b * skb + kv_h * skh + keys * skt + offs_d[None, :] * skd, mask=kv_inside, other=0.0
    )
    v = tl.load(
        V + b * svb + kv_h * svh + keys * svt + offs_d[None, :] * svd, mask=kv_inside, other=0.0
    )
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    first = 0
    if CAUSAL:  # the first query that sees key n is n - causal_offset
        first = (tl.maximum(pid_n * BLOCK_N - causal_offset, 0) // BLOCK_M) * BLOCK_M
    for g in range(GROUP):
        h = kv_h * GROUP + g
        for start_m in range(first, q_len, BLOCK_M):
            offs_m = start_m + offs_m0
            rows = q_start + offs_m
            q_inside = (offs_m[None, :] < q_len) & (offs_d[:, None] < HEAD_DIM)
            q_t = tl.load(
                Q + b * sqb + h * sqh + rows[None, :] * sqt + offs_d[:, None] * sqd,
                mask=q_inside,
                other=0.0,
            )  # (BLOCK_D, BLOCK_M)  fmt: skip
            mask_ptrs = MASK + b * smb + h * smh + offs_m[None, :] * smq + offs_n[:, None] * smk
            lse_ptrs = LSE + b * slb + h * slh + rows * slt
            p_t = _weights_tile(
                q_t, k, lse_ptrs, mask_ptrs, offs_m, offs_n, q_len, k_len, causal_offset,
                scale_log2, CAUSAL, HAS_MASK, DOT_PRECISION,
            )  # fmt: skip
            do = tl.load(
                dOut + b * sdb + h * sdh + rows[:, None] * sdt + offs_d[None, :] * sdd,
                mask=tl.trans(q_inside),
                other=0.0,
            )  # (BLOCK_M, BLOCK_D)  fmt: skip
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
            delta = tl.load(Delta + b * slb + h * slh + rows * slt, mask=offs_m < q_len, other=0.0)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
            ds_t = p_t * (dp_t - delta[None, :])  # gradient of the scaled scores
            dk = tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), dk, input_precision=DOT_PRECISION)
    dk = dk * scale  # s = scale * q . k, so dL/dk = scale * sum_i ds_i q_i
    tl.store(dK + b * sdkb + kv_h * sdkh + keys * sdkt + offs_d[None, :] * sdkd,
             dk.to(dK.dtype.element_ty), mask=kv_inside)  # fmt: skip
    tl.store(dV + b * sdvb + kv_h * sdvh + keys * sdvt + offs_d[None, :] * sdvd,
             dv.to(dV.dtype.element_ty), mask=kv_inside)  # fmt: skip


@autotuned(DQ_TILES)
@triton.jit
def backward_dq_kernel(
    Q, K, V, dOut, LSE, Delta, dQ, MASK, CU_Q, CU_K,
    sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd,
    sdb, sdh, sdt, sdd, slb, slh, slt, smb, smh, smq, smk, sdqb, sdqh, sdqt, sdqd,
    H, GROUP, Tq, Tk, scale, scale_log2, TQ_BUCKET, TK_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """dQ for BLOCK_M queries of one (batch, head): grid (query tiles, B * H)."""
    pid_m, b, h, q_start, q_len, k_start, k_len = _query_program(CU_Q, CU_K, H, Tq, Tk, VARLEN)
    if pid_m * BLOCK_M >= q_len:
        return
    kv_h = h // GROUP
    causal_offset = k_len - q_len
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = q_start + offs_m
    q_inside = (offs_m[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqt + offs_d[None, :] * sqd,
                mask=q_inside, other=0.0)  # fmt: skip
    do = tl.load(dOut + b * sdb + h * sdh + rows[:, None] * sdt + offs_d[None, :] * sdd,
                 mask=q_inside, other=0.0)  # fmt: skip
    delta = tl.load(Delta + b * slb + h * slh + rows * slt, mask=offs_m < q_len, other=0.0)
    lse_ptrs = LSE + b * slb + h * slh + rows * slt
    q_t = tl.trans(q)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, _key_stop(pid_m, k_len, causal_offset, BLOCK_M, CAUSAL), BLOCK_N):
        offs_n = start_n + offs_n0
        keys = k_start + offs_n[:, None]
        kv_inside = (offs_n[:, None] < k_len) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(
            K + b * skb + kv_h * skh + keys * skt + offs_d[None, :] * skd, mask=kv_inside, other=0.0
        )  # (BLOCK_N, BLOCK_D)  fmt: skip
        v = tl.load(V + b * svb + kv_h * svh + keys * svt + offs_d[None, :] * svd,
                    mask=kv_inside, other=0.0)  # fmt: skip
        mask_ptrs = MASK + b * smb + h * smh + offs_m[None, :] * smq + offs_n[:, None] * smk
        p_t = _weights_tile(q_t, k, lse_ptrs, mask_ptrs, offs_m, offs_n, q_len, k_len,
                            causal_offset, scale_log2, CAUSAL, HAS_MASK, DOT_PRECISION)  # fmt: skip
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        ds = tl.trans(p_t * (dp_t - delta[None, :]))  # (BLOCK_M, BLOCK_N)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    dq = dq * scale
    tl.store(dQ + b * sdqb + h * sdqh + rows[:, None] * sdqt + offs_d[None, :] * sdqd,
             dq.to(dQ.dtype.element_ty), mask=q_inside)  # fmt: skip
