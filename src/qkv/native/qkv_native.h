/* qkv's native CPU code: what every C file shares. Plain C11, no torch ABI: Python calls
 * these functions through ctypes on tensors' memory (qkv/native/__init__.py builds and
 * loads the library). */
#ifndef QKV_NATIVE_H
#define QKV_NATIVE_H

#include <stdint.h>

/* One task, run by nth threads at once: thread ith (0..nth-1) does its share. */
typedef void (*qkv_task)(void *arg, int ith, int nth);

/* fn(arg, ith, nth) on nth threads (the caller's is thread 0), returning when all are done.
 * The workers are kept between calls, spinning a little before they sleep, so that calls a
 * few microseconds apart (a decoding step's products) cost no thread start or wake-up. */
void qkv_parallel(qkv_task fn, void *arg, int nth);

/* Instruction-set variants of the kernels, lowest first; each runs where the CPU has it. */
enum { QKV_SCALAR = 0, QKV_AVX2 = 1, QKV_AVX_VNNI = 2, QKV_AVX512_VNNI = 3, QKV_VARIANTS = 4 };

#if defined(__x86_64__) || defined(_M_X64)
#define QKV_X86 1
#endif

#endif
