// PageGroups::append_batch: one call per engine step grows every row's
// sequence and returns the step plan as arrays (see StepPlan in kv.h), so no
// per-row work is left to the caller.
#include <algorithm>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_set>

#include "mlx_infer/kv.h"

namespace mlx_infer {

namespace {

mx::array ints(const std::vector<int32_t>& v, mx::Shape shape) {
  return mx::array(v.begin(), std::move(shape), mx::int32);
}

// Every int32 input of a step in one host buffer, each array a view of it. On CUDA, MLX keeps an
// array made from host data in managed memory and the GPU's first touch of each such buffer
// migrates its pages: a fault per buffer (50-150 us per kernel in the H200 profile of a decode
// step, session 6); one buffer faults once.
class Packed {
 public:
  // Adds v; returns its index for view().
  int add(const std::vector<int32_t>& v, mx::Shape shape) {
    parts_.push_back({data_.size(), v.size(), std::move(shape)});
    data_.insert(data_.end(), v.begin(), v.end());
    return static_cast<int>(parts_.size()) - 1;
  }
  // Call once everything is added: the buffer made, its pages sent to the GPU (a hint; see prefetch.cpp).
  void seal() {
    all_ = ints(data_, {static_cast<int>(data_.size())});
    prefetch_to_gpu(*all_);
  }
  mx::array view(int i) const {
    const auto& p = parts_[i];
    auto flat = mx::slice(*all_, {static_cast<int>(p.offset)}, {static_cast<int>(p.offset + p.size)});
    return mx::reshape(flat, p.shape);
  }

 private:
  struct Part {
    size_t offset, size;
    mx::Shape shape;
  };
  std::vector<int32_t> data_;
  std::vector<Part> parts_;
  std::optional<mx::array> all_;
};

}  // namespace

std::optional<StepPlan> PageGroups::append_batch(
    const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& counts, int table_bucket,
    int row_bucket) {
  if (seq_ids.empty() || seq_ids.size() != counts.size()) {
    throw std::invalid_argument(
        "[PageGroups.append_batch] need one count per sequence (at least one sequence); got " +
        std::to_string(seq_ids.size()) + " ids and " + std::to_string(counts.size()) + " counts.");
  }
  if (table_bucket < 1 || row_bucket < 1) {
    throw std::invalid_argument("[PageGroups.append_batch] table_bucket and row_bucket must be >= 1, got " +
                                std::to_string(table_bucket) + " and " + std::to_string(row_bucket) + ".");
  }
  std::unordered_set<int64_t> seen;
  int64_t R = 0;
  for (size_t i = 0; i < seq_ids.size(); ++i) {
    first(seq_ids[i], "append_batch");
    if (!seen.insert(seq_ids[i]).second) {
      throw std::invalid_argument("[PageGroups.append_batch] sequence " + std::to_string(seq_ids[i]) +
                                  " is listed twice; give each sequence once with its token count.");
    }
    if (counts[i] < 1) {
      throw std::invalid_argument("[PageGroups.append_batch] counts must be >= 1, got " +
                                  std::to_string(counts[i]) + " for sequence " +
                                  std::to_string(seq_ids[i]) + ".");
    }
    R += counts[i];
  }
  const int G = num_groups();
  // Release first (as append does), then check every group's total need:
  // sequences are distinct, so their needs add up (each counts its own
  // copy-on-write copy of a shared last page).
  for (int g = 0; g < G; ++g) {
    if (keep_[g] > 0) {
      for (int64_t id : seq_ids) pools_[g].release_outside_window(id, keep_[g]);
    }
  }
  for (int g = 0; g < G; ++g) {
    int64_t need = 0;
    for (size_t i = 0; i < seq_ids.size(); ++i) {
      need += pools_[g].pages_needed(seq_ids[i], counts[i]);
    }
    if (need > pools_[g].num_free_pages()) return std::nullopt;
  }

  // Padding rows (R rounded up to row_bucket): position 0, length 1, an all-null
  // table, written at slot 0 of the null page; they read only that slot.
  const int64_t real_rows = R;
  R = (R + row_bucket - 1) / row_bucket * row_bucket;
  std::vector<int32_t> positions(R, 0), lengths(R, 1), call_ends(R, 1);
  std::vector<std::vector<int32_t>> slots(G, std::vector<int32_t>(R, 0));
  std::vector<std::vector<int32_t>> src(G), dst(G);
  std::vector<std::vector<std::vector<int32_t>>> tables(G, std::vector<std::vector<int32_t>>(seq_ids.size()));
  size_t width = 0;
  int64_t row = 0;
  for (size_t i = 0; i < seq_ids.size(); ++i) {
    const int64_t id = seq_ids[i], n = counts[i];
    const int64_t start = pools_[0].length(id);
    for (int g = 0; g < G; ++g) {
      auto r = pools_[g].append(id, n);
      if (!r) throw std::logic_error("[PageGroups.append_batch] a pool refused an append it had room for");
      for (int64_t j = 0; j < n; ++j) slots[g][row + j] = static_cast<int32_t>(r->slots[j]);
      for (const auto& [s, d] : r->copies) {
        src[g].push_back(s);
        dst[g].push_back(d);
      }
      tables[g][i] = pools_[g].block_table(id);
      width = std::max(width, tables[g][i].size());
    }
    for (int64_t j = 0; j < n; ++j) {
      positions[row + j] = static_cast<int32_t>(start + j);
      lengths[row + j] = static_cast<int32_t>(start + j + 1);
      call_ends[row + j] = static_cast<int32_t>(start + n);
    }
    row += n;
  }
  const int T = static_cast<int>((width + table_bucket - 1) / table_bucket * table_bucket);
  Packed packed;
  const int i_pos = packed.add(positions, {static_cast<int>(R)});
  const int i_len = packed.add(lengths, {static_cast<int>(R)});
  const int i_end = packed.add(call_ends, {static_cast<int>(R)});
  std::vector<std::vector<int32_t>> host_tables(G);
  std::vector<int> i_tab(G), i_slot(G), i_src(G), i_dst(G);
  for (int g = 0; g < G; ++g) {
    std::vector<int32_t> tab(static_cast<size_t>(R) * T, 0);  // 0: the null page
    row = 0;
    for (size_t i = 0; i < seq_ids.size(); ++i) {
      const auto& t = tables[g][i];
      for (int64_t j = 0; j < counts[i]; ++j, ++row) {
        std::copy(t.begin(), t.end(), tab.begin() + row * T);
      }
    }
    i_tab[g] = packed.add(tab, {static_cast<int>(R), T});
    host_tables[g] = std::move(tab);
    i_slot[g] = packed.add(slots[g], {static_cast<int>(R)});
    const int c = static_cast<int>(src[g].size());
    i_src[g] = packed.add(src[g], {c});
    i_dst[g] = packed.add(dst[g], {c});
  }
  packed.seal();
  StepPlan plan{packed.view(i_pos), packed.view(i_len), packed.view(i_end), {}, {}, {}, {}, {},
                static_cast<int>(R), 0, 0};
  plan.real_rows = static_cast<int>(real_rows);
  plan.min_length = *std::min_element(lengths.begin(), lengths.end());
  plan.max_length = *std::max_element(lengths.begin(), lengths.end());
  plan.page_size = page_size_;
  plan.table_width = T;
  plan.host_lengths = lengths;
  for (int g = 0; g < G; ++g) {
    plan.block_tables.push_back(packed.view(i_tab[g]));
    plan.host_tables.push_back(std::move(host_tables[g]));
    plan.write_slots.push_back(packed.view(i_slot[g]));
    plan.num_copies.push_back(static_cast<int>(src[g].size()));
    plan.copy_src.push_back(packed.view(i_src[g]));
    plan.copy_dst.push_back(packed.view(i_dst[g]));
  }
  return plan;
}

// window 4, page_size 4, lengths [6, 2], table row 0 [7, 3]:
//
//   row 0 reads positions 2..5 -> pages [7 7 3 3], offsets [2 3 0 1], valid 1 1 1 1
//   row 1 reads positions 0..1 -> pages [t t 0 0], offsets [0 1 0 0], valid 1 1 0 0
std::tuple<mx::array, mx::array, mx::array> StepPlan::gather_index(int group, int64_t window,
                                                                   int bucket) const {
  if (group < 0 || group >= static_cast<int>(host_tables.size())) {
    throw std::invalid_argument("[StepPlan.gather_index] group " + std::to_string(group) +
                                " is out of range [0, " + std::to_string(host_tables.size()) + ").");
  }
  if (window < 0 || bucket < 1) {
    throw std::invalid_argument("[StepPlan.gather_index] window must be >= 0 (0 = global) and bucket >= 1.");
  }
  const int64_t hi = window == 0 ? max_length : std::min<int64_t>(max_length, window);
  const int S = static_cast<int>((hi + bucket - 1) / bucket * bucket);
  const auto& tab = host_tables[group];
  std::vector<int32_t> pages(static_cast<size_t>(rows) * S, 0), offs(pages.size(), 0);
  std::unique_ptr<bool[]> valid(new bool[pages.size()]());
  for (int r = 0; r < rows; ++r) {
    const int64_t len = host_lengths[r];
    const int64_t lo = window == 0 ? 0 : std::max<int64_t>(0, len - window);
    const int32_t* row_tab = tab.data() + static_cast<size_t>(r) * table_width;
    for (int64_t s = 0; s < len - lo; ++s) {
      const int64_t pos = lo + s;
      const size_t i = static_cast<size_t>(r) * S + s;
      pages[i] = row_tab[pos / page_size];
      offs[i] = static_cast<int32_t>(pos % page_size);
      valid[i] = true;
    }
  }
  return {ints(pages, {rows, S}), ints(offs, {rows, S}),
          mx::array(valid.get(), {rows, S}, mx::bool_)};
}

}  // namespace mlx_infer
