// speclab's decoder layers in C++: the same ATen ops, in the same order, as `speclab.core.layers` runs them from
// Python (so every output is bitwise the Python path's), without the interpreter between them. On the zoo's 2-core
// CPU a Python-level op costs a few microseconds of dispatch, and a decode step of the target calls about 300 of
// them: this file is that step's loop, not new math. Built on first use by `speclab.core.native`.
#include <torch/extension.h>
#include <cstring>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

using at::Tensor;
using OptT = std::optional<Tensor>;

// `layers.linear`: oneDNN's prepacked bf16 product where Python has a packed copy of the weight, else F.linear
static Tensor linear(const Tensor& x, const Tensor& w, const OptT& b, const OptT& packed) {
  if (packed.has_value()) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    static const c10::IValue attr{std::string("none")}, scalars{c10::List<std::optional<at::Scalar>>()},
        algorithm{std::string("")};  // made once: every call passes the same
    std::vector<c10::IValue> stack{x, *packed, b, attr, scalars, algorithm};
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
  bool gqa = q.size(-3) != ck.size(-3);
  return at::scaled_dot_product_attention(q.unsqueeze(0), ck.slice(1, 0, end).unsqueeze(0),
                                          cv.slice(1, 0, end).unsqueeze(0), mask, 0.0, false, scale, gqa).squeeze(0);
}

// The attention step of layer i over one or several sequences' caches (`LeanDecoder._mix`, `lean.mix_many`): rows
// of sequence j (ns[j] of them, in order) written to its cache ck[j], cv[j] ([layers, kv_heads, slots, D]) at slots
// starts[j].., its queries (nqs[j] of them, empty: ns) attending over slots [0, starts[j] + ns[j]) under masks[j].
// q [heads, queries, D], k, v [kv_heads, rows, D]
static Tensor mix(int64_t i, const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<Tensor>& ck,
                  const std::vector<Tensor>& cv, const std::vector<int64_t>& starts, const std::vector<int64_t>& ns,
                  const std::vector<OptT>& masks, double scale, const std::vector<int64_t>& nqs = {}) {
  std::vector<Tensor> out;
  int64_t a = 0, qa = 0;
  for (size_t j = 0; j < ck.size(); ++j) {
    int64_t b = a + ns[j], end = starts[j] + ns[j], qb = qa + (nqs.empty() ? ns[j] : nqs[j]);
    auto cki = ck[j].select(0, i), cvi = cv[j].select(0, i);
    cki.slice(1, starts[j], end).copy_(k.slice(1, a, b));
    cvi.slice(1, starts[j], end).copy_(v.slice(1, a, b));
    out.push_back(attend(q.slice(1, qa, qb), cki, cvi, end, masks[j], scale));
    a = b, qa = qb;
  }
  return out.size() == 1 ? out[0] : at::cat(out, 1);  // one sequence: its attention as it is
}

// `Layer.finish` with the MLP `down(silu(gate(x)) * up(x))`; gate and up fused (`FusedLayer`) or not (`MLP`)
static Tensor finish(const Tensor& h, const Tensor& a, const Tensor& o, const OptT& ob, const OptT& op,
                     const Tensor& post, double eps, const std::vector<OptT>& mlp) {
  auto h1 = h + linear(a.transpose(-2, -3).flatten(-2), o, ob, op);
  auto x = rms_norm(h1, post, eps);
  Tensor g, u;
  if (mlp.size() == 4) {  // gate_up, its packed copy, down, its packed copy
    auto gu = linear(x, *mlp[0], std::nullopt, mlp[1]).chunk(2, -1);
    g = gu[0], u = gu[1];
    return h1 + linear(at::silu(g) * u, *mlp[2], std::nullopt, mlp[3]);
  }
  // gate, packed, up, packed, down, packed
  g = linear(x, *mlp[0], std::nullopt, mlp[1]);
  u = linear(x, *mlp[2], std::nullopt, mlp[3]);
  return h1 + linear(at::silu(g) * u, *mlp[4], std::nullopt, mlp[5]);
}

// The lean forward's layers (`LeanDecoder._layers` over `KVCache`s: `_mix` for one sequence, `mix_many` for a
// ragged batch): rows h [rows, d] of the sequences (see `mix`). Each layer's weights, as
// `speclab.core.native.fused_weights` lists them: in_norm, qkv, qkv bias, qkv packed, qk norm, o, o bias, o packed,
// post norm, gate_up, gate_up packed, down, down packed. -> [h, the outputs of the layers in `keep` (ascending)]
std::vector<Tensor> fused_layers(Tensor h, const Tensor& cos, const Tensor& sin, const std::vector<std::vector<OptT>>& W,
                                 const std::vector<Tensor>& ck, const std::vector<Tensor>& cv,
                                 const std::vector<int64_t>& starts, const std::vector<int64_t>& ns,
                                 const std::vector<OptT>& masks, double scale, double eps, int64_t H, int64_t KV,
                                 int64_t D, const std::vector<int64_t>& keep) {
  int64_t d = h.size(-1);
  std::vector<Tensor> out{Tensor()};
  for (size_t i = 0; i < W.size(); ++i) {
    const auto& w = W[i];
    auto qkv = linear(rms_norm(h, w[0], eps), *w[1], w[2], w[3]).unflatten(-1, {H + 2 * KV, D});
    auto qk = qkv.slice(-2, 0, H + KV);
    auto v = qkv.slice(-2, H + KV).transpose(-2, -3);
    if (w[4].has_value()) qk = rms_norm(qk, std::nullopt, eps) * *w[4];
    qk = rope(qk, cos, sin).transpose(-2, -3);
    auto a = mix(i, qk.slice(-3, 0, H), qk.slice(-3, H), v, ck, cv, starts, ns, masks, scale);
    h = finish(h, a, *w[5], w[6], w[7], *w[8], eps, {w[9], w[10], w[11], w[12]});
    for (auto j : keep)
      if (j == (int64_t)i) out.push_back(h);
  }
  out[0] = h;
  return out;
}

// One `DecoderLayer` (a drafter's: one Linear a projection), layer i of its caches, after its input norm: attention
// input x [rows, d_in] of the sequences (see `mix`); queries of the rows `q_rows` (`Attention.qkv`'s q_rows; None:
// every row), nqs[j] of them the last rows of sequence j, with the residual h of those rows. Weights as
// `speclab.core.native.decoder_weights` lists them: q, q bias, q packed, k .., v .., q norm, k norm, o, o bias,
// o packed, post norm, then gate, packed, up, packed, down, packed. -> the layer's output of the query rows
Tensor decoder_layer(const Tensor& x, const Tensor& h, const Tensor& cos, const Tensor& sin, const std::vector<OptT>& w,
                     int64_t i, const std::vector<Tensor>& ck, const std::vector<Tensor>& cv,
                     const std::vector<int64_t>& starts, const std::vector<int64_t>& ns,
                     const std::vector<OptT>& masks, double scale, double qk_eps, double eps, int64_t H, int64_t KV,
                     int64_t D, const OptT& q_rows, const std::vector<int64_t>& nqs) {
  auto q = linear(q_rows ? x.index({*q_rows}) : x, *w[0], w[1], w[2]).unflatten(-1, {H, D});
  if (w[9].has_value()) q = rms_norm(q, w[9], qk_eps);
  auto k = linear(x, *w[3], w[4], w[5]).unflatten(-1, {KV, D});
  if (w[10].has_value()) k = rms_norm(k, w[10], qk_eps);
  auto v = linear(x, *w[6], w[7], w[8]).unflatten(-1, {KV, D});
  k = rope(k, cos, sin).transpose(-2, -3);
  v = v.transpose(-2, -3);
  q = (q_rows ? rope(q, cos.index({*q_rows}), sin.index({*q_rows})) : rope(q, cos, sin)).transpose(-2, -3);
  return finish(h, mix(i, q, k, v, ck, cv, starts, ns, masks, scale, nqs), *w[11], w[12], w[13], *w[14], eps,
                {w[15], w[16], w[17], w[18], w[19], w[20]});
}

// `precision.Head` with fp32 refinement: logits of the weight's dtype upcast, the top k of each row recomputed as fp32
// dot products; and which rows an unrefined logit could still reach the refined maximum in (Python recomputes those
// in full fp32, rarely). h [.., d] (fp32 or the weight's dtype) -> (logits [.., V], unsafe rows [rows] bool)
std::vector<Tensor> refined_head(const Tensor& h, const Tensor& w, const OptT& packed, int64_t k, double w_norm) {
  auto low = linear(h.to(w.scalar_type()), w, std::nullopt, packed).to(at::kFloat);
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

// The GIL is released while a call runs, as torch's own Python bindings release it around each op: other Python
// threads (the trace's writer, the app's server) keep running meanwhile
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("fused_layers", &fused_layers, release());
  m.def("decoder_layer", &decoder_layer, release());
  m.def("refined_head", &refined_head, release());
  m.def("rms_norm", &rms_norm, release());
  m.def("rope", &rope, release());
  m.def("set_fused", &set_fused);
}
