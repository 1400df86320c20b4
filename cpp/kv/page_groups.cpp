// PageGroups: one PagePool per layer group (global, or one sliding window),
// driven together so every sequence has the same length in every group.
#include "mlx_infer/kv.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

namespace mlx_infer {

namespace {

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

}  // namespace

PageGroups::PageGroups(const std::vector<int>& num_pages, int page_size,
                       const std::vector<int64_t>& windows, int64_t slack,
                       const std::vector<int>& materialized)
    : page_size_(page_size), slack_(slack) {
  if (windows.empty() || windows.size() != num_pages.size()) {
    throw std::invalid_argument(
        "[PageGroups] need one window and one pool size per group (at least "
        "one group); got " + std::to_string(windows.size()) + " windows and " +
        std::to_string(num_pages.size()) + " pool sizes.");
  }
  if (slack < 0) {
    throw std::invalid_argument(
        "[PageGroups] slack must be >= 0 tokens, got " + std::to_string(slack) + ".");
  }
  if (!materialized.empty() && materialized.size() != num_pages.size()) {
    throw std::invalid_argument(
        "[PageGroups] need one materialized size per group (or none: all pages); got " +
        std::to_string(materialized.size()) + " for " + std::to_string(num_pages.size()) + " groups.");
  }
  pools_.reserve(windows.size());
  for (size_t g = 0; g < windows.size(); ++g) {
    if (windows[g] < 0) {
      throw std::invalid_argument(
          "[PageGroups] window of group " + std::to_string(g) +
          " must be >= 0 (0 = global), got " + std::to_string(windows[g]) + ".");
    }
    pools_.emplace_back(num_pages[g], page_size,
                        materialized.empty() ? -1 : materialized[g]);  // validates all three
    windows_.push_back(windows[g]);
    // The next query reads the last w - 1 tokens; keep at least one so the
    // release call stays meaningful for w = 1.
    keep_.push_back(windows[g] == 0 ? 0 : std::max<int64_t>(windows[g] - 1 + slack, 1));
  }
}

void PageGroups::check_group(int group, const char* fn) const {
  if (group < 0 || group >= num_groups()) {
    throw std::invalid_argument(
        std::string("[PageGroups.") + fn + "] group " + std::to_string(group) +
        " is out of range [0, " + std::to_string(num_groups()) + ").");
  }
}

PagePool& PageGroups::pool(int group) {
  check_group(group, "pool");
  return pools_[group];
}

const PagePool& PageGroups::pool(int group) const {
  check_group(group, "pool");
  return pools_[group];
}

int64_t PageGroups::window(int group) const {
  check_group(group, "window");
  return windows_[group];
}

int64_t PageGroups::keep(int group) const {
  check_group(group, "keep");
  return keep_[group];
}

const PagePool& PageGroups::first(int64_t seq_id, const char* fn) const {
  if (!pools_[0].has_sequence(seq_id)) {
    throw std::invalid_argument(
        std::string("[PageGroups.") + fn + "] unknown sequence id " +
        std::to_string(seq_id) + " (never added, or already freed).");
  }
  return pools_[0];
}

// -- sequences ----------------------------------------------------------------

void PageGroups::add_sequence(int64_t seq_id, const std::string& ns) {
  if (has_sequence(seq_id)) {
    throw std::invalid_argument(
        "[PageGroups.add_sequence] sequence id " + std::to_string(seq_id) +
        " already exists; free it first or pick another id.");
  }
  for (auto& p : pools_) {
    p.add_sequence(seq_id, ns);
  }
}

// The first page a group holds in a sequence of n_pages cached pages: what
// release_outside_window would leave at that length.
int64_t PageGroups::first_page(int group, int64_t n_pages) const {
  if (keep_[group] == 0) {
    return 0;
  }
  return std::max<int64_t>(0, n_pages - ceil_div(keep_[group], page_size_));
}

// Prefix hit over groups, page_size 4, keep 6 (window 7) -> 2 pages needed:
//
//   logical page      0  1  2  3  4  5
//   global group      h  h  h  h  h  .      valid k: 0..5
//   windowed group    .  .  .  h  h  h      valid k: 0, 5 (pages 3, 4), 6
//   best k = 5: both groups allow it
int64_t PageGroups::best_prefix(const std::vector<int32_t>& token_ids,
                                const std::string& ns, int64_t max_pages) const {
  // misses[g][i]: pages among the first i of group g that are not indexed.
  std::vector<std::vector<int64_t>> misses;
  for (const auto& p : pools_) {
    auto hits = p.prefix_hits(token_ids, ns, static_cast<size_t>(max_pages));
    std::vector<int64_t> m(max_pages + 1, 0);
    for (int64_t i = 0; i < max_pages; ++i) {
      m[i + 1] = m[i] + (hits[i] == 0 ? 1 : 0);
    }
    misses.push_back(std::move(m));
  }
  for (int64_t k = max_pages; k > 0; --k) {
    bool ok = true;
    for (int g = 0; g < num_groups() && ok; ++g) {
      ok = misses[g][k] - misses[g][first_page(g, k)] == 0;
    }
    if (ok) {
      return k;
    }
  }
  return 0;
}

int64_t PageGroups::add_sequence_with_prefix(
    int64_t seq_id, const std::vector<int32_t>& token_ids, const std::string& ns) {
  if (has_sequence(seq_id)) {
    throw std::invalid_argument(
        "[PageGroups.add_sequence_with_prefix] sequence id " +
        std::to_string(seq_id) + " already exists; free it first or pick another id.");
  }
  // At least one prompt token must still run through the model, or the
  // caller would have no logits to sample the first new token from.
  const int64_t max_pages = token_ids.empty()
      ? 0 : static_cast<int64_t>((token_ids.size() - 1) / page_size_);
  const int64_t k = best_prefix(token_ids, ns, max_pages);
  for (int g = 0; g < num_groups(); ++g) {
    pools_[g].add_sequence_with_pages(seq_id, token_ids, ns, k, first_page(g, k), max_pages);
  }
  hits_ += k;
  misses_ += max_pages - k;
  return k * page_size_;
}

int64_t PageGroups::match_prefix(
    const std::vector<int32_t>& token_ids, const std::string& ns) const {
  const int64_t max_pages = token_ids.empty()
      ? 0 : static_cast<int64_t>((token_ids.size() - 1) / page_size_);
  return best_prefix(token_ids, ns, max_pages) * page_size_;
}

std::optional<std::vector<AppendResult>> PageGroups::append(
    int64_t seq_id, int64_t n_tokens) {
  first(seq_id, "append");
  if (n_tokens < 0) {
    throw std::invalid_argument(
        "[PageGroups.append] n_tokens must be >= 0, got " +
        std::to_string(n_tokens) + ".");
  }
  // Release first, so a windowed group reuses its own old pages for the new
  // tokens instead of needing more.
  for (int g = 0; g < num_groups(); ++g) {
    if (keep_[g] > 0) {
      pools_[g].release_outside_window(seq_id, keep_[g]);
    }
  }
  for (auto& p : pools_) {
    if (p.pages_needed(seq_id, n_tokens) > p.num_free_pages()) {
      return std::nullopt;
    }
  }
  std::vector<AppendResult> out;
  out.reserve(pools_.size());
  for (auto& p : pools_) {
    auto r = p.append(seq_id, n_tokens);
    if (!r) {
      throw std::logic_error(
          "[PageGroups.append] a pool refused an append it said it had room for");
    }
    out.push_back(std::move(*r));
  }
  return out;
}

std::vector<int64_t> PageGroups::pages_needed(const std::vector<int64_t>& seq_ids,
                                              const std::vector<int64_t>& counts) const {
  if (seq_ids.size() != counts.size()) {
    throw std::invalid_argument(
        "[PageGroups.pages_needed] need one count per sequence; got " + std::to_string(seq_ids.size()) +
        " ids and " + std::to_string(counts.size()) + " counts.");
  }
  std::vector<int64_t> need(pools_.size(), 0);
  for (size_t i = 0; i < seq_ids.size(); ++i) {
    first(seq_ids[i], "pages_needed");
    for (size_t g = 0; g < pools_.size(); ++g) {
      need[g] += pools_[g].pages_needed(seq_ids[i], counts[i]);
    }
  }
  return need;
}

int PageGroups::grow(int group, int to) {
  check_group(group, "grow");
  return pools_[group].grow(to);
}

void PageGroups::fork(int64_t src, int64_t dst) {
  first(src, "fork");
  if (has_sequence(dst)) {
    throw std::invalid_argument(
        "[PageGroups.fork] destination sequence id " + std::to_string(dst) +
        " already exists; free it first or pick another id.");
  }
  for (auto& p : pools_) {
    p.fork(src, dst);
  }
}

void PageGroups::free(int64_t seq_id) {
  first(seq_id, "free");
  for (auto& p : pools_) {
    p.free(seq_id);
  }
}

void PageGroups::truncate(int64_t seq_id, int64_t n_tokens) {
  const int64_t len = first(seq_id, "truncate").length(seq_id);
  if (n_tokens < 0 || n_tokens > len) {
    throw std::invalid_argument(
        "[PageGroups.truncate] cannot drop " + std::to_string(n_tokens) +
        " tokens from sequence " + std::to_string(seq_id) + " of length " +
        std::to_string(len) + "; n_tokens must be in [0, length].");
  }
  const int64_t new_len = len - n_tokens;
  // Validate every group before changing any.
  for (int g = 0; g < num_groups(); ++g) {
    if (keep_[g] == 0 || new_len == 0) {
      continue;
    }
    const int64_t reads_from = std::max<int64_t>(0, new_len - (windows_[g] - 1));
    if (reads_from < pools_[g].first_held_token(seq_id)) {
      throw std::invalid_argument(
          "[PageGroups.truncate] dropping " + std::to_string(n_tokens) +
          " tokens from sequence " + std::to_string(seq_id) + " rolls back past "
          "what its window-" + std::to_string(windows_[g]) + " layers still hold "
          "(tokens from " + std::to_string(pools_[g].first_held_token(seq_id)) +
          "); roll back at most the slack (" + std::to_string(slack_) +
          " tokens) beyond the last step, or build the store with more slack.");
    }
  }
  for (auto& p : pools_) {
    p.truncate(seq_id, n_tokens);
  }
}

int PageGroups::register_full_pages(
    int64_t seq_id, const std::vector<int32_t>& token_ids) {
  first(seq_id, "register_full_pages");
  int added = 0;
  for (auto& p : pools_) {
    added += p.register_full_pages(seq_id, token_ids);
  }
  return added;
}

bool PageGroups::has_sequence(int64_t seq_id) const {
  return pools_[0].has_sequence(seq_id);
}

std::vector<int64_t> PageGroups::sequences() const {
  return pools_[0].sequences();
}

int64_t PageGroups::length(int64_t seq_id) const {
  return first(seq_id, "length").length(seq_id);
}

std::vector<int32_t> PageGroups::block_table(int64_t seq_id, int group) const {
  check_group(group, "block_table");
  first(seq_id, "block_table");
  return pools_[group].block_table(seq_id);
}

int PageGroups::held_pages(int64_t seq_id, int group) const {
  auto table = block_table(seq_id, group);
  return static_cast<int>(std::count_if(
      table.begin(), table.end(), [](int32_t p) { return p != 0; }));
}

void PageGroups::check() const {
  auto fail = [](const std::string& what) {
    throw std::logic_error("[PageGroups.check] " + what);
  };
  const auto ids = pools_[0].sequences();
  for (int g = 0; g < num_groups(); ++g) {
    pools_[g].check();
    if (pools_[g].sequences() != ids) {
      fail("group " + std::to_string(g) + " holds other sequences than group 0");
    }
    for (int64_t id : ids) {
      if (pools_[g].length(id) != pools_[0].length(id)) {
        fail("sequence " + std::to_string(id) + " has another length in group " +
             std::to_string(g));
      }
      if (keep_[g] == 0 && pools_[g].first_held_token(id) != 0) {
        fail("global group " + std::to_string(g) + " released pages of sequence " +
             std::to_string(id));
      }
    }
  }
}

}  // namespace mlx_infer
