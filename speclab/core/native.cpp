// speclab's decoder layers in C++: the same ATen ops, in the same order, as `speclab.core.layers` runs them from
// Python (so every output is bitwise the Python path's), without the interpreter between them. On the zoo's 2-core
// CPU a Python-level op costs a few microseconds of dispatch, and a decode step of the target calls about 300 of
// them: this file is that step's loop, not new math. Built on first use by `speclab.core.native`.
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

using at::Tensor;
using OptT = std::optional<Tensor>;

// `layers.linear`: oneDNN's prepacked bf16 product where Python has a packed copy of the weight, else F.linear
static Tensor linear(const Tensor& x, const Tensor& w, const OptT& b, const OptT& packed) {
  if (packed.has_value()) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    std::vector<c10::IValue> stack;
    stack.reserve(6);
    stack.emplace_back(x);
    stack.emplace_back(*packed);
    stack.emplace_back(b);
    stack.emplace_back(std::string("none"));
    stack.emplace_back(c10::List<std::optional<at::Scalar>>());
    stack.emplace_back(std::string(""));
    op.callBoxed(&stack);
    return stack[0].toTensor();
  }
  return at::linear(x, w, b);
}

// `layers.apply_rope`: x * cos + swap_halves(x) * sin
static Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  return x * cos + x.unflatten(-1, {2, -1}).flip({-2}).flatten(-2) * sin;
}

// `layers.attend` of queries [heads, n, D] over layer i's cache slots [0, end) (`lean.KVCache.attend`)
static Tensor attend(const Tensor& q, const Tensor& ck, const Tensor& cv, int64_t end, const OptT& mask, double scale) {
  bool gqa = q.size(-3) != ck.size(-3);
  return at::scaled_dot_product_attention(q.unsqueeze(0), ck.slice(1, 0, end).unsqueeze(0),
                                          cv.slice(1, 0, end).unsqueeze(0), mask, 0.0, false, scale, gqa).squeeze(0);
}

// `Layer.finish` with the MLP `down(silu(gate(x)) * up(x))`; gate and up fused (`FusedLayer`) or not (`MLP`)
static Tensor finish(const Tensor& h, const Tensor& a, const Tensor& o, const OptT& ob, const OptT& op,
                     const Tensor& post, double eps, const std::vector<OptT>& mlp) {
  auto h1 = h + linear(a.transpose(-2, -3).flatten(-2), o, ob, op);
  auto x = at::rms_norm(h1, {h1.size(-1)}, post, eps);
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

// The lean forward's layers (`LeanDecoder._layers` with `_mix` over a `KVCache`): rows h [n, d] written at cache
// slots start..start+n, attending under `mask` ([n, end]; None: every slot). Each layer's weights, as
// `speclab.core.native.fused_weights` lists them: in_norm, qkv, qkv bias, qkv packed, qk norm, o, o bias, o packed,
// post norm, gate_up, gate_up packed, down, down packed. -> [h, the outputs of the layers in `keep`, first n rows]
std::vector<Tensor> fused_layers(Tensor h, const Tensor& cos, const Tensor& sin, const std::vector<std::vector<OptT>>& W,
                                 const Tensor& ck, const Tensor& cv, int64_t start, const OptT& mask, double scale,
                                 double eps, int64_t H, int64_t KV, int64_t D, const std::vector<int64_t>& keep) {
  int64_t n = h.size(0), d = h.size(-1), end = start + n;
  std::vector<Tensor> out{Tensor()};
  for (size_t i = 0; i < W.size(); ++i) {
    const auto& w = W[i];
    auto qkv = linear(at::rms_norm(h, {d}, w[0], eps), *w[1], w[2], w[3]).unflatten(-1, {H + 2 * KV, D});
    auto qk = qkv.slice(-2, 0, H + KV);
    auto v = qkv.slice(-2, H + KV).transpose(-2, -3);
    if (w[4].has_value()) qk = at::rms_norm(qk, {D}, std::nullopt, eps) * *w[4];
    qk = rope(qk, cos, sin).transpose(-2, -3);
    auto cki = ck.select(0, i), cvi = cv.select(0, i);
    cki.slice(1, start, end).copy_(qk.slice(-3, H));
    cvi.slice(1, start, end).copy_(v);
    h = finish(h, attend(qk.slice(-3, 0, H), cki, cvi, end, mask, scale), *w[5], w[6], w[7], *w[8], eps,
               {w[9], w[10], w[11], w[12]});
    for (auto j : keep)
      if (j == (int64_t)i) out.push_back(h.slice(0, 0, n));
  }
  out[0] = h;
  return out;
}

// One `DecoderLayer` (a drafter's: one Linear a projection) after its input norm: attention input x [n, d_in];
// keys and values of every row written to one layer's cache (ck, cv [kv_heads, slots, D]) at start..; queries of
// the rows from `q_from` on (`Attention.qkv`'s q_rows) attending over slots [0, start + n) under `mask`, with the
// residual h of those rows. Weights as `speclab.core.native.decoder_weights` lists them: q, q bias, q packed, k ..,
// v .., q norm, k norm, o, o bias, o packed, post norm, then gate, packed, up, packed, down, packed. -> the layer's
// output of the query rows
Tensor decoder_layer(const Tensor& x, const Tensor& h, const Tensor& cos, const Tensor& sin, const std::vector<OptT>& w,
                     const Tensor& ck, const Tensor& cv, int64_t start, const OptT& mask, double scale, double qk_eps,
                     double eps, int64_t H, int64_t KV, int64_t D, int64_t q_from) {
  int64_t n = x.size(0), end = start + n;
  auto q = linear(q_from ? x.slice(0, q_from) : x, *w[0], w[1], w[2]).unflatten(-1, {H, D});
  if (w[9].has_value()) q = at::rms_norm(q, {D}, *w[9], qk_eps);
  auto k = linear(x, *w[3], w[4], w[5]).unflatten(-1, {KV, D});
  if (w[10].has_value()) k = at::rms_norm(k, {D}, *w[10], qk_eps);
  auto v = linear(x, *w[6], w[7], w[8]).unflatten(-1, {KV, D});
  k = rope(k, cos, sin).transpose(-2, -3);
  v = v.transpose(-2, -3);
  q = (q_from ? rope(q, cos.slice(0, q_from), sin.slice(0, q_from)) : rope(q, cos, sin)).transpose(-2, -3);
  ck.slice(1, start, end).copy_(k);
  cv.slice(1, start, end).copy_(v);
  return finish(h, attend(q, ck, cv, end, mask, scale), *w[11], w[12], w[13], *w[14], eps,
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_layers", &fused_layers);
  m.def("decoder_layer", &decoder_layer);
  m.def("refined_head", &refined_head);
}
