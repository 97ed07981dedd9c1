// speclab's decoder layers in C++: the same ATen ops, in the same order, as `speclab.core.layers` runs them from
// Python (so every output is bitwise the Python path's), without the interpreter between them. On the zoo's 2-core
// CPU a Python-level op costs a few microseconds of dispatch, and a decode step of the target calls about 300 of
// them: this file is that step's loop, not new math. It also holds the bf16 product of a decode's few rows on AMX
// tiles (`tile_linear`, below) and, on CPUs with AVX512-BF16 and no AMX, in dot-product instructions (`dp_linear`),
// whose products are F.linear's bits where `layers.linear` takes them. A decode step's few rows of one sequence take
// loops over raw rows instead of those ops (`decode_layers`, `decode_layer_rows`: the same arithmetic per element, so
// the same bits). Built on first use by `speclab.core.native`.
#include <torch/extension.h>
#include <algorithm>
#include <cstring>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <ATen/core/dispatch/Dispatcher.h>

using at::Tensor;
using OptT = std::optional<Tensor>;

// bf16 <-> fp32 as c10::BFloat16 converts (round to nearest even; NaN to a quiet NaN), written so the loops below
// vectorize; `load` and `store` are that for bf16 and nothing for fp32
static inline float load(float v) { return v; }
static inline float load(at::BFloat16 v) {
  uint32_t u = (uint32_t)v.x << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
template <typename T> static inline T store(float f);
template <> inline float store<float>(float f) { return f; }
template <> inline at::BFloat16 store<at::BFloat16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return at::BFloat16(f != f ? (uint16_t)0x7FC0 : r, at::BFloat16::from_bits());
}

// ---- The tile product: bf16 x [M, K] times a weight [N, K] on AMX, for `layers.linear` -----------------------------
// oneDNN's product of a decode's few rows (1-16) costs 1.4-1.6x what reading its weight costs on the Intel Xeon with
// AMX (its per-call set-up and threading, not the arithmetic): this is the same arithmetic without them. The weight is
// packed once (`tile_pack`) into AMX's layout, 64 outputs x 32 inputs per 4 KB block, the blocks of 64 outputs in
// input order so that a thread reads its share of the weight front to back; `tile_linear` multiplies by it, each
// tile of up to 16 rows x 16 outputs summing the inputs 32 at a time in fp32 (TDPBF16PS), then rounds once to bf16
// (after the bias). Every output's sum is the same instructions in the same order whatever the other rows are, so a
// row's result does not depend on the row count; `layers._packed` takes a weight's tile copy only where its products
// are bit for bit F.linear's (checked when the copy is made: oneDNN's AMX kernel sums alike up to 32 rows), so no
// decode's output changes, only its time (`docs/ARCHITECTURE.md` "Prepacked weights"). Calls of more rows than
// `tile_max_rows` take oneDNN's copy kept beside the tile copy (`linear`'s `wide`).
static bool tile_ok = false;
// the most rows `linear` multiplies by a packed copy, tiles' and oneDNN's (`layers.TILE_ROWS`, `layers.CHECK_ROWS`'s
// last; `set_row_limits`): more are at::linear's, where the copy's product was not checked against it
static int64_t tile_max_rows = 32, packed_max_rows = 200;
static void set_row_limits(int64_t tiles, int64_t packed) { tile_max_rows = tiles, packed_max_rows = packed; }

// Whether this CPU has AMX (bf16) and this process may use its tile registers (Linux asks each process to request
// them); once asked, kept
static bool tile_init() {
  static const bool ok = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
                         syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  tile_ok = ok;
  return ok;
}

// w [N, K] bf16 -> [ceil(N / 64), ceil(K / 32), 4, 16, 16, 2] bf16: per block of 64 outputs and 32 inputs, four
// 16 x 16 tiles (one per 16 outputs), row r of a tile holding inputs 2r and 2r + 1 of its 16 outputs; zeros past N, K
static Tensor tile_pack(const Tensor& w_) {
  TORCH_CHECK(w_.dim() == 2 && w_.scalar_type() == at::kBFloat16, "tile_pack: a 2-D bf16 weight");
  auto w = w_.contiguous();
  const int64_t N = w.size(0), K = w.size(1), G = (N + 63) / 64, KC = (K + 31) / 32;
  auto out = at::zeros({G, KC, 4, 16, 16, 2}, w.options());
  const uint16_t* src = (const uint16_t*)w.data_ptr();
  uint16_t* dst = (uint16_t*)out.data_ptr();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t k = 0; k < K; ++k)
        dst[((((n / 64) * KC + k / 32) * 4 + (n % 64) / 16) * 16 + (k % 32) / 2) * 32 + (n % 16) * 2 + k % 2] =
            src[n * K + k];
  });
  return out;
}

struct TileConfig {  // AMX's 64-byte tile configuration (palette 1)
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Outputs of blocks [g0, g1) for rows [m0, m0 + rows): tiles 0-3 sum one block's four 16-output tiles, tile 4 holds
// 32 inputs of the rows, tiles 5-7 the weight's tiles; the fp32 sums go to acc [M, G * 64]
__attribute__((target("amx-tile,amx-bf16"))) static void tile_rows(const uint16_t* x, int64_t ldx, const uint16_t* p,
                                                                   int64_t KC, int64_t g0, int64_t g1, int64_t m0,
                                                                   int64_t rows, float* acc, int64_t ldacc) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) cfg.rows[t] = (uint8_t)rows, cfg.colsb[t] = 64;
  for (int t = 5; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  for (int64_t g = g0; g < g1; ++g) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* blk = p + g * KC * 2048;
    for (int64_t kc = 0; kc < KC; ++kc, blk += 2048) {
      for (int l = 0; l < 64; ++l) _mm_prefetch((const char*)(blk + 2048 + l * 32), _MM_HINT_T0);  // the next 4 KB
      _tile_loadd(4, x + m0 * ldx + kc * 32, ldx * 2);
      _tile_loadd(5, blk, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, blk + 512, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, blk + 1024, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, blk + 1536, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
    float* out = acc + m0 * ldacc + g * 64;
    _tile_stored(0, out, ldacc * 4);
    _tile_stored(1, out + 16, ldacc * 4);
    _tile_stored(2, out + 32, ldacc * 4);
    _tile_stored(3, out + 48, ldacc * 4);
  }
  _tile_release();
}

// Rows [m0, m0 + 16 + rows2) of blocks [g0, g1), two row tiles at once (17-32 rows): each weight tile is loaded
// once for both (tiles 0-3: the sums of 2 row tiles x 2 tiles of 16 outputs, tiles 4-5 the rows' inputs, 6-7 the
// weight's), half a block of outputs per pass. Every output's sum is the same TDPBF16PS sequence as in `tile_rows`
// (its row, its 16 outputs, the inputs in order), so the bits are the same as there.
__attribute__((target("amx-tile,amx-bf16"))) static void tile_rows2(const uint16_t* x, int64_t ldx, const uint16_t* p,
                                                                    int64_t KC, int64_t g0, int64_t g1, int64_t m0,
                                                                    int64_t rows2, float* acc, int64_t ldacc) {
  TileConfig cfg;
  for (int t : {0, 1, 4}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  for (int t : {2, 3, 5}) cfg.rows[t] = (uint8_t)rows2, cfg.colsb[t] = 64;
  for (int t : {6, 7}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  const uint16_t* x0 = x + m0 * ldx;
  const uint16_t* x1 = x0 + 16 * ldx;
  for (int64_t g = g0; g < g1; ++g)
    for (int half = 0; half < 2; ++half) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const uint16_t* blk = p + g * KC * 2048 + half * 1024;
      for (int64_t kc = 0; kc < KC; ++kc, blk += 2048) {
        for (int l = 0; l < 32; ++l) _mm_prefetch((const char*)(blk + 2048 + l * 32), _MM_HINT_T0);  // the next 2 KB
        _tile_loadd(4, x0 + kc * 32, ldx * 2);
        _tile_loadd(5, x1 + kc * 32, ldx * 2);
        _tile_loadd(6, blk, 64);
        _tile_loadd(7, blk + 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      float* out = acc + m0 * ldacc + g * 64 + half * 32;
      _tile_stored(0, out, ldacc * 4);
      _tile_stored(1, out + 16, ldacc * 4);
      _tile_stored(2, out + 16 * ldacc, ldacc * 4);
      _tile_stored(3, out + 16 * ldacc + 16, ldacc * 4);
    }
  _tile_release();
}

// What both packed products (`tile_linear`, `dp_linear`) start from: x's M rows as xs [M, Kp] (contiguous, zeros
// past K; undefined when M is 0), the output y [.., N] (contiguous) and the bias (contiguous; undefined without one)
struct ProductIO {
  Tensor xs, y, bias;
  int64_t M;
};

static ProductIO product_io(const Tensor& x, const OptT& b, int64_t N, int64_t K, int64_t Kp) {
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  ProductIO io{Tensor(), at::empty(sizes, x.options().memory_format(at::MemoryFormat::Contiguous)),
               b.has_value() ? b->contiguous() : Tensor(), x.numel() / std::max<int64_t>(K, 1)};
  if (io.M > 0) {
    io.xs = x.reshape({io.M, K});
    if (K != Kp || !io.xs.is_contiguous()) io.xs = at::constant_pad_nd(io.xs, {0, Kp - K}).contiguous();
  }
  return io;
}

// `speclab::tile_linear`: x [.., K] bf16 by a `tile_pack`ed weight [N, K] (+ bias b [N] bf16) -> [.., N] bf16
static Tensor tile_linear(const Tensor& x, const Tensor& p, const OptT& b, int64_t N, int64_t K) {
  TORCH_CHECK(tile_ok, "speclab::tile_linear: no AMX tiles in this process (native.tile_module)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && p.scalar_type() == at::kBFloat16 && p.dim() == 6 &&
              x.device().is_cpu() && p.is_contiguous(), "speclab::tile_linear: bf16 rows by a tile_pack'ed weight");
  const int64_t G = p.size(0), KC = p.size(1), Kp = KC * 32;
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K && K > 0 && (K + 31) / 32 == KC && N > 0 && (N + 63) / 64 == G,
              "speclab::tile_linear: the inputs' width or N does not match the packed weight");
  TORCH_CHECK(!b.has_value() || (b->scalar_type() == at::kBFloat16 && b->numel() == N), "speclab::tile_linear: bias");
  const ProductIO io = product_io(x, b, N, K, Kp);
  const int64_t M = io.M;
  if (M == 0) return io.y;
  auto acc = at::empty({M, G * 64}, x.options().dtype(at::kFloat));
  const uint16_t* xp = (const uint16_t*)io.xs.data_ptr();
  const uint16_t* pp = (const uint16_t*)p.data_ptr();
  const at::BFloat16* bp = b.has_value() ? io.bias.data_ptr<at::BFloat16>() : nullptr;
  float* ap = acc.data_ptr<float>();
  at::BFloat16* yp = io.y.data_ptr<at::BFloat16>();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {  // blocks of outputs are independent: any split, same bits
    for (int64_t m0 = 0; m0 < M; m0 += 32) {  // 32 rows at a time: two row tiles sharing each weight tile
      if (M - m0 > 16)
        tile_rows2(xp, Kp, pp, KC, g0, g1, m0, std::min<int64_t>(16, M - m0 - 16), ap, G * 64);
      else
        tile_rows(xp, Kp, pp, KC, g0, g1, m0, M - m0, ap, G * 64);
    }
    const int64_t n0 = g0 * 64, n1 = std::min(N, g1 * 64);
    for (int64_t m = 0; m < M; ++m) {  // two loops, so that each vectorizes
      const float* a = ap + m * G * 64;
      at::BFloat16* out = yp + m * N;
      if (bp)
        for (int64_t n = n0; n < n1; ++n) out[n] = store<at::BFloat16>(a[n] + load(bp[n]));
      else
        for (int64_t n = n0; n < n1; ++n) out[n] = store<at::BFloat16>(a[n]);
    }
  });
  return io.y;
}

// ---- The dot product: bf16 x [M, K] times a weight [N, K] in AVX512-BF16, for `layers.linear` where there is no AMX -
// On the AMD EPYC (avx512_bf16, no AMX) oneDNN's product of a decode's few rows costs 2-3x what this one does on
// the zoo's weights (16 us for a 512 x 512 weight at one row, 6 us here: `scripts/linear_bench.py`), its per-call
// set-up again. This is oneDNN's arithmetic on that CPU without it: each output a sum of input pairs in
// input order by VDPBF16PS, 16 outputs to a register, in blocks of `dp_block` inputs, each block summed from zero and
// added to the total as oneDNN's kernel blocks them there (one row: blocks of 512; more rows: 512 up to 1024 inputs,
// else 1024; measured bit for bit against F.linear at 6 widths from 576 to 3072, 1-64 rows, 1 and 2 threads, on
// normal, sparse and SwiGLU-like inputs), then the bias added in fp32 and rounded once to bf16. So, as F.linear's,
// a row's outputs are the same in any call of 2 or more rows, and in a call of its own where K is at most 1024. The
// weight is packed once (`dp_pack`) as blocks of 64 outputs, the 64 outputs' two weights of each input pair side by
// side (256 bytes), the blocks' pairs in input order, so a thread streams its share front to back. `layers._packed`
// takes a weight's copy only where its products are F.linear's bits (checked at 1, 5, 16 and 32 rows).
static bool dp_ok = false;

static bool dp_init() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  dp_ok = ok;
  return ok;
}

// inputs per summed block, as oneDNN's kernel blocks a product of M rows by K inputs on this CPU
static int64_t dp_block(int64_t K, int64_t M) { return K <= 512 ? K : M == 1 || K <= 1024 ? 512 : 1024; }

// w [N, K] bf16 -> [ceil(N / 64), ceil(K / 2), 64, 2] bf16: per block of 64 outputs, per input pair, the 64 outputs'
// two weights; zeros past N, K
static Tensor dp_pack(const Tensor& w_) {
  TORCH_CHECK(w_.dim() == 2 && w_.scalar_type() == at::kBFloat16, "dp_pack: a 2-D bf16 weight");
  auto w = w_.contiguous();
  const int64_t N = w.size(0), K = w.size(1), G = (N + 63) / 64, KP = (K + 1) / 2;
  auto out = at::zeros({G, KP, 64, 2}, w.options());
  const uint16_t* src = (const uint16_t*)w.data_ptr();
  uint16_t* dst = (uint16_t*)out.data_ptr();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t k = 0; k < K; ++k) dst[(((n / 64) * KP + k / 2) * 64 + n % 64) * 2 + k % 2] = src[n * K + k];
  });
  return out;
}

// How far ahead of its reads a thread prefetches the packed weight, in bf16 elements (`set_dp_ahead`, for A/B runs):
// 16 KB. At 2 KB (until session 53) the lines arrived late: on the AMD EPYC (2 cores, the zoo target, a 200-token
// cache; in one process, alternating) a 1-row call took 0.56 ms against 0.52-0.53 at 8-24 KB and a 5-row one 0.86
// against 0.75-0.77. A prefetch only moves lines: the products' bits are the same at any distance.
static int64_t dp_ahead = 8192;
static int64_t set_dp_ahead(int64_t elems) {  // -> the distance before
  const int64_t before = dp_ahead;
  dp_ahead = std::max<int64_t>(elems, 0);
  return before;
}

// R rows [R, KP] (input pairs as 32-bit words) by one block of 64 outputs [KP, 64, 2] -> the fp32 sums acc [R, 64],
// the pairs summed in blocks of KB pairs (each from zero, then added to the total)
template <int R>
__attribute__((target("avx512f,avx512bf16"))) static void dp_rows(const uint32_t* x, int64_t ldx, const uint16_t* p,
                                                                  int64_t KP, int64_t KB, float* acc) {
  __m512 tot[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) tot[r][j] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < KP; k0 += KB) {
    __m512 a[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) a[r][j] = _mm512_setzero_ps();
    const int64_t k1 = std::min(KP, k0 + KB);
    for (int64_t kp = k0; kp < k1; ++kp) {
      const uint16_t* blk = p + kp * 128;
      for (int l = 0; l < 4; ++l) _mm_prefetch((const char*)(blk + dp_ahead + l * 32), _MM_HINT_T0);
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(blk), w1 = (__m512bh)_mm512_loadu_si512(blk + 32),
                     w2 = (__m512bh)_mm512_loadu_si512(blk + 64), w3 = (__m512bh)_mm512_loadu_si512(blk + 96);
      for (int r = 0; r < R; ++r) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x[r * ldx + kp]);
        a[r][0] = _mm512_dpbf16_ps(a[r][0], xb, w0);
        a[r][1] = _mm512_dpbf16_ps(a[r][1], xb, w1);
        a[r][2] = _mm512_dpbf16_ps(a[r][2], xb, w2);
        a[r][3] = _mm512_dpbf16_ps(a[r][3], xb, w3);
      }
    }
    for (int r = 0; r < R; ++r)  // the first block's sum is the total as it is (0 + s = s, bit for bit)
      for (int j = 0; j < 4; ++j) tot[r][j] = k0 == 0 ? a[r][j] : _mm512_add_ps(tot[r][j], a[r][j]);
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + r * 64 + j * 16, tot[r][j]);
}

// The lanes of a 16-wide step that hold elements, `left` of them still to go
static inline __mmask16 lanes(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

// 16 bf16 values widened to fp32 (exactly), and 16 fp32 values rounded to bf16 as `store` rounds them (to nearest even;
// NaN to the quiet NaN 0x7FC0), `m` the lanes that hold elements; the same IEEE operation per element as the scalar
// `load` / `store`, 16 at a time (`dp_round`, `attn_rows`, the raw-row paths)
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
AVX512 static inline __m512 load16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
AVX512 static inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
AVX512 static inline __m512 round16(__m512 v) {  // v rounded to bf16 and widened back (an op's bf16 output, read again)
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}
AVX512 static inline void store16(uint16_t* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits(v)));
}

// acc [n] fp32 (+ bias b [n] bf16) -> out [n] bf16, rounded as `store` rounds (to nearest even, NaN to a quiet NaN)
AVX512 static void dp_round(const float* acc, const uint16_t* b, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    __m512 v = _mm512_maskz_loadu_ps(m, acc + i);
    if (b) v = _mm512_add_ps(v, load16(b + i, m));
    store16(out + i, v, m);
  }
}

static void dp_run(const uint32_t* xp, int64_t M, const Tensor& p, const uint16_t* bp, int64_t N, int64_t K,
                   uint16_t* yp);

// `speclab::dp_linear`: x [.., K] bf16 by a `dp_pack`ed weight [N, K] (+ bias b [N] bf16) -> [.., N] bf16
static Tensor dp_linear(const Tensor& x, const Tensor& p, const OptT& b, int64_t N, int64_t K) {
  TORCH_CHECK(dp_ok, "speclab::dp_linear: no AVX512-BF16 on this CPU (native.product_module)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && p.scalar_type() == at::kBFloat16 && p.dim() == 4 &&
              x.device().is_cpu() && p.is_contiguous(), "speclab::dp_linear: bf16 rows by a dp_pack'ed weight");
  const int64_t G = p.size(0), KP = p.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K && K > 0 && (K + 1) / 2 == KP && N > 0 && (N + 63) / 64 == G &&
                  p.size(2) == 64 && p.size(3) == 2,
              "speclab::dp_linear: the inputs' width or N does not match the packed weight");
  TORCH_CHECK(!b.has_value() || (b->scalar_type() == at::kBFloat16 && b->numel() == N), "speclab::dp_linear: bias");
  const ProductIO io = product_io(x, b, N, K, KP * 2);
  if (io.M == 0) return io.y;
  dp_run((const uint32_t*)io.xs.data_ptr(), io.M, p, b.has_value() ? (const uint16_t*)io.bias.data_ptr() : nullptr, N,
         K, (uint16_t*)io.y.data_ptr());
  return io.y;
}

// `dp_linear`'s product of M rows xp [M, KP] (input pairs, contiguous) by the packed weight p into yp [M, N] (contiguous),
// the bias bp [N] (or none) added before the rounding
static void dp_run(const uint32_t* xp, int64_t M, const Tensor& p, const uint16_t* bp, int64_t N, int64_t K,
                   uint16_t* yp) {
  const int64_t G = p.size(0), KP = p.size(1);
  const uint16_t* pp = (const uint16_t*)p.data_ptr();
  const int64_t KB = dp_block(K, M) / 2;
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {  // blocks of outputs are independent: any split, same bits
    alignas(64) float acc[6 * 64];
    for (int64_t g = g0; g < g1; ++g) {
      const uint16_t* blk = pp + g * KP * 128;
      const int64_t n0 = g * 64, nn = std::min<int64_t>(64, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += 6) {  // 6 rows at a time (24 sums in registers), the block's weights from
        const int64_t R = std::min<int64_t>(6, M - m0);  // the cache after the first
        const uint32_t* xr = xp + m0 * KP;
        switch (R) {
          case 6: dp_rows<6>(xr, KP, blk, KP, KB, acc); break;
          case 5: dp_rows<5>(xr, KP, blk, KP, KB, acc); break;
          case 4: dp_rows<4>(xr, KP, blk, KP, KB, acc); break;
          case 3: dp_rows<3>(xr, KP, blk, KP, KB, acc); break;
          case 2: dp_rows<2>(xr, KP, blk, KP, KB, acc); break;
          default: dp_rows<1>(xr, KP, blk, KP, KB, acc);
        }
        for (int64_t r = 0; r < R; ++r) dp_round(acc + r * 64, bp ? bp + n0 : nullptr, yp + (m0 + r) * N + n0, nn);
      }
    }
  });
}

// ---- `kernels.reference.softmax_entropy` on the CPU, for the trace's round events ------------------------------------
// The reference is seven ATen passes over the logits (log_softmax, two maxima, exp, a product, a sum): 20-80 us for
// 1-9 rows of the zoo's 8,192 logits, most of a traced round's record time on the AMD EPYC. Here two passes a row:
// its max m, then e = exp(x - m) summed (s) and times (x - m) summed (t): logsumexp = m + log s, entropy = log s - t / s.
// Equal to the reference up to rounding (`tests/test_native.py`), not bit for bit: it sums in another order.
static bool se_ok = false;

static bool se_init() {
  static const bool ok = __builtin_cpu_supports("avx512f");
  se_ok = ok;
  return ok;
}

// e^x for x <= 0, to within a few units in the last place: 2^n e^r with n = round(x / ln 2), |r| <= ln 2 / 2 (ln 2
// in two parts), e^r by its Taylor polynomial to r^7 (relative error under 1e-8 there); x below -104: 0
__attribute__((target("avx512f"))) static inline __m512 exp_nonpos(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606820309417e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

__attribute__((target("avx512f"))) static void se_row(const float* x, int64_t V, float* lse, float* ent) {
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 k = lanes(V - i);
    vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, x + i));
  }
  const float m = _mm512_reduce_max_ps(vm);
  const __m512 M = _mm512_set1_ps(m), lo = _mm512_set1_ps(-104.0f);
  __m512 vs = _mm512_setzero_ps(), vt = _mm512_setzero_ps();
  for (int64_t i = 0; i < V; i += 16) {  // lanes past V read -inf: e = 0 and e * max(d, -104) = 0
    const __mmask16 k = lanes(V - i);
    const __m512 d = _mm512_sub_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, x + i), M);
    const __m512 e = exp_nonpos(d);
    vs = _mm512_add_ps(vs, e);
    vt = _mm512_fmadd_ps(e, _mm512_max_ps(d, lo), vt);
  }
  const float ls = std::log(_mm512_reduce_add_ps(vs));
  *lse = m + ls;
  *ent = ls - _mm512_reduce_add_ps(vt) / _mm512_reduce_add_ps(vs);
}

// (logsumexp [R], entropy [R]) of rows of logits [R, V], in fp32
static std::vector<Tensor> softmax_entropy(const Tensor& logits) {
  TORCH_CHECK(se_ok && logits.dim() == 2 && logits.device().is_cpu(), "softmax_entropy: [R, V] CPU rows, AVX512F");
  const Tensor x = logits.to(at::kFloat).contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  auto lse = at::empty({R}, x.options()), ent = at::empty({R}, x.options());
  const float* xp = x.data_ptr<float>();
  float *lp = lse.data_ptr<float>(), *ep = ent.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) se_row(xp + r * V, V, lp + r, ep + r);
  });
  return {lse, ent};
}

// A traced round's figures from its verification logits [R, V] (`engine.round_event`): `softmax_entropy`'s
// logsumexp and entropy of every row, each node's log-probability logits[rows[i], tokens[i]] - lse[rows[i]] and the
// log-probability of the target's token `bonus` at every row, in fp32 (the same subtractions as the ops, one call
// instead of seven). -> [node log-probs [n], entropy [R], the bonus token's log-probs [R]]
static std::vector<Tensor> round_stats(const Tensor& logits, const Tensor& rows_in, const Tensor& tokens_in,
                                       int64_t bonus) {
  const auto se = softmax_entropy(logits);
  const Tensor x = logits.to(at::kFloat).contiguous(), rows = rows_in.to(at::kLong).contiguous(),
               tokens = tokens_in.to(at::kLong).contiguous();
  const int64_t R = x.size(0), V = x.size(1), n = rows.numel();
  TORCH_CHECK(tokens.numel() == n && bonus >= 0 && bonus < V, "round_stats: a token per row index, a bonus in V");
  const float *xp = x.data_ptr<float>(), *lp = se[0].data_ptr<float>();
  const int64_t *rp = rows.data_ptr<int64_t>(), *tp = tokens.data_ptr<int64_t>();
  auto node = at::empty({n}, x.options()), extra = at::empty({R}, x.options());
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(rp[i] >= 0 && rp[i] < R && tp[i] >= 0 && tp[i] < V, "round_stats: row or token out of range");
    node.data_ptr<float>()[i] = xp[rp[i] * V + tp[i]] - lp[rp[i]];
  }
  for (int64_t r = 0; r < R; ++r) extra.data_ptr<float>()[r] = xp[r * V + bonus] - lp[r];
  return {node, se[1], extra};
}

// ---- Drawing tokens and testing a sampled chain: `speclab.core.sampling.sample` and `verify`'s chain test ----------
// Each is a handful of ATen ops on a row of the vocabulary (cumsum, searchsorted, clamp, gather, an index_add into
// zeros; a gather, two clamps, a division, a comparison, a cumulative product), a few microseconds of dispatch each:
// 0.2-0.4 ms of a sampled round of the zoo's EAGLE-3 on the AMD EPYC. Here one call each, bit for bit the ops': ATen's
// CPU cumsum of floats adds in double, rounding each prefix to float, and searchsorted(right=True) finds the first
// prefix above u times the last one (so does this loop; `tests/test_native.py` checks the bits).

// The index of one row of probabilities q [V] that inverse-CDF sampling takes at uniform u (clamped to V - 1)
static int64_t inverse_cdf(const float* q, int64_t V, float u, std::vector<float>& cdf) {
  double acc = 0;
  for (int64_t i = 0; i < V; ++i) {
    acc += q[i];
    cdf[i] = (float)acc;
  }
  const float v = u * cdf[V - 1];
  return std::min<int64_t>(std::upper_bound(cdf.begin(), cdf.begin() + V, v) - cdf.begin(), V - 1);
}

// Rows of probabilities q [R, V] (fp32), uniforms u [R] -> [the drawn index of each row, mapped through `to_target`
// [V] where given; q at it [R]; q's rows spread over `vocab` target ids by `to_target` (an empty tensor without it)]
static std::vector<Tensor> draw_rows(const Tensor& q_in, const Tensor& u_in, const OptT& to_target, int64_t vocab) {
  TORCH_CHECK(q_in.dim() == 2 && q_in.scalar_type() == at::kFloat && q_in.device().is_cpu(), "draw_rows: [R, V] fp32");
  const Tensor q = q_in.contiguous(), u = u_in.to(at::kFloat).contiguous().view({-1});
  const int64_t R = q.size(0), V = q.size(1);
  TORCH_CHECK(u.numel() == R && V > 0, "draw_rows: one uniform per row");
  auto idx = at::empty({R}, q.options().dtype(at::kLong));
  auto qx = at::empty({R}, q.options());
  const float* qp = q.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  std::vector<float> cdf(V);
  for (int64_t r = 0; r < R; ++r) {
    ip[r] = inverse_cdf(qp + r * V, V, u.data_ptr<float>()[r], cdf);
    qx.data_ptr<float>()[r] = qp[r * V + ip[r]];
  }
  if (!to_target.has_value()) return {idx, qx, Tensor()};
  const Tensor map = to_target->to(at::kLong).contiguous();
  TORCH_CHECK(map.numel() == V, "draw_rows: a target id per draft id");
  const int64_t* mp = map.data_ptr<int64_t>();
  auto spread = at::zeros({R, vocab}, q.options());
  float* sp = spread.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = 0; j < V; ++j) sp[r * vocab + mp[j]] += qp[r * V + j];
    ip[r] = mp[ip[r]];
  }
  return {idx, qx, spread};
}

// A sampled chain's tests: node i (token x[i], drawn from q [n, V]; the target's p [>= n, V], fp32) is accepted when
// u[i] < min(1, p[i, x] / max(q[i, x], 1e-30)) -> how many nodes pass before the first that does not
static int64_t chain_accept(const Tensor& p, const Tensor& q, const Tensor& x, const Tensor& u) {
  TORCH_CHECK(p.dim() == 2 && q.dim() == 2 && p.scalar_type() == at::kFloat && q.scalar_type() == at::kFloat &&
              p.size(1) == q.size(1) && p.size(0) >= q.size(0) && x.numel() == q.size(0) && u.numel() >= q.size(0),
              "chain_accept: p [>= n, V], q [n, V] fp32, x [n], u [n]");
  const Tensor xs = x.to(at::kLong).contiguous(), us = u.to(at::kFloat).contiguous();
  const auto P = p.accessor<float, 2>(), Q = q.accessor<float, 2>();
  for (int64_t i = 0; i < q.size(0); ++i) {
    const int64_t t = xs.data_ptr<int64_t>()[i];
    const float ratio = std::min(P[i][t] / std::max(Q[i][t], 1e-30f), 1.0f);
    if (!(us.data_ptr<float>()[i] < ratio)) return i;
  }
  return q.size(0);
}

// ---- Attention of a decode's few bf16 query rows over a cache, for `layers.attend` ------------------------------------
// torch's fused CPU kernel (`_scaled_dot_product_flash_attention_for_cpu`) costs 16 us for one query row over 20
// keys (the zoo target's 8 heads of 64 over 4 kv heads) and grows to 73 us over 200 keys and 184 over 500: at the
// zoo's contexts a third of the target's 1-row call (AMD EPYC). Here each query row alone: its scores in fp32
// (VDPBF16PS over pairs of dimensions) times the scale, plus the mask; their max m; p = exp(s - m) (`exp_nonpos`) and
// l = sum p; the output sum_j p_j v_j / l in fp32, rounded once to bf16. Not bit for bit the fused kernel (which
// sums in other orders and blocks): 30-40% of the bf16 outputs differ from its in the last bit, each within one bf16
// rounding of the exact (fp64) attention, as its are (`tests/test_native.py`). fp32, autograd, 4-D batches, more than
// `ATTN_ROWS` rows, head sizes that are not a multiple of 32 up to 256 and masks of other shapes take the fused
// kernel, so fp32 outputs are unchanged. Every row is the same instructions whatever the other rows are. The scores
// of 16 keys are reduced together (`reduce16`: the pairs `_mm512_reduce_add_ps` adds, in its order), and the queries
// that read the same keys (a kv head's heads, one sequence's rows) share each value's widening and sum side by side
// (`attn_outs`), each in slot order: the same bits as each row alone, 25-35% less time at 5-20 rows (Intel Xeon).
// Where this process may use AMX the dot products are tile products instead (`tile_dots_few`, `tile_dots`: each
// element of a tile its query's and key's alone, so a row's bits still do not depend on the others; 2,374 of 17.2 M
// outputs differ from the AVX path's, each within one bf16 rounding of fp64): 0.69-0.82x the time at 5-20 rows.
static bool attn_ok = false;
static bool attn_tiles = true;  // the dot products on AMX where there are tiles (`set_attn_tiles`: A/B runs)
static void set_attn_tiles(bool on) { attn_tiles = on; }
static constexpr int64_t ATTN_ROWS = 32;

static bool attn_init() {
  attn_ok = dp_init();  // the same instructions as the dot product
  tile_init();  // and its dot products on AMX where this process may use the tiles (decided here, once)
  return attn_ok;
}

// A stretch of keys and values `attn_rows` reads: n slots, slot t's key at k + t * ks (its value at v + t * vs)
struct KVRun {
  const uint16_t* k;
  int64_t ks;
  const uint16_t* v;
  int64_t vs;
  int64_t n;
};

// Layer i's keys and values of kv head g in a cache pair ([layers, kv_heads, slots, D] each), its first S slots
static KVRun cache_run(const Tensor& ck, const Tensor& cv, int64_t i, int64_t g, int64_t S) {
  return {(const uint16_t*)ck.data_ptr() + i * ck.stride(0) + g * ck.stride(1), ck.stride(2),
          (const uint16_t*)cv.data_ptr() + i * cv.stride(0) + g * cv.stride(1), cv.stride(2), S};
}

#define AVXBF __attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))

// The sums of 16 registers a[0..15] in one, lane t holding _mm512_reduce_add_ps(a[t]) bit for bit: the same pairs
// added in the same order (lanes i and i + 8, then i and i + 4, i and i + 2, i and i + 1; an addition commutes
// exactly), four levels of shuffles over all 16 at once instead of each register's own
AVX512 static inline __m512 reduce16(const __m512* a) {
  __m512 l1[8], l2[4], l3[2];
  for (int t = 0; t < 8; ++t)
    l1[t] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * t], a[2 * t + 1], 0x44),
                          _mm512_shuffle_f32x4(a[2 * t], a[2 * t + 1], 0xEE));
  for (int t = 0; t < 4; ++t)
    l2[t] = _mm512_add_ps(_mm512_shuffle_f32x4(l1[2 * t], l1[2 * t + 1], 0x88),
                          _mm512_shuffle_f32x4(l1[2 * t], l1[2 * t + 1], 0xDD));
  for (int t = 0; t < 2; ++t)
    l3[t] = _mm512_add_ps(_mm512_shuffle_ps(l2[2 * t], l2[2 * t + 1], 0x44),
                          _mm512_shuffle_ps(l2[2 * t], l2[2 * t + 1], 0xEE));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(l3[0], l3[1], 0x88), _mm512_shuffle_ps(l3[0], l3[1], 0xDD));
  // lane 4q + j holds register 4j + q's sum: back to register order
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

// The dot products of one query row q [D] with the keys of `nruns` runs one after another (slot j the j-th of them: a
// concatenation read where each part lies): sbuf[j] = q . k_j, the VDPBF16PS sums over pairs of dimensions reduced as
// _mm512_reduce_add_ps reduces (16 keys at a time by `reduce16`, a run's last ones alone)
AVXBF static void attn_dots(const uint16_t* q, const KVRun* runs, int nruns, int64_t D, float* sbuf) {
  const int64_t C = D / 32;  // 32 dimensions (16 pairs) a register
  __m512bh qv[8];
  for (int64_t c = 0; c < C; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  int64_t j = 0;
  for (int u = 0; u < nruns; ++u) {
    const KVRun& r = runs[u];
    int64_t t = 0;
    for (; t + 16 <= r.n; t += 16, j += 16) {  // 16 keys at a time: their dot products, then one reduction
      __m512 acc[16];
      for (int e = 0; e < 16; ++e) {
        const uint16_t* kj = r.k + (t + e) * r.ks;
        acc[e] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(kj));
        for (int64_t c = 1; c < C; ++c)
          acc[e] = _mm512_dpbf16_ps(acc[e], qv[c], (__m512bh)_mm512_loadu_si512(kj + 32 * c));
      }
      _mm512_storeu_ps(sbuf + j, reduce16(acc));
    }
    for (; t < r.n; ++t, ++j) {  // the run's last keys one by one
      const uint16_t* kj = r.k + t * r.ks;
      __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(kj));
      for (int64_t c = 1; c < C; ++c) acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512(kj + 32 * c));
      sbuf[j] = _mm512_reduce_add_ps(acc);
    }
  }
}

// A query row's scores from its S dot products in sbuf (`attn_dots`, or the tiles' `tile_dots`): sbuf[j] = dot_j *
// scale, plus the mask row (at most one of: `madd` fp32 or `madd16` bf16, additive; `seen` bool; none: every key) ->
// their maximum (a NaN score ignored, as std::max(m, s) does)
AVX512 static float attn_scores(int64_t S, const float* madd, const uint16_t* madd16, const bool* seen, float scale,
                                float* sbuf) {
  const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
  __m512 M = ninf;
  for (int64_t j = 0; j < S; j += 16) {  // times the scale, plus the mask (each the scalar operation, 16 at a time)
    const __mmask16 msk = lanes(S - j);
    __m512 s = _mm512_mul_ps(_mm512_maskz_loadu_ps(msk, sbuf + j), sc);
    if (madd) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(msk, madd + j));  // an unseen key: -inf, as masked_fill's
    if (madd16) s = _mm512_add_ps(s, load16(madd16 + j, msk));  // bf16 widened exactly, as a copy to fp32 would
    if (seen) s = _mm512_mask_add_ps(s, _mm_mask_cmpeq_epi8_mask(msk, _mm_maskz_loadu_epi8(msk, seen + j),
                                                                   _mm_setzero_si128()), s, ninf);
    _mm512_mask_storeu_ps(sbuf + j, msk, s);
    M = _mm512_mask_max_ps(M, msk, s, M);  // a NaN score: M kept (the second operand), as std::max(M, s)
  }
  return _mm512_reduce_max_ps(M);
}

// A query row's probabilities over its S slots: sbuf = exp(s - m) (`exp_nonpos`) of its scores (`attn_scores`; the
// dot products by `attn_dots` unless `dotted`: already in sb) -> 1 / l, l = sum p (16 lanes, then reduced)
AVXBF static float attn_probs(const uint16_t* q, const KVRun* runs, int nruns, int64_t S, int64_t D, const float* madd,
                              const uint16_t* madd16, const bool* seen, float scale, float* sb, bool dotted) {
  if (!dotted) attn_dots(q, runs, nruns, D, sb);
  const __m512 M = _mm512_set1_ps(attn_scores(S, madd, madd16, seen, scale, sb));
  __m512 vl = _mm512_setzero_ps();
  for (int64_t j = 0; j < S; j += 16) {
    const __mmask16 msk = lanes(S - j);
    const __m512 e = exp_nonpos(_mm512_sub_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), msk, sb + j), M));
    _mm512_mask_storeu_ps(sb + j, msk, e);
    vl = _mm512_add_ps(vl, e);
  }
  return 1.0f / _mm512_reduce_add_ps(vl);
}

// The outputs of NB query rows from their probabilities p[a] [S]: sum_j p_j v_j (each row's sum in slot order, one
// fused multiply-add a slot and 16 dimensions) times its 1 / l, rounded once to bf16 -> out[a] [D]. The values: the
// runs' bf16 rows widened as they are read (`wide` null), or their fp32 copy `wide` [S, D] (widened once for every
// row of a group); the same values, so the same bits. DC = D / 16 (0: D at run time, the sums in memory)
template <int NB, int DC>
AVX512 static void attn_out(const float* const* p, const float* inv, const KVRun* runs, int nruns, const float* wide,
                            int64_t D, uint16_t* const* out) {
  constexpr int RC = DC > 0 ? DC : 16;
  const int64_t dc = DC > 0 ? DC : D / 16;
  __m512 o[NB][RC];
  for (int a = 0; a < NB; ++a)
    for (int64_t c = 0; c < dc; ++c) o[a][c] = _mm512_setzero_ps();
  for (int64_t u = 0, j = 0; u < nruns; ++u)
    for (int64_t t = 0; t < runs[u].n; ++t, ++j) {
      const uint16_t* vj = runs[u].v + t * runs[u].vs;
      for (int64_t c = 0; c < dc; ++c) {
        const __m512 x = wide ? _mm512_loadu_ps(wide + j * D + 16 * c)
                              : _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(vj + 16 * c))), 16));
        for (int a = 0; a < NB; ++a) o[a][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[a][j]), x, o[a][c]);
      }
    }
  for (int a = 0; a < NB; ++a) {
    alignas(64) float res[256];
    const __m512 iv = _mm512_set1_ps(inv[a]);
    for (int64_t c = 0; c < dc; ++c) _mm512_store_ps(res + 16 * c, _mm512_mul_ps(o[a][c], iv));
    dp_round(res, nullptr, out[a], D);
  }
}

// `attn_out` for Q rows, NB at a time (as many as their sums and a slot's values fit the registers)
template <int DC>
static void attn_outs(const float* const* p, const float* inv, int64_t Q, const KVRun* runs, int nruns,
                      const float* wide, int64_t D, uint16_t* const* out) {
  constexpr int NB = DC == 0 ? 1 : DC <= 2 ? 8 : DC <= 4 ? 4 : DC <= 8 ? 2 : 1;
  int64_t a = 0;
  for (; a + NB <= Q; a += NB) attn_out<NB, DC>(p + a, inv + a, runs, nruns, wide, D, out + a);
  for (; a < Q; ++a) attn_out<1, DC>(p + a, inv + a, runs, nruns, wide, D, out + a);
}

// Row r of a mask [rows, S] as `attn_scores` reads it, in the dtype it came in (at most one pointer set; an undefined
// mask: none, every key seen)
struct MaskRow {
  const float* add = nullptr;
  const uint16_t* add16 = nullptr;
  const bool* seen = nullptr;
};
static MaskRow mask_row(const Tensor& m, int64_t r, int64_t S) {
  MaskRow row;
  if (!m.defined()) return row;
  if (m.scalar_type() == at::kFloat) row.add = m.data_ptr<float>() + r * S;
  if (m.scalar_type() == at::kBFloat16) row.add16 = (const uint16_t*)m.data_ptr() + r * S;
  if (m.scalar_type() == at::kBool) row.seen = m.data_ptr<bool>() + r * S;
  return row;
}

// 16 registers of 16 32-bit elements transposed: r[k] lane p -> r[p] lane k
AVX512 static inline void transpose16(__m512i* r) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // b[c + 4 i]'s 128-bit lane L holds elements 4 L + c of rows 4 i .. 4 i + 3
    const __m512i x0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44),
                  y1 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// The keys of the runs (S slots) as AMX B tiles: per block of 16 slots and 32 dimensions, 16 rows (pairs of
// dimensions) of 16 slots' pairs -> kt [ceil(S / 16)][D / 32][16][32] bf16 (zeros past S)
AVX512 static void key_tiles(const KVRun* runs, int nruns, int64_t S, int64_t D, uint16_t* kt) {
  const int64_t C = D / 32;
  const uint16_t* kp[16];
  for (int64_t j0 = 0, u = 0, t = 0; j0 < S; j0 += 16) {
    for (int e = 0; e < 16; ++e) {
      if (j0 + e < S) {
        while (t == runs[u].n) ++u, t = 0;
        kp[e] = runs[u].k + t * runs[u].ks;
        ++t;
      } else {
        kp[e] = nullptr;
      }
    }
    for (int64_t c = 0; c < C; ++c, kt += 512) {
      __m512i r[16];
      for (int e = 0; e < 16; ++e) r[e] = kp[e] ? _mm512_loadu_si512(kp[e] + 32 * c) : _mm512_setzero_si512();
      transpose16(r);
      for (int e = 0; e < 16; ++e) _mm512_storeu_si512(kt + 32 * e, r[e]);
    }
  }
}

// The dot products of Q query rows (q[a] [D] bf16) with the S keys of `key_tiles`, on AMX: up to 16 queries a tile
// (A: the queries' 32 dimensions, B: a block's keys, C: their fp32 sums), sums over D / 32 products -> sb[a * ld + j]
// (the raw products, as `attn_dots` leaves them). A query's sums are its own: each element of C is
// its query row's and its key's alone, whatever else the tile holds
__attribute__((target("amx-tile,amx-bf16,avx512f"))) static void tile_dots(const uint16_t* const* q, int64_t Q,
                                                                         const uint16_t* kt, int64_t S, int64_t D,
                                                                         uint16_t* qbuf, float* sb, int64_t ld) {
  const int64_t C = D / 32, blocks = (S + 15) / 16;
  for (int64_t a = 0; a < Q; ++a) std::memcpy(qbuf + a * D, q[a], D * 2);
  for (int64_t a0 = 0; a0 < Q; a0 += 16) {
    const int64_t qn = std::min<int64_t>(16, Q - a0);
    TileConfig cfg;
    cfg.rows[0] = cfg.rows[1] = (uint8_t)qn, cfg.colsb[0] = cfg.colsb[1] = 64;
    cfg.rows[2] = 16, cfg.colsb[2] = 64;
    _tile_loadconfig(&cfg);
    for (int64_t b = 0; b < blocks; ++b) {
      _tile_zero(0);
      for (int64_t c = 0; c < C; ++c) {
        _tile_loadd(1, qbuf + a0 * D + 32 * c, D * 2);
        _tile_loadd(2, kt + (b * C + c) * 512, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, sb + a0 * ld + 16 * b, ld * 4);
    }
  }
  _tile_release();
}

// `tile_dots` for a few queries (Q <= 4) with the keys as the A tile, read where they lie (no transposition): C [16
// keys x Q] = keys . queries (B: the queries' pairs of dimensions, [16 pairs][Q]), each element the same sums in the
// same order as `tile_dots`' (the products commute exactly), so the same bits -> sb[a * ld + j]
__attribute__((target("amx-tile,amx-bf16"))) static void tile_dots_few(const uint16_t* const* q, int64_t Q,
                                                                     const KVRun* runs, int nruns, int64_t S,
                                                                     int64_t D, uint16_t* scratch, float* sb,
                                                                     int64_t ld) {
  const int64_t C = D / 32;
  uint32_t qt[8][16][4];  // per 32 dimensions: [pair][query]
  for (int64_t c = 0; c < C; ++c)
    for (int p = 0; p < 16; ++p)
      for (int64_t a = 0; a < Q; ++a) std::memcpy(&qt[c][p][a], q[a] + 32 * c + 2 * p, 4);
  TileConfig cfg;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[2] = 16;
  cfg.colsb[0] = cfg.colsb[2] = (uint16_t)(Q * 4), cfg.colsb[1] = 64;
  _tile_loadconfig(&cfg);
  float ct[16][4];
  for (int64_t j0 = 0, u = 0, t = 0; j0 < S; j0 += 16) {
    while (t == runs[u].n) ++u, t = 0;
    const uint16_t* kp;
    int64_t stride;
    if (runs[u].n - t >= 16) {  // 16 keys of one run: the A tile straight from the cache
      kp = runs[u].k + t * runs[u].ks, stride = runs[u].ks * 2;
      t += 16;
    } else {  // across runs, or the last keys: copied (zeros past S)
      for (int e = 0; e < 16; ++e) {
        if (j0 + e < S) {
          while (t == runs[u].n) ++u, t = 0;
          std::memcpy(scratch + e * D, runs[u].k + t * runs[u].ks, D * 2);
          ++t;
        } else {
          std::memset(scratch + e * D, 0, D * 2);
        }
      }
      kp = scratch, stride = D * 2;
    }
    _tile_zero(0);
    for (int64_t c = 0; c < C; ++c) {
      _tile_loadd(1, kp + 32 * c, stride);
      _tile_loadd(2, &qt[c][0][0], 16);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, &ct[0][0], 16);
    for (int64_t a = 0; a < Q; ++a)
      for (int e = 0; e < 16; ++e) sb[a * ld + j0 + e] = ct[e][a];
  }
  _tile_release();
}

// Whether two rows read the same runs (the rows of one sequence)
static bool same_runs(const KVRun* a, int na, const KVRun* b, int nb) {
  if (na != nb) return false;
  for (int u = 0; u < na; ++u)
    if (a[u].k != b[u].k || a[u].ks != b[u].ks || a[u].v != b[u].v || a[u].vs != b[u].vs || a[u].n != b[u].n)
      return false;
  return true;
}

// A run's values [n, D] bf16 widened to fp32 rows of `wide` (exactly, as `attn_out` widens them)
AVX512 static void widen_runs(const KVRun* runs, int nruns, int64_t D, float* wide) {
  for (int u = 0; u < nruns; ++u)
    for (int64_t t = 0; t < runs[u].n; ++t, wide += D)
      for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(wide + c, load16(runs[u].v + t * runs[u].vs + c, 0xFFFF));
}

// `attn_rows`' buffers, one set a thread
struct AttnScratch {
  std::vector<float> sbuf, wide, inv;
  std::vector<uint16_t> kt, qbuf;
  std::vector<const uint16_t*> qs;
  std::vector<const float*> ps;
  std::vector<uint16_t*> os;
};
static thread_local AttnScratch attn_scratch;

// The attention rows of `rows` queries (query i of head h at q + h * qh + i * qr) over what `keys(i, g, runs,
// mask_row)` gives query row i with kv head g (its runs, at most 3, and mask row; returns how many runs), at most S
// slots -> out [rows, H, D]. Work goes by kv head and block of rows; the rows of a block that read the same runs (one
// sequence's) and the heads of the kv head are a group: each query's probabilities by `attn_probs`, then their outputs
// side by side (`attn_outs`), the values widened once for the group where it has more than two queries. A query's
// result is the same instructions on the same numbers whatever the other queries are: any split, the same bits
template <typename Keys>
static void attn_rows(const uint16_t* q, int64_t qh, int64_t qr, int64_t H, int64_t G, int64_t rows, int64_t S,
                      int64_t D, double scale, uint16_t* out, Keys keys) {
  constexpr int64_t RB = 8;  // rows a block
  const int64_t KV = H / G, blocks = (rows + RB - 1) / RB, ld = S + 16;
  const bool tiles = attn_tiles && tile_ok;
  at::parallel_for(0, KV * blocks, 1, [&](int64_t a, int64_t b) {
    AttnScratch& w = attn_scratch;  // this thread's, kept from call to call (six layers a forward, no allocations)
    auto &sbuf = w.sbuf, &wide = w.wide, &inv = w.inv;
    auto &kt = w.kt, &qbuf = w.qbuf;
    auto& qs = w.qs;
    auto& ps = w.ps;
    auto& os = w.os;
    if ((int64_t)sbuf.size() < RB * G * ld) sbuf.resize(RB * G * ld);
    if ((int64_t)qbuf.size() < RB * G * D) qbuf.resize(RB * G * D);
    if ((int64_t)qs.size() < RB * G) qs.resize(RB * G), ps.resize(RB * G), inv.resize(RB * G), os.resize(RB * G);
    KVRun runs[RB][3];
    MaskRow mr[RB];
    int nr[RB];
    for (int64_t t = a; t < b; ++t) {
      const int64_t g = t / blocks, i0 = t % blocks * RB, i1 = std::min(rows, i0 + RB);
      for (int64_t i = i0; i < i1; ++i) nr[i - i0] = keys(i, g, runs[i - i0], mr[i - i0]);
      for (int64_t i = i0, e; i < i1; i = e) {
        for (e = i + 1; e < i1 && same_runs(runs[i - i0], nr[i - i0], runs[e - i0], nr[e - i0]); ++e) {
        }
        const KVRun* rs = runs[i - i0];
        const int n = nr[i - i0];
        int64_t Sg = 0, Q = 0;
        for (int u = 0; u < n; ++u) Sg += rs[u].n;
        for (int64_t r = i; r < e; ++r)
          for (int64_t h = g * G; h < (g + 1) * G; ++h, ++Q) qs[Q] = q + h * qh + r * qr;
        if (tiles && Q <= 4) {  // every query's dot products on AMX: a few with the keys where they lie
          if ((int64_t)kt.size() < 16 * D) kt.resize(16 * D);
          tile_dots_few(qs.data(), Q, rs, n, Sg, D, kt.data(), sbuf.data(), ld);
        } else if (tiles) {  // more with the keys transposed once for all of them
          if ((int64_t)kt.size() < (Sg + 15) / 16 * D * 16) kt.resize((Sg + 15) / 16 * D * 16);
          key_tiles(rs, n, Sg, D, kt.data());
          tile_dots(qs.data(), Q, kt.data(), Sg, D, qbuf.data(), sbuf.data(), ld);
        }
        Q = 0;
        for (int64_t r = i; r < e; ++r)
          for (int64_t h = g * G; h < (g + 1) * G; ++h, ++Q) {
            float* sb = sbuf.data() + Q * ld;
            const MaskRow& m = mr[r - i0];
            inv[Q] = attn_probs(qs[Q], rs, n, Sg, D, m.add, m.add16, m.seen, (float)scale, sb, tiles);
            ps[Q] = sb;
            os[Q] = out + (r * H + h) * D;
          }
        const float* w = nullptr;
        if (Q > 2) {
          if ((int64_t)wide.size() < Sg * D) wide.resize(Sg * D);
          widen_runs(rs, n, D, wide.data());
          w = wide.data();
        }
        if (D == 32)
          attn_outs<2>(ps.data(), inv.data(), Q, rs, n, w, D, os.data());
        else if (D == 64)
          attn_outs<4>(ps.data(), inv.data(), Q, rs, n, w, D, os.data());
        else if (D == 128)
          attn_outs<8>(ps.data(), inv.data(), Q, rs, n, w, D, os.data());
        else
          attn_outs<0>(ps.data(), inv.data(), Q, rs, n, w, D, os.data());
      }
    }
  });
}

// The same over S keys and values (those of kv head g at k + g * kh, slot j j * ks on; v alike) under the mask m
// (undefined: none). `attention`'s loop, and the raw-row paths' (`decode_layers`, `decode_layer_rows`)
static void attn_rows(const uint16_t* q, int64_t qh, int64_t qr, int64_t H, int64_t G, int64_t rows, const uint16_t* k,
                      int64_t kh, int64_t ks, const uint16_t* v, int64_t vh, int64_t vs, int64_t S, int64_t D,
                      const Tensor& m, double scale, uint16_t* out) {
  attn_rows(q, qh, qr, H, G, rows, S, D, scale, out, [&](int64_t i, int64_t g, KVRun* runs, MaskRow& mr) {
    runs[0] = {k + g * kh, ks, v + g * vh, vs, S};
    mr = mask_row(m, i, S);
    return 1;
  });
}

// `layers.attend` on a CPU outside autograd: queries q [.., heads, n, D] over keys and values [.., kv_heads, S, D]
// under `mask` ([.., n, S] bool, True = seen, or additive; None: every key). bf16 3-D calls of up to `ATTN_ROWS`
// rows by `attn_rows`; everything else torch's fused kernel, as `layers.attend` calls it
static Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const OptT& mask, double scale) {
  const bool gqa = q.size(-3) != k.size(-3);
  const bool fast = attn_ok && q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.device().is_cpu() &&
                    q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                    v.scalar_type() == at::kBFloat16 && q.size(1) <= ATTN_ROWS && q.size(2) % 32 == 0 &&
                    q.size(2) <= 256 && k.size(2) == q.size(2) && v.size(2) == q.size(2) && k.size(1) == v.size(1) &&
                    k.size(0) == v.size(0) && q.size(0) % k.size(0) == 0 && k.size(1) > 0 && k.stride(2) == 1 &&
                    v.stride(2) == 1 && q.stride(2) == 1 &&
                    (!mask.has_value() || (mask->dim() == 2 && mask->size(0) == q.size(1) &&
                                           mask->size(1) == k.size(1) && (mask->scalar_type() == at::kBool ||
                                           mask->scalar_type() == at::kBFloat16 || mask->scalar_type() == at::kFloat)));
  if (!fast) {
    if (q.dim() == 3)
      return at::scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask, 0.0, false, scale,
                                              gqa).squeeze(0);
    return at::scaled_dot_product_attention(q, k, v, mask, 0.0, false, scale, gqa);
  }
  const int64_t H = q.size(0), n = q.size(1), D = q.size(2), KV = k.size(0), S = k.size(1), G = H / KV;
  // q read where it lies (a rope output transposed to [heads, n, D]: no copy), the mask in its own dtype (no fp32
  // copy in every layer), and the output laid out [n, heads, D], returned as its [heads, n, D] view: the caller's
  // transpose back to rows and flatten (`finish`) is then a view, not a copy
  const Tensor m = mask.has_value() ? mask->contiguous() : Tensor();
  auto out = at::empty({n, H, D}, q.options());
  const uint16_t* qp = (const uint16_t*)q.data_ptr();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const uint16_t* kp = (const uint16_t*)k.data_ptr();
  const uint16_t* vp = (const uint16_t*)v.data_ptr();
  uint16_t* op = (uint16_t*)out.data_ptr();
  attn_rows(qp, qs0, qs1, H, G, n, kp, k.stride(0), k.stride(1), vp, v.stride(0), v.stride(1), S, D, m, scale, op);
  return out.transpose(0, 1);
}

// ---- int8 drafter weights: W8A8 dot products (AVX512-VNNI) -------------------------------------------------------
// A drafter's weight as int8 values q [N, K] times a power-of-two scale per output (`layers.quantize_int8`; the bf16
// weight holds q x scale exactly), packed as [ceil(N / 64), ceil(K / 4), 64, 4]: per block of 64 outputs, per
// quadruple of inputs, the 64 outputs' four values (zeros past N, K). `meta` [2, N] fp32: the scales and the sums of
// each output's q. A row x is quantized to u = round(x / s) + 128 (s = max |x| / 127), VPDPBUSD sums u x q by fours
// in int32, and y = (sum - 128 sum(q)) s scale: half the bytes of the bf16 weight read, exact integer sums.
#define AVXVNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
static int64_t int8_max_rows = 8;  // `layers.INT8_ROWS` (`set_int8_rows`): more rows take F.linear by the bf16 weight
static void set_int8_rows(int64_t rows) { int8_max_rows = rows; }
static bool vnni_ok() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return ok;
}

// R rows [R, KQ] (four u8 inputs as a 32-bit word) by J x 16 of one block's 64 outputs (from output j0 on; the
// block [KQ, 64, 4]) -> the int32 sums acc [R, 64] at those outputs
template <int R, int J>
AVXVNNI static void i8_rows(const uint32_t* x, int64_t ldx, const int8_t* p, int64_t KQ, int j0, int32_t* acc) {
  __m512i a[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) a[r][j] = _mm512_setzero_si512();
  for (int64_t kq = 0; kq < KQ; ++kq) {
    const int8_t* blk = p + kq * 256 + j0 * 4;
    _mm_prefetch((const char*)(blk + 16384), _MM_HINT_T0);
    __m512i w[J];
    for (int j = 0; j < J; ++j) w[j] = _mm512_loadu_si512(blk + j * 64);
    for (int r = 0; r < R; ++r) {
      const __m512i xb = _mm512_set1_epi32((int)x[r * ldx + kq]);
      for (int j = 0; j < J; ++j) a[r][j] = _mm512_dpbusd_epi32(a[r][j], xb, w[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) _mm512_storeu_si512(acc + r * 64 + j0 + j * 16, a[r][j]);
}

// a block's rows r0.. (R of them, at most 8) -> acc: up to four rows by all 64 outputs at once, five to eight by
// two halves of 32 (the registers: R x J sums, J weights and the row's input)
static void i8_block(const uint32_t* x, int64_t ldx, const int8_t* p, int64_t KQ, int64_t R, int32_t* acc) {
  switch (R) {
    case 1: return i8_rows<1, 4>(x, ldx, p, KQ, 0, acc);
    case 2: return i8_rows<2, 4>(x, ldx, p, KQ, 0, acc);
    case 3: return i8_rows<3, 4>(x, ldx, p, KQ, 0, acc);
    case 4: return i8_rows<4, 4>(x, ldx, p, KQ, 0, acc);
    case 5: i8_rows<5, 2>(x, ldx, p, KQ, 0, acc); return i8_rows<5, 2>(x, ldx, p, KQ, 32, acc);
    case 6: i8_rows<6, 2>(x, ldx, p, KQ, 0, acc); return i8_rows<6, 2>(x, ldx, p, KQ, 32, acc);
    case 7: i8_rows<7, 2>(x, ldx, p, KQ, 0, acc); return i8_rows<7, 2>(x, ldx, p, KQ, 32, acc);
    default: i8_rows<8, 2>(x, ldx, p, KQ, 0, acc); return i8_rows<8, 2>(x, ldx, p, KQ, 32, acc);
  }
}

// row r of x [M, K] bf16 -> u8 inputs u [KQ * 4] (zero point 128; 128 past K) at the row's scale, which it returns:
// max |x| / 127 (1 for a row of zeros or non-finite values), x times 127 / max rounded to nearest even
AVX512 static float i8_quantize(const uint16_t* x, int64_t K, uint8_t* u) {
  __m512 top = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) top = _mm512_max_ps(top, _mm512_abs_ps(load16(x + k, lanes(K - k))));
  const float t = _mm512_reduce_max_ps(top);
  const bool ok = t > 0.f && std::isfinite(t);
  const __m512 inv = _mm512_set1_ps(ok ? 127.f / t : 1.f), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  const __m512i zero = _mm512_set1_epi32(128);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = lanes(K - k);
    const __m512 q = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(load16(x + k, m), inv), lo), hi);
    _mm_mask_storeu_epi8(u + k, m, _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(q), zero)));
  }
  return ok ? t / 127.f : 1.f;
}

// one row's 64 (or fewer, `n` of them) int32 sums -> bf16 outputs: (sum - 128 sum(q)) x s x scale (+ bias)
AVX512 static void i8_outputs(const int32_t* acc, const float* qsum, const float* scale, const float* bias, float s,
                              int64_t n, uint16_t* y) {
  const __m512 vs = _mm512_set1_ps(s), zp = _mm512_set1_ps(128.f);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = lanes(n - j);
    const __m512 sum = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, acc + j));
    __m512 v = _mm512_mul_ps(_mm512_fnmadd_ps(zp, _mm512_maskz_loadu_ps(m, qsum + j), sum),
                             _mm512_mul_ps(vs, _mm512_maskz_loadu_ps(m, scale + j)));
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + j));
    store16(y + j, v, m);
  }
}

static Tensor i8_linear(const Tensor& x_, const Tensor& p, const Tensor& meta, const OptT& b, int64_t N, int64_t K) {
  TORCH_CHECK(vnni_ok() && x_.scalar_type() == at::kBFloat16 && p.scalar_type() == at::kChar && p.dim() == 4 &&
                  p.size(2) == 64 && p.size(3) == 4 && p.size(0) == (N + 63) / 64 && p.size(1) == (K + 3) / 4 &&
                  p.is_contiguous() && meta.scalar_type() == at::kFloat && meta.dim() == 2 && meta.size(1) == N &&
                  meta.is_contiguous() && x_.size(-1) == K,
              "speclab::i8_linear: bf16 rows by an int8-packed weight");
  const int64_t M = x_.numel() / std::max<int64_t>(K, 1), G = p.size(0), KQ = p.size(1);
  const Tensor x = x_.reshape({M, K}).contiguous();
  const uint16_t* xp = (const uint16_t*)x.data_ptr();
  std::vector<uint8_t> xu(M * KQ * 4, 128);
  std::vector<float> sx(M);
  for (int64_t r = 0; r < M; ++r) sx[r] = i8_quantize(xp + r * K, K, xu.data() + r * KQ * 4);
  auto shape = x_.sizes().vec();
  shape.back() = N;
  auto y = at::empty(shape, x_.options());
  uint16_t* yp = (uint16_t*)y.data_ptr();
  const float *scale = meta.data_ptr<float>(), *qsum = scale + N;
  const Tensor bias = b.has_value() ? b->to(at::kFloat).contiguous() : Tensor();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const int8_t* pp = p.data_ptr<int8_t>();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) int32_t acc[8 * 64];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * 64, n = std::min<int64_t>(64, N - n0);
      for (int64_t r0 = 0; r0 < M; r0 += 8) {
        const int64_t R = std::min<int64_t>(8, M - r0);
        i8_block((const uint32_t*)(xu.data() + r0 * KQ * 4), KQ, pp + g * KQ * 256, KQ, R, acc);
        for (int64_t r = 0; r < R; ++r)
          i8_outputs(acc + r * 64, qsum + n0, scale + n0, bp ? bp + n0 : nullptr, sx[r0 + r], n,
                     yp + (r0 + r) * N + n0);
      }
    }
  });
  return y;
}

// The native product this process multiplies bf16 by (`layers.linear`): "tiles" (AMX), else "dp" (AVX512-BF16),
// else "" (none: oneDNN's prepacked copies)
static std::string product_init() { return tile_init() ? "tiles" : dp_init() ? "dp" : ""; }

// The weight packed for this process's native product (`product_init`)
static Tensor native_pack(const Tensor& w) {
  TORCH_CHECK(tile_ok || dp_ok, "native_pack: no native product in this process");
  return tile_ok ? tile_pack(w) : dp_pack(w);
}

TORCH_LIBRARY(speclab, m) {
  m.def("tile_linear(Tensor x, Tensor packed, Tensor? b, int n, int k) -> Tensor");
  m.def("dp_linear(Tensor x, Tensor packed, Tensor? b, int n, int k) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
  m.def("i8_linear(Tensor x, Tensor packed, Tensor meta, Tensor? b, int n, int k) -> Tensor");
}
TORCH_LIBRARY_IMPL(speclab, CPU, m) {
  m.impl("tile_linear", &tile_linear);
  m.impl("dp_linear", &dp_linear);
  m.impl("attention", &attention);
  m.impl("i8_linear", &i8_linear);
}

// `layers.linear` (`layers.by_packed`): the product by Python's packed copy of the weight where it has one (the
// tile product's, 6-D, or the dot product's, 4-D, up to `tile_max_rows` rows; oneDNN's prepacked layout up to
// `packed_max_rows`: `packed`, or `wide` where `packed` is a native product's), else F.linear
static Tensor linear(const Tensor& x, const Tensor& w, const OptT& b, const OptT& packed, const OptT& wide) {
  if (packed.has_value() && packed->scalar_type() == at::kChar) {  // a drafter's int8 weight (`i8_linear`)
    if (x.numel() > int8_max_rows * x.size(-1)) return at::linear(x, w, b);
    using Op = Tensor(const Tensor&, const Tensor&, const Tensor&, const OptT&, int64_t, int64_t);
    static auto i8 = c10::Dispatcher::singleton().findSchemaOrThrow("speclab::i8_linear", "").typed<Op>();
    return i8.call(x, *packed, *wide, b, w.size(0), w.size(1));
  }
  OptT p = packed;
  if (p.has_value() && (p->dim() == 6 || p->dim() == 4)) {  // through the dispatcher, as torch's ops: the profiler
    if (x.numel() <= tile_max_rows * x.size(-1)) {         // sees them
      using Op = Tensor(const Tensor&, const Tensor&, const OptT&, int64_t, int64_t);
      static auto tiles = c10::Dispatcher::singleton().findSchemaOrThrow("speclab::tile_linear", "").typed<Op>();
      static auto dp = c10::Dispatcher::singleton().findSchemaOrThrow("speclab::dp_linear", "").typed<Op>();
      return (p->dim() == 6 ? tiles : dp).call(x, *p, b, w.size(0), w.size(1));
    }
    p = wide;
  }
  if (p.has_value() && x.numel() <= packed_max_rows * x.size(-1)) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    static const c10::IValue attr{std::string("none")}, scalars{c10::List<std::optional<at::Scalar>>()},
        algorithm{std::string("")};  // made once: every call passes the same
    std::vector<c10::IValue> stack{x, *p, b, attr, scalars, algorithm};
    op.callBoxed(&stack);
    return stack[0].toTensor();
  }
  return at::linear(x, w, b);
}

// Whether `rms_norm` and `rope` run their loops (true) or ATen's ops: `speclab.core.native.build` checks once per
// process that the loops are bitwise this torch's ops (whose composite may change between versions) and sets it
static bool fused = true;
static void set_fused(bool on) { fused = on; }

// rows per task of the loops below: a decode step's few rows run inline, a prefill's split over the threads
static constexpr int64_t ROW_GRAIN = 256;

// the offset of row r of x (its elements before the last dim, in order) by x's strides
static int64_t row_offset(const Tensor& x, int64_t r) {
  int64_t off = 0;
  for (int64_t d = x.dim() - 2; d >= 0; --d) {
    off += (r % x.size(d)) * x.stride(d);
    r /= x.size(d);
  }
  return off;
}

// `torch.rms_norm` (ATen's composite: x32 = x.float(); (x32 * rsqrt(mean(x32^2) + eps) * w).to(x's dtype))
// in three ATen calls instead of about fifteen: the squares and the scaling are loops here; the row sums stay ATen's
// sum over the same [.., N] fp32 tensor the composite's mean reduces, so the reduction order is its own. Every other
// step is one IEEE operation per element, rounded as ATen rounds it (fp32, then RNE to bf16 where the op's output
// is bf16), so the output is bitwise at::rms_norm's (`tests/test_native.py`). Where it does not apply (another
// dtype, a weight of another dtype, a last dim that is not contiguous) it is at::rms_norm.
template <typename T>
static void rms_rows(const Tensor& x, const Tensor& out, const float* sums, const OptT& w, double eps) {
  const int64_t N = x.size(-1), rows = out.numel() / N;
  const T* wp = w.has_value() ? w->data_ptr<T>() : nullptr;
  const float fN = (float)N, feps = (float)eps;
  at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t r0, int64_t r1) {  // rows are independent: any split, same bits
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x.data_ptr<T>() + row_offset(x, r);
      T* yr = out.data_ptr<T>() + r * N;
      const float m = sums[r] / fN;        // mean's div_ by the element count
      const float v = m + feps;            // add_(eps)
      const float s = 1.0f / std::sqrt(v);  // rsqrt
      if (wp)
        for (int64_t i = 0; i < N; ++i) yr[i] = store<T>(load(xr[i]) * s * load(wp[i]));  // mul, mul(weight), type_as
      else
        for (int64_t i = 0; i < N; ++i) yr[i] = store<T>(load(xr[i]) * s);
    }
  });
}

static Tensor rms_norm(const Tensor& x, const OptT& w, double eps) {
  auto t = x.scalar_type();
  bool ok = fused && (t == at::kFloat || t == at::kBFloat16) && x.dim() >= 1 && x.stride(-1) == 1 && x.numel() > 0 &&
            (!w.has_value() || (w->scalar_type() == t && w->is_contiguous() && w->numel() == x.size(-1)));
  if (!ok) return at::rms_norm(x, {x.size(-1)}, w, eps);
  const int64_t N = x.size(-1), rows = x.numel() / N;
  auto sq = at::empty(x.sizes(), x.options().dtype(at::kFloat));  // pow(x32, 2), contiguous as ATen makes it
  float* q = sq.data_ptr<float>();
  at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int64_t off = row_offset(x, r);
      float* qr = q + r * N;
      if (t == at::kFloat) {
        const float* xr = x.data_ptr<float>() + off;
        for (int64_t i = 0; i < N; ++i) qr[i] = xr[i] * xr[i];
      } else {
        const at::BFloat16* xr = x.data_ptr<at::BFloat16>() + off;
        for (int64_t i = 0; i < N; ++i) qr[i] = load(xr[i]) * load(xr[i]);
      }
    }
  });
  auto sums = at::sum(sq, {x.dim() - 1}, true).contiguous();
  auto out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (t == at::kFloat)
    rms_rows<float>(x, out, sums.data_ptr<float>(), w, eps);
  else
    rms_rows<at::BFloat16>(x, out, sums.data_ptr<float>(), w, eps);
  return out;
}

// `layers.apply_rope`: x * cos + swap_halves(x) * sin, in one pass instead of four ATen ops (two products, the
// flip's copy, the sum): each product and the sum rounded to x's dtype as ATen's elementwise ops round them (fp32
// arithmetic, RNE to bf16), so bitwise theirs (`tests/test_native.py`). cos and sin broadcast against x; another
// dtype or a layout this loop does not read is ATen's ops.
template <typename T>
static void rope_rows(const Tensor& x, const Tensor& c, const Tensor& s, const Tensor& out) {
  const int64_t D = x.size(-1), h = D / 2, rows = x.numel() / D;
  at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x.data_ptr<T>() + row_offset(x, r);
      const T* cr = c.data_ptr<T>() + row_offset(c, r);
      const T* sr = s.data_ptr<T>() + row_offset(s, r);
      T* yr = out.data_ptr<T>() + r * D;
      for (int64_t i = 0; i < h; ++i)  // each product rounded to T, then their sum
        yr[i] = store<T>(load(store<T>(load(xr[i]) * load(cr[i]))) + load(store<T>(load(xr[i + h]) * load(sr[i]))));
      for (int64_t i = h; i < D; ++i)
        yr[i] = store<T>(load(store<T>(load(xr[i]) * load(cr[i]))) + load(store<T>(load(xr[i - h]) * load(sr[i]))));
    }
  });
}

static Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  auto t = x.scalar_type();
  bool ok = fused && (t == at::kFloat || t == at::kBFloat16) && cos.scalar_type() == t && sin.scalar_type() == t &&
            x.numel() > 0 && x.size(-1) % 2 == 0 && x.stride(-1) == 1 && cos.stride(-1) == 1 && sin.stride(-1) == 1 &&
            cos.dim() <= x.dim() && sin.dim() <= x.dim() && at::infer_size(x.sizes(), cos.sizes()) == x.sizes() &&
            at::infer_size(x.sizes(), sin.sizes()) == x.sizes();
  if (!ok) return x * cos + x.unflatten(-1, {2, -1}).flip({-2}).flatten(-2) * sin;
  auto out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  auto c = cos.expand(x.sizes()), s = sin.expand(x.sizes());
  if (t == at::kFloat)
    rope_rows<float>(x, c, s, out);
  else
    rope_rows<at::BFloat16>(x, c, s, out);
  return out;
}

// `layers.attend` of queries [heads, n, D] over layer i's cache slots [0, end) (`lean.KVCache.attend`)
static Tensor attend(const Tensor& q, const Tensor& ck, const Tensor& cv, int64_t end, const OptT& mask, double scale) {
  return attention(q, ck.slice(1, 0, end), cv.slice(1, 0, end), mask, scale);
}

// Keys and values k, v [kv_heads, rows, D] of the sequences' rows (ns[j] of sequence j, in order) into layer i of
// each one's caches ck[j], cv[j] at slots starts[j].. (`lean.KVCache.write`)
static void write_kv(int64_t i, const Tensor& k, const Tensor& v, const std::vector<Tensor>& ck,
                     const std::vector<Tensor>& cv, const std::vector<int64_t>& starts, const std::vector<int64_t>& ns) {
  int64_t a = 0;
  for (size_t j = 0; j < ck.size(); ++j) {
    const int64_t b = a + ns[j];
    ck[j].select(0, i).slice(1, starts[j], starts[j] + ns[j]).copy_(k.slice(1, a, b));
    cv[j].select(0, i).slice(1, starts[j], starts[j] + ns[j]).copy_(v.slice(1, a, b));
    a = b;
  }
}

static Tensor mix_rows(int64_t i, const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<Tensor>& ck,
                       const std::vector<Tensor>& cv, const std::vector<int64_t>& starts,
                       const std::vector<int64_t>& ns, const std::vector<OptT>& masks, double scale,
                       const std::vector<int64_t>& nqs);

// The attention step of layer i over one or several sequences' caches (`LeanDecoder._mix`, `lean.mix_many`): rows
// of sequence j (ns[j] of them, in order) written to its cache ck[j], cv[j] ([layers, kv_heads, slots, D]) at slots
// starts[j].., its queries (nqs[j] of them, empty: ns) attending over slots [0, starts[j] + ns[j]) under masks[j].
// q [heads, queries, D], k, v [kv_heads, rows, D]
static Tensor mix(int64_t i, const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<Tensor>& ck,
                  const std::vector<Tensor>& cv, const std::vector<int64_t>& starts, const std::vector<int64_t>& ns,
                  const std::vector<OptT>& masks, double scale, const std::vector<int64_t>& nqs = {}) {
  if (ck.size() > 1) {  // a ragged batch: every sequence's rows in one pass where `attention`'s rows would all be
    auto out = mix_rows(i, q, k, v, ck, cv, starts, ns, masks, scale, nqs);
    if (out.defined()) return out;
  }
  write_kv(i, k, v, ck, cv, starts, ns);
  std::vector<Tensor> out;
  int64_t qa = 0;
  for (size_t j = 0; j < ck.size(); ++j) {
    const int64_t qb = qa + (nqs.empty() ? ns[j] : nqs[j]);
    out.push_back(attend(q.slice(1, qa, qb), ck[j].select(0, i), cv[j].select(0, i), starts[j] + ns[j], masks[j],
                         scale));
    qa = qb;
  }
  return out.size() == 1 ? out[0] : at::cat(out, 1);  // one sequence: its attention as it is
}

// `mix` of a ragged batch in one pass: each sequence's keys and values copied into its caches row by row, then ONE
// parallel loop over every (sequence, head, query row), each row by `attn_rows` as `attention` computes it, the output
// laid out [rows, heads, D] as `attention` lays it out (so `finish`'s flatten is a view). The same instructions for
// every row as a call of `attention` per sequence, so the same bits, without each sequence's own slices, copies,
// parallel region and the concatenation after them (about 25 us a sequence and layer here). Undefined where any
// sequence falls outside `attention`'s fast path (`mix` then goes sequence by sequence).
static Tensor mix_rows(int64_t i, const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<Tensor>& ck,
                       const std::vector<Tensor>& cv, const std::vector<int64_t>& starts,
                       const std::vector<int64_t>& ns, const std::vector<OptT>& masks, double scale,
                       const std::vector<int64_t>& nqs) {
  const auto bf16 = at::kBFloat16;
  if (!attn_ok || q.dim() != 3 || k.dim() != 3 || v.dim() != 3 || !q.device().is_cpu() || q.scalar_type() != bf16 ||
      k.scalar_type() != bf16 || v.scalar_type() != bf16)
    return Tensor();
  const int64_t H = q.size(0), D = q.size(2), KV = k.size(0), J = (int64_t)ck.size();
  if (D % 32 != 0 || D > 256 || k.size(2) != D || v.size(2) != D || v.size(0) != KV || KV == 0 || H % KV != 0 ||
      q.stride(2) != 1 || k.stride(2) != 1 || v.stride(2) != 1 || k.size(1) != v.size(1) ||
      cv.size() != ck.size() || starts.size() != ck.size() || ns.size() != ck.size() || masks.size() != ck.size() ||
      (!nqs.empty() && nqs.size() != ck.size()))
    return Tensor();
  std::vector<int64_t> qoff(J + 1, 0), roff(J + 1, 0), S(J);
  std::vector<Tensor> m(J);
  int64_t Smax = 0;
  for (int64_t j = 0; j < J; ++j) {
    const int64_t nq = nqs.empty() ? ns[j] : nqs[j];
    S[j] = starts[j] + ns[j];
    for (const Tensor* c : {&ck[j], &cv[j]})
      if (c->scalar_type() != bf16 || c->dim() != 4 || c->size(0) <= i || c->size(1) != KV || c->size(2) < S[j] ||
          c->size(3) != D || c->stride(3) != 1)
        return Tensor();
    if (nq > ATTN_ROWS || nq < 0 || ns[j] < 0 || S[j] <= 0) return Tensor();
    if (masks[j].has_value()) {
      const Tensor& mk = *masks[j];
      if (mk.dim() != 2 || mk.size(0) != nq || mk.size(1) != S[j] ||
          !(mk.scalar_type() == at::kBool || mk.scalar_type() == bf16 || mk.scalar_type() == at::kFloat))
        return Tensor();
      m[j] = mk.contiguous();
    }
    qoff[j + 1] = qoff[j] + nq, roff[j + 1] = roff[j] + ns[j];
    Smax = std::max(Smax, S[j]);
  }
  if (qoff[J] != q.size(1) || roff[J] != k.size(1)) return Tensor();
  const size_t row_bytes = D * sizeof(uint16_t);
  for (int64_t j = 0; j < J; ++j)  // `write_kv`'s copies: a few rows of D values each
    for (int64_t g = 0; g < KV; ++g)
      for (int64_t r = 0; r < ns[j]; ++r) {
        const int64_t slot = i * ck[j].stride(0) + g * ck[j].stride(1) + (starts[j] + r) * ck[j].stride(2);
        const int64_t vslot = i * cv[j].stride(0) + g * cv[j].stride(1) + (starts[j] + r) * cv[j].stride(2);
        std::memcpy((uint16_t*)ck[j].data_ptr() + slot,
                    (const uint16_t*)k.data_ptr() + g * k.stride(0) + (roff[j] + r) * k.stride(1), row_bytes);
        std::memcpy((uint16_t*)cv[j].data_ptr() + vslot,
                    (const uint16_t*)v.data_ptr() + g * v.stride(0) + (roff[j] + r) * v.stride(1), row_bytes);
      }
  const int64_t T = qoff[J], G = H / KV;
  auto out = at::empty({T, H, D}, q.options());
  const uint16_t* qp = (const uint16_t*)q.data_ptr();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  std::vector<int64_t> qseq(T);  // each query's sequence
  for (int64_t j = 0; j < J; ++j) std::fill(qseq.begin() + qoff[j], qseq.begin() + qoff[j + 1], j);
  attn_rows(qp, qs0, qs1, H, G, T, Smax, D, scale, (uint16_t*)out.data_ptr(),
            [&](int64_t t, int64_t g, KVRun* runs, MaskRow& mr) {
              const int64_t j = qseq[t];
              runs[0] = cache_run(ck[j], cv[j], i, g, S[j]);
              mr = mask_row(m[j], t - qoff[j], S[j]);
              return 1;
            });
  return out.transpose(0, 1);
}

// `Layer.finish` with the MLP `down(silu(gate(x)) * up(x))`; gate and up fused (`FusedLayer`) or not (`MLP`)
// (each weight with its two packed copies, `native._copies`)
static Tensor finish(const Tensor& h, const Tensor& a, const Tensor& o, const OptT& ob, const OptT& op,
                     const OptT& owide, const Tensor& post, double eps, const std::vector<OptT>& mlp) {
  auto h1 = h + linear(a.transpose(-2, -3).flatten(-2), o, ob, op, owide);
  auto x = rms_norm(h1, post, eps);
  Tensor g, u;
  if (mlp.size() == 6) {  // gate_up, its copies, down, its copies
    auto gu = linear(x, *mlp[0], std::nullopt, mlp[1], mlp[2]).chunk(2, -1);
    g = gu[0], u = gu[1];
    return h1 + linear(at::silu(g) * u, *mlp[3], std::nullopt, mlp[4], mlp[5]);
  }
  // gate, its copies, up, its copies, down, its copies
  g = linear(x, *mlp[0], std::nullopt, mlp[1], mlp[2]);
  u = linear(x, *mlp[3], std::nullopt, mlp[4], mlp[5]);
  return h1 + linear(at::silu(g) * u, *mlp[6], std::nullopt, mlp[7], mlp[8]);
}

// The attention step of layer i for one sequence whose last rows (after its ns[0] plain rows) are extra rows that
// write nothing to the cache (`LeanDecoder._mix` with `lean.ConRows`: ConFu's contemplate rows): the plain rows as
// `mix`; each extra row over the keys and values only they see (soft_k, soft_v [layers, kv_heads, s, D]), the
// cache up to the plain rows' end, and the extra rows' own, under con_mask [extra, s + end + extra]
static Tensor mix_con(int64_t i, const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<Tensor>& ck,
                      const std::vector<Tensor>& cv, const std::vector<int64_t>& starts,
                      const std::vector<int64_t>& ns, const std::vector<OptT>& masks, double scale,
                      const Tensor& soft_k, const Tensor& soft_v, const Tensor& con_mask) {
  const int64_t n = ns[0], end = starts[0] + n;
  auto o = mix(i, q.slice(1, 0, n), k.slice(1, 0, n), v.slice(1, 0, n), ck, cv, starts, ns, masks, scale);
  auto keys = at::cat({soft_k.select(0, i).to(k.scalar_type()), ck[0].select(0, i).slice(1, 0, end), k.slice(1, n)}, 1);
  auto vals = at::cat({soft_v.select(0, i).to(v.scalar_type()), cv[0].select(0, i).slice(1, 0, end), v.slice(1, n)}, 1);
  return at::cat({o, attention(q.slice(1, n), keys, vals, con_mask, scale)}, 1);
}

// ---- A decode step's layers without ATen's small ops (`fused_layers`' fast path) --------------------------------------
// A few bf16 rows of one sequence or of a ragged batch (a decode step, a chain's verification, a draft model's step,
// a serving step; one sequence's with the extra rows that ride after them, ConFu's contemplate rows, as `mix_con`
// attends them) through every layer with the arithmetic of the loop below, element by element and in the same
// order, so every output is bitwise that loop's: its views, copies, elementwise ops and their dispatch (about forty
// ATen calls a layer, 35-45 us of the zoo target's 1-row call on a 2-core CPU) become loops over rows, and the
// products are called directly. ATen keeps the norms' row sums (its reduction order) and the SiLU (its exp).
// `decode_layers` returns false where any part falls outside it (then the loop below runs).

// out = a + b or a * b over n bf16 values (ATen's bf16 add and mul: in fp32, rounded once; out may be a or b)
template <bool MUL>
AVX512 static void bf16_binary(const uint16_t* a, const uint16_t* b, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    const __m512 x = load16(a + i, m), y = load16(b + i, m);
    store16(out + i, MUL ? _mm512_mul_ps(x, y) : _mm512_add_ps(x, y), m);
  }
}

// The product of rows x [M, K] (contiguous bf16) by a weight's entries (weight, bias, its two packed copies, as
// `linear` takes them) -> [M, N] contiguous: the dot product's copy called directly (what `linear` would dispatch)
static Tensor rows_product(const Tensor& x, const OptT& w, const OptT& b, const OptT& packed, const OptT& wide) {
  const int64_t M = x.size(0), K = x.size(1), N = w->size(0);
  if (packed.has_value() && packed->dim() == 4 && M <= tile_max_rows && K % 2 == 0 && packed->size(1) * 2 == K &&
      packed->size(0) == (N + 63) / 64 && (!b.has_value() || b->is_contiguous())) {
    auto y = at::empty({M, N}, x.options());
    RECORD_FUNCTION("speclab::dp_linear", std::vector<c10::IValue>());  // the profiler's name for it (`costs step`)
    dp_run((const uint32_t*)x.data_ptr(), M, *packed, b.has_value() ? (const uint16_t*)b->data_ptr() : nullptr, N, K,
           (uint16_t*)y.data_ptr());
    return y;
  }
  return linear(x, *w, b, packed, wide).contiguous();
}

// `rms_norm` of R rows of N bf16 values (row r at row(r)) -> out [R, N] bf16, times the weight wp [N] where given
// (`rms_rows`' arithmetic), then (`after` [period, N]: the qk norm's weight, row r % period) times `after` as a
// separate rounded product; `shape`: the sizes `rms_norm`'s input had (ATen sums its squares over the last of them)
template <typename Row>
AVX512 static void rms_rows_into(Row row, int64_t R, int64_t N, at::IntArrayRef shape, const uint16_t* wp, double eps,
                                 uint16_t* out, const at::TensorOptions& fopt, const uint16_t* after = nullptr,
                                 int64_t period = 1) {
  auto sq = at::empty(shape, fopt);
  float* q = sq.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    const uint16_t* xr = row(r);
    for (int64_t i = 0; i < N; i += 16) {
      const __mmask16 m = lanes(N - i);
      const __m512 x = load16(xr + i, m);
      _mm512_mask_storeu_ps(q + r * N + i, m, _mm512_mul_ps(x, x));
    }
  }
  auto sums = at::sum(sq, {(int64_t)shape.size() - 1}, true).contiguous();
  const float* sp = sums.data_ptr<float>();
  const float fN = (float)N, feps = (float)eps;
  for (int64_t r = 0; r < R; ++r) {
    const uint16_t* xr = row(r);
    uint16_t* yr = out + r * N;
    const float mean = sp[r] / fN;
    const float v = mean + feps;
    const __m512 sc = _mm512_set1_ps(1.0f / std::sqrt(v));
    for (int64_t i = 0; i < N; i += 16) {
      const __mmask16 m = lanes(N - i);
      __m512 y = _mm512_mul_ps(load16(xr + i, m), sc);
      if (wp) y = _mm512_mul_ps(y, load16(wp + i, m));
      if (after) y = _mm512_mul_ps(round16(y), load16(after + (r % period) * N + i, m));
      store16(yr + i, y, m);
    }
  }
}

// `rope_rows` of one row x [D] in place (c, s: its cos and sin rows): each product rounded to bf16, then their sum
AVX512 static void rope_row(uint16_t* x, const uint16_t* c, const uint16_t* s, int64_t D) {
  alignas(64) uint16_t t[256];
  std::memcpy(t, x, D * sizeof(uint16_t));
  const int64_t h = D / 2;
  for (int64_t i = 0; i < D; i += 16) {  // D % 32 == 0: a chunk of 16 lies in one half
    const __mmask16 m = lanes(D - i);
    const int64_t j = i < h ? i + h : i - h;
    const __m512 a = round16(_mm512_mul_ps(load16(t + i, m), load16(c + i, m)));
    const __m512 b = round16(_mm512_mul_ps(load16(t + j, m), load16(s + i, m)));
    store16(x + i, _mm512_add_ps(a, b), m);
  }
}

static bool fast_layers = true;  // `set_fast_layers` (tests compare both paths)
static void set_fast_layers(bool on) { fast_layers = on; }
static int64_t fast_calls = 0;
static int64_t get_fast_calls() { return fast_calls; }

// What both raw-row paths read, checked: the rows' cos and sin ([n, 1, D] bf16 table rows), the caches (bf16
// [layers, KV, slots, D], at least `layers` layers and S slots) and the mask ([rows, S] bool, bf16 or fp32; none:
// `m` stays undefined) -> whether they can, with the mask contiguous in `m`
static bool raw_rows_ok(const Tensor& cos, const Tensor& sin, const Tensor& ck, const Tensor& cv, const OptT& mask,
                        int64_t n, int64_t rows, int64_t layers, int64_t KV, int64_t S, int64_t D, Tensor& m) {
  const auto bf16 = at::kBFloat16;
  for (const Tensor* t : {&cos, &sin})
    if (t->scalar_type() != bf16 || t->dim() != 3 || t->size(0) != n || t->size(1) != 1 || t->size(2) != D ||
        t->stride(2) != 1)
      return false;
  for (const Tensor* c : {&ck, &cv})
    if (c->scalar_type() != bf16 || c->dim() != 4 || c->size(0) < layers || c->size(1) != KV || c->size(2) < S ||
        c->size(3) != D || c->stride(3) != 1)
      return false;
  if (mask.has_value()) {
    const Tensor& mk = *mask;
    if (mk.dim() != 2 || mk.size(0) != rows || mk.size(1) != S ||
        !(mk.scalar_type() == at::kBool || mk.scalar_type() == bf16 || mk.scalar_type() == at::kFloat))
      return false;
    m = mk.contiguous();
  }
  return true;
}

// A bf16 vector (a norm's weight, a bias) of `numel` values, contiguous
static bool bf16_vec(const OptT& t, int64_t numel) {
  return t.has_value() && t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->numel() == numel;
}

// A ragged batch as both raw-row paths read it: sequence j's rows off[j].. (ns[j], at most `most` of them) written
// to its caches at slots starts[j].., its queries qoff[j].. (nqs[j], at most `ATTN_ROWS`, so that `mix` attends each
// by `attn_rows`) over its first S[j] slots under masks[j] (`raw_rows_ok`, cos and sin of `rows` rows); each row's
// and each query's sequence. False where any part falls outside it
struct Ragged {
  std::vector<int64_t> off, qoff, S, seq, qseq;
  std::vector<Tensor> m;
};
static bool ragged_ok(const Tensor& cos, const Tensor& sin, const std::vector<Tensor>& ck, const std::vector<Tensor>& cv,
                      const std::vector<int64_t>& starts, const std::vector<int64_t>& ns,
                      const std::vector<int64_t>& nqs, const std::vector<OptT>& masks, int64_t rows, int64_t most,
                      int64_t layers, int64_t KV, int64_t D, Ragged& g) {
  const int64_t J = (int64_t)ck.size();
  if (J < 1 || (int64_t)cv.size() != J || (int64_t)starts.size() != J || (int64_t)ns.size() != J ||
      (int64_t)nqs.size() != J || (int64_t)masks.size() != J)
    return false;
  g.off.assign(J + 1, 0), g.qoff.assign(J + 1, 0), g.S.assign(J, 0), g.m.assign(J, Tensor());
  for (int64_t j = 0; j < J; ++j) {
    if (ns[j] < 1 || ns[j] > most || nqs[j] < 1 || nqs[j] > ATTN_ROWS || starts[j] < 0) return false;
    g.off[j + 1] = g.off[j] + ns[j], g.qoff[j + 1] = g.qoff[j] + nqs[j], g.S[j] = starts[j] + ns[j];
    if (!raw_rows_ok(cos, sin, ck[j], cv[j], masks[j], rows, nqs[j], layers, KV, g.S[j], D, g.m[j])) return false;
  }
  g.seq.resize(g.off[J]), g.qseq.resize(g.qoff[J]);
  for (int64_t j = 0; j < J; ++j) {
    std::fill(g.seq.begin() + g.off[j], g.seq.begin() + g.off[j + 1], j);
    std::fill(g.qseq.begin() + g.qoff[j], g.qseq.begin() + g.qoff[j + 1], j);
  }
  return true;
}

static bool decode_layers(const Tensor& h0, const Tensor& cos, const Tensor& sin,
                          const std::vector<std::vector<OptT>>& W, const std::vector<Tensor>& ck,
                          const std::vector<Tensor>& cv, const std::vector<int64_t>& starts,
                          const std::vector<int64_t>& ns, const std::vector<OptT>& masks, double scale, double eps,
                          int64_t H, int64_t KV, int64_t D, const std::vector<int64_t>& keep, const OptT& soft_k,
                          const OptT& soft_v, const OptT& con_mask, std::vector<Tensor>& out) {
  const auto bf16 = at::kBFloat16;
  if (!fused || !fast_layers || !attn_ok || h0.dim() != 2 || h0.scalar_type() != bf16 || !h0.is_contiguous() ||
      !h0.device().is_cpu() || (soft_k.has_value() && ck.size() != 1) || D % 32 != 0 || D > 256 || KV <= 0 ||
      H % KV != 0)
    return false;
  // every row queries; after one sequence's plain rows, c extra rows
  const int64_t R = h0.size(0), d = h0.size(1), QK = H + KV, C3 = H + 2 * KV, L = (int64_t)W.size(), G = H / KV;
  Ragged rg;
  if (!ragged_ok(cos, sin, ck, cv, starts, ns, ns, masks, R, ATTN_ROWS, L, KV, D, rg)) return false;
  const auto &off = rg.off, &S = rg.S, &seq = rg.seq;
  const auto& m = rg.m;
  const int64_t n = off.back(), c = R - n;  // the plain rows, the extra rows
  if (c < 0 || c > ATTN_ROWS || (c > 0) != soft_k.has_value()) return false;
  Tensor sk, sv, cm;
  int64_t P = 0;  // the extra rows' own keys and values (ConFu's soft prompts) a layer and kv head
  if (c > 0) {  // [layers, KV, P, D] each, in bf16 (what `mix_con` casts them to), and a bool mask [c, P + S + c]
    if (!soft_v.has_value() || !con_mask.has_value() || soft_k->dim() != 4 || soft_k->size(0) < L ||
        soft_k->size(1) != KV || soft_k->size(3) != D || soft_v->sizes() != soft_k->sizes() ||
        con_mask->scalar_type() != at::kBool || con_mask->dim() != 2 || con_mask->size(0) != c)
      return false;
    P = soft_k->size(2);
    if (con_mask->size(1) != P + S[0] + c) return false;
    sk = soft_k->to(bf16).contiguous(), sv = soft_v->to(bf16).contiguous(), cm = con_mask->contiguous();
  }
  for (const auto& w : W) {
    if (w.size() != 17 || !bf16_vec(w[0], d) || !bf16_vec(w[10], d) || !w[1] || !w[6] || !w[11] || !w[14]) return false;
    if (w[5].has_value() && !(bf16_vec(w[5], QK * D) && w[5]->dim() == 2 && w[5]->size(0) == QK)) return false;
    if ((w[2].has_value() && !bf16_vec(w[2], C3 * D)) || (w[7].has_value() && !bf16_vec(w[7], d))) return false;
    for (const OptT* x : {&w[1], &w[6], &w[11], &w[14]})
      if ((*x)->scalar_type() != bf16 || (*x)->dim() != 2) return false;
    if (w[1]->size(0) != C3 * D || w[1]->size(1) != d || w[6]->size(0) != d || w[6]->size(1) != H * D ||
        w[11]->size(1) != d || w[11]->size(0) % 2 != 0 || w[14]->size(0) != d || 2 * w[14]->size(1) != w[11]->size(0))
      return false;
  }
  const auto opt = h0.options();
  const auto fopt = opt.dtype(at::kFloat);
  const int64_t cs = cos.stride(0), ss = sin.stride(0);
  const uint16_t* cp = (const uint16_t*)cos.data_ptr();
  const uint16_t* snp = (const uint16_t*)sin.data_ptr();
  Tensor h = h0;
  out.assign(1, Tensor());
  for (int64_t li = 0; li < L; ++li) {
    const auto& w = W[li];
    const uint16_t* hp = (const uint16_t*)h.data_ptr();
    // the input norm, then q, k and v in one product
    auto x = at::empty({R, d}, opt);
    rms_rows_into([&](int64_t r) { return hp + r * d; }, R, d, {R, d}, (const uint16_t*)w[0]->data_ptr(), eps,
                  (uint16_t*)x.data_ptr(), fopt);
    auto qkv = rows_product(x, w[1], w[2], w[3], w[4]);  // [R, (H + 2 KV) D]
    const uint16_t* qkvp = (const uint16_t*)qkv.data_ptr();
    // q and k: per head the norm (Qwen3) and its weight, then the rotary embedding, in place -> [R, H + KV, D]
    auto qk = at::empty({R, QK, D}, opt);
    uint16_t* qkp = (uint16_t*)qk.data_ptr();
    auto head_row = [&](int64_t t) { return qkvp + (t / QK) * C3 * D + (t % QK) * D; };
    if (w[5].has_value())
      rms_rows_into(head_row, R * QK, D, {R, QK, D}, nullptr, eps, qkp, fopt, (const uint16_t*)w[5]->data_ptr(), QK);
    else
      for (int64_t t = 0; t < R * QK; ++t) std::memcpy(qkp + t * D, head_row(t), D * sizeof(uint16_t));
    for (int64_t t = 0; t < R * QK; ++t) rope_row(qkp + t * D, cp + (t / QK) * cs, snp + (t / QK) * ss, D);
    // the plain rows' keys and values into layer li of their sequences' caches (`write_kv`)
    for (int64_t r = 0; r < n; ++r) {
      const int64_t j = seq[r], slot = starts[j] + r - off[j];
      uint16_t* kc = (uint16_t*)ck[j].data_ptr() + li * ck[j].stride(0) + slot * ck[j].stride(2);
      uint16_t* vc = (uint16_t*)cv[j].data_ptr() + li * cv[j].stride(0) + slot * cv[j].stride(2);
      for (int64_t g = 0; g < KV; ++g) {
        std::memcpy(kc + g * ck[j].stride(1), qkp + (r * QK + H + g) * D, D * sizeof(uint16_t));
        std::memcpy(vc + g * cv[j].stride(1), qkvp + r * C3 * D + (QK + g) * D, D * sizeof(uint16_t));
      }
    }
    // attention, each (head, row) by `attn_rows` as `attention` runs it -> [R, H D]: a plain row over its sequence's
    // cache's first S slots; an extra row over [its own keys and values ; those slots ; the extra rows'] (`mix_con`'s
    // concatenation, read where each part lies) under its mask row
    auto a = at::empty({R, H * D}, opt);
    uint16_t* ap = (uint16_t*)a.data_ptr();
    const int64_t Smax = *std::max_element(S.begin(), S.end());
    {
      RECORD_FUNCTION("speclab::attention", std::vector<c10::IValue>());  // the profiler's name for it
      attn_rows(qkp, D, QK * D, H, G, R, P + Smax + c, D, scale, ap, [&](int64_t i, int64_t g, KVRun* runs, MaskRow& mr) {
        const int64_t j = i < n ? seq[i] : 0;
        runs[0] = cache_run(ck[j], cv[j], li, g, S[j]);
        if (i < n) {
          mr = mask_row(m[j], i - off[j], S[j]);
          return 1;
        }
        const int64_t own = (li * KV + g) * P * D;
        runs[1] = runs[0];
        runs[0] = {(const uint16_t*)sk.data_ptr() + own, D, (const uint16_t*)sv.data_ptr() + own, D, P};
        runs[2] = {qkp + (n * QK + H + g) * D, QK * D, qkvp + n * C3 * D + (QK + g) * D, C3 * D, c};
        mr = mask_row(cm, i - n, P + S[0] + c);
        return 3;
      });
    }
    // the output projection and the residual, in place in the product's output: h1 = h + o(a)
    auto h1 = rows_product(a, w[6], w[7], w[8], w[9]);
    uint16_t* h1p = (uint16_t*)h1.data_ptr();
    bf16_binary<false>(hp, h1p, h1p, R * d);
    // the MLP: post norm, gate and up in one product, SiLU(gate) (ATen's) times up, down, the residual
    auto x2 = at::empty({R, d}, opt);
    rms_rows_into([&](int64_t r) { return (const uint16_t*)h1p + r * d; }, R, d, {R, d},
                  (const uint16_t*)w[10]->data_ptr(), eps, (uint16_t*)x2.data_ptr(), fopt);
    auto gu = rows_product(x2, w[11], std::nullopt, w[12], w[13]);  // [R, 2 I]
    const int64_t I = gu.size(1) / 2;
    auto act = at::silu(gu.narrow(1, 0, I)).contiguous();
    uint16_t* actp = (uint16_t*)act.data_ptr();
    const uint16_t* gup = (const uint16_t*)gu.data_ptr();
    for (int64_t r = 0; r < R; ++r) bf16_binary<true>(actp + r * I, gup + r * 2 * I + I, actp + r * I, I);
    auto y = rows_product(act, w[14], std::nullopt, w[15], w[16]);
    uint16_t* yp = (uint16_t*)y.data_ptr();
    bf16_binary<false>(h1p, yp, yp, R * d);
    h = y;
    for (auto j : keep)
      if (j == li) out.push_back(h);
  }
  out[0] = h;
  ++fast_calls;
  return true;
}

// The lean forward's layers (`LeanDecoder._layers` over `KVCache`s: `_mix` for one sequence, `mix_many` for a
// ragged batch): rows h [rows, d] of the sequences (see `mix`), and for one sequence optionally extra rows after
// its plain ones (soft_k given: see `mix_con`). Each layer's weights, as `speclab.core.native.fused_weights` lists
// them (each projection with its two packed copies): in_norm, qkv, qkv bias, 2 copies, qk norm, o, o bias, 2
// copies, post norm, gate_up, 2 copies, down, 2 copies. -> [h, the outputs of the layers in `keep` (ascending)]
std::vector<Tensor> fused_layers(Tensor h, const Tensor& cos, const Tensor& sin, const std::vector<std::vector<OptT>>& W,
                                 const std::vector<Tensor>& ck, const std::vector<Tensor>& cv,
                                 const std::vector<int64_t>& starts, const std::vector<int64_t>& ns,
                                 const std::vector<OptT>& masks, double scale, double eps, int64_t H, int64_t KV,
                                 int64_t D, const std::vector<int64_t>& keep, const OptT& soft_k = std::nullopt,
                                 const OptT& soft_v = std::nullopt, const OptT& con_mask = std::nullopt) {
  TORCH_CHECK(!soft_k.has_value() || (ck.size() == 1 && soft_v.has_value() && con_mask.has_value()),
              "speclab fused_layers: extra rows ride with one sequence, with their keys, values and mask");
  std::vector<Tensor> out;
  if (decode_layers(h, cos, sin, W, ck, cv, starts, ns, masks, scale, eps, H, KV, D, keep, soft_k, soft_v, con_mask,
                    out))
    return out;
  out.assign(1, Tensor());
  for (size_t i = 0; i < W.size(); ++i) {
    const auto& w = W[i];
    auto qkv = linear(rms_norm(h, w[0], eps), *w[1], w[2], w[3], w[4]).unflatten(-1, {H + 2 * KV, D});
    auto qk = qkv.slice(-2, 0, H + KV);
    auto v = qkv.slice(-2, H + KV).transpose(-2, -3);
    if (w[5].has_value()) qk = rms_norm(qk, std::nullopt, eps) * *w[5];
    qk = rope(qk, cos, sin).transpose(-2, -3);
    auto a = soft_k.has_value()
                 ? mix_con(i, qk.slice(-3, 0, H), qk.slice(-3, H), v, ck, cv, starts, ns, masks, scale, *soft_k,
                           *soft_v, *con_mask)
                 : mix(i, qk.slice(-3, 0, H), qk.slice(-3, H), v, ck, cv, starts, ns, masks, scale);
    h = finish(h, a, *w[6], w[7], w[8], w[9], *w[10], eps, {w[11], w[12], w[13], w[14], w[15], w[16]});
    for (auto j : keep)
      if (j == (int64_t)i) out.push_back(h);
  }
  out[0] = h;
  return out;
}

// `layers.Attention.kv`: keys and values [kv_heads, rows, D] of a `DecoderLayer`'s attention inputs x (its k and v
// projections, the k norm, rope on the keys). Weights as `decoder_layer` lists them
static std::pair<Tensor, Tensor> keys_values(const Tensor& x, const Tensor& cos, const Tensor& sin,
                                             const std::vector<OptT>& w, double qk_eps, int64_t KV, int64_t D) {
  auto k = linear(x, *w[4], w[5], w[6], w[7]).unflatten(-1, {KV, D});
  if (w[13].has_value()) k = rms_norm(k, w[13], qk_eps);
  auto v = linear(x, *w[8], w[9], w[10], w[11]).unflatten(-1, {KV, D});
  return {rope(k, cos, sin).transpose(-2, -3), v.transpose(-2, -3)};
}

// `decoder_layer`'s fast path (see `decode_layers`): a few bf16 rows x [n, d_in] of one sequence or of a ragged batch
// (sequence j's ns[j] rows, in order) written to layer li of their caches at slots starts[j].., the query rows (q_rows
// of x, or every row; the first nqs[0] of them sequence 0's, and so on) with their residual h [nq, d]; the same
// arithmetic as the ops below, bit for bit. False where any part falls outside it (then the ops run).
static bool decode_layer_rows(const Tensor& x, const Tensor& h, const Tensor& cos, const Tensor& sin,
                              const std::vector<OptT>& w, int64_t li, const std::vector<Tensor>& ck,
                              const std::vector<Tensor>& cv, const std::vector<int64_t>& starts,
                              const std::vector<int64_t>& ns, const std::vector<OptT>& masks, double scale,
                              double qk_eps, double eps, int64_t H, int64_t KV, int64_t D, const OptT& q_rows,
                              const std::vector<int64_t>& nqs, Tensor& result) {
  const auto bf16 = at::kBFloat16;
  const int64_t n = x.dim() == 2 ? x.size(0) : 0, nq = q_rows.has_value() ? q_rows->numel() : n;
  if (!fused || !fast_layers || !attn_ok || x.dim() != 2 || x.scalar_type() != bf16 || !x.is_contiguous() ||
      !x.device().is_cpu() || h.dim() != 2 || h.scalar_type() != bf16 || !h.is_contiguous() || h.size(0) != nq ||
      nq < 1 || D % 32 != 0 || D > 256 || KV <= 0 || H % KV != 0 || w.size() != 28)
    return false;
  if (q_rows.has_value() && (q_rows->scalar_type() != at::kLong || q_rows->dim() != 1 || !q_rows->is_contiguous() ||
                             !q_rows->device().is_cpu()))
    return false;
  // the queries: q_rows's, the first nqs[0] sequence 0's and so on (one sequence: all of them); else every row
  const std::vector<int64_t> nq_of = !q_rows ? ns : !nqs.empty() ? nqs : std::vector<int64_t>{nq};
  if (!q_rows && !nqs.empty() && nqs != ns) return false;
  Ragged rg;
  if (!ragged_ok(cos, sin, ck, cv, starts, ns, nq_of, masks, n, 64, li + 1, KV, D, rg) || rg.off.back() != n ||
      rg.qoff.back() != nq)
    return false;
  const auto &off = rg.off, &qoff = rg.qoff, &S = rg.S, &seq = rg.seq, &qseq = rg.qseq;
  const auto& m = rg.m;
  const int64_t din = x.size(1), d = h.size(1), G = H / KV;
  auto mat = [&](const OptT& t, int64_t rows, int64_t cols) {
    return t.has_value() && t->scalar_type() == bf16 && t->dim() == 2 && t->size(0) == rows && t->size(1) == cols;
  };
  if (!mat(w[0], H * D, din) || !mat(w[4], KV * D, din) || !mat(w[8], KV * D, din) || !mat(w[14], d, H * D) ||
      !bf16_vec(w[18], d) || !w[19] || !mat(w[19], w[19]->size(0), d) || !mat(w[22], w[19]->size(0), d) ||
      !mat(w[25], d, w[19]->size(0)))
    return false;
  for (auto [i, numel] : {std::pair<int, int64_t>{1, H * D}, {5, KV * D}, {9, KV * D}, {12, D}, {13, D}, {15, d}})
    if (w[i].has_value() && !bf16_vec(w[i], numel)) return false;
  const auto opt = x.options();
  const auto fopt = opt.dtype(at::kFloat);
  const int64_t cs = cos.stride(0), ss = sin.stride(0);
  const uint16_t* cp = (const uint16_t*)cos.data_ptr();
  const uint16_t* snp = (const uint16_t*)sin.data_ptr();
  const int64_t* qr = q_rows.has_value() ? q_rows->data_ptr<int64_t>() : nullptr;
  for (int64_t r = 0; qr && r < nq; ++r)
    if (qr[r] < 0 || qr[r] >= n) return false;
  auto row_of = [&](int64_t r) { return qr ? qr[r] : r; };  // query r's row of x (its position's cos and sin)
  // queries: the query rows' product, the q norm (with its weight), the rotary embedding at their rows' positions
  Tensor xq = x;
  if (qr) {
    xq = at::empty({nq, din}, opt);
    for (int64_t r = 0; r < nq; ++r)
      std::memcpy((uint16_t*)xq.data_ptr() + r * din, (const uint16_t*)x.data_ptr() + qr[r] * din, din * 2);
  }
  auto q = rows_product(xq, w[0], w[1], w[2], w[3]);  // [nq, H D]
  uint16_t* qp = (uint16_t*)q.data_ptr();
  if (w[12].has_value())
    rms_rows_into([&](int64_t t) { return (const uint16_t*)qp + t * D; }, nq * H, D, {nq, H, D},
                  (const uint16_t*)w[12]->data_ptr(), qk_eps, qp, fopt);
  for (int64_t t = 0; t < nq * H; ++t) rope_row(qp + t * D, cp + row_of(t / H) * cs, snp + row_of(t / H) * ss, D);
  // keys (the k norm, the rotary embedding) and values of every row, into the cache (`keys_values`, `write_kv`)
  auto k = rows_product(x, w[4], w[5], w[6], w[7]);  // [n, KV D]
  uint16_t* kp = (uint16_t*)k.data_ptr();
  if (w[13].has_value())
    rms_rows_into([&](int64_t t) { return (const uint16_t*)kp + t * D; }, n * KV, D, {n, KV, D},
                  (const uint16_t*)w[13]->data_ptr(), qk_eps, kp, fopt);
  for (int64_t t = 0; t < n * KV; ++t) rope_row(kp + t * D, cp + (t / KV) * cs, snp + (t / KV) * ss, D);
  auto v = rows_product(x, w[8], w[9], w[10], w[11]);  // [n, KV D]
  const uint16_t* vp = (const uint16_t*)v.data_ptr();
  for (int64_t r = 0; r < n; ++r) {
    const int64_t j = seq[r], slot = starts[j] + r - off[j];
    uint16_t* kc = (uint16_t*)ck[j].data_ptr() + li * ck[j].stride(0) + slot * ck[j].stride(2);
    uint16_t* vc = (uint16_t*)cv[j].data_ptr() + li * cv[j].stride(0) + slot * cv[j].stride(2);
    for (int64_t g = 0; g < KV; ++g) {
      std::memcpy(kc + g * ck[j].stride(1), kp + (r * KV + g) * D, D * 2);
      std::memcpy(vc + g * cv[j].stride(1), vp + (r * KV + g) * D, D * 2);
    }
  }
  // attention of each query over its sequence's cache's first S slots (`attention`'s rows) -> [nq, H D]
  auto a = at::empty({nq, H * D}, opt);
  uint16_t* ap = (uint16_t*)a.data_ptr();
  {
    RECORD_FUNCTION("speclab::attention", std::vector<c10::IValue>());  // the profiler's name for it
    attn_rows(qp, D, H * D, H, G, nq, *std::max_element(S.begin(), S.end()), D, scale, ap,
              [&](int64_t t, int64_t g, KVRun* runs, MaskRow& mr) {
                const int64_t j = qseq[t];
                runs[0] = cache_run(ck[j], cv[j], li, g, S[j]);
                mr = mask_row(m[j], t - qoff[j], S[j]);
                return 1;
              });
  }
  // `finish`: h1 = h + o(a); the MLP down(silu(gate(x2)) * up(x2)) of x2 = post norm(h1); h1 + it
  auto h1 = rows_product(a, w[14], w[15], w[16], w[17]);
  uint16_t* h1p = (uint16_t*)h1.data_ptr();
  bf16_binary<false>((const uint16_t*)h.data_ptr(), h1p, h1p, nq * d);
  auto x2 = at::empty({nq, d}, opt);
  rms_rows_into([&](int64_t r) { return (const uint16_t*)h1p + r * d; }, nq, d, {nq, d},
                (const uint16_t*)w[18]->data_ptr(), eps, (uint16_t*)x2.data_ptr(), fopt);
  auto act = at::silu(rows_product(x2, w[19], std::nullopt, w[20], w[21]));
  auto u = rows_product(x2, w[22], std::nullopt, w[23], w[24]);
  bf16_binary<true>((const uint16_t*)act.data_ptr(), (const uint16_t*)u.data_ptr(), (uint16_t*)act.data_ptr(),
                    act.numel());
  auto y = rows_product(act, w[25], std::nullopt, w[26], w[27]);
  uint16_t* yp = (uint16_t*)y.data_ptr();
  bf16_binary<false>(h1p, yp, yp, nq * d);
  result = y;
  ++fast_calls;
  return true;
}

// One `DecoderLayer` (a drafter's: one Linear a projection), layer i of its caches, after its input norm: attention
// input x [rows, d_in] of the sequences (see `mix`); queries of the rows `q_rows` (`Attention.qkv`'s q_rows; None:
// every row), nqs[j] of them the last rows of sequence j, with the residual h of those rows. Weights as
// `speclab.core.native.decoder_weights` lists them: q, q bias, its 2 packed copies, k .., v .., q norm, k norm, o,
// o bias, 2 copies, post norm, then gate, 2 copies, up, 2 copies, down, 2 copies. -> the layer's output of the query
// rows
Tensor decoder_layer(const Tensor& x, const Tensor& h, const Tensor& cos, const Tensor& sin, const std::vector<OptT>& w,
                     int64_t i, const std::vector<Tensor>& ck, const std::vector<Tensor>& cv,
                     const std::vector<int64_t>& starts, const std::vector<int64_t>& ns,
                     const std::vector<OptT>& masks, double scale, double qk_eps, double eps, int64_t H, int64_t KV,
                     int64_t D, const OptT& q_rows, const std::vector<int64_t>& nqs) {
  Tensor fast;
  if (decode_layer_rows(x, h, cos, sin, w, i, ck, cv, starts, ns, masks, scale, qk_eps, eps, H, KV, D, q_rows, nqs,
                        fast))
    return fast;
  auto q = linear(q_rows ? x.index({*q_rows}) : x, *w[0], w[1], w[2], w[3]).unflatten(-1, {H, D});
  if (w[12].has_value()) q = rms_norm(q, w[12], qk_eps);
  auto [k, v] = keys_values(x, cos, sin, w, qk_eps, KV, D);
  q = (q_rows ? rope(q, cos.index({*q_rows}), sin.index({*q_rows})) : rope(q, cos, sin)).transpose(-2, -3);
  return finish(h, mix(i, q, k, v, ck, cv, starts, ns, masks, scale, nqs), *w[14], w[15], w[16], w[17], *w[18], eps,
                {w[19], w[20], w[21], w[22], w[23], w[24], w[25], w[26], w[27]});
}

// A `DecoderLayer`'s keys and values of context rows alone (`layers.Attention.kv`: k and v projections, the k norm,
// rope on k; DFlash's KV injection of the target's context, `DFlashDrafter._absorb`), written into layer i of each
// sequence's caches (ns[j] rows of sequence j, in order, at its slots starts[j]..). Weights as `decoder_layer`'s.
void context_kv(const Tensor& x, const Tensor& cos, const Tensor& sin, const std::vector<OptT>& w, int64_t i,
                const std::vector<Tensor>& ck, const std::vector<Tensor>& cv, const std::vector<int64_t>& starts,
                const std::vector<int64_t>& ns, double qk_eps, int64_t KV, int64_t D) {
  auto [k, v] = keys_values(x, cos, sin, w, qk_eps, KV, D);
  write_kv(i, k, v, ck, cv, starts, ns);
}

// The k (<= 16) largest of x [V] as a set (indices in any order) and the k-th largest value, where the set is one:
// no NaN and no tie at the k-th value (then every top-k, ATen's included, picks the same elements; the refined head
// uses the set and that value only). The 16 lanes' maxima are 16 elements, so the k-th largest is at least their
// smallest: only the elements from there on are sorted. False where it does not apply (then ATen's topk decides)
AVX512 static bool top_set(const float* x, int64_t V, int64_t k, int64_t* idx, float* kth) {
  if (k > 16 || V < 16) return false;
  __m512 M = _mm512_set1_ps(-INFINITY);
  for (int64_t v = 0; v < V; v += 16) {
    const __mmask16 m = lanes(V - v);
    const __m512 e = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, x + v);
    if (_mm512_cmp_ps_mask(e, e, _CMP_UNORD_Q)) return false;  // a NaN
    M = _mm512_max_ps(M, e);
  }
  const float floor = _mm512_reduce_min_ps(M);
  if (!(floor > -INFINITY)) return false;
  constexpr int64_t CAP = 512;
  float cv[CAP + 16];
  int32_t ci[CAP + 16];
  int64_t c = 0;
  const __m512i step = _mm512_set1_epi32(16);
  __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 F = _mm512_set1_ps(floor);
  for (int64_t v = 0; v < V; v += 16, iota = _mm512_add_epi32(iota, step)) {
    const __mmask16 m = lanes(V - v);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, x + v), F, _CMP_GE_OQ);
    if (!hit) continue;
    _mm512_mask_compressstoreu_ps(cv + c, hit, _mm512_maskz_loadu_ps(m, x + v));
    _mm512_mask_compressstoreu_epi32(ci + c, hit, iota);
    c += __builtin_popcount(hit);
    if (c > CAP) return false;
  }
  if (c < k) return false;
  float sorted[CAP + 16];
  std::memcpy(sorted, cv, c * 4);
  std::nth_element(sorted, sorted + (k - 1), sorted + c, std::greater<float>());
  const float t = sorted[k - 1];
  int64_t above = 0, at = 0;
  for (int64_t i = 0; i < c; ++i) above += cv[i] > t, at += cv[i] == t;
  if (above + at != k) return false;  // a tie at the k-th value: which of them is ATen's choice
  for (int64_t i = 0, j = 0; i < c; ++i)
    if (cv[i] >= t) idx[j++] = ci[i];
  *kth = t;
  return true;
}

// `refined_head` of fp32 states h [n, d] by a bf16 head w [V, d] with its native product's copy (the dot product's or
// the tiles'): the same ops' arithmetic from raw rows (the product as `linear` runs it, widened; ATen keeps the top-k,
// the fp32 dot products' sums and the norm, so their orders and ties are its), bit for bit. False where it does not
// apply (then the ops run).
AVX512 static bool refined_rows(const Tensor& h, const Tensor& w, const OptT& packed, const OptT& wide, int64_t k,
                                double w_norm, std::vector<Tensor>& result) {
  if (!fast_layers || !dp_ok || h.dim() != 2 || h.scalar_type() != at::kFloat || !h.is_contiguous() ||
      !h.device().is_cpu() || w.dim() != 2 || w.scalar_type() != at::kBFloat16 || !w.is_contiguous() ||
      !packed.has_value() || (packed->dim() != 4 && packed->dim() != 6) || h.size(1) != w.size(1) ||
      h.size(1) % 2 != 0 || h.size(0) < 1 || h.size(0) > tile_max_rows || k < 1 || k >= w.size(0))
    return false;
  const int64_t n = h.size(0), d = h.size(1), V = w.size(0);
  const float* hp = h.data_ptr<float>();
  auto xb = at::empty({n, d}, h.options().dtype(at::kBFloat16));  // h.to(bf16): c10's rounding (`store`)
  uint16_t* xp = (uint16_t*)xb.data_ptr();
  for (int64_t i = 0; i < n * d; i += 16) {
    const __mmask16 m = lanes(n * d - i);
    store16(xp + i, _mm512_maskz_loadu_ps(m, hp + i), m);
  }
  const Tensor lowb = linear(xb, w, std::nullopt, packed, wide).contiguous();  // [n, V] bf16
  auto out = at::empty({n, V}, h.options());  // .to(fp32): exact
  float* op = out.data_ptr<float>();
  const uint16_t* lp = (const uint16_t*)lowb.data_ptr();
  for (int64_t i = 0; i < n * V; i += 16) {
    const __mmask16 m = lanes(n * V - i);
    _mm512_mask_storeu_ps(op + i, m, load16(lp + i, m));
  }
  auto idx = at::empty({n, k}, h.options().dtype(at::kLong));
  int64_t* ip = idx.data_ptr<int64_t>();
  std::vector<float> kth(n);
  for (int64_t r = 0; r < n; ++r)  // each row's top k: by `top_set` where it is unambiguous, else ATen's topk
    if (!top_set(op + r * V, V, k, ip + r * k, &kth[r])) {
      auto t = out[r].topk(k, -1);
      std::memcpy(ip + r * k, std::get<1>(t).contiguous().data_ptr<int64_t>(), k * 8);
      kth[r] = std::get<0>(t)[k - 1].item<float>();
    }
  auto prod = at::empty({n, k, d}, h.options());  // w[idx].float() * h: fp32 products, summed by ATen
  float* pp = prod.data_ptr<float>();
  const uint16_t* wp = (const uint16_t*)w.data_ptr();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < k; ++j) {
      const uint16_t* wr = wp + ip[r * k + j] * d;
      float* dst = pp + (r * k + j) * d;
      for (int64_t e = 0; e < d; e += 16) {
        const __mmask16 m = lanes(d - e);
        _mm512_mask_storeu_ps(dst + e, m, _mm512_mul_ps(load16(wr + e, m), _mm512_maskz_loadu_ps(m, hp + r * d + e)));
      }
    }
  auto exact = prod.sum(-1).contiguous();  // [n, k]
  const float* ep = exact.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r)  // scatter_: the top logits replaced by their fp32 dot products
    for (int64_t j = 0; j < k; ++j) op[r * V + ip[r * k + j]] = ep[r * k + j];
  // a row is unsafe where an unrefined logit could reach the refined maximum (`refined_head`'s bound, the same
  // float operations: ATen's scalars are taken in fp32)
  auto diff = at::empty({n, d}, h.options());
  float* dp = diff.data_ptr<float>();
  for (int64_t i = 0; i < n * d; i += 16) {
    const __mmask16 m = lanes(n * d - i);
    const __m512 x = _mm512_maskz_loadu_ps(m, hp + i);
    _mm512_mask_storeu_ps(dp + i, m, _mm512_sub_ps(x, round16(x)));
  }
  auto nrm = diff.norm(2, -1).contiguous();
  const float* np_ = nrm.data_ptr<float>();
  auto unsafe = at::empty({n}, h.options().dtype(at::kBool));
  bool* up = unsafe.data_ptr<bool>();
  const float scale = std::pow(2.0f, -7.0f), wn = (float)w_norm, tiny = (float)1e-3;
  for (int64_t r = 0; r < n; ++r) {
    const float err = std::fabs(kth[r]) * scale + wn * np_[r] + tiny;
    float mx = -INFINITY;
    for (int64_t j = 0; j < k; ++j) {
      const float x = ep[r * k + j];
      if (x != x) {  // max propagates NaN; a comparison with it is false
        mx = x;
        break;
      }
      mx = std::max(mx, x);
    }
    up[r] = kth[r] + err >= mx;
  }
  result = {out, unsafe};
  ++fast_calls;
  return true;
}

// `precision.Head` with fp32 refinement: logits of the weight's dtype upcast, the top k of each row recomputed as fp32
// dot products; and which rows an unrefined logit could still reach the refined maximum in (Python recomputes those
// in full fp32, rarely). h [.., d] (fp32 or the weight's dtype) -> (logits [.., V], unsafe rows [rows] bool)
std::vector<Tensor> refined_head(const Tensor& h, const Tensor& w, const OptT& packed, const OptT& wide, int64_t k,
                                 double w_norm) {
  std::vector<Tensor> fast;
  if (refined_rows(h, w, packed, wide, k, w_norm, fast)) return fast;
  auto low = linear(h.to(w.scalar_type()), w, std::nullopt, packed, wide).to(at::kFloat);
  auto shape = low.sizes().vec();
  low = low.reshape({-1, shape.back()});
  auto hf = h.reshape({-1, h.size(-1)}).to(at::kFloat);
  auto top = low.topk(k, -1);
  auto idx = std::get<1>(top);
  auto exact = (w.index({idx}).to(at::kFloat) * hf.unsqueeze(1)).sum(-1);
  auto out = low.scatter_(-1, idx, exact);
  Tensor unsafe;
  if (k < shape.back()) {
    auto kth = std::get<0>(top).select(1, -1);
    auto err = kth.abs() * std::pow(2.0, -7) + w_norm * (hf - hf.to(w.scalar_type()).to(at::kFloat)).norm(2, -1) + 1e-3;
    unsafe = (kth + err).ge(std::get<0>(exact.max(-1)));
  } else {
    unsafe = at::zeros({out.size(0)}, out.options().dtype(at::kBool));
  }
  return {out.view(shape), unsafe};
}

// `LeanDecoder.forward` of one sequence's rows at consecutive positions after its cache, or `forward_many` of several
// sequences' (ids[j] after cache j from slot starts[j]), with no tree mask, no contemplate rows and no other head than
// the model's, in one call: the embedding's rows, the rotary tables' rows from each start, the additive causal mask of
// each sequence of more than one row (`layers.causal_mask`), `fused_layers`, the kept layers' outputs joined in the
// order asked, the last `last` rows (0: all; one sequence), then with fp32 logits (k > 0: the head's refined top k)
// the final norm in fp32 (`precision.rms_norm32`, `norm` its fp32 weight) and `refined_head`, else (k = 0) the final
// norm and the head in the model's dtype, upcast: the Python path's ops in its order, the same bits, without its
// dispatch. -> [logits, the rows to recompute in full fp32 (undefined at k = 0), final-norm states, features
// (undefined without layers)], every sequence's rows in order
std::vector<Tensor> lean_forward(const std::vector<Tensor>& ids, const Tensor& embed, const Tensor& cos_t,
                                 const Tensor& sin_t, const std::vector<std::vector<OptT>>& W,
                                 const std::vector<Tensor>& ck, const std::vector<Tensor>& cv,
                                 const std::vector<int64_t>& starts, double scale, double eps, int64_t H, int64_t KV,
                                 int64_t D, const std::vector<int64_t>& layers, int64_t last, const Tensor& norm,
                                 double norm_eps, const Tensor& head_w, const OptT& packed, const OptT& wide,
                                 int64_t k, double w_norm) {
  const size_t S = ids.size();
  TORCH_CHECK(S >= 1 && ck.size() == S && cv.size() == S && starts.size() == S && (last == 0 || S == 1),
              "speclab lean_forward: one cache and start per sequence (and `last` for one sequence only)");
  std::vector<int64_t> ns(S);
  std::vector<OptT> masks(S);
  std::vector<Tensor> cs(S), ss(S);
  for (size_t j = 0; j < S; ++j) {
    const int64_t n = ns[j] = ids[j].numel(), start = starts[j], end = start + n;
    TORCH_CHECK(n >= 1 && end <= cos_t.size(0) && end <= ck[j].size(2),
                "speclab lean_forward: rows past the rotary tables or the cache");
    cs[j] = cos_t.slice(0, start, end);
    ss[j] = sin_t.slice(0, start, end);
    if (n > 1)
      masks[j] = at::zeros({n, end}, embed.options())
                     .masked_fill_(at::ones({n, end}, embed.options().dtype(at::kBool)).tril(end - n).logical_not(),
                                   -INFINITY);
  }
  // the rows `embed[ids]` takes, as index_select: advanced indexing sets up a TensorIterator (14 us a call, cold)
  auto h = embed.index_select(0, S == 1 ? ids[0] : at::cat(ids));
  auto cos = (S == 1 ? cs[0] : at::cat(cs)).unsqueeze(1), sin = (S == 1 ? ss[0] : at::cat(ss)).unsqueeze(1);
  std::vector<int64_t> keep(layers.begin(), layers.end());
  std::sort(keep.begin(), keep.end());
  keep.erase(std::unique(keep.begin(), keep.end()), keep.end());
  auto out = fused_layers(h, cos, sin, W, ck, cv, starts, ns, masks, scale, eps, H, KV, D, keep);
  Tensor feats;
  if (!layers.empty()) {
    std::vector<Tensor> parts;
    for (auto l : layers) parts.push_back(out[1 + (std::lower_bound(keep.begin(), keep.end(), l) - keep.begin())]);
    feats = parts.size() == 1 ? parts[0] : at::cat(parts, -1);
  }
  h = out[0];
  if (last > 0) h = h.slice(0, -last);
  if (k == 0) {  // logits of the model's dtype (`logits='model'`, or an fp32 model): its norm, its head, upcast
    h = rms_norm(h, norm, norm_eps);
    return {linear(h.to(head_w.scalar_type()), head_w, std::nullopt, packed, wide).to(at::kFloat), Tensor(), h, feats};
  }
  h = rms_norm(h.to(at::kFloat), norm, norm_eps);
  auto lr = refined_head(h, head_w, packed, wide, k, w_norm);
  return {lr[0], lr[1], h, feats};
}

// Two rows' RMSNorms side by side: [rms_norm(a, wa), rms_norm(b, wb)] (EAGLE-3's attention input,
// `Eagle3Model.attn_input`: the embedding's and the hidden state's norms), one call instead of three from Python
Tensor pair_norm(const Tensor& a, const OptT& wa, double ea, const Tensor& b, const OptT& wb, double eb) {
  return at::cat({rms_norm(a, wa, ea), rms_norm(b, wb, eb)}, -1);
}

// A drafter's head as log-probabilities: log_softmax(float(linear(rms_norm(h, nw), w))) over the last dim, the ops of
// `Eagle3Drafter._logits` and the log_softmax after it in one call (`layers.linear`'s product: `linear` above)
Tensor head_logp(const Tensor& h, const OptT& nw, double eps, const Tensor& w, const OptT& packed, const OptT& wide) {
  return at::log_softmax(linear(rms_norm(h, nw, eps), w, std::nullopt, packed, wide).to(at::kFloat), -1);
}

// The first index of the maximum of x [V] (a NaN counts as the maximum: its first index), as `max(-1)`'s indices
AVX512 static int64_t first_max(const float* x, int64_t V) {
  __m512 M = _mm512_set1_ps(-INFINITY);
  for (int64_t v = 0; v < V; v += 16) {
    const __mmask16 m = lanes(V - v);
    const __m512 e = _mm512_maskz_loadu_ps(m, x + v);
    if (_mm512_mask_cmp_ps_mask(m, e, e, _CMP_UNORD_Q))
      for (int64_t u = v;; ++u)
        if (x[u] != x[u]) return u;
    M = _mm512_mask_max_ps(M, m, e, M);
  }
  const float mx = _mm512_reduce_max_ps(M);
  for (int64_t v = 0; v < V; ++v)
    if (x[v] == mx) return v;
  return 0;  // every element -inf: the first
}

// A greedy chain's verdict (`verify.verify_tokens` of a chain): the accepted nodes are the first a of tokens [n] each
// equal to the first maximal index of its parent's row of logits [>= n + 1, V] (fp32; row 0 the root's), and the
// target's token is row a's; the rows after the first mismatch are not read. -> {a, the target's token}
static std::vector<int64_t> greedy_chain(const Tensor& logits_in, const Tensor& tokens_in) {
  const Tensor x = logits_in.contiguous(), tokens = tokens_in.to(at::kLong).contiguous();
  const int64_t n = tokens.numel(), V = x.size(-1);
  TORCH_CHECK(se_ok && x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(0) > n && x.device().is_cpu(),
              "greedy_chain: fp32 CPU rows, one more than the chain's tokens, AVX512F");
  const float* xp = x.data_ptr<float>();
  const int64_t* tp = tokens.data_ptr<int64_t>();
  for (int64_t a = 0;; ++a) {
    const int64_t top = first_max(xp + a * V, V);
    if (a == n || tp[a] != top) return {a, top};
  }
}

// row = l + float(bias) [V] (bias bf16 where b16, else fp32), one IEEE addition an element -> its first maximal index
AVX512 static int64_t biased_max(const float* l, const char* bias, bool b16, float* row, int64_t V) {
  for (int64_t v = 0; v < V; v += 16) {
    const __mmask16 m = lanes(V - v);
    const __m512 x = b16 ? load16((const uint16_t*)bias + v, m) : _mm512_maskz_loadu_ps(m, (const float*)bias + v);
    _mm512_mask_storeu_ps(row + v, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, l + v), x));
  }
  return first_max(row, V);
}

// DSpark's Markov head over draft blocks at T = 0, left to right (`DFlashDrafter._markov_chains`): block j's row k
// (logits[j] [n_j, V] fp32) gets the bias W2 W1[x] of the token before it (the root for k = 0, then the row before's
// pick) and its argmax is the pick, for every block still drafting at once; the ops of the Python loop, in its order,
// from C++ (a row took about ten calls from Python). -> [each block's picks [n_j]..., their softmax probabilities
// [n_j]...]
std::vector<Tensor> markov_chains(const std::vector<Tensor>& logits, const Tensor& roots, const Tensor& w1,
                                  const Tensor& w2, const OptT& packed, const OptT& wide) {
  // the ops' arithmetic from raw rows, in their order: per row, bias = linear(W1[x], W2) over every block still
  // drafting (the same product), row = logits + float(bias) (one IEEE addition an element), its first maximal
  // index; the probabilities: one softmax over every block's rows (a row's softmax is its own, however many rows)
  const int64_t R = (int64_t)logits.size(), r = w1.size(1);
  int64_t n = 0, total = 0;
  std::vector<int64_t> off(R + 1, 0);
  std::vector<Tensor> ls(R);
  for (int64_t j = 0; j < R; ++j) {
    ls[j] = logits[j].to(at::kFloat).contiguous();
    n = std::max(n, ls[j].size(0));
    off[j + 1] = off[j] + ls[j].size(0);
  }
  total = off[R];
  const int64_t V = w2.size(0);
  bool rows_ok = true;  // every block's rows as wide as the bias
  for (const auto& l : ls) rows_ok = rows_ok && l.dim() == 2 && l.size(1) == V;
  const bool raw = rows_ok && fast_layers && dp_ok && w1.is_contiguous() && w1.dim() == 2 && w2.dim() == 2 &&
                   (w1.scalar_type() == at::kBFloat16 || w1.scalar_type() == at::kFloat) && roots.dim() == 1 &&
                   roots.scalar_type() == at::kLong && total > 0;
  if (!raw) {  // the ops
    auto prev = roots.clone();
    std::vector<std::vector<Tensor>> rows(R), picks(R);
    for (int64_t k = 0; k < n; ++k) {
      std::vector<int64_t> live;
      std::vector<Tensor> lk;
      for (int64_t j = 0; j < R; ++j)
        if (k < logits[j].size(0)) live.push_back(j), lk.push_back(logits[j][k]);
      auto idx = at::tensor(live, roots.options());
      auto row = at::stack(lk) + linear(w1.index_select(0, prev.index_select(0, idx)), w2, std::nullopt, packed, wide)
                                     .to(at::kFloat);
      auto pick = std::get<1>(row.max(-1));  // argmax's first maximal index, by the faster kernel (`sampling.argmax`)
      prev = prev.clone();
      prev.index_put_({idx}, pick);
      for (size_t i = 0; i < live.size(); ++i) {
        rows[live[i]].push_back(row[i]);
        picks[live[i]].push_back(pick.slice(0, i, i + 1));
      }
    }
    std::vector<Tensor> out;
    for (int64_t j = 0; j < R; ++j) out.push_back(at::cat(picks[j]));
    for (int64_t j = 0; j < R; ++j)
      out.push_back(at::softmax(at::stack(rows[j]), -1).gather(1, out[j].unsqueeze(1)).select(1, 0));
    return out;
  }
  std::vector<int64_t> prev(R);
  for (int64_t j = 0; j < R; ++j) prev[j] = roots[j].item<int64_t>();
  auto rows = at::empty({total, V}, ls[0].options());
  auto picks = at::empty({total}, roots.options());
  float* rp = rows.data_ptr<float>();
  int64_t* pp = picks.data_ptr<int64_t>();
  const size_t esz = w1.element_size();
  const char* w1p = (const char*)w1.data_ptr();
  for (int64_t k = 0; k < n; ++k) {
    std::vector<int64_t> live;
    for (int64_t j = 0; j < R; ++j)
      if (k < ls[j].size(0)) live.push_back(j);
    const int64_t L = (int64_t)live.size();
    auto emb = at::empty({L, r}, w1.options());  // W1[x]: its rows, copied
    for (int64_t i = 0; i < L; ++i)
      std::memcpy((char*)emb.data_ptr() + i * r * esz, w1p + prev[live[i]] * r * esz, r * esz);
    const Tensor bias = linear(emb, w2, std::nullopt, packed, wide).contiguous();  // [L, V]
    const bool b16 = bias.scalar_type() == at::kBFloat16;
    at::parallel_for(0, L, 1, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) {
        const int64_t j = live[i];
        const float* lp = ls[j].data_ptr<float>() + k * V;
        float* row = rp + (off[j] + k) * V;
        pp[off[j] + k] = biased_max(lp, (const char*)bias.data_ptr() + i * V * bias.element_size(), b16, row, V);
      }
    });
    for (int64_t j : live) prev[j] = pp[off[j] + k];
  }
  const Tensor sm = at::softmax(rows, -1);
  const Tensor got = sm.gather(1, picks.unsqueeze(1)).select(1, 0);
  std::vector<Tensor> out;
  for (int64_t j = 0; j < R; ++j) out.push_back(picks.slice(0, off[j], off[j + 1]));
  for (int64_t j = 0; j < R; ++j) out.push_back(got.slice(0, off[j], off[j + 1]));
  return out;
}

// `sampling.logits_to_probs` at T > 0, its ops in its order: rows of logits -> the distribution sampled from
// (temperature t, then top-k where 0 < top_k < V, then top-p where top_p < 1)
static Tensor probs_of(const Tensor& logits_in, double t, int64_t top_k, double top_p) {
  Tensor logits = t == 1.0 ? logits_in.to(at::kFloat) : logits_in.to(at::kFloat) / t;
  const int64_t V = logits.size(-1);
  if (top_k > 0 && top_k < V) {
    auto kth = std::get<0>(at::topk(logits, top_k, -1)).narrow(-1, top_k - 1, 1);
    logits = logits.masked_fill(logits < kth, -INFINITY);
  }
  if (top_p < 1.0) {
    auto [sorted, idx] = at::sort(logits, -1, true);
    auto cum = sorted.softmax(-1).cumsum(-1);
    auto drop = (cum - sorted.softmax(-1)) > top_p;
    sorted = sorted.masked_fill(drop, -INFINITY);
    logits = at::full_like(logits, -INFINITY).scatter(-1, idx, sorted);
  }
  return at::softmax(logits, -1);
}

// DSpark's Markov head over one draft block at T > 0, left to right (`DFlashDrafter._left_to_right`): row k of
// logits [n, V] gets the bias W2 W1[x] of the token before it (the root for k = 0), then its token is drawn from
// q_k = `probs_of` (t: the target's temperature times the draft temperature) at uniform u[k] (`draw_rows`); the ops
// of the Python loop in its order. -> [the tokens [n], q at them [n], the rows q [n, V]]
std::vector<Tensor> markov_draws(const Tensor& logits, const Tensor& root, const Tensor& w1, const Tensor& w2,
                                 const OptT& packed, const OptT& wide, const Tensor& u, double t, int64_t top_k,
                                 double top_p) {
  const int64_t n = logits.size(0), V = w2.size(0), r = w1.dim() == 2 ? w1.size(1) : 0;
  if (fast_layers && dp_ok && logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
      logits.size(1) == V && w1.dim() == 2 && w1.is_contiguous() && root.numel() == 1 && u.numel() >= n &&
      (w1.scalar_type() == at::kBFloat16 || w1.scalar_type() == at::kFloat)) {
    // from raw rows: W1[x] copied, one product, the add in a loop, `probs_of`, the inverse CDF on q's row (the ops'
    // bits: the same IEEE additions, ATen's transform and softmax, `draw_rows`'s loop), without eight ops a row
    int64_t prev = root.to(at::kLong).item<int64_t>();
    auto tokens = at::empty({n}, root.options().dtype(at::kLong)), qx = at::empty({n}, logits.options());
    auto qs = at::empty({n, V}, logits.options());
    const Tensor us = u.to(at::kFloat).contiguous();
    auto emb = at::empty({1, r}, w1.options());
    auto row = at::empty({1, V}, logits.options());
    std::vector<float> cdf(V);
    const size_t esz = w1.element_size();
    for (int64_t k = 0; k < n; ++k) {
      std::memcpy(emb.data_ptr(), (const char*)w1.data_ptr() + prev * r * esz, r * esz);
      const Tensor bias = linear(emb, w2, std::nullopt, packed, wide).contiguous();
      const float* lp = logits.data_ptr<float>() + k * V;
      float* rp = row.data_ptr<float>();
      if (bias.scalar_type() == at::kBFloat16) {
        const at::BFloat16* bp = bias.data_ptr<at::BFloat16>();
        for (int64_t v = 0; v < V; ++v) rp[v] = lp[v] + (float)bp[v];
      } else {
        const float* bp = bias.data_ptr<float>();
        for (int64_t v = 0; v < V; ++v) rp[v] = lp[v] + bp[v];
      }
      const Tensor q = probs_of(row, t, top_k, top_p).contiguous();
      const float* qp = q.data_ptr<float>();
      std::memcpy(qs.data_ptr<float>() + k * V, qp, V * sizeof(float));
      prev = inverse_cdf(qp, V, us.data_ptr<float>()[k], cdf);
      tokens.data_ptr<int64_t>()[k] = prev;
      qx.data_ptr<float>()[k] = qp[prev];
    }
    return {tokens, qx, qs};
  }
  auto prev = root.view({1});
  std::vector<Tensor> tokens, qx, qs;
  for (int64_t k = 0; k < logits.size(0); ++k) {
    auto row = logits.narrow(0, k, 1) + linear(w1.index_select(0, prev), w2, std::nullopt, packed, wide).to(at::kFloat);
    auto q = probs_of(row, t, top_k, top_p);
    auto drawn = draw_rows(q, u.narrow(0, k, 1), std::nullopt, 0);
    prev = drawn[0];
    tokens.push_back(drawn[0]), qx.push_back(drawn[1]), qs.push_back(q);
  }
  return {at::cat(tokens), at::cat(qx), at::cat(qs)};
}

// A sampled chain's block verification (`verify._verify_sampled_chain` under the block rule, Sun et al. 2025): the
// target's distributions p = `probs_of`(logits [n + 1, V], t, top_k, top_p); node i's token x[i] drawn from q[i]
// (q [n, V] fp32; none: point masses at x); weights w_0 = 1, w_i = min(w_{i-1} p_{i-1}(x) / q_{i-1}(x), 1) in double;
// tests h_i = S_i / (S_i + 1 - w_i) below n (S_i = sum max(w_i p_i - q_i, 0), a point mass: w_i (1 - p_i(x))), h_n =
// w_n; the longest path whose test passes at u[i - 1] < h_i; the target's token after it drawn at ub from p_n or from
// norm(max(w_a p_a - q_a, 0)) (`draw_rows`). The Python functions' ops and scalars in their order: the same bits, the
// same decisions, from one call instead of about twenty (no nodes: the target's token drawn from p_0, an AR step's
// or a round without a draft's). -> [p, the nodes kept a, the token]
std::vector<Tensor> block_verify(const Tensor& logits, double t, int64_t top_k, double top_p, const OptT& q,
                                 const Tensor& x_in, const Tensor& u_in, const Tensor& ub) {
  const Tensor p = probs_of(logits, t, top_k, top_p).contiguous();
  const Tensor x = x_in.to(at::kLong).contiguous(), u = u_in.to(at::kFloat).contiguous();
  const int64_t n = x.numel(), V = p.size(-1);
  TORCH_CHECK(p.dim() == 2 && p.size(0) >= n + 1 && u.numel() >= n &&
              (!q.has_value() || (q->scalar_type() == at::kFloat && q->size(0) >= n && q->size(1) == V)),
              "block_verify: p [>= n + 1, V], q [n, V] fp32 or none, x [n], u [n]");
  const int64_t* xp = x.data_ptr<int64_t>();
  const float* pp = p.data_ptr<float>();
  std::vector<float> px(n);
  std::vector<double> w{1.0};
  const Tensor qc = q.has_value() ? q->contiguous() : Tensor();
  for (int64_t i = 0; i < n; ++i) {
    px[i] = pp[i * V + xp[i]];
    const float ratio = q.has_value() ? px[i] / std::max(qc.data_ptr<float>()[i * V + xp[i]], 1e-30f) : px[i];
    w.push_back(std::min(w.back() * (double)ratio, 1.0));
  }
  std::vector<double> mass(std::max<int64_t>(n - 1, 0));
  if (n > 1 && q.has_value()) {
    const Tensor wt = at::tensor(std::vector<float>(w.begin() + 1, w.begin() + n), p.options());
    const Tensor s = (wt.unsqueeze(1) * p.narrow(0, 1, n - 1) - qc.narrow(0, 1, n - 1)).clamp(0).sum(-1);
    for (int64_t i = 0; i < n - 1; ++i) mass[i] = s.data_ptr<float>()[i];
  } else {
    for (int64_t i = 1; i < n; ++i) mass[i - 1] = w[i] * (1.0 - (double)px[i]);
  }
  int64_t a = 0;
  for (int64_t i = n; i >= 1; --i) {
    const double h = i == n ? w[n] : mass[i - 1] / std::max(mass[i - 1] + 1.0 - w[i], 1e-30);
    if ((double)u.data_ptr<float>()[i - 1] < h) {
      a = i;
      break;
    }
  }
  Tensor row = p.narrow(0, a, 1);
  if (a < n) {
    const Tensor wp = p[a] * w[a];
    const Tensor qa = q.has_value() ? qc[a] : at::one_hot(x.narrow(0, a, 1), V).to(at::kFloat)[0];
    const Tensor r = (wp - qa).clamp(0);
    const Tensor sum = r.sum(-1, true);
    row = at::where(sum > 0, r / sum.clamp(1e-30), wp).unsqueeze(0);
  }
  const Tensor tok = draw_rows(row, ub, std::nullopt, 0)[0];
  return {p, at::scalar_tensor(a, x.options()), tok};
}

// EAGLE-3's KV-only catch-up (`Eagle3Drafter._prefill` with its dense head): the backlog's m tokens `ids` (rows of
// `embed`, in the drafter's dtype) with the target's features `feats` [m, F] through fc, `pair_norm` and
// `decoder_layer` at cache slots start.. (rotary positions start..), its last row alone querying, then the head's
// logits of that row in fp32. The ops of the Python method, in its order (the same bits), in one call.
// -> [the last row's pre-norm output [1, H], its logits [1, Vd]]
std::vector<Tensor> eagle3_prefill(const Tensor& ids, const Tensor& embed, const Tensor& feats, const Tensor& fc,
                                   const OptT& fc_packed, const OptT& fc_wide, const Tensor& cos, const Tensor& sin,
                                   int64_t start, const std::vector<OptT>& w, const Tensor& ck, const Tensor& cv,
                                   double scale, double qk_eps, double eps, int64_t H, int64_t KV, int64_t D,
                                   const OptT& in_w, double in_eps, const OptT& hid_w, double hid_eps,
                                   const OptT& out_w, double out_eps, const Tensor& head, const OptT& packed,
                                   const OptT& wide) {
  const int64_t m = ids.numel();
  TORCH_CHECK(m >= 1 && feats.dim() == 2 && feats.size(0) == m, "eagle3_prefill: m >= 1 tokens, a feature row each");
  const auto dtype = fc.scalar_type();
  const Tensor emb = embed.index_select(0, ids).to(dtype);
  const Tensor h = linear(feats.to(dtype), fc, std::nullopt, fc_packed, fc_wide);
  const Tensor pos = at::arange(start, start + m, ids.options().dtype(at::kLong));
  const Tensor out = decoder_layer(pair_norm(emb, in_w, in_eps, h, hid_w, hid_eps), h.narrow(0, m - 1, 1),
                                   cos.index_select(0, pos).unsqueeze(1), sin.index_select(0, pos).unsqueeze(1), w, 0,
                                   {ck}, {cv}, {start}, {m}, {std::nullopt}, scale, qk_eps, eps, H, KV, D,
                                   at::tensor({m - 1}, pos.options()), {1});
  return {out, linear(rms_norm(out, out_w, out_eps), head, std::nullopt, packed, wide).to(at::kFloat)};
}

// A standalone draft model's chain (`StandaloneDraft._chain` with its dense head and no stop_prob): from the root row's
// fp32 logits [1, V], level by level its token and draft probability (greedy, t <= 0: the first maximum and
// exp(logit - logsumexp); else drawn from `probs_of` at t, the target's temperature times the draft temperature, at
// uniform u[level] by `draw_rows`: its q(x)), then, below the last level, that token's `lean_forward` after the draft's
// cache (one row at slot start + level) for the next level's logits, a row the refined head marks recomputed in full
// fp32 as `Head.full_rows` does. The ops of the Python loop, in its order (the same bits), without its dispatch.
// -> [the tokens [depth], their draft probabilities [depth], q's rows [depth, V] (sampled; else undefined)]
std::vector<Tensor> draft_chain(const Tensor& root_logits, int64_t depth, double t, int64_t top_k, double top_p,
                                const Tensor& u, const Tensor& embed, const Tensor& cos_t, const Tensor& sin_t,
                                const std::vector<std::vector<OptT>>& W, const Tensor& ck, const Tensor& cv,
                                int64_t start, double scale, double eps, int64_t H, int64_t KV, int64_t D,
                                const Tensor& norm, double norm_eps, const Tensor& head_w, const OptT& packed,
                                const OptT& wide, int64_t k, double w_norm) {
  TORCH_CHECK(depth >= 1 && root_logits.dim() == 2 && root_logits.size(0) == 1 &&
                  root_logits.scalar_type() == at::kFloat && (t <= 0 || u.numel() >= depth),
              "draft_chain: one fp32 root row, depth >= 1, a uniform a level");
  Tensor logits = root_logits;
  std::vector<Tensor> toks, dps, qs;
  for (int64_t level = 0; level < depth; ++level) {
    Tensor tok;
    if (t <= 0) {
      auto [top, idx] = logits.max(-1);  // `argmax`: the first maximal index (NaN counts as maximal)
      tok = idx;
      dps.push_back((logits.select(0, 0).index({idx}) - logits.select(0, 0).logsumexp(-1)).exp());
    } else {
      const Tensor q = probs_of(logits, t, top_k, top_p);
      auto drawn = draw_rows(q, u.narrow(0, level, 1), std::nullopt, 0);
      tok = drawn[0];
      dps.push_back(drawn[1]);
      qs.push_back(q);
    }
    toks.push_back(tok);
    if (level == depth - 1) break;
    auto out = lean_forward({tok}, embed, cos_t, sin_t, W, {ck}, {cv}, {start + level}, scale, eps, H, KV, D, {}, 0,
                            norm, norm_eps, head_w, packed, wide, k, w_norm);
    logits = out[0];
    if (out[1].defined() && out[1].any().item<bool>())  // `Head.full_rows`: the row in full fp32
      logits = at::linear(out[2], head_w.to(at::kFloat));
  }
  return {at::cat(toks), at::cat(dps), qs.empty() ? Tensor() : at::cat(qs)};
}

// EAGLE-3's chain (`Eagle3Drafter._chain` with its dense head): from the root row's logits [1, Vd] and pre-norm output
// [1, H], `depth` tokens, each the argmax of the log-probabilities (t = 0) or drawn from q = `probs_of`(log-probs, t,
// top_k, top_p) at uniform u[level - 1] (`draw_rows`, q spread over the target's `vocab` ids by `to_target`); after
// every token but the last, one drafter layer call on it: its embedding row (in the drafter's dtype), `pair_norm` with
// its parent's output, `decoder_layer` at cache slot start + level - 1 and rotary position pos0 + level, `head_logp`.
// The ops of the Python loop, in its order (so the same bits), without its dispatch: about 50 us a level from Python.
// -> [tokens [depth] (target ids), log q(x) [depth], q's rows [depth, vocab] (sampled; empty at t = 0)]
std::vector<Tensor> eagle3_chain(const Tensor& root_logits, const Tensor& root_h, int64_t depth, const Tensor& embed,
                                 const Tensor& cos, const Tensor& sin, int64_t pos0, const std::vector<OptT>& w,
                                 const Tensor& ck, const Tensor& cv, int64_t start, double scale, double qk_eps,
                                 double eps, int64_t H, int64_t KV, int64_t D, const OptT& in_w, double in_eps,
                                 const OptT& hid_w, double hid_eps, const OptT& out_w, double out_eps,
                                 const Tensor& head, const OptT& packed, const OptT& wide, const Tensor& to_target,
                                 int64_t vocab, double t, int64_t top_k, double top_p, const Tensor& u) {
  TORCH_CHECK(depth >= 1 && root_logits.dim() == 2 && root_logits.size(0) == 1 && root_h.dim() == 2 &&
              (t <= 0 || u.numel() >= depth), "eagle3_chain: one root row, depth >= 1, a uniform a level");
  Tensor logp = at::log_softmax(root_logits.to(at::kFloat), -1), h = root_h;
  std::vector<Tensor> toks, lqs, qs;
  for (int64_t level = 1; level <= depth; ++level) {
    Tensor tok;
    if (t <= 0) {
      auto [lq, idx] = logp.max(-1);
      tok = to_target.index({idx});
      lqs.push_back(lq);
    } else {
      auto drawn = draw_rows(probs_of(logp, t, top_k, top_p), u.narrow(0, level - 1, 1), to_target, vocab);
      tok = drawn[0];
      lqs.push_back(drawn[1].log());
      qs.push_back(drawn[2]);
    }
    toks.push_back(tok);
    if (level == depth) break;
    const int64_t p = pos0 + level;
    const Tensor emb = embed.index_select(0, tok).to(root_h.scalar_type());
    h = decoder_layer(pair_norm(emb, in_w, in_eps, h, hid_w, hid_eps), h, cos.narrow(0, p, 1).unsqueeze(1),
                      sin.narrow(0, p, 1).unsqueeze(1), w, 0, {ck}, {cv}, {start + level - 1}, {1}, {std::nullopt},
                      scale, qk_eps, eps, H, KV, D, std::nullopt, {1});
    logp = head_logp(h, out_w, out_eps, head, packed, wide);
  }
  return {at::cat(toks), at::cat(lqs), qs.empty() ? Tensor() : at::cat(qs)};
}

// DFlash's draft forward (`DFlashDrafter.blocks_logits` with a dense head) for the drafters of one model: first the
// backlogs (`_absorb`): the context rows feats [sum cn, F] of drafters ctx (indices into the caches; cn[j] rows each)
// through fc and hidden_norm, and each layer's keys and values of them (`context_kv`) at slots known[j]..; then every
// drafter's block ids [sum n] (its root, then masks) from the embedding table times emb_scale, through each layer
// (`decoder_layer` after the layer's input norm, each block over its own cache's context and itself) at slots and
// rotary positions after its context; the mask rows' final norm and the head in the drafter's dtype, upcast, times
// out_mult. The ops of the Python path, in its order (the same bits), without its dispatch. With no ids, the backlogs
// alone (a drafter's own catch-up) -> [].
// -> [the mask rows' final-norm states [sum (n - 1), H], their fp32 logits [sum (n - 1), V]]
std::vector<Tensor> dflash_block(const Tensor& feats, const Tensor& fc, const OptT& fc_b, const OptT& fc_packed,
                                 const OptT& fc_wide, const OptT& hid_w, double hid_eps,
                                 const std::vector<int64_t>& ctx, const std::vector<int64_t>& cn, const Tensor& ids,
                                 const Tensor& embed, double emb_scale, const Tensor& cos_t, const Tensor& sin_t,
                                 const std::vector<std::vector<OptT>>& W, const std::vector<OptT>& in_w,
                                 const std::vector<double>& in_eps, const std::vector<double>& qk_eps,
                                 const std::vector<double>& kn_eps, const std::vector<double>& post_eps,
                                 const std::vector<Tensor>& ck, const std::vector<Tensor>& cv,
                                 const std::vector<int64_t>& known, const std::vector<int64_t>& ns, double scale,
                                 int64_t H, int64_t KV, int64_t D, const OptT& norm_w, double norm_eps,
                                 const Tensor& head, const OptT& packed, const OptT& wide, double out_mult) {
  const size_t S = ck.size(), C = ctx.size(), NL = W.size();
  TORCH_CHECK(S >= 1 && cv.size() == S && known.size() == S && ns.size() == S && cn.size() == C &&
              in_w.size() == NL && in_eps.size() == NL && qk_eps.size() == NL && kn_eps.size() == NL &&
              post_eps.size() == NL, "speclab dflash_block: a cache, a context length and a block per drafter");
  const auto dtype = fc.scalar_type();
  auto ropes = [&](const std::vector<int64_t>& starts, const std::vector<int64_t>& rows) {
    std::vector<Tensor> cs, ss;
    for (size_t j = 0; j < starts.size(); ++j) {
      TORCH_CHECK(starts[j] + rows[j] <= cos_t.size(0), "speclab dflash_block: rows past the rotary tables");
      cs.push_back(cos_t.slice(0, starts[j], starts[j] + rows[j]).unsqueeze(1));
      ss.push_back(sin_t.slice(0, starts[j], starts[j] + rows[j]).unsqueeze(1));
    }
    return std::make_pair(cs.size() == 1 ? cs[0] : at::cat(cs), ss.size() == 1 ? ss[0] : at::cat(ss));
  };
  std::vector<int64_t> starts(known.begin(), known.end());
  if (C) {  // the backlogs: context keys and values only
    const Tensor c = rms_norm(linear(feats, fc, fc_b, fc_packed, fc_wide), hid_w, hid_eps);
    std::vector<int64_t> at0;
    std::vector<Tensor> k, v;
    for (auto j : ctx) at0.push_back(known[j]), k.push_back(ck[j]), v.push_back(cv[j]);
    auto [cos, sin] = ropes(at0, cn);
    for (size_t i = 0; i < NL; ++i) {
      auto kv = keys_values(c, cos, sin, W[i], kn_eps[i], KV, D);
      write_kv(i, kv.first, kv.second, k, v, at0, cn);
    }
    for (size_t j = 0; j < C; ++j) starts[ctx[j]] += cn[j];
  }
  if (ids.numel() == 0) return {};
  Tensor x = embed.index_select(0, ids).to(dtype) * emb_scale;
  auto [cos, sin] = ropes(starts, ns);
  const std::vector<OptT> masks(S);
  for (size_t i = 0; i < NL; ++i)
    x = decoder_layer(rms_norm(x, in_w[i], in_eps[i]), x, cos, sin, W[i], i, ck, cv, starts, ns, masks, scale,
                      qk_eps[i], post_eps[i], H, KV, D, std::nullopt, {});
  std::vector<Tensor> rows;
  int64_t a = 0;
  for (size_t j = 0; j < S; ++j) rows.push_back(x.slice(0, a + 1, a + ns[j])), a += ns[j];
  const Tensor h = rms_norm(S == 1 ? rows[0] : at::cat(rows), norm_w, norm_eps);
  return {h, linear(h, head, std::nullopt, packed, wide).to(at::kFloat) * out_mult};
}

// The GIL is released while a call runs, as torch's own Python bindings release it around each op: other Python
// threads (the trace's writer, the app's server) keep running meanwhile
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("fused_layers", &fused_layers, release());
  m.def("decoder_layer", &decoder_layer, release());
  m.def("context_kv", &context_kv, release());
  m.def("refined_head", &refined_head, release());
  m.def("lean_forward", &lean_forward, release());
  m.def("pair_norm", &pair_norm, release());
  m.def("head_logp", &head_logp, release());
  m.def("markov_chains", &markov_chains, release());
  m.def("markov_draws", &markov_draws, release());
  m.def("eagle3_chain", &eagle3_chain, release());
  m.def("draft_chain", &draft_chain, release());
  m.def("block_verify", &block_verify, release());
  m.def("eagle3_prefill", &eagle3_prefill, release());
  m.def("dflash_block", &dflash_block, release());
  m.def("rms_norm", &rms_norm, release());
  m.def("rope", &rope, release());
  m.def("set_fused", &set_fused);
  m.def("set_fast_layers", &set_fast_layers);
  m.def("set_attn_tiles", &set_attn_tiles);
  m.def("set_dp_ahead", &set_dp_ahead);
  m.def("get_fast_calls", &get_fast_calls);
  m.def("product_init", &product_init);
  m.def("se_init", &se_init);
  m.def("attn_init", &attn_init);
  m.def("softmax_entropy", &softmax_entropy, release());
  m.def("round_stats", &round_stats, release());
  m.def("draw_rows", &draw_rows, release());
  m.def("chain_accept", &chain_accept, release());
  m.def("greedy_chain", &greedy_chain, release());
  m.def("set_row_limits", &set_row_limits);
  m.def("set_int8_rows", &set_int8_rows);
  m.def("vnni_ok", &vnni_ok);
  m.def("tile_pack", &tile_pack, release());
  m.def("dp_pack", &dp_pack, release());
  m.def("native_pack", &native_pack, release());
}
