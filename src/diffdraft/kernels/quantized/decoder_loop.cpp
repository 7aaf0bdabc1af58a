// A whole forward of a Llama-family target's decoder layers in one op: the loop of
// FusedDecoderLayers.__call__ (decoder_ops.py) over the layers, each step the same op it calls there
// (decoder_ops.cpp, int8_matmul.cpp), in the same order, on the same tensors, so every output is
// bit for bit the Python loop's. What it saves is the loop itself: nine op calls a layer from Python
// (dispatch, argument boxing, module lookups) cost a one-token forward of SmolLM2-135M about a fifth
// of its time on a 2-core CPU (figures: benchmarks/README.md, 'Measurements behind the code').
//
// The ops are called through the dispatcher by name, as Python calls them, so each keeps its checks
// and this file needs none of their code.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using OptionalTensor = c10::optional<Tensor>;

constexpr int64_t kLinears = 4;  // per layer, in order: q|k|v, output, gate|up, down
const char* const kFormats[] = {"diffdraft_blocks::q4_1_int8_matmul", "diffdraft_blocks::q8_0_int8_matmul"};

template <class Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using Matmul = Tensor(const Tensor&, const Tensor&, int64_t, const OptionalTensor&);

// The forward's rows [n, H] (the embeddings) through every layer: returns the final norm's output and
// then the outputs of layers `taps` (ascending), as FusedDecoderLayers.__call__ does with its cache writes.
// Per layer l and linear i (kLinears of them): weights[kLinears * l + i] (the int8 kernel's tiles),
// out_features and formats (0: Q4_1, 1: Q8_0) alike, biases (or none); norms and epsilons: the first
// layer's input norm, then each layer's post-attention norm and the norm after it (the next layer's
// input norm, the decoder's final norm after the last). Attention: attend_cached over `buffers` at
// each layer's cache index, with the segments' starts, counts and masks.
std::vector<Tensor> decode_layers(const Tensor& hidden_in, const Tensor& cos, const Tensor& sin, at::TensorList weights,
                                  at::IntArrayRef out_features, at::IntArrayRef formats,
                                  const c10::List<OptionalTensor>& biases, at::TensorList norms,
                                  at::ArrayRef<double> epsilons, int64_t heads, int64_t kv_heads,
                                  at::ArrayRef<double> scalings, at::TensorList buffers, at::IntArrayRef cache_layers,
                                  at::IntArrayRef starts, at::IntArrayRef counts,
                                  const c10::List<OptionalTensor>& masks, at::IntArrayRef taps) {
  static const c10::TypedOperatorHandle<Matmul> matmuls[] = {op<Matmul>(kFormats[0]), op<Matmul>(kFormats[1])};
  static const auto rms_norm = op<Tensor(const Tensor&, const Tensor&, double)>("diffdraft_decoder::rms_norm");
  static const auto residual_rms_norm = op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                                      double)>("diffdraft_decoder::residual_rms_norm");
  static const auto rotary_split =
      op<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t,
                                            const OptionalTensor&, const OptionalTensor&, double)>(
          "diffdraft_decoder::rotary_split");
  static const auto attend_cached =
      op<Tensor(const Tensor&, const Tensor&, const Tensor&, at::TensorList, int64_t, at::IntArrayRef,
                at::IntArrayRef, const c10::List<OptionalTensor>&, double)>("diffdraft_decoder::attend_cached");
  static const auto silu_gate = op<Tensor(const Tensor&)>("diffdraft_decoder::silu_gate");

  const int64_t layers = static_cast<int64_t>(cache_layers.size());
  const int64_t linears = kLinears * layers;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == linears && static_cast<int64_t>(out_features.size()) == linears &&
                  static_cast<int64_t>(formats.size()) == linears && static_cast<int64_t>(biases.size()) == linears,
              "give ", kLinears, " weights, output widths, formats and biases per layer (", layers, " layers)");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 1 + 2 * layers && norms.size() == epsilons.size(),
              "give the first input norm and two norms per layer, each with its epsilon");
  TORCH_CHECK(static_cast<int64_t>(scalings.size()) == layers, "give one attention scaling per layer");
  for (int64_t format : formats) TORCH_CHECK(format == 0 || format == 1, "a format is 0 (Q4_1) or 1 (Q8_0)");
  const OptionalTensor no_norm;
  auto linear = [&](const Tensor& x, int64_t index) {
    return matmuls[formats[index]].call(x, weights[index], out_features[index], biases.get(index));
  };

  Tensor hidden = hidden_in;
  Tensor normed = rms_norm.call(hidden, norms[0], epsilons[0]);
  std::vector<Tensor> outputs{Tensor()};
  size_t next_tap = 0;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const int64_t first = kLinears * layer, post = 1 + 2 * layer;
    auto [query, key, value] =
        rotary_split.call(linear(normed, first), cos, sin, heads, kv_heads, no_norm, no_norm, 0.0);
    const Tensor attended =
        attend_cached.call(query, key, value, buffers, cache_layers[layer], starts, counts, masks, scalings[layer]);
    std::tie(hidden, normed) =
        residual_rms_norm.call(hidden, linear(attended, first + 1), norms[post], epsilons[post]);
    const Tensor gated = silu_gate.call(linear(normed, first + 2));
    std::tie(hidden, normed) =
        residual_rms_norm.call(hidden, linear(gated, first + 3), norms[post + 1], epsilons[post + 1]);
    if (next_tap < taps.size() && taps[next_tap] == layer) {
      outputs.push_back(hidden);
      ++next_tap;
    }
  }
  TORCH_CHECK(next_tap == taps.size(), "taps must be ascending layer indices below ", layers);
  outputs[0] = normed;
  return outputs;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(diffdraft_decoder, m) {
  m.def(
      "decode_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, int[] out_features, int[] formats, "
      "Tensor?[] biases, Tensor[] norms, float[] epsilons, int heads, int kv_heads, float[] scalings, "
      "Tensor[] buffers, int[] cache_layers, int[] starts, int[] counts, Tensor?[] masks, int[] taps) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(diffdraft_decoder, CPU, m) { m.impl("decode_layers", &decode_layers); }
