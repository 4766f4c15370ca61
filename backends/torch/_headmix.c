/* damcha_torch._headmix: the cross-head map of a decoding step's few tokens,
 * fused into one call on the CPU.
 *
 * Why a C kernel: at B = 1 a decoding step's map is six tiny torch ops (phi's
 * norm, hypot, the generator GEMV, the phi scaling, the gate product, the
 * batched head mix), and on a 2-core CPU each costs 5-8 us in a step (its
 * dispatch, a new tensor, and caches emptied by the projections' weights
 * streaming through), about 50 us against the ~8 us their arithmetic needs.
 * torch.compile's wrapper costs more than it saves at this size
 * (docs/benchmarks.md), and no library offers this fusion. The torch ops stay
 * the path everywhere else (CUDA, autograd, 16-bit, compiled graphs) and
 * wherever this module is missing (a build without a C compiler).
 *
 * The math is damcha_core's (spec.md): for each token t with features x_t (E)
 * and its stacked heads y_t (S heads of size d), with
 *   A_t = phi(x_t) W^T + b     (S*S; phi(x) = x / sqrt(mean(x^2) + eps))
 *   z_t^h = y_t^h + sum_a g_h A_t[h, a] y_t^a
 * computed as sqrt(E) / sqrt(|x|^2 + E eps) times x W^T, then + b (the torch
 * path's order: x W^T first, so the GEMV reads the weight, not phi(x)).
 * |x|^2 is summed in double, as the spec's float64 statistic: for float32
 * tokens with |x| above about 1.8e19 the torch ops' float32 norm overflows
 * (phi = 0, A = b) where this stays finite (tested against the spec). NaN and
 * inf propagate as in the torch ops: nothing here tests a value. A gate of 0
 * gives y bit for bit when A is finite (y + 0; -0.0 becomes +0.0, as there).
 *
 * Layout (all pointers are element addresses, strides in elements):
 *   x     T rows of E, row stride x_stride, unit stride within a row
 *   W     (S*S, E) contiguous;  b (S*S) contiguous;  g (S) contiguous
 *   y     per token `blocks` blocks of S heads of d (unit stride within a
 *         head), head a of block k at y + t * y_stride + k * block_stride +
 *         a * head_stride, all mapped by the token's one A: q and k of a tied
 *         layer (adjacent in the packed projection's output: head stride d,
 *         block stride S d), a run of a converted model's fused projection,
 *         or the heads of an interleaved one (GPT-NeoX's query_key_value, each
 *         head's q, k and v in turn: head stride 3 d, block stride d)
 *   out   (T, blocks, S, d) contiguous (out_stride 0), or rows of out_stride
 *         elements holding the blocks at y's head and block strides from each
 *         row's start: out may be y itself (in place; a block's heads are
 *         mixed into scratch first)
 * The callers (few_tokens_step, _models_fused.map_blocks_) check devices, dtypes, shapes and strides;
 * this file trusts them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdlib.h>

/* AVX2 + FMA where the machine has them (chosen once at load, glibc ifunc),
 * baseline x86-64 otherwise: a wheel built here runs on any x86-64. */
/* GCC 11 or later (arch=x86-64-v3) with glibc's ifunc; elsewhere (older GCC,
 * musl, clang) one baseline build, so the extension still compiles. */
#if defined(__GNUC__) && __GNUC__ >= 11 && defined(__x86_64__) && defined(__GLIBC__) && !defined(__clang__)
#define DAMCHA_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define DAMCHA_CLONES
#endif


#define DAMCHA_KERNEL(NAME, REAL)                                                                        \
    DAMCHA_CLONES static void NAME(Py_ssize_t T, Py_ssize_t E, Py_ssize_t S, Py_ssize_t d,               \
                                   const REAL *x, Py_ssize_t x_stride, const REAL *W, const REAL *b,    \
                                   const REAL *g, const REAL *y, Py_ssize_t y_stride, Py_ssize_t blocks, \
                                   REAL *out, Py_ssize_t out_stride, double eps, Py_ssize_t hs,         \
                                   Py_ssize_t bs, REAL *P, REAL *acc) {                                 \
        const Py_ssize_t SS = S * S;                                                                     \
        /* out's head and block strides: y's in rows of out_stride, else (T, blocks, S, d). */          \
        const Py_ssize_t ohs = out_stride ? hs : d, obs = out_stride ? bs : S * d;                      \
        const Py_ssize_t orow = out_stride ? out_stride : blocks * S * d;                               \
        /* x W^T, four rows of W by two tokens at a time: eight independent sums, where one    \
         * dot product at a time waits on its one accumulator's FMA latency (about 6x slower     \
         * at E = 512), and each row loaded once per token pair. */                               \
        Py_ssize_t r = 0;                                                                        \
        for (; r + 4 <= SS; r += 4) {                                                            \
            const REAL *w0 = W + r * E, *w1 = w0 + E, *w2 = w1 + E, *w3 = w2 + E;                \
            Py_ssize_t t = 0;                                                                    \
            for (; t + 2 <= T; t += 2) {                                                         \
                const REAL *x0 = x + t * x_stride, *x1 = x0 + x_stride;                          \
                REAL s00 = 0, s01 = 0, s10 = 0, s11 = 0, s20 = 0, s21 = 0, s30 = 0, s31 = 0;     \
                _Pragma("omp simd reduction(+ : s00, s01, s10, s11, s20, s21, s30, s31)")        \
                for (Py_ssize_t e = 0; e < E; ++e) {                                             \
                    const REAL u = x0[e], v = x1[e];                                             \
                    s00 += w0[e] * u; s01 += w0[e] * v; s10 += w1[e] * u; s11 += w1[e] * v;      \
                    s20 += w2[e] * u; s21 += w2[e] * v; s30 += w3[e] * u; s31 += w3[e] * v;      \
                }                                                                                \
                REAL *p0 = P + t * SS + r, *p1 = p0 + SS;                                        \
                p0[0] = s00; p0[1] = s10; p0[2] = s20; p0[3] = s30;                              \
                p1[0] = s01; p1[1] = s11; p1[2] = s21; p1[3] = s31;                              \
            }                                                                                    \
            for (; t < T; ++t) {                                                                 \
                const REAL *x0 = x + t * x_stride;                                               \
                REAL s0 = 0, s1 = 0, s2 = 0, s3 = 0;                                             \
                _Pragma("omp simd reduction(+ : s0, s1, s2, s3)")                                \
                for (Py_ssize_t e = 0; e < E; ++e) {                                             \
                    const REAL u = x0[e];                                                        \
                    s0 += w0[e] * u; s1 += w1[e] * u; s2 += w2[e] * u; s3 += w3[e] * u;          \
                }                                                                                \
                REAL *p0 = P + t * SS + r;                                                       \
                p0[0] = s0; p0[1] = s1; p0[2] = s2; p0[3] = s3;                                  \
            }                                                                                    \
        }                                                                                        \
        for (; r < SS; ++r) { /* the last SS mod 4 rows (S odd) */                               \
            const REAL *w = W + r * E;                                                           \
            for (Py_ssize_t t = 0; t < T; ++t) {                                                 \
                const REAL *xt = x + t * x_stride;                                               \
                REAL s = 0;                                                                      \
                _Pragma("omp simd reduction(+ : s)") for (Py_ssize_t e = 0; e < E; ++e) s += w[e] * xt[e]; \
                P[t * SS + r] = s;                                                               \
            }                                                                                    \
        }                                                                                        \
        for (Py_ssize_t t = 0; t < T; ++t) {                                                             \
            const REAL *xt = x + t * x_stride;                                                           \
            double n2 = 0.0;                                                                             \
            _Pragma("omp simd reduction(+ : n2)") for (Py_ssize_t e = 0; e < E; ++e) n2 += (double)xt[e] * (double)xt[e]; \
            const REAL scale = (REAL)(sqrt((double)E) / sqrt(n2 + (double)E * eps));                    \
            REAL *A = P + t * SS;                                                                        \
            for (Py_ssize_t h = 0; h < S; ++h)                                                           \
                for (Py_ssize_t a = 0; a < S; ++a) A[h * S + a] = (scale * A[h * S + a] + b[h * S + a]) * g[h]; \
            for (Py_ssize_t k = 0; k < blocks; ++k) {                                                    \
                const REAL *yt = y + t * y_stride + k * bs;                                              \
                REAL *z = out + t * orow + k * obs;                                                      \
                /* The block's heads into acc first: z may be y itself (in place). */                     \
                for (Py_ssize_t h = 0; h < S; ++h) {                                                     \
                    REAL *ah = acc + h * d;                                                              \
                    for (Py_ssize_t i = 0; i < d; ++i) ah[i] = 0;                                        \
                    for (Py_ssize_t a = 0; a < S; ++a) {                                                 \
                        const REAL c = A[h * S + a];                                                     \
                        const REAL *ya = yt + a * hs;                                                    \
                        _Pragma("omp simd") for (Py_ssize_t i = 0; i < d; ++i) ah[i] += c * ya[i];        \
                    }                                                                                    \
                }                                                                                        \
                for (Py_ssize_t h = 0; h < S; ++h) {                                                     \
                    const REAL *yh = yt + h * hs, *ah = acc + h * d;                                     \
                    REAL *zh = z + h * ohs;                                                              \
                    _Pragma("omp simd") for (Py_ssize_t i = 0; i < d; ++i) zh[i] = yh[i] + ah[i];        \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
    }

DAMCHA_KERNEL(map_f32, float)
DAMCHA_KERNEL(map_f64, double)

/* map(is_double, T, E, S, d, x, x_stride, W, b, g, y, y_stride, blocks, out, out_stride, eps,
 * head_stride, block_stride) with the pointers as Python ints (Tensor.data_ptr()). */
static PyObject *damcha_map(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 18) {
        PyErr_Format(PyExc_TypeError, "map() takes 18 arguments, got %zd", nargs);
        return NULL;
    }
    const int is_double = PyObject_IsTrue(args[0]);
    enum { NSIZES = 10, NPTRS = 6 };
    /* T, E, S, d, x_stride, y_stride, blocks, out_stride, head_stride, block_stride; x, W, b, g, y, out */
    const int sizes_at[NSIZES] = {1, 2, 3, 4, 6, 11, 12, 14, 16, 17}, ptrs_at[NPTRS] = {5, 7, 8, 9, 10, 13};
    Py_ssize_t n[NSIZES];
    void *p[NPTRS];
    if (is_double < 0) return NULL;
    for (int i = 0; i < NSIZES; ++i) {
        n[i] = PyLong_AsSsize_t(args[sizes_at[i]]);
        if (n[i] == -1 && PyErr_Occurred()) return NULL;
    }
    for (int i = 0; i < NPTRS; ++i) {
        p[i] = PyLong_AsVoidPtr(args[ptrs_at[i]]);
        if (p[i] == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "map(): a null pointer");
            return NULL;
        }
    }
    const double eps = PyFloat_AsDouble(args[15]);
    if (eps == -1.0 && PyErr_Occurred()) return NULL;
    const Py_ssize_t T = n[0], E = n[1], S = n[2], d = n[3];
    const Py_ssize_t x_stride = n[4], y_stride = n[5], blocks = n[6], out_stride = n[7], hs = n[8], bs = n[9];
    if (T <= 0 || E <= 0 || S <= 0 || d <= 0 || blocks <= 0 || x_stride < 0 || y_stride < 0 || out_stride < 0 ||
        hs < 0 || bs < 0) {
        PyErr_SetString(PyExc_ValueError, "map(): sizes and blocks must be positive, strides non-negative");
        return NULL;
    }
    const size_t item = is_double ? sizeof(double) : sizeof(float);
    void *scratch = malloc(((size_t)T * (size_t)(S * S) + (size_t)(S * d)) * item);
    if (scratch == NULL) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    if (is_double) {
        double *P = (double *)scratch;
        map_f64(T, E, S, d, p[0], x_stride, p[1], p[2], p[3], p[4], y_stride, blocks, p[5], out_stride, eps, hs,
                bs, P, P + T * S * S);
    } else {
        float *P = (float *)scratch;
        map_f32(T, E, S, d, p[0], x_stride, p[1], p[2], p[3], p[4], y_stride, blocks, p[5], out_stride, eps, hs,
                bs, P, P + T * S * S);
    }
    Py_END_ALLOW_THREADS
    free(scratch);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"map", (PyCFunction)(void (*)(void))damcha_map, METH_FASTCALL,
     "map(is_double, T, E, S, d, x, x_stride, W, b, g, y, y_stride, blocks, out, out_stride, eps, head_stride, "
     "block_stride): the head map of T tokens."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_headmix", NULL, -1, methods, NULL, NULL, NULL, NULL};

/* The calling convention's version: damcha_torch uses the module only when
 * it matches its own (a stale build of an older source is ignored, not
 * called with arguments it reads otherwise). */
#define DAMCHA_HEADMIX_ABI 3

PyMODINIT_FUNC PyInit__headmix(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "ABI", DAMCHA_HEADMIX_ABI) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#ifdef Py_GIL_DISABLED
    /* A free-threaded build (3.13t) would re-enable the GIL for a module that does not
     * say otherwise: map() keeps no state between calls and touches no Python object
     * once its arguments are read. */
    if (m != NULL && PyUnstable_Module_SetGIL(m, Py_MOD_GIL_NOT_USED) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#endif
    return m;
}
