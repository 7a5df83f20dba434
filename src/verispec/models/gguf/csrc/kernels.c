/* verispec's CPU kernels for GGUF models: repacked quantized matmuls over int8 activations, and the
 * per-row ops of a Llama / Qwen2 forward (RMSNorm, RoPE, attention over a KV cache, SwiGLU).
 *
 * Batch invariance is the rule every function here keeps: a token's outputs are computed with the same
 * sequence of operations whatever else is in the call (how many tokens, which thread, which tile).
 * Integer dot products are exact, and the float epilogues use explicit fmaf in one fixed order, so the
 * AVX-512 VNNI path and the portable path give the same bits (the tests check it).
 *
 * The parts, in the order this file includes them (one translation unit):
 *   layout.h          weight types, the repacked layout, half / bfloat16 conversions
 *   cpu.h             the kernel path, threads, AVX-512 tile height, profile
 *   repack.h          GGUF blocks to the packed layout and back
 *   activations.h     float rows to int8 blocks
 *   matmul_generic.h  the portable matmul kernel
 *   matmul_avx512.h   the AVX-512 VNNI kernel
 *   matmul_avx2.h     the AVX2 kernel (avx2_tile.h: once with AVX-VNNI's vpdpbusd, once without)
 *   matmul_amx.h      the AMX tile kernels (amx_tiles.h, amx_group.h), real and emulated
 *   matmul.h          vs_matmul: kernels and threads for a quantized matmul
 *   rowops.h          float matmuls, RMSNorm, RoPE, SwiGLU / GeGLU
 *   attention.h       attention over the caches (attend_cache.h: once for float, once for half caches)
 *   layer.h           a whole decoder layer, the MoE FFN
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h> /* only so that Python can import this file (and find it); the functions use ctypes */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define VS_X86 1
#endif

static struct PyModuleDef vs_module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, NULL, NULL, NULL, NULL, NULL};
PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&vs_module); }

#include "layout.h"
#include "cpu.h"
#include "repack.h"
#include "activations.h"
#include "matmul_generic.h"
#include "matmul_avx512.h"
#include "matmul_avx2.h"
#include "matmul_amx.h"
#include "matmul.h"
#include "rowops.h"
#include "attention.h"
#include "layer.h"
