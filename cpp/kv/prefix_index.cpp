// The prefix index of PagePool: content-addressed full pages.
//
//   prompt  [ t0 .. t15 ][ t16 .. t31 ][ t32 .. t37 ]
//   hashes  h0 = H(root(ns), t0..t15, ns)
//           h1 = H(h0,       t16..t31, ns)      partial page: never hashed
//   index   h0 -> page 4, h1 -> page 9
//
// A page's hash covers everything before it (through its parent), so equal
// hashes mean equal K/V for the whole prefix, not just equal page contents.
// Each indexed page keeps its parent, namespace and tokens, and a lookup
// compares them: a 64-bit collision becomes a miss, never wrong K/V.
#include "mlx_infer/kv.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

namespace mlx_infer {

namespace {

// Fixed mixers rather than std::hash, so hashes are identical across runs,
// platforms and processes (a persisted prompt cache can trust them).
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t fnv1a64(const std::string& bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) {
    h = (h ^ c) * 0x100000001b3ull;
  }
  return h;
}

}  // namespace

int PagePool::intern(const std::string& ns) {
  if (auto found = find_ns(ns)) {
    return *found;
  }
  namespaces_.push_back(ns);
  ns_hash_.push_back(fnv1a64(ns));
  return static_cast<int>(namespaces_.size()) - 1;
}

std::optional<int> PagePool::find_ns(const std::string& ns) const {
  auto it = std::find(namespaces_.begin(), namespaces_.end(), ns);
  if (it == namespaces_.end()) {
    return std::nullopt;
  }
  return static_cast<int>(it - namespaces_.begin());
}

uint64_t PagePool::root_hash(int ns) const {
  return splitmix64(ns_hash_[ns] ^ 0x6d6c782d696e6672ull);
}

uint64_t PagePool::chain_hash(uint64_t parent, const int32_t* tokens, int ns) const {
  uint64_t x = splitmix64(parent ^ ns_hash_[ns]);
  for (int i = 0; i < page_size_; ++i) {
    x = splitmix64(x ^ static_cast<uint32_t>(tokens[i]));
  }
  return x;
}

std::vector<int32_t> PagePool::match(
    const std::vector<int32_t>& token_ids, int ns, size_t max_pages,
    std::vector<uint64_t>* hashes) const {
  std::vector<int32_t> pages;
  const size_t n = std::min(max_pages, token_ids.size() / page_size_);
  uint64_t parent = root_hash(ns);
  for (size_t i = 0; i < n; ++i) {
    const int32_t* tokens = token_ids.data() + i * page_size_;
    const uint64_t h = chain_hash(parent, tokens, ns);
    auto it = index_.find(h);
    if (it == index_.end()) {
      break;
    }
    const PageKey& key = *keys_[it->second];
    if (key.parent != parent || key.ns != ns ||
        !std::equal(key.tokens.begin(), key.tokens.end(), tokens)) {
      break;  // a hash collision
    }
    pages.push_back(it->second);
    if (hashes) {
      hashes->push_back(h);
    }
    parent = h;
  }
  return pages;
}

std::vector<int32_t> PagePool::match_prefix(
    const std::vector<int32_t>& token_ids, const std::string& ns) const {
  auto id = find_ns(ns);
  if (!id) {
    return {};  // nothing was ever cached under this namespace
  }
  return match(token_ids, *id, std::numeric_limits<size_t>::max(), nullptr);
}

int64_t PagePool::add_sequence_with_prefix(
    int64_t seq_id, const std::vector<int32_t>& token_ids, const std::string& ns) {
  if (seqs_.count(seq_id)) {
    throw std::invalid_argument(
        "[PagePool.add_sequence_with_prefix] sequence id " +
        std::to_string(seq_id) + " already exists; free it first or pick another id.");
  }
  Sequence q;
  q.ns = intern(ns);
  // At least one prompt token must still run through the model, or the
  // caller would have no logits to sample the first new token from.
  const size_t max_pages =
      token_ids.empty() ? 0 : (token_ids.size() - 1) / page_size_;
  q.pages = match(token_ids, q.ns, max_pages, &q.hashes);
  for (int32_t p : q.pages) {
    take_ref(p);
  }
  hits_ += static_cast<int64_t>(q.pages.size());
  misses_ += static_cast<int64_t>(max_pages - q.pages.size());
  q.length = static_cast<int64_t>(q.pages.size()) * page_size_;
  const int64_t cached = q.length;
  seqs_.emplace(seq_id, std::move(q));
  return cached;
}

std::vector<int32_t> PagePool::prefix_hits(
    const std::vector<int32_t>& token_ids, const std::string& ns,
    size_t max_pages) const {
  const size_t n = std::min(max_pages, token_ids.size() / page_size_);
  std::vector<int32_t> pages(n, 0);
  auto id = find_ns(ns);
  if (!id) {
    return pages;  // nothing was ever cached under this namespace
  }
  uint64_t parent = root_hash(*id);
  for (size_t i = 0; i < n; ++i) {
    const int32_t* tokens = token_ids.data() + i * page_size_;
    // The chain hash comes from the tokens alone, so a page can be looked up
    // even when the pages before it were released or evicted.
    const uint64_t h = chain_hash(parent, tokens, *id);
    auto it = index_.find(h);
    if (it != index_.end()) {
      const PageKey& key = *keys_[it->second];
      if (key.parent == parent && key.ns == *id &&
          std::equal(key.tokens.begin(), key.tokens.end(), tokens)) {
        pages[i] = it->second;  // else a hash collision: a miss
      }
    }
    parent = h;
  }
  return pages;
}

void PagePool::add_sequence_with_pages(
    int64_t seq_id, const std::vector<int32_t>& token_ids, const std::string& ns,
    int64_t n_pages, int64_t first, int64_t max_pages) {
  const char* fn = "[PagePool.add_sequence_with_pages] ";
  if (seqs_.count(seq_id)) {
    throw std::invalid_argument(
        std::string(fn) + "sequence id " + std::to_string(seq_id) +
        " already exists; free it first or pick another id.");
  }
  if (first < 0 || first > n_pages || n_pages > max_pages ||
      n_pages * page_size_ > static_cast<int64_t>(token_ids.size())) {
    throw std::invalid_argument(
        std::string(fn) + "need 0 <= first (" + std::to_string(first) +
        ") <= n_pages (" + std::to_string(n_pages) + ") <= max_pages (" +
        std::to_string(max_pages) + ") and n_pages full pages in token_ids (" +
        std::to_string(token_ids.size()) + " tokens).");
  }
  std::vector<int32_t> hits = prefix_hits(token_ids, ns, n_pages);
  for (int64_t i = first; i < n_pages; ++i) {
    if (hits[i] == 0) {
      throw std::invalid_argument(
          std::string(fn) + "logical page " + std::to_string(i) +
          " of token_ids is not in the prefix index; take n_pages and first "
          "from prefix_hits.");
    }
  }
  Sequence q;
  q.ns = intern(ns);
  uint64_t parent = root_hash(q.ns);
  for (int64_t i = 0; i < n_pages; ++i) {
    parent = chain_hash(parent, token_ids.data() + i * page_size_, q.ns);
    q.hashes.push_back(parent);
    q.pages.push_back(i < first ? 0 : hits[i]);
  }
  for (int64_t i = first; i < n_pages; ++i) {
    take_ref(q.pages[i]);
  }
  hits_ += n_pages - first;
  misses_ += max_pages - n_pages;
  q.length = n_pages * page_size_;
  q.released_upto = first;
  seqs_.emplace(seq_id, std::move(q));
}

int PagePool::register_full_pages(
    int64_t seq_id, const std::vector<int32_t>& token_ids) {
  Sequence& q = seq(seq_id, "register_full_pages");
  const size_t full = static_cast<size_t>(
      std::min<int64_t>(static_cast<int64_t>(token_ids.size()), q.length) /
      page_size_);
  if (full <= q.hashes.size()) {
    return 0;
  }
  // Compute and validate everything first so a bad call changes nothing.
  std::vector<uint64_t> hashes;
  std::vector<uint64_t> parents;
  uint64_t parent = q.hashes.empty() ? root_hash(q.ns) : q.hashes.back();
  for (size_t i = q.hashes.size(); i < full; ++i) {
    const uint64_t h = chain_hash(parent, token_ids.data() + i * page_size_, q.ns);
    const int32_t page = q.pages[i];
    if (page != 0 && keys_[page] && keys_[page]->hash != h) {
      throw std::invalid_argument(
          "[PagePool.register_full_pages] token_ids disagree with the tokens "
          "already registered for page " + std::to_string(page) + " (logical "
          "page " + std::to_string(i) + " of sequence " + std::to_string(seq_id) +
          "); pass the sequence's own tokens from position 0.");
    }
    parents.push_back(parent);
    hashes.push_back(h);
    parent = h;
  }
  int added = 0;
  for (size_t k = 0; k < hashes.size(); ++k) {
    const size_t i = q.hashes.size();
    const int32_t page = q.pages[i];
    q.hashes.push_back(hashes[k]);
    // A null page (window-released) still extends the chain; an equal page
    // indexed earlier keeps the entry, and this one stays private.
    if (page == 0 || keys_[page] || index_.count(hashes[k])) {
      continue;
    }
    const int32_t* tokens = token_ids.data() + i * page_size_;
    keys_[page] = PageKey{hashes[k], parents[k], q.ns,
                          std::vector<int32_t>(tokens, tokens + page_size_)};
    index_.emplace(hashes[k], page);
    ++added;
  }
  return added;
}

void PagePool::unhash(int page) {
  if (!keys_[page]) {
    return;
  }
  auto it = index_.find(keys_[page]->hash);
  if (it != index_.end() && it->second == page) {
    index_.erase(it);
  }
  keys_[page].reset();
}

void PagePool::evict_front() {
  const int32_t page = lru_.front();
  lru_.pop_front();
  in_lru_[page] = 0;
  unhash(page);
  free_.push_back(page);
  ++evictions_;
}

void PagePool::enforce_cap() {
  while (static_cast<int>(lru_.size()) > cache_cap_) {
    evict_front();
  }
}

void PagePool::set_cache_cap(int pages) {
  if (pages < 0) {
    throw std::invalid_argument(
        "[PagePool.set_cache_cap] pages must be >= 0 (0 disables prefix "
        "caching of freed pages), got " + std::to_string(pages) + ".");
  }
  cache_cap_ = pages;
  enforce_cap();
}

std::optional<uint64_t> PagePool::page_hash(int page) const {
  check_page(page, "page_hash");
  if (!keys_[page]) {
    return std::nullopt;
  }
  return keys_[page]->hash;
}

}  // namespace mlx_infer
