// Page allocation, block tables, copy-on-write and window release.
// The prefix index half of PagePool lives in prefix_index.cpp.
#include "mlx_infer/kv.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

namespace mlx_infer {

namespace {

int64_t pages_for(int64_t tokens, int page_size) {
  return (tokens + page_size - 1) / page_size;
}

std::string id_str(int64_t seq_id) {
  return std::to_string(seq_id);
}

}  // namespace

PagePool::PagePool(int num_pages, int page_size, int materialized) : page_size_(page_size) {
  // Powers of two keep page boundaries aligned with kernel tiles and make
  // slot math a shift and a mask on every backend.
  if (page_size <= 0 || (page_size & (page_size - 1)) != 0) {
    throw std::invalid_argument(
        "[PagePool] page_size must be a positive power of two (e.g. 16), got " +
        std::to_string(page_size) + ".");
  }
  if (num_pages < 2) {
    throw std::invalid_argument(
        "[PagePool] num_pages must be at least 2 (page 0 is the reserved null "
        "page), got " + std::to_string(num_pages) + ".");
  }
  // Flat slots travel as int32 through slot_mapping and MLX index arrays.
  if (static_cast<int64_t>(num_pages) * page_size >
      std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument(
        "[PagePool] num_pages * page_size must fit in int32 (flat slot ids), "
        "got " + std::to_string(num_pages) + " * " + std::to_string(page_size) +
        "; use fewer or smaller pages.");
  }
  if (materialized < 0) {
    materialized = num_pages;
  }
  if (materialized < 2 || materialized > num_pages) {
    throw std::invalid_argument(
        "[PagePool] materialized must be in [2, num_pages = " + std::to_string(num_pages) +
        "] (the null page and at least one usable page), got " + std::to_string(materialized) +
        "; pass -1 (or None) to materialize every page.");
  }
  refcount_.assign(num_pages, 0);
  where_.resize(num_pages);
  in_lru_.assign(num_pages, 0);
  keys_.resize(num_pages);
  materialized_ = 1;  // the null page
  grow(materialized);
  cache_cap_ = num_pages;
  intern("");
}

// Growth appends the new ids to the free queue's back: pages freed earlier
// are reused first, and every id below `materialized` keeps its meaning.
int PagePool::grow(int to) {
  if (to < materialized_ || to > num_pages()) {
    throw std::invalid_argument(
        "[PagePool.grow] to must be in [materialized = " + std::to_string(materialized_) +
        ", num_pages = " + std::to_string(num_pages()) + "] (the pool never shrinks and never "
        "exceeds its capacity), got " + std::to_string(to) + ".");
  }
  for (int p = materialized_; p < to; ++p) {
    free_.push_back(p);
  }
  const int added = to - materialized_;
  materialized_ = to;
  return added;
}

// -- helpers ------------------------------------------------------------------

PagePool::Sequence& PagePool::seq(int64_t seq_id, const char* fn) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) {
    throw std::invalid_argument(
        std::string("[PagePool.") + fn + "] unknown sequence id " +
        id_str(seq_id) + " (never added, or already freed).");
  }
  return it->second;
}

const PagePool::Sequence& PagePool::seq(int64_t seq_id, const char* fn) const {
  return const_cast<PagePool*>(this)->seq(seq_id, fn);
}

void PagePool::check_page(int page, const char* fn) const {
  if (page < 0 || page >= num_pages()) {
    throw std::invalid_argument(
        std::string("[PagePool.") + fn + "] page " + std::to_string(page) +
        " is out of range [0, " + std::to_string(num_pages()) + ").");
  }
}

int PagePool::allocate() {
  int page;
  if (!free_.empty()) {
    page = free_.front();
    free_.pop_front();
  } else {
    // The caller checked capacity, so the LRU is non-empty here.
    page = lru_.front();
    lru_.pop_front();
    in_lru_[page] = 0;
    unhash(page);
    ++evictions_;
  }
  refcount_[page] = 1;
  ++used_;
  return page;
}

void PagePool::release(int page) {
  if (--refcount_[page] > 0) {
    return;
  }
  --used_;
  if (keys_[page]) {
    where_[page] = lru_.insert(lru_.end(), page);
    in_lru_[page] = 1;
    enforce_cap();
  } else {
    free_.push_back(page);
  }
}

void PagePool::take_ref(int page) {
  if (refcount_[page]++ == 0) {
    // Only hashed pages are handed out again from refcount 0, and those
    // sit in the LRU: a reused cached page stops being evictable.
    lru_.erase(where_[page]);
    in_lru_[page] = 0;
    ++used_;
  }
}

// -- sequences ----------------------------------------------------------------

void PagePool::add_sequence(int64_t seq_id, const std::string& ns) {
  if (seqs_.count(seq_id)) {
    throw std::invalid_argument(
        "[PagePool.add_sequence] sequence id " + id_str(seq_id) +
        " already exists; free it first or pick another id.");
  }
  Sequence s;
  s.ns = intern(ns);
  seqs_.emplace(seq_id, std::move(s));
}

// Appending n tokens to a sequence whose last page is shared:
//
//   before   seq A [ 4 ][ 9 ]   page 9 holds 6/16 tokens, refcount 2 (fork)
//            seq B [ 4 ][ 9 ]
//   after    seq A [ 4 ][ 3 ]   copies (9 -> 3), then A writes slots 3*16+6..
//            seq B [ 4 ][ 9 ]   page 9 refcount 1; page 4 stays shared
//
// Full pages are never written again, so only the last page can need a copy.
std::optional<AppendResult> PagePool::append(int64_t seq_id, int64_t n_tokens) {
  Sequence& q = seq(seq_id, "append");
  if (n_tokens < 0) {
    throw std::invalid_argument(
        "[PagePool.append] n_tokens must be >= 0, got " +
        std::to_string(n_tokens) + ".");
  }
  AppendResult out;
  out.page_size = page_size_;
  if (n_tokens == 0) {
    return out;
  }
  const int64_t len = q.length;
  // More tokens than the whole pool holds can never fit (and would overflow
  // the page math below). Compare against n_tokens alone, not len + n_tokens:
  // a windowed sequence's length counts tokens whose pages were released to
  // the null page, so it may exceed the pool's capacity and still grow.
  if (n_tokens > static_cast<int64_t>(num_pages()) * page_size_) {
    return std::nullopt;
  }
  const int64_t new_pages = pages_for(len + n_tokens, page_size_) -
      static_cast<int64_t>(q.pages.size());
  const bool partial = len % page_size_ != 0;
  const int last = partial ? q.pages.back() : 0;
  const bool cow = partial && refcount_[last] > 1;
  if (pages_needed(seq_id, n_tokens) > num_free_pages()) {
    return std::nullopt;
  }

  if (cow) {
    int dst = allocate();
    out.copies.emplace_back(last, dst);
    q.pages.back() = dst;
    release(last);
  } else if (partial && keys_[last]) {
    // Sole owner of a hashed page it is about to overwrite (it was truncated
    // back into it): the cached content stops being true, so forget it.
    unhash(last);
  }
  for (int64_t i = 0; i < new_pages; ++i) {
    q.pages.push_back(allocate());
  }
  out.slots.reserve(n_tokens);
  for (int64_t t = len; t < len + n_tokens; ++t) {
    out.slots.push_back(
        static_cast<int64_t>(q.pages[t / page_size_]) * page_size_ +
        t % page_size_);
  }
  q.length = len + n_tokens;
  return out;
}

void PagePool::fork(int64_t src, int64_t dst) {
  const Sequence& from = seq(src, "fork");
  if (seqs_.count(dst)) {
    throw std::invalid_argument(
        "[PagePool.fork] destination sequence id " + id_str(dst) +
        " already exists; free it first or pick another id.");
  }
  Sequence copy = from;
  for (int32_t p : copy.pages) {
    if (p != 0) {
      take_ref(p);
    }
  }
  seqs_.emplace(dst, std::move(copy));
}

void PagePool::free(int64_t seq_id) {
  Sequence& q = seq(seq_id, "free");
  // Tail first: the LRU then evicts a chain's tail before its head, and a
  // prefix chain without its head can never match again.
  for (auto it = q.pages.rbegin(); it != q.pages.rend(); ++it) {
    if (*it != 0) {
      release(*it);
    }
  }
  seqs_.erase(seq_id);
}

void PagePool::truncate(int64_t seq_id, int64_t n_tokens) {
  Sequence& q = seq(seq_id, "truncate");
  if (n_tokens < 0 || n_tokens > q.length) {
    throw std::invalid_argument(
        "[PagePool.truncate] cannot drop " + std::to_string(n_tokens) +
        " tokens from sequence " + id_str(seq_id) + " of length " +
        std::to_string(q.length) + "; n_tokens must be in [0, length].");
  }
  const int64_t new_len = q.length - n_tokens;
  const int64_t keep = pages_for(new_len, page_size_);
  if (keep > 0 && q.pages[keep - 1] == 0) {
    throw std::invalid_argument(
        "[PagePool.truncate] dropping " + std::to_string(n_tokens) +
        " tokens from sequence " + id_str(seq_id) + " would end it inside a "
        "page already released by release_outside_window; keep more slack in "
        "the window than the longest rollback.");
  }
  for (int64_t i = static_cast<int64_t>(q.pages.size()) - 1; i >= keep; --i) {
    if (q.pages[i] != 0) {
      release(q.pages[i]);
    }
  }
  q.pages.resize(keep);
  q.hashes.resize(std::min<size_t>(q.hashes.size(), new_len / page_size_));
  q.released_upto = std::min(q.released_upto, keep);
  q.length = new_len;
}

// Window release, window = 20, page_size = 16, length = 60:
//
//   tokens    0......15 16.....31 32.....47 48...59
//   pages     [  4   ] [  9   ] [  2   ] [  7  ]
//   window                          |<-- last 20 -->|  (tokens 40..59)
//   after     [  0   ] [  0   ] [  2   ] [  7  ]    pages 4, 9 released
//
// Page 2 still holds tokens 40..47, so it stays.
int PagePool::release_outside_window(int64_t seq_id, int64_t window) {
  Sequence& q = seq(seq_id, "release_outside_window");
  if (window <= 0) {
    throw std::invalid_argument(
        "[PagePool.release_outside_window] window must be positive, got " +
        std::to_string(window) + ".");
  }
  const int64_t cutoff = q.length - window;
  if (cutoff <= 0) {
    return 0;
  }
  const int64_t upto = cutoff / page_size_;
  int released = 0;
  // Newest first, so the chain head is the last of these to be evicted.
  for (int64_t i = upto - 1; i >= q.released_upto; --i) {
    if (q.pages[i] != 0) {
      release(q.pages[i]);
      q.pages[i] = 0;
      ++released;
    }
  }
  q.released_upto = std::max(q.released_upto, upto);
  return released;
}

int PagePool::pages_needed(int64_t seq_id, int64_t n_tokens) const {
  const Sequence& q = seq(seq_id, "pages_needed");
  if (n_tokens < 0) {
    throw std::invalid_argument(
        "[PagePool.pages_needed] n_tokens must be >= 0, got " +
        std::to_string(n_tokens) + ".");
  }
  if (n_tokens == 0) {
    return 0;
  }
  // The same arithmetic as append, which must agree with it exactly.
  if (n_tokens > static_cast<int64_t>(num_pages()) * page_size_) {
    return std::numeric_limits<int>::max();
  }
  const int64_t new_pages = pages_for(q.length + n_tokens, page_size_) -
      static_cast<int64_t>(q.pages.size());
  const bool partial = q.length % page_size_ != 0;
  const bool cow = partial && refcount_[q.pages.back()] > 1;
  return static_cast<int>(new_pages + (cow ? 1 : 0));
}

int64_t PagePool::first_held_token(int64_t seq_id) const {
  return seq(seq_id, "first_held_token").released_upto * page_size_;
}

bool PagePool::has_sequence(int64_t seq_id) const {
  return seqs_.count(seq_id) > 0;
}

std::vector<int64_t> PagePool::sequences() const {
  std::vector<int64_t> ids;
  ids.reserve(seqs_.size());
  for (const auto& kv : seqs_) {
    ids.push_back(kv.first);
  }
  std::sort(ids.begin(), ids.end());
  return ids;
}

std::vector<int32_t> PagePool::block_table(int64_t seq_id) const {
  return seq(seq_id, "block_table").pages;
}

int64_t PagePool::length(int64_t seq_id) const {
  return seq(seq_id, "length").length;
}

// -- pages --------------------------------------------------------------------

int PagePool::num_free_pages() const {
  return static_cast<int>(free_.size() + lru_.size());
}

int PagePool::num_used_pages() const {
  return used_;
}

int PagePool::refcount(int page) const {
  check_page(page, "refcount");
  return refcount_[page];
}

std::vector<int32_t> PagePool::cached_pages() const {
  return std::vector<int32_t>(lru_.begin(), lru_.end());
}

void PagePool::check() const {
  auto fail = [](const std::string& what) {
    throw std::logic_error("[PagePool.check] " + what);
  };
  const int n = num_pages();
  if (refcount_[0] != 0 || keys_[0] || in_lru_[0]) {
    fail("the null page is in use");
  }
  std::vector<int32_t> refs(n, 0);
  for (const auto& [id, q] : seqs_) {
    if (static_cast<int64_t>(q.pages.size()) != pages_for(q.length, page_size_)) {
      fail("sequence " + id_str(id) + " has a block table of the wrong size");
    }
    if (static_cast<int64_t>(q.hashes.size()) > q.length / page_size_) {
      fail("sequence " + id_str(id) + " hashes a page that is not full");
    }
    std::vector<int32_t> seen;
    for (size_t i = 0; i < q.pages.size(); ++i) {
      int32_t p = q.pages[i];
      if ((p == 0) != (static_cast<int64_t>(i) < q.released_upto)) {
        fail("sequence " + id_str(id) + " has a null page outside its "
             "released prefix, or a live page inside it");
      }
      if (p != 0) {
        ++refs[p];
        seen.push_back(p);
      }
    }
    std::sort(seen.begin(), seen.end());
    if (std::adjacent_find(seen.begin(), seen.end()) != seen.end()) {
      fail("sequence " + id_str(id) + " holds one page twice");
    }
  }
  int used = 0;
  std::vector<uint8_t> in_free(n, 0);
  for (int32_t p : free_) {
    if (p <= 0 || p >= n || in_free[p]) {
      fail("free queue holds page " + std::to_string(p) + " badly");
    }
    in_free[p] = 1;
  }
  size_t lru_count = 0;
  for (int32_t p : lru_) {
    if (!in_lru_[p]) {
      fail("LRU membership flag out of sync for page " + std::to_string(p));
    }
    ++lru_count;
  }
  for (int p = 1; p < materialized_; ++p) {
    if (refs[p] != refcount_[p]) {
      fail("page " + std::to_string(p) + " has refcount " +
           std::to_string(refcount_[p]) + " but is in " +
           std::to_string(refs[p]) + " block tables");
    }
    const bool cached = keys_[p].has_value();
    if (refcount_[p] > 0) {
      ++used;
      if (in_free[p] || in_lru_[p]) {
        fail("used page " + std::to_string(p) + " is also free");
      }
    } else if (in_free[p] + in_lru_[p] != 1 || in_lru_[p] != cached) {
      fail("page " + std::to_string(p) + " with refcount 0 is not in exactly "
           "the right one of the free queue (unhashed) and the LRU (hashed)");
    }
    if (cached) {
      auto it = index_.find(keys_[p]->hash);
      if (it == index_.end() || it->second != p) {
        fail("page " + std::to_string(p) + " carries a hash the index lacks");
      }
    }
  }
  for (const auto& [h, p] : index_) {
    if (p <= 0 || p >= n || !keys_[p] || keys_[p]->hash != h) {
      fail("index entry points at page " + std::to_string(p) + " without its key");
    }
  }
  for (int p = materialized_; p < n; ++p) {
    if (refcount_[p] != 0 || in_free[p] || in_lru_[p] || keys_[p]) {
      fail("page " + std::to_string(p) + " is not materialized but is in use, free or cached");
    }
  }
  if (used != used_ || lru_count != lru_.size() ||
      free_.size() + lru_.size() + used_ != static_cast<size_t>(materialized_ - 1)) {
    fail("free + cached + used != materialized - 1");
  }
  if (static_cast<int>(lru_.size()) > cache_cap_) {
    fail("more cached pages than the cache cap");
  }
}

}  // namespace mlx_infer
