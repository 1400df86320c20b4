// Internal to cpp/decode/: adapter inputs inside a step's forward (mlx_infer/lora.h).
#pragma once

#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "mlx_infer/lora.h"

namespace mlx_infer {

struct Linear;

/// Where each target's arrays sit in the step's inputs, relative to the adapter section's start:
/// [slots, then per target a, b, scales, (g)].
struct LoraLayout {
  struct Entry {
    int a, b, scales, g;  // g = -1 when absent
    int group;            // -1, or the group of linears sharing its input (one update for all)
    int part;             // its part of the group's update
  };
  struct Group {
    int members = 0;
    std::vector<int> outs;  // per member, in order
  };
  std::unordered_map<std::string, Entry> entries;  // by linear name (a group's members each)
  std::vector<Group> groups;
  int count = 0;  // arrays in the section, slots included
  std::string key;  // targets and g presence: a new key needs a new trace
};

/// Validates ``in`` against the step's linears (``outs``: name -> output features) and the
/// bank's slot count; returns the layout. A target named ``a+b+c`` is a group of linears that
/// share one input (q|k|v, gate|up): one dense update for all, split by member.
/// Raises std::invalid_argument naming the problem.
std::shared_ptr<const LoraLayout> make_lora_layout(const LoraInputs& in,
                                                   const std::unordered_map<std::string, int>& outs);
/// The section's arrays after ``slots`` (B,) int32, in layout order.
std::vector<mx::array> lora_arrays(const LoraInputs& in);
/// (B,) int32 slots, checked against the bank (values are not checked: a traced input).
mx::array lora_slots(const std::optional<mx::array>& slots, int B, const std::string& where);

/// While alive, apply_linear adds the adapters of ``layout`` whose arrays start at
/// ``inputs[start]`` (the forward of one step, on this thread; nests nothing).
class LoraScope {
 public:
  LoraScope(const LoraLayout* layout, const std::vector<mx::array>* inputs, int start);
  ~LoraScope();
  LoraScope(const LoraScope&) = delete;
  LoraScope& operator=(const LoraScope&) = delete;
};

/// The adapted product of ``l`` when the active scope targets it; none otherwise.
std::optional<mx::array> lora_linear(const Linear& l, const mx::array& x);

}  // namespace mlx_infer
