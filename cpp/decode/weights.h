// Internal to cpp/decode/: reading a decode step's weights by canonical name (weights.cpp).
#pragma once

#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "graph.h"

namespace mlx_infer {

/// Builds the graph's weights from canonical names (see decode.h).
void load_graph_weights(
    DecodeStep::Graph& g,
    const std::unordered_map<std::string, mx::array>& weights,
    const std::unordered_map<std::string, QuantSpec>& quantization);

/// The linears the forward runs (those an adapter may target): name -> output features.
std::unordered_map<std::string, int> linear_outs(const DecodeStep::Graph& g);

/// The weight, or none; records ``name`` as read while load_graph_weights runs.
std::optional<mx::array> find_weight(const std::unordered_map<std::string, mx::array>& w,
                                     const std::string& name);
/// The weight, or std::invalid_argument naming it.
mx::array require_weight(const std::unordered_map<std::string, mx::array>& w, const std::string& name);
/// ``name``.{weight,bias,scales,biases} with the quantization of ``name`` (if any).
Linear read_linear(const std::unordered_map<std::string, mx::array>& w,
                   const std::unordered_map<std::string, QuantSpec>& quant,
                   const std::vector<std::string>& fast, const std::string& name,
                   bool required = true);
/// Marks ``l`` for tuned_linear (Linear::tuned) when ``cfg.tuned_products`` is on and ``l`` is a dense
/// product on MLX's kernels (not quantized, not on the CPU kernels); returns it.
Linear with_tuned_product(Linear l, const DecodeConfig& cfg);

}  // namespace mlx_infer
