// Whole forwards of decoder layers in one op each: decode_layers is the loop of a Llama-family target's
// FusedDecoderLayers.__call__ (decoder_ops.py), decode_gemma_layers that of a Gemma 3 target's, draft_layers
// that of a DFlash / DFlare drafter's FusedDraftLayers.__call__ (fused_dflash.py) for one block, draft_context
// its projection of committed tokens' target states into every draft layer's context keys and values
// (FusedDraftLayers.project), and draft_block a whole drafting round of one sequence (both, then the LM
// head: DFlashDrafter.propose).
// Each step is the same op the Python loop calls (decoder_ops.cpp, int8_matmul.cpp), in the same order,
// on the same tensors, so every output is bit for bit the Python loop's. What it saves is the loop
// itself: nine op calls a layer from Python (dispatch, argument boxing, module lookups) are a large share
// of a small target's one-token forward on a CPU, and a drafting round's two dozen calls, each after the
// target's forward has left the caches cold, a large share of the round's drafting (docs/decisions.md,
// "the layer loop in one op").
//
// The ops are called through the dispatcher by name, as Python calls them, so each keeps its checks
// and this file needs none of their code.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstring>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using OptionalTensor = c10::optional<Tensor>;

constexpr int64_t kLinears = 4;  // per layer, in order: q|k|v, output, gate|up, down
// The int8 kernel's ops by format number (INT8_OPS in block_linear.py, the order int8_matmul.cpp
// defines them in; the last takes siblings stacked across formats).
constexpr const char* kFormats[] = {
    "diffdraft_blocks::q4_1_int8_matmul", "diffdraft_blocks::q8_0_int8_matmul", "diffdraft_blocks::q4_0_int8_matmul",
    "diffdraft_blocks::q5_0_int8_matmul", "diffdraft_blocks::q4_k_int8_matmul", "diffdraft_blocks::q5_k_int8_matmul",
    "diffdraft_blocks::q6_k_int8_matmul", "diffdraft_blocks::stacked_int8_matmul"};
constexpr int64_t kFormatCount = sizeof(kFormats) / sizeof(kFormats[0]);

template <class Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using Matmul = Tensor(const Tensor&, const Tensor&, int64_t, const OptionalTensor&);
using Norm = Tensor(const Tensor&, const Tensor&, double);
using ResidualNorm = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double);
using RotarySplit = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t,
                                                       const OptionalTensor&, const OptionalTensor&, double);
using Gate = Tensor(const Tensor&);
using NormedResidualNorm =
    std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double, const Tensor&, double);
using AttendCached = Tensor(const Tensor&, const Tensor&, const Tensor&, at::TensorList, int64_t, at::IntArrayRef,
                            at::IntArrayRef, const c10::List<OptionalTensor>&, double, int64_t);

// The ops both loops call, looked up once.
struct Ops {
  std::vector<c10::TypedOperatorHandle<Matmul>> matmuls = [] {
    std::vector<c10::TypedOperatorHandle<Matmul>> handles;
    for (const char* name : kFormats) handles.push_back(op<Matmul>(name));
    return handles;
  }();
  c10::TypedOperatorHandle<Norm> rms_norm = op<Norm>("diffdraft_decoder::rms_norm");
  c10::TypedOperatorHandle<ResidualNorm> residual_rms_norm = op<ResidualNorm>("diffdraft_decoder::residual_rms_norm");
  c10::TypedOperatorHandle<RotarySplit> rotary_split = op<RotarySplit>("diffdraft_decoder::rotary_split");
  c10::TypedOperatorHandle<Gate> silu_gate = op<Gate>("diffdraft_decoder::silu_gate");
  c10::TypedOperatorHandle<Gate> gelu_tanh_gate = op<Gate>("diffdraft_decoder::gelu_tanh_gate");
  c10::TypedOperatorHandle<NormedResidualNorm> normed_residual_rms_norm =
      op<NormedResidualNorm>("diffdraft_decoder::normed_residual_rms_norm");
  c10::TypedOperatorHandle<AttendCached> attend_cached = op<AttendCached>("diffdraft_decoder::attend_cached");

  static const Ops& get() {
    static const Ops ops;
    return ops;
  }
};

// A linear on the int8 kernel: its format's number in kFormats, the weight as its tiles.
Tensor matmul(const Tensor& x, const Tensor& weight, int64_t out_features, int64_t format, const OptionalTensor& bias) {
  TORCH_CHECK(format >= 0 && format < kFormatCount, "a format is a number in 0..", kFormatCount - 1, ", got ", format);
  return Ops::get().matmuls[format].call(x, weight, out_features, bias);
}

// The layers' linears (kLinears a layer: weights, output widths, format numbers, biases) and
// norms with their epsilons (the first layer's input norm, then each layer's post-attention norm and the
// norm after it: the next layer's input norm, the final norm after the last layer).
struct Layers {
  at::TensorList weights;
  at::IntArrayRef out_features, formats;
  const c10::List<OptionalTensor>& biases;
  at::TensorList norms;
  at::ArrayRef<double> epsilons;

  void check(int64_t layers) const {
    const int64_t linears = kLinears * layers;
    TORCH_CHECK(static_cast<int64_t>(weights.size()) == linears &&
                    static_cast<int64_t>(out_features.size()) == linears &&
                    static_cast<int64_t>(formats.size()) == linears && static_cast<int64_t>(biases.size()) == linears,
                "give ", kLinears, " weights, output widths, formats and biases per layer (", layers, " layers)");
    TORCH_CHECK(static_cast<int64_t>(norms.size()) == 1 + 2 * layers && norms.size() == epsilons.size(),
                "give the first input norm and two norms per layer, each with its epsilon");
  }

  Tensor linear(const Tensor& x, int64_t index) const {
    return matmul(x, weights[index], out_features[index], formats[index], biases.get(index));
  }

  // Layer `layer` after its attention: the output projection, the residual and post-attention norm, the
  // gated MLP and the residual and next norm, updating (hidden, normed).
  void finish(int64_t layer, const Tensor& attended, Tensor& hidden, Tensor& normed) const {
    const Ops& ops = Ops::get();
    const int64_t first = kLinears * layer, post = 1 + 2 * layer;
    std::tie(hidden, normed) =
        ops.residual_rms_norm.call(hidden, linear(attended, first + 1), norms[post], epsilons[post]);
    const Tensor gated = ops.silu_gate.call(linear(normed, first + 2));
    std::tie(hidden, normed) =
        ops.residual_rms_norm.call(hidden, linear(gated, first + 3), norms[post + 1], epsilons[post + 1]);
  }
};

// A layer's output rows [n, H] into column `index` of the taps [n, taps, H], row by row: a one-token forward
// copied nine taps through a strided copy_ (a view and a dispatch each), a visible cost for a few
// kilobytes (docs/decisions.md, "the layer loop in one op").
void copy_tap(const Tensor& tapped, int64_t index, const Tensor& hidden) {
  const Tensor rows = hidden.contiguous();
  const int64_t count = rows.size(0), taps = tapped.size(1);
  const size_t bytes = static_cast<size_t>(rows.size(1)) * rows.element_size();
  char* out = static_cast<char*>(tapped.data_ptr()) + index * bytes;
  const char* in = static_cast<const char*>(rows.data_ptr());
  for (int64_t row = 0; row < count; ++row) {
    std::memcpy(out + row * taps * bytes, in + row * bytes, bytes);
  }
}

// The outputs of the layers a loop taps (ascending indices), each copied out as the loop passes it, so
// every layer's rows can reuse the freed (cache-warm) memory of the layer before, as without taps
// (docs/decisions.md, "the layer loop in one op").
struct Taps {
  at::IntArrayRef layers;
  Tensor tapped;
  size_t next = 0;

  Taps(at::IntArrayRef taps, const Tensor& hidden) : layers(taps) {
    if (!taps.empty()) {
      tapped = at::empty({hidden.size(0), static_cast<int64_t>(taps.size()), hidden.size(1)}, hidden.options());
    }
  }

  void pass(int64_t layer, const Tensor& hidden) {
    if (next < layers.size() && layers[next] == layer) {
      copy_tap(tapped, static_cast<int64_t>(next), hidden);
      ++next;
    }
  }

  // The loop's outputs: the final norm's rows, then the taps stacked [n, taps, H] when there are any.
  std::vector<Tensor> outputs(const Tensor& normed, int64_t layer_count) const {
    TORCH_CHECK(next == layers.size(), "taps must be ascending layer indices below ", layer_count);
    std::vector<Tensor> out{normed};
    if (!layers.empty()) {
      out.push_back(tapped);
    }
    return out;
  }
};

// The forward's rows [n, H] (the embeddings) through every layer: returns the final norm's output and, when
// `taps` (ascending layer indices) is not empty, those layers' outputs stacked [n, taps, H], as
// FusedDecoderLayers.__call__ does with its cache writes (one tensor back, not one per tap).
// Linears and norms as Layers holds them (weights[kLinears * l + i]: layer l's linear i, the int8
// kernel's tiles). Attention: attend_cached over `buffers` at each layer's cache index, with the
// segments' starts, counts and masks.
std::vector<Tensor> decode_layers(const Tensor& hidden_in, const Tensor& cos, const Tensor& sin, at::TensorList weights,
                                  at::IntArrayRef out_features, at::IntArrayRef formats,
                                  const c10::List<OptionalTensor>& biases, at::TensorList norms,
                                  at::ArrayRef<double> epsilons, int64_t heads, int64_t kv_heads,
                                  at::ArrayRef<double> scalings, at::TensorList buffers, at::IntArrayRef cache_layers,
                                  at::IntArrayRef starts, at::IntArrayRef counts,
                                  const c10::List<OptionalTensor>& masks, at::IntArrayRef taps) {
  const auto& attend_cached = Ops::get().attend_cached;
  const Ops& ops = Ops::get();
  const Layers stack{weights, out_features, formats, biases, norms, epsilons};
  const int64_t layers = static_cast<int64_t>(cache_layers.size());
  stack.check(layers);
  TORCH_CHECK(static_cast<int64_t>(scalings.size()) == layers, "give one attention scaling per layer");
  const OptionalTensor no_norm;

  Tensor hidden = hidden_in;
  Tensor normed = ops.rms_norm.call(hidden, norms[0], epsilons[0]);
  Taps tapped(taps, hidden);
  for (int64_t layer = 0; layer < layers; ++layer) {
    auto [query, key, value] = ops.rotary_split.call(stack.linear(normed, kLinears * layer), cos, sin, heads, kv_heads,
                                                     no_norm, no_norm, 0.0);
    const Tensor attended =
        attend_cached.call(query, key, value, buffers, cache_layers[layer], starts, counts, masks, scalings[layer], 0);
    stack.finish(layer, attended, hidden, normed);
    tapped.pass(layer, hidden);
  }
  return tapped.outputs(normed, layers);
}

// decode_layers for Gemma 3 (FusedDecoderLayers.__call__'s Gemma loop): every norm Gemma's (float32 1 + weight
// tensors), four a layer after the first input norm (post-attention, pre-feedforward, post-feedforward, and
// the next layer's input norm or the final one), each normed update added to the residual stream; per-head
// query and key norms before the rotation; GELU (tanh) gating. Layer l's type is `kinds[l]`: its rotary
// table is cos[kinds[l]] / sin[kinds[l]] ([n, head_dim]), its masks are masks[kinds[l] * segments + s], and
// windows[l] its sliding window (0: full attention), as attend_cached takes it.
std::vector<Tensor> decode_gemma_layers(const Tensor& hidden_in, at::TensorList cos, at::TensorList sin,
                                        at::IntArrayRef kinds, at::TensorList weights, at::IntArrayRef out_features,
                                        at::IntArrayRef formats, const c10::List<OptionalTensor>& biases,
                                        at::TensorList norms, at::ArrayRef<double> epsilons,
                                        at::TensorList query_norms, at::TensorList key_norms,
                                        at::ArrayRef<double> head_epsilons, int64_t heads, int64_t kv_heads,
                                        at::ArrayRef<double> scalings, at::IntArrayRef windows, at::TensorList buffers,
                                        at::IntArrayRef cache_layers, at::IntArrayRef starts, at::IntArrayRef counts,
                                        const c10::List<OptionalTensor>& masks, at::IntArrayRef taps) {
  const Ops& ops = Ops::get();
  const int64_t layers = static_cast<int64_t>(cache_layers.size());
  const int64_t linears = kLinears * layers;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == linears && static_cast<int64_t>(out_features.size()) == linears &&
                  static_cast<int64_t>(formats.size()) == linears && static_cast<int64_t>(biases.size()) == linears,
              "give ", kLinears, " weights, output widths, formats and biases per layer (", layers, " layers)");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 1 + 4 * layers && norms.size() == epsilons.size(),
              "give the first input norm and four norms per layer, each with its epsilon");
  for (const size_t given : {kinds.size(), query_norms.size(), key_norms.size(), head_epsilons.size(),
                             scalings.size(), windows.size()}) {
    TORCH_CHECK(static_cast<int64_t>(given) == layers,
                "give per layer its kind, head norms with their epsilon, scaling and window");
  }
  TORCH_CHECK(cos.size() == sin.size() && !cos.empty(), "give a cos and a sin table per layer kind");
  const size_t segments = buffers.size();
  TORCH_CHECK(masks.size() == cos.size() * segments, "give a mask per layer kind and segment");
  std::vector<c10::List<OptionalTensor>> kind_masks(cos.size());
  for (size_t k = 0; k < cos.size(); ++k) {
    for (size_t s = 0; s < segments; ++s) kind_masks[k].push_back(masks.get(k * segments + s));
  }
  const Layers stack{weights, out_features, formats, biases, norms, epsilons};

  Tensor hidden = hidden_in;
  Tensor normed = ops.rms_norm.call(hidden, norms[0], epsilons[0]);
  Taps tapped(taps, hidden);
  for (int64_t layer = 0; layer < layers; ++layer) {
    const int64_t kind = kinds[layer], first = kLinears * layer, norm = 1 + 4 * layer;
    TORCH_CHECK(kind >= 0 && kind < static_cast<int64_t>(cos.size()), "layer ", layer, "'s kind ", kind,
                " has no rotary table");
    auto [query, key, value] = ops.rotary_split.call(stack.linear(normed, first), cos[kind], sin[kind], heads, kv_heads,
                                                     query_norms[layer], key_norms[layer], head_epsilons[layer]);
    const Tensor attended = ops.attend_cached.call(query, key, value, buffers, cache_layers[layer], starts, counts,
                                                   kind_masks[kind], scalings[layer], windows[layer]);
    std::tie(hidden, normed) = ops.normed_residual_rms_norm.call(hidden, stack.linear(attended, first + 1),
                                                                 norms[norm], epsilons[norm], norms[norm + 1],
                                                                 epsilons[norm + 1]);
    const Tensor gated = ops.gelu_tanh_gate.call(stack.linear(normed, first + 2));
    std::tie(hidden, normed) = ops.normed_residual_rms_norm.call(hidden, stack.linear(gated, first + 3),
                                                                 norms[norm + 2], epsilons[norm + 2], norms[norm + 3],
                                                                 epsilons[norm + 3]);
    tapped.pass(layer, hidden);
  }
  return tapped.outputs(normed, layers);
}

// One draft block's rows [n, H] (its embeddings) through the drafter's layers, over one sequence's context:
// returns the final norm's output, as FusedDraftLayers.__call__ does for one block. Linears and norms as
// decode_layers takes them; per layer its per-head query and key norm weights (one epsilon each), its
// scaling, and its context's key and value buffers [1, kv_heads, capacity, head_dim] holding `context`
// rows: the block's own keys and values are written after them (as DraftContext.with_block does) and
// the block attends over both, every row seeing all of them.
Tensor draft_layers(const Tensor& block, const Tensor& cos, const Tensor& sin, at::TensorList weights,
                    at::IntArrayRef out_features, at::IntArrayRef formats, const c10::List<OptionalTensor>& biases,
                    at::TensorList norms, at::ArrayRef<double> epsilons, at::TensorList query_norms,
                    at::TensorList key_norms, at::ArrayRef<double> head_epsilons, int64_t heads, int64_t kv_heads,
                    at::ArrayRef<double> scalings, at::TensorList keys, at::TensorList values, int64_t context) {
  static const auto attention = op<Tensor(const Tensor&, const Tensor&, const Tensor&, const OptionalTensor&, double)>(
      "diffdraft_decoder::attention");
  const Ops& ops = Ops::get();
  const Layers stack{weights, out_features, formats, biases, norms, epsilons};
  const int64_t layers = static_cast<int64_t>(keys.size());
  stack.check(layers);
  TORCH_CHECK(static_cast<int64_t>(values.size()) == layers && static_cast<int64_t>(query_norms.size()) == layers &&
                  static_cast<int64_t>(key_norms.size()) == layers &&
                  static_cast<int64_t>(head_epsilons.size()) == layers &&
                  static_cast<int64_t>(scalings.size()) == layers,
              "give per layer its key and value buffers, head norms, their epsilon and its scaling");
  const int64_t rows = block.size(0);
  Tensor hidden = block;
  Tensor normed = ops.rms_norm.call(hidden, norms[0], epsilons[0]);
  for (int64_t layer = 0; layer < layers; ++layer) {
    TORCH_CHECK(keys[layer].dim() == 4 && context + rows <= keys[layer].size(2) &&
                    values[layer].sizes() == keys[layer].sizes(),
                "layer ", layer, "'s key and value buffers must be [1, kv_heads, capacity, head_dim] with room for ",
                rows, " rows after ", context);
    auto [query, key, value] = ops.rotary_split.call(stack.linear(normed, kLinears * layer), cos, sin, heads, kv_heads,
                                                     query_norms[layer], key_norms[layer], head_epsilons[layer]);
    keys[layer].narrow(2, context, rows).copy_(key);
    values[layer].narrow(2, context, rows).copy_(value);
    const Tensor attended = attention.call(query, keys[layer].narrow(2, 0, context + rows),
                                           values[layer].narrow(2, 0, context + rows), c10::nullopt, scalings[layer]);
    stack.finish(layer, attended, hidden, normed);
  }
  return normed;
}

// The context rows of a DFlash / DFlare drafter from committed tokens' target taps [c, T, H]: each draft
// layer's context features (DFlare: its softmax mix of the taps in float32, rounded to bfloat16, then
// its context norm; DFlash: one fc projection of the taps side by side and its norm, shared by all
// layers), projected by the layer's context k|v linear (DFlash: its q|k|v, the `context_heads` query heads
// dropped), its keys normed per head and rotated by the rows' rotary `cos`/`sin` [c, head_dim]. Written
// into the layers' key and value buffers [1, kv_heads, capacity, head_dim] at rows [context, context + c),
// as FusedDraftLayers.context_features, context_kv and DraftContext.append do, op for op.
void draft_context(const Tensor& taps, const OptionalTensor& tap_weights, const OptionalTensor& fc_weight,
                   int64_t fc_out_features, int64_t fc_format, at::TensorList feature_norms,
                   at::ArrayRef<double> feature_epsilons, const Tensor& cos, const Tensor& sin, at::TensorList weights,
                   at::IntArrayRef out_features, at::IntArrayRef formats, const c10::List<OptionalTensor>& biases,
                   int64_t context_heads, int64_t kv_heads, at::TensorList query_norms, at::TensorList key_norms,
                   at::ArrayRef<double> head_epsilons, at::TensorList keys, at::TensorList values, int64_t context) {
  const Ops& ops = Ops::get();
  const int64_t layers = static_cast<int64_t>(keys.size());
  TORCH_CHECK(taps.dim() == 3, "taps must be [rows, taps, hidden], got ", taps.sizes());
  TORCH_CHECK(tap_weights.has_value() != fc_weight.has_value(), "give the tap weights (DFlare) or fc (DFlash)");
  const int64_t features = tap_weights.has_value() ? layers : 1;
  TORCH_CHECK(static_cast<int64_t>(feature_norms.size()) == features && feature_epsilons.size() == feature_norms.size(),
              "give ", features, " context norms with their epsilons");
  for (const size_t given : {values.size(), weights.size(), out_features.size(), formats.size(), biases.size(),
                             query_norms.size(), key_norms.size(), head_epsilons.size()}) {
    TORCH_CHECK(static_cast<int64_t>(given) == layers,
                "give per layer its key and value buffers, context linear and head norms with their epsilon");
  }
  const int64_t rows = taps.size(0), taps_count = taps.size(1), hidden = taps.size(2);
  std::vector<Tensor> rows_of;  // each layer's context features [c, H], or one shared by all
  if (tap_weights.has_value()) {
    const Tensor by_tap = taps.transpose(0, 1).reshape({taps_count, rows * hidden}).to(at::kFloat);
    const Tensor mixed = at::matmul(*tap_weights, by_tap).to(taps.scalar_type()).view({layers, rows, hidden});
    for (int64_t layer = 0; layer < layers; ++layer) {
      rows_of.push_back(ops.rms_norm.call(mixed[layer], feature_norms[layer], feature_epsilons[layer]));
    }
  } else {
    const Tensor fc = matmul(taps.flatten(-2), *fc_weight, fc_out_features, fc_format, c10::nullopt);
    rows_of.push_back(ops.rms_norm.call(fc, feature_norms[0], feature_epsilons[0]));
  }
  for (int64_t layer = 0; layer < layers; ++layer) {
    TORCH_CHECK(keys[layer].dim() == 4 && context + rows <= keys[layer].size(2) &&
                    values[layer].sizes() == keys[layer].sizes(),
                "layer ", layer, "'s key and value buffers must be [1, kv_heads, capacity, head_dim] with room for ",
                rows, " rows after ", context);
    const Tensor projected = matmul(rows_of[features == 1 ? 0 : layer], weights[layer], out_features[layer],
                                    formats[layer], biases.get(layer));
    auto [query, key, value] = ops.rotary_split.call(projected, cos, sin, context_heads, kv_heads, query_norms[layer],
                                                     key_norms[layer], head_epsilons[layer]);
    keys[layer].narrow(2, context, rows).copy_(key);
    values[layer].narrow(2, context, rows).copy_(value);
  }
}

// A whole drafting round of a DFlash / DFlare drafter over one sequence's context, as DFlashDrafter.propose
// runs it step by step: the committed tokens' taps not yet in the context, if any, appended as
// draft_context does; the block of the `root` token and `depth` mask tokens embedded (`embedding`: the
// target's table) and run through the layers as draft_layers does; its drafted rows (all but the root's)
// through the LM head (`lm_head_*`: its int8 kernel operands) to float32 log-probabilities [depth, vocabulary].
// `cos`/`sin` cover the taps' rows, then the block's: positions [context, context + c + depth + 1).
Tensor draft_block(int64_t root, int64_t mask_token, int64_t depth, const Tensor& embedding, const Tensor& cos,
                   const Tensor& sin, const OptionalTensor& taps, const OptionalTensor& tap_weights,
                   const OptionalTensor& fc_weight, int64_t fc_out_features, int64_t fc_format,
                   at::TensorList feature_norms, at::ArrayRef<double> feature_epsilons, at::TensorList context_weights,
                   at::IntArrayRef context_out_features, at::IntArrayRef context_formats,
                   const c10::List<OptionalTensor>& context_biases, int64_t context_heads, at::TensorList weights,
                   at::IntArrayRef out_features, at::IntArrayRef formats, const c10::List<OptionalTensor>& biases,
                   at::TensorList norms, at::ArrayRef<double> epsilons, at::TensorList query_norms,
                   at::TensorList key_norms, at::ArrayRef<double> head_epsilons, int64_t heads, int64_t kv_heads,
                   at::ArrayRef<double> scalings, const Tensor& lm_head_weight, int64_t lm_head_out_features,
                   int64_t lm_head_format, const OptionalTensor& lm_head_bias, at::TensorList keys,
                   at::TensorList values, int64_t context) {
  TORCH_CHECK(depth > 0, "a block drafts at least one position, got depth ", depth);
  const int64_t appended = taps.has_value() ? taps->size(0) : 0, rows = depth + 1;
  TORCH_CHECK(cos.size(0) == appended + rows && sin.sizes() == cos.sizes(), "cos and sin must cover the ", appended,
              " taps' rows and the block's ", rows);
  if (taps.has_value()) {
    draft_context(*taps, tap_weights, fc_weight, fc_out_features, fc_format, feature_norms, feature_epsilons,
                  cos.narrow(0, 0, appended), sin.narrow(0, 0, appended), context_weights, context_out_features,
                  context_formats, context_biases, context_heads, kv_heads, query_norms, key_norms, head_epsilons,
                  keys, values, context);
  }
  Tensor ids = at::full({rows}, mask_token, at::kLong);
  ids.data_ptr<int64_t>()[0] = root;
  const Tensor normed = draft_layers(at::embedding(embedding, ids), cos.narrow(0, appended, rows),
                                     sin.narrow(0, appended, rows), weights, out_features, formats, biases, norms,
                                     epsilons, query_norms, key_norms, head_epsilons, heads, kv_heads, scalings, keys,
                                     values, context + appended);
  const Tensor logits =
      matmul(normed.narrow(0, 1, depth), lm_head_weight, lm_head_out_features, lm_head_format, lm_head_bias);
  return at::log_softmax(logits.to(at::kFloat), -1);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(diffdraft_decoder, m) {
  m.def(
      "decode_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, int[] out_features, int[] formats, "
      "Tensor?[] biases, Tensor[] norms, float[] epsilons, int heads, int kv_heads, float[] scalings, "
      "Tensor[] buffers, int[] cache_layers, int[] starts, int[] counts, Tensor?[] masks, int[] taps) -> Tensor[]");
  m.def(
      "decode_gemma_layers(Tensor hidden, Tensor[] cos, Tensor[] sin, int[] kinds, Tensor[] weights, "
      "int[] out_features, int[] formats, Tensor?[] biases, Tensor[] norms, float[] epsilons, Tensor[] query_norms, "
      "Tensor[] key_norms, float[] head_epsilons, int heads, int kv_heads, float[] scalings, int[] windows, "
      "Tensor[] buffers, int[] cache_layers, int[] starts, int[] counts, Tensor?[] masks, int[] taps) -> Tensor[]");
  m.def(
      "draft_layers(Tensor block, Tensor cos, Tensor sin, Tensor[] weights, int[] out_features, int[] formats, "
      "Tensor?[] biases, Tensor[] norms, float[] epsilons, Tensor[] query_norms, Tensor[] key_norms, "
      "float[] head_epsilons, int heads, int kv_heads, float[] scalings, Tensor[] keys, Tensor[] values, "
      "int context) -> Tensor");
  m.def(
      "draft_context(Tensor taps, Tensor? tap_weights, Tensor? fc_weight, int fc_out_features, int fc_format, "
      "Tensor[] feature_norms, float[] feature_epsilons, Tensor cos, Tensor sin, Tensor[] weights, "
      "int[] out_features, int[] formats, Tensor?[] biases, int context_heads, int kv_heads, Tensor[] query_norms, "
      "Tensor[] key_norms, float[] head_epsilons, Tensor[] keys, Tensor[] values, int context) -> ()");
  m.def(
      "draft_block(int root, int mask_token, int depth, Tensor embedding, Tensor cos, Tensor sin, Tensor? taps, "
      "Tensor? tap_weights, Tensor? fc_weight, int fc_out_features, int fc_format, Tensor[] feature_norms, "
      "float[] feature_epsilons, Tensor[] context_weights, int[] context_out_features, int[] context_formats, "
      "Tensor?[] context_biases, int context_heads, Tensor[] weights, int[] out_features, int[] formats, "
      "Tensor?[] biases, Tensor[] norms, float[] epsilons, Tensor[] query_norms, Tensor[] key_norms, "
      "float[] head_epsilons, int heads, int kv_heads, float[] scalings, Tensor lm_head_weight, "
      "int lm_head_out_features, int lm_head_format, Tensor? lm_head_bias, Tensor[] keys, Tensor[] values, "
      "int context) -> Tensor");
}

TORCH_LIBRARY_IMPL(diffdraft_decoder, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("decode_gemma_layers", &decode_gemma_layers);
  m.impl("draft_layers", &draft_layers);
  m.impl("draft_context", &draft_context);
  m.impl("draft_block", &draft_block);
}
